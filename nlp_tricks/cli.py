"""The ``nlp-tricks`` command: ``nlp-tricks plot OUTPUT_DIR``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nlp-tricks", description="Tools for nlp_tricks runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser(
        "plot",
        help="draw loss, eval metrics, per-group learning rates and teacher forcing from trainer_state.json",
        description="Draw PNG plots from OUTPUT_DIR/trainer_state.json (or its newest checkpoint's), written next "
        "to it: loss.png, eval.png, learning_rate.png, teacher_forcing.png.",
    )
    plot.add_argument("output_dir", help="a training output_dir, a checkpoint-N folder or a trainer_state.json")
    args = parser.parse_args(argv)

    if args.command == "plot":
        from .plot import plot_run

        try:
            written = plot_run(args.output_dir)
        except (FileNotFoundError, ImportError, ValueError) as err:
            print(f"nlp-tricks plot: {err}", file=sys.stderr)
            return 1
        if not written:
            print(f"nlp-tricks plot: {args.output_dir}: the log holds nothing to plot", file=sys.stderr)
            return 1
        for path in written:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
