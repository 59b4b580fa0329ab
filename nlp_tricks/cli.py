"""The ``nlp-tricks`` command: ``nlp-tricks plot OUTPUT_DIR``, ``nlp-tricks average CKPT [CKPT ...] --output DIR``."""

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
        "to it: loss.png, eval.png (scores; per-entity F1 in its own panel), learning_rate.png, teacher_forcing.png. "
        "A self-training output_dir gets self_training.png and the plots of each round's teacher and student.",
    )
    plot.add_argument(
        "output_dir",
        help="a training output_dir, a checkpoint-N folder, a trainer_state.json, or a self-training output_dir",
    )
    average = commands.add_parser(
        "average",
        help="average checkpoints of one model uniformly into a new model folder (safetensors)",
        description="Load each checkpoint strictly (wrapper prefixes module. / _orig_mod. removed, tied weights "
        "once), average the weights uniformly and write the result with save_pretrained to --output, with the "
        "tokenizer files of the config folder and an averaging.json naming the checkpoints.",
    )
    average.add_argument(
        "checkpoints", nargs="+", help="checkpoint-N / save_pretrained folders or .safetensors / .bin / .pt files"
    )
    average.add_argument("--output", required=True, help="folder to write the averaged model to")
    average.add_argument(
        "--config", default=None, help="folder with the model's config.json (default: the first checkpoint folder)"
    )
    args = parser.parse_args(argv)

    if args.command == "plot":
        from .plot import plot_run

        notes: list[str] = []
        try:
            written = plot_run(args.output_dir, notes)
        except (FileNotFoundError, ImportError, ValueError) as err:
            print(f"nlp-tricks plot: {err}", file=sys.stderr)
            return 1
        for note in notes:
            print(f"nlp-tricks plot: {note}", file=sys.stderr)
        if not written:
            print(f"nlp-tricks plot: {args.output_dir}: the log holds nothing to plot", file=sys.stderr)
            return 1
        for path in written:
            print(path)
    elif args.command == "average":
        import pickle

        from .runtime.averaging import average_checkpoints
        from .runtime.checkpoint import CheckpointMismatchError

        try:
            print(average_checkpoints(args.checkpoints, args.output, config=args.config))
        except (OSError, ValueError, TypeError, CheckpointMismatchError, pickle.UnpicklingError) as err:
            print(f"nlp-tricks average: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
