"""Running a recipe: its threads, its one-line data errors, and the end of every run (train, evaluate, predict,
``all_results.json``; the exit of a preempted run)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from nlp_tricks.data import DataError
from nlp_tricks.model_card import write_model_card
from nlp_tricks.runtime.divergence import DIVERGED_EXIT_CODE, TrainingDivergedError
from nlp_tricks.runtime.integrity import NO_SPACE_EXIT_CODE, NoSpaceLeftError, is_disk_full
from nlp_tricks.runtime.lock import NotDistributedError, OutputDirBusyError
from nlp_tricks.runtime.preemption import PREEMPTED_EXIT_CODE, describe_stop
from nlp_tricks.runtime.resume import CheckpointResumeError, get_last_complete_checkpoint

from .outputs import output_dir_locks, write_json_atomic
from .peft import merge_trained_adapter
from .process import is_main_process
from .summary import print_summary
from .threads import choose_threads


def run_recipe(main: Callable[[], None]) -> None:
    """Run ``main`` with the torch threads :func:`choose_threads` picks; a :class:`~nlp_tricks.data.DataError`, an
    ``--output_dir`` another run holds or a checkpoint that cannot be resumed ends it with one line on stderr and exit
    status 1, a diverged training run with status 3 (``DIVERGED_EXIT_CODE``), a full disk while saving with status 74
    (``NO_SPACE_EXIT_CODE``).

    Only rank 0 prints, so a launched job with N processes shows the line once; the refusal of a job whose arguments
    are not distributed is printed by every process (each would have trained alone). Nothing else is caught: a bug
    keeps its traceback. The output folder's lock is released when ``main`` ends, however it ends.
    """
    choose_threads()
    try:
        main()
    except (DataError, OutputDirBusyError, TrainingDivergedError, NoSpaceLeftError, CheckpointResumeError) as err:
        if is_main_process():
            print(str(err), file=sys.stderr, flush=True)
        codes = {TrainingDivergedError: DIVERGED_EXIT_CODE, NoSpaceLeftError: NO_SPACE_EXIT_CODE}
        sys.exit(next((code for kind, code in codes.items() if isinstance(err, kind)), 1))
    except NotDistributedError as err:  # every process says it, in one write: the lines of two do not mix
        sys.stderr.write(f"{err}\n")
        sys.stderr.flush()
        sys.exit(1)
    except OSError as err:  # a full disk outside a save that names its file (the trainer state, the results)
        if not is_disk_full(err):
            raise
        if is_main_process():
            print(f"no space left on device: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(NO_SPACE_EXIT_CODE)
    finally:
        while output_dir_locks:
            output_dir_locks.pop().release()


def resume_argument(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint``: ``true`` means the newest complete checkpoint in output_dir, else a path."""
    if value is not None and value.strip().lower() in ("true", "yes", "1"):
        return True
    return value or None


def train_evaluate_predict(
    trainer,
    train_dataset,
    eval_datasets: dict,
    write_test_predictions: Callable[[object], None] | None = None,
    split_metrics: dict[str, Callable] | None = None,
    record: dict | None = None,
    extra_results: Callable[[dict], None] | None = None,
) -> dict:
    """The end of every recipe: train (``--resume_from_checkpoint`` honoured; skipped with ``--do_train false``), save
    the model and the Trainer state, evaluate on validation, predict on test (``write_test_predictions(output)`` on
    rank 0, with the ``PredictionOutput``), then write ``all_results.json`` once, atomically, on rank 0, and print
    the run's summary there (the headline scores, where everything is, the commands that predict and plot). Returns
    the results.

    ``split_metrics`` gives each split its own ``compute_metrics`` (the Trainer's is swapped in before that split
    is scored), for metrics that need the split's own data: every word of an NER sentence, the full reference
    summaries. ``record`` is stored in ``all_results.json`` as it is (data files, label list, truncation counts);
    ``extra_results(results)`` may add to the results first (pretraining: perplexities).
    """
    results = _train(trainer, train_dataset) if trainer.args.do_train else {}
    results.update(_evaluate_and_predict(trainer, eval_datasets, write_test_predictions, split_metrics))
    record = record or {}
    results.update({key: value for key, value in record.items() if isinstance(value, int | float)})
    if extra_results is not None:
        extra_results(results)
    trainer.log_metrics("all", results)
    results.update(record)
    if trainer.is_world_process_zero():
        write_json_atomic(Path(trainer.args.output_dir) / "all_results.json", results)
        print_summary(results, trainer.args.output_dir, trained=trainer.args.do_train)
    return results


