"""The ``nlp-tricks`` command: ``nlp-tricks plot OUTPUT_DIR``, ``nlp-tricks average CKPT [CKPT ...] --output DIR``,
``nlp-tricks average --soup {uniform,greedy} MODEL [MODEL ...] --output DIR``."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
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
    average.add_argument(
        "--soup",
        choices=["uniform", "greedy"],
        default=None,
        help="a model soup of fine-tuned models of one architecture, label set and tokenizer (fold or seed models, "
        "save_pretrained folders, or PEFT LoRA adapter folders of one base, averaged tensor by tensor): uniform "
        "averages them all; greedy tries them best first and keeps one only when the soup's score on a held-out "
        "split (--select_command) does not drop (Wortsman et al. 2022). Writes soup.json beside the weights",
    )
    average.add_argument(
        "--select_command",
        default=None,
        help="with --soup greedy: a command that scores a model folder on held-out data, with {model} (the candidate "
        "soup's folder) and {output} (a scratch folder); it must write {output}/all_results.json holding "
        "--select_metric, e.g. 'python recipes/classification.py --model_name_or_path {model} --do_train false "
        "--test_file dev.csv --output_dir {output}'",
    )
    average.add_argument(
        "--select_metric", default="test_f1", help="with --soup greedy: the all_results.json key to maximise"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "average" and args.soup is not None:
        return _soup(args)

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


def _soup(args) -> int:
    """``nlp-tricks average --soup``: :func:`nlp_tricks.soup.soup_folders`, a bad member or flag in one line."""
    from .soup import SoupError, soup_folders

    if args.config is not None:
        print("nlp-tricks average: --config is for checkpoints of one run; a soup's members are model folders",
              file=sys.stderr)  # fmt: skip
        return 2
    if (args.soup == "greedy") != (args.select_command is not None):
        print("nlp-tricks average: --select_command goes with --soup greedy (and only with it)", file=sys.stderr)
        return 2
    score = _command_score(args.select_command, args.select_metric) if args.select_command else None
    try:
        info = soup_folders(args.checkpoints, args.output, args.soup, score)
    except (OSError, SoupError, RuntimeError) as err:
        print(f"nlp-tricks average: {err}", file=sys.stderr)
        return 1
    kept = info.get("kept", info["members"])
    print(f"{args.output}: a {args.soup} soup of {len(kept)} of {len(info['members'])} members")
    return 0


def _command_score(template: str, metric: str):
    """The selection score of a model folder: ``template`` run with ``{model}`` and ``{output}`` filled in, and
    ``metric`` read from the ``all_results.json`` it writes."""
    import json
    import shlex
    import subprocess
    import tempfile
    from pathlib import Path

    def score(model: str) -> float:
        with tempfile.TemporaryDirectory() as scratch:
            output = str(Path(scratch) / "scored")
            command = [part.format(model=model, output=output) for part in shlex.split(template)]
            proc = subprocess.run(command, capture_output=True, text=True)
            results = Path(output) / "all_results.json"
            if proc.returncode != 0 or not results.is_file():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"--select_command failed on {model} (exit {proc.returncode}): {tail[0]}")
            values = json.loads(results.read_text())
            if not isinstance(values.get(metric), int | float):
                raise RuntimeError(f"--select_metric {metric}: not a number in {results} (keys: {sorted(values)})")
            return float(values[metric])

    return score


if __name__ == "__main__":
    sys.exit(main())
