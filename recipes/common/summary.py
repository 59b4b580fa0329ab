"""The few lines a person reads at the end of a run, after the Trainer's block of every metric: the headline scores,
where the model, predictions, metrics and plots are, and the commands that predict with the model and plot the run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .config_file import is_config_file
from .process import is_main_process
from .threads import launch_index, launcher

# The scores a summary shows, in this order, for each split that has them (``test_f1``, ``eval_f1``, ...).
HEADLINE_METRICS = ("f1", "precision", "recall", "accuracy", "micro_f1", "rouge1", "rouge2", "rougeL", "perplexity")
PREDICTION_FILES = ("test_predictions.*", "test_probabilities.npy")
# A recipe whose model is the input of another: the recipe its "use" line names.
USED_BY = {"pretraining": "classification"}
# The command line of this process's recipe run, as start_recipe parsed it (a recipe process runs one recipe).
_command: dict = {}


def remember_command(recipe: str, argv: list[str], data_flags: set[str]) -> None:
    """Keep what the summary's commands repeat: the recipe's name and the flags of ``argv`` that say which data it
    read (``data_flags``: the names of the data dataclass's fields), with a config file given first."""
    _command.update(recipe=recipe, argv=list(argv), data_flags=set(data_flags))


def data_arguments(argv: list[str], names: set[str]) -> list[str]:
    """The items of ``argv`` that give the fields ``names`` (each flag with its values), a config file first."""
    names = names | {f"no_{name}" for name in names}  # HfArgumentParser's negations of boolean fields
    kept, keep = [], False
    for i, arg in enumerate(argv):
        if i == 0 and is_config_file(arg):
            kept.append(arg)
            continue
        if arg.startswith("--"):
            keep = arg[2:].partition("=")[0].replace("-", "_") in names
        if keep:
            kept.append(arg)
    return kept


def launch_command(script: str | None = None) -> list[str]:
    """How this process was started, up to the script: ``accelerate launch [its options] recipes/ner.py`` as typed,
    else ``python recipes/ner.py``; ``script`` replaces the script's path."""
    this = sys.argv[0]
    script = script or this
    started = launcher()
    if started is not None:
        command = started[1]
        start = launch_index(command) + 1
        options = command[start : command.index(this, start)] if this in command[start:] else []
        return ["accelerate", "launch", *options, script]
    return ["python", script]


def summary_lines(
    results: dict,
    output_dir: str | Path,
    *,
    trained: bool = True,
    model_dir: str | Path | None = None,
    metrics_file: str = "all_results.json",
    predict_script: str | None = None,
    predict_data_flags: set[str] | None = None,
) -> list[str]:
    """The summary of a run that wrote ``results`` (``eval_`` / ``test_`` metrics) into ``output_dir``.

    ``model_dir`` is where the trained model is (default ``output_dir``; nothing with ``trained=False``);
    ``predict_script`` the recipe that predicts with it (default the one running). The predict command repeats the
    run's data flags (the labels are read from its training data; ``predict_data_flags`` keeps only those of the
    predicting recipe) with the model and ``--do_train false``.
    """
    out = Path(output_dir)
    model = Path(model_dir) if model_dir is not None else out
    recipe = _command.get("recipe", Path(sys.argv[0]).stem)
    rows = [(name, _scores(results, prefix)) for prefix, name in (("test", "test"), ("eval", "validation"))]
    rows = [(name, text) for name, text in rows if text]
    rows.append(("model", str(model) if trained else "none written (--do_train false)"))
    predictions = sorted(str(p) for pattern in PREDICTION_FILES for p in out.glob(pattern))
    rows.append(("predictions", ", ".join(predictions) or "none written"))
    rows.append(("metrics", str(out / metrics_file)))
    if (trained and (out / "trainer_state.json").is_file()) or (out / "self_training_results.json").is_file():
        rows.append(("plots", f"nlp-tricks plot {shlex.quote(str(out))}  (loss, eval and learning-rate PNGs there)"))
    if trained and not (model / "config.json").is_file() and (model / "adapter_config.json").is_file():
        rows.append(("", "a LoRA adapter alone: peft's AutoPeftModel*.from_pretrained loads it on its base model"))
    elif trained:
        rows.append(_use_row(recipe, model, out, predict_script, predict_data_flags))
    width = max(len(name) for name, _ in rows) + 2
    return [f"***** {recipe}: done *****", *(f"{name:<{width}}{text}" for name, text in rows)]


def print_summary(*args, **kwargs) -> None:
    """Print :func:`summary_lines` on the main process."""
    if is_main_process():
        print("\n".join(summary_lines(*args, **kwargs)), flush=True)


def _use_row(
    recipe: str, model: Path, out: Path, predict_script: str | None, data_flags: set[str] | None
) -> tuple[str, str]:
    if recipe in USED_BY:  # its model is a start for other recipes (continued pretraining)
        script = str(Path(sys.argv[0]).with_name(f"{USED_BY[recipe]}.py"))
        return "use", shlex.join([*launch_command(script), "--model_name_or_path", str(model)])
    names = _command.get("data_flags", set())
    data = data_arguments(_command.get("argv", []), names & data_flags if data_flags is not None else names)
    flags = [*data, "--model_name_or_path", str(model), "--do_train", "false"]
    flags += ["--output_dir", f"{str(out).rstrip('/')}_predict"]
    return "predict", shlex.join([*launch_command(predict_script), *flags])


def _scores(results: dict, prefix: str) -> str:
    parts = []
    for name in HEADLINE_METRICS:
        value = results.get(f"{prefix}_{name}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"{name} {value:.3f}" if abs(value) <= 1 else f"{name} {value:.2f}")
            before = results.get(f"{prefix}_{name}_before")
            if isinstance(before, int | float):
                parts[-1] += f" (before training {before:.2f})"
    samples = results.get(f"{prefix}_samples")
    if parts and isinstance(samples, int):
        parts.append(f"({samples} examples)")
    return "  ".join(parts)