def _train(trainer, train_dataset) -> dict:
    """Train (from the checkpoint ``--resume_from_checkpoint`` names), exit if preempted, save the model and the
    Trainer state; the training metrics."""
    args = trainer.args
    resume = resume_argument(args.resume_from_checkpoint)
    if resume is True and get_last_complete_checkpoint(args.output_dir, trainer.required_checkpoint_files) is None:
        raise DataError(
            None,
            None,
            f"--resume_from_checkpoint true: no complete checkpoint-N in {args.output_dir} (a run writes them "
            "with --save_steps N or --save_strategy epoch)",
        )
    train_result = trainer.train(resume_from_checkpoint=resume)
    exit_if_preempted(trainer)
    merge_trained_adapter(trainer)  # --peft lora --merge_lora true: saved, evaluated and predicting merged
    trainer.save_model()
    if trainer.is_world_process_zero():  # a CRF, span head or pooling: how to load it so that it predicts as evaluated
        write_model_card(args.output_dir, trainer.model.config)
    trainer.save_state()
    results = dict(train_result.metrics)
    if hasattr(train_dataset, "__len__"):  # a stream (pretraining's --streaming) has no length
        results["train_samples"] = len(train_dataset)
    return results


def _evaluate_and_predict(
    trainer, eval_datasets: dict, write_test_predictions: Callable | None, split_metrics: dict | None
) -> dict:
    """Evaluate on validation and predict on test (each with its own ``compute_metrics`` where ``split_metrics``
    gives one), writing the test predictions on rank 0; the metrics."""
    results = {}
    if "validation" in eval_datasets:
        if split_metrics and "validation" in split_metrics:
            trainer.compute_metrics = split_metrics["validation"]
        results.update(trainer.evaluate(eval_datasets["validation"]))
        results["eval_samples"] = len(eval_datasets["validation"])
    if "test" in eval_datasets:
        if split_metrics and "test" in split_metrics:
            trainer.compute_metrics = split_metrics["test"]
        output = trainer.predict(eval_datasets["test"], metric_key_prefix="test")
        results.update(output.metrics)
        results["test_samples"] = len(eval_datasets["test"])
        if trainer.is_world_process_zero() and write_test_predictions is not None:
            write_test_predictions(output)
    return results


def exit_if_preempted(trainer, hint: str = "rerun with --resume_from_checkpoint true") -> None:
    """End the recipe if training was stopped early (a preemption signal or ``--max_time``): one line on rank 0
    (``stopped by SIGTERM at step 7; rerun with --resume_from_checkpoint true``) and exit status 75, with no final
    model, evaluation, predictions or ``all_results.json``: nothing that looks like a finished run. The checkpoint
    of the step it stopped at is complete."""
    if getattr(trainer, "preempted", None) is None:
        return
    if trainer.is_world_process_zero():
        print(describe_stop(trainer.preemption, hint), file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)


def own_rows(array, n: int):
    """The first ``n`` rows of a split's gathered predictions / labels.

    A multi-process evaluation completes its last batch with repeated samples, which ``gather_for_metrics``
    normally drops; an evaluation inside the training loop (``eval_strategy``) can still bring them
    (accelerate's one ``GradientState`` for both dataloaders). They come after the split's own rows, in order.
    """
    if len(array) < n:
        raise RuntimeError(f"{len(array)} predictions for {n} examples")
    return array[:n]
