"""Self-training with a teacher (Noisy Student style) for NER and text classification, with every trick as a flag.

    accelerate launch recipes/self_training.py --task ner --unlabeled_fraction 0.9        # WNUT-16, 10% labelled
    accelerate launch recipes/self_training.py --task classification --unlabeled_fraction 0.9 --soft_labels true
    accelerate launch recipes/self_training.py --task ner --train_file train.conll --validation_file dev.conll \\
        --unlabeled_file raw.txt --confidence_threshold 0.9 --rounds 2
    accelerate launch recipes/self_training.py --help      # every data, model, self-training and trick flag

Per round: (round 1) train a teacher on the labelled data; let it label the unlabelled data; train a fresh student
(from ``--student_model_name_or_path``, default the teacher's starting model) on the kept pseudo-labels mixed with the
labelled data; evaluate teacher and student on validation and test. The student is the next round's teacher.
Xie et al. 2020, https://arxiv.org/abs/1911.04252; Du et al. 2021, https://arxiv.org/abs/2010.02194.

Features:

- ``--task ner|classification``: the data flags, readers, tokenization and metrics are those of ``recipes/ner.py``
  and ``recipes/classification.py`` (``--dataset_name demo`` by default: WNUT-16 tweets / BBC News).
- Unlabelled data: ``--unlabeled_file`` (classification: CSV / JSON lines with ``--text_column``; NER: plain text
  ``.txt``, one sentence per line, words split on whitespace; JSON lines with ``--tokens_column``; or CoNLL style
  ``.conll`` / ``.tsv`` / ..., one word per line in the first column, blank line between sentences), or
  ``--unlabeled_fraction F``: that share of the training split is held out and its labels removed (used only to
  report the pseudo-labels' accuracy, never to train). Labels are those of the whole training split.
- ``--confidence_threshold``: pseudo-labels below it are dropped. A text's confidence is the teacher's largest
  softmax probability; a sentence's is the smallest one over its words (first sub-tokens).
- ``--soft_labels``: the student distils the teacher's logits at ``--distill_temperature`` with weight
  ``--distill_alpha`` (the rest is cross-entropy on the argmax / gold label); labelled examples carry their gold
  one-hot as teacher logits. Without it, the student trains on hard (argmax) pseudo-labels.
- ``--rounds``: how many teacher -> student rounds.
- Pseudo-labelling runs batched (``--per_device_eval_batch_size``) under ``torch.no_grad``, split across the
  processes of the job, with a progress bar.
- Outputs in ``--output_dir`` (default ``outputs/self_training``): ``round_<r>/{teacher,student}`` (models, each
  with its ``trainer_state.json``: ``nlp-tricks plot OUTPUT_DIR`` draws every stage and the rounds), and
  ``self_training_results.json`` with each round's teacher and student metrics and pseudo-label counts, written
  once at the end; a table is printed. Bad input stops the run before training: one ``file:line: message`` line on
  stderr, exit status 1, no results file.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from datasets import Dataset
from transformers import DataCollatorWithPadding, set_seed

from nlp_tricks import TricksArguments, TricksTrainer
from nlp_tricks.data import DataError, split_examples
from nlp_tricks.self_training import PseudoLabels, TeacherLogitsCollator, predict_logits

from classification import CLASSIFICATION_TASK, ClassificationDataArguments
from common import (
    DataArguments,
    ModelArguments,
    check_label_arguments,
    exit_if_preempted,
    is_main_process,
    merge_trained_adapter,
    print_summary,
    resolve_model_path,
    run_recipe,
    start_recipe,
    user_tricks,
    write_json_atomic,
)
from ner import NER_TASK, NerDataArguments

# Those of recipes/ner.py and recipes/classification.py, but no evaluation during training: each stage is scored
# once at its end.
RECIPE_DEFAULTS = {
    "learning_rate": 1.5e-4,
    "num_train_epochs": 2,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "weight_decay": 0.01,
    "head_lr_scale": 10.0,
    "eval_strategy": "no",
    "save_strategy": "no",
}


class SelfTrainingTask(Protocol):
    """What self-training needs of a task: ``NER_TASK`` in recipes/ner.py, ``CLASSIFICATION_TASK`` in
    recipes/classification.py. ``data`` is the parsed :class:`SelfTrainingDataArguments`."""

    label_key: str  # an example's gold label(s)
    self_training_defaults: dict  # overrides of RECIPE_DEFAULTS, applied unless the flag is given
    table_metrics: tuple[str, ...]  # the columns of the printed table
    supports_crf: bool

    def read_labelled(self, data) -> tuple[dict, list[str], list[dict], dict[str, list[dict]]]:
        """``(splits, labels, train_examples, eval_examples)`` (see ``common.labelled_splits``)."""

    def read_unlabeled(self, path: str, data) -> list[dict]: ...

    def load_model(self, model_args, labels: list[str], model_path: str, training_args=None) -> tuple:
        """``(model, tokenizer)`` with a fresh head over ``labels``, ready to train with ``training_args`` (a LoRA
        adapter with ``--peft lora``)."""

    def tokenize(self, examples, tokenizer, label2id: dict, data, train: bool) -> Dataset: ...

    def tokenize_unlabeled(self, examples: list[dict], tokenizer, max_seq_length: int) -> tuple[Dataset, list | None]:
        """The inputs, and per example its word ids (None: one label per example)."""

    def collator(self, tokenizer) -> Callable: ...

    def evaluation_sets(self, eval_examples: dict, tokenizer, labels: list[str], data) -> dict:
        """Per split, ``(dataset, compute_metrics)``."""

    def pseudo_labels(self, logits: list, word_ids: list | None, threshold: float, crf=None) -> PseudoLabels: ...

    def pseudo_examples(self, unlabeled: list[dict], pseudo: PseudoLabels, labels: list[str]) -> list[dict]:
        """The kept unlabelled examples with their pseudo-labels, in the form ``tokenize`` reads."""

    def pseudo_label_accuracy(self, pseudo: PseudoLabels, hidden_gold: list, labels: list[str]) -> float | None: ...

    def teacher_logits(self, examples, teacher, dataset: Dataset, tokenizer, label2id: dict, data) -> list:
        """The ``teacher_logits`` column of soft labels: per example the teacher's (``teacher[i]``) or, where it is
        None, the gold one-hot, aligned with ``dataset``'s labels."""


TASKS: dict[str, SelfTrainingTask] = {"ner": NER_TASK, "classification": CLASSIFICATION_TASK}
# Per-task defaults, applied unless the flag is given.
TASK_DEFAULTS = {name: task.self_training_defaults for name, task in TASKS.items()}


@dataclass
class SelfTrainingDataArguments(NerDataArguments, ClassificationDataArguments):
    """Where the labelled, unlabelled and evaluation data come from: the NER and classification recipes' data
    arguments (each task reads its own), plus the unlabelled data."""

    FLAG_HELP = {
        "dataset_name": (
            "'demo' (NER: WNUT-16 tweets; classification: BBC News; offline) or a Hub dataset. Ignored when "
            "--train_file is given."
        ),
        "train_file": "Labelled data. NER: CoNLL or JSON lines; classification: CSV or JSON lines.",
        "split_seed": "Seed of the 80/10/10 split of single-split data and of --unlabeled_fraction.",
    }

    task: str = field(default="ner", metadata={"help": "The task.", "choices": list(TASKS)})
    unlabeled_file: str | None = field(
        default=None,
        metadata={
            "help": "Unlabelled data. NER: JSON lines with --tokens_column, or one word per line (first column) "
            "with a blank line between sentences; classification: CSV or JSON lines with --text_column."
        },
    )
    unlabeled_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Instead of --unlabeled_file: hold out this share in (0, 1) of the training split and remove its "
            "labels (e.g. 0.9 keeps 10%% labelled)."
        },
    )
    max_unlabeled_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N unlabelled examples."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not allowed; choose one of {', '.join(map(repr, TASKS))}")
        if (self.unlabeled_file is None) == (self.unlabeled_fraction is None):
            raise ValueError(
                "give exactly one of unlabeled_file or unlabeled_fraction (e.g. --unlabeled_fraction 0.9)"
            )
        if self.unlabeled_fraction is not None and not 0.0 < self.unlabeled_fraction < 1.0:
            raise ValueError(f"unlabeled_fraction={self.unlabeled_fraction} is not allowed; it must be in (0, 1)")
        if self.text_pair_column is not None or self.multi_label:
            raise ValueError(
                "text_pair_column and multi_label are not supported by self-training (one text, one label)"
            )


@dataclass
class SelfTrainingArguments:
    """How pseudo-labels are made and used."""

    confidence_threshold: float = field(
        default=0.0,
        metadata={
            "help": "Drop pseudo-labels whose confidence is below this value in [0, 1]: the largest softmax "
            "probability of a text, the smallest one over the words of a sentence (NER). 0 keeps all."
        },
    )
    soft_labels: bool = field(
        default=False,
        metadata={
            "help": "Distil the teacher's logits at --distill_temperature (weight --distill_alpha; the rest is "
            "cross-entropy on the argmax label) instead of training on hard argmax pseudo-labels."
        },
    )
    rounds: int = field(default=1, metadata={"help": "Teacher -> student rounds (>= 1); a student teaches the next."})

    def __post_init__(self):
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold} is not allowed; it must be in [0, 1]")
        if int(self.rounds) != self.rounds or self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} is not allowed; it must be an integer >= 1")


@dataclass
class SelfTrainingModelArguments(ModelArguments):
    """The teacher's and the student's starting models."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "The teacher's starting model: a folder, a Hub id, or a raw state-dict file. Default: the "
            "all-MiniLM-L6-v2 encoder shipped by the demo extra."
        },
    )
    student_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The students' starting model (same forms). Default: the teacher's."}
    )


# ---- Data ---------------------------------------------------------------------------------------------------------


def setup_data(task: SelfTrainingTask, data: SelfTrainingDataArguments) -> dict:
    """Read everything (and fail on bad input) before any training: labelled, unlabelled, validation, test, labels."""
    splits, labels, train, eval_examples = task.read_labelled(data)
    hidden_gold = None
    if data.unlabeled_file:
        labelled = train
        unlabeled = task.read_unlabeled(data.unlabeled_file, data)
        source = data.unlabeled_file
    else:
        labelled, held_out = split_examples(
            train, (1.0 - data.unlabeled_fraction, data.unlabeled_fraction), seed=data.split_seed
        )
        # The labels are removed from what the teacher sees; they only measure the pseudo-labels' accuracy.
        hidden_gold = [ex[task.label_key] for ex in held_out]
        unlabeled = [{k: v for k, v in ex.items() if k not in (task.label_key, "tag_lines")} for ex in held_out]
        source = splits["train"][1]
    unlabeled = unlabeled[: data.max_unlabeled_samples]
    hidden_gold = None if hidden_gold is None else hidden_gold[: len(unlabeled)]
    if not labelled:
        raise DataError(splits["train"][1], None, "no labelled examples left; lower --unlabeled_fraction")
    if not unlabeled:
        raise DataError(source, None, "no unlabelled examples; raise --unlabeled_fraction or --max_unlabeled_samples")
    return {
        "labels": labels,
        "labelled": labelled,
        "unlabeled": unlabeled,
        "hidden_gold": hidden_gold,
        "eval": eval_examples,
    }


# ---- Model, training, evaluation ---------------------------------------------------------------------------------


def build_model(task: SelfTrainingTask, model_path: str, model_args, labels: list[str], training_args):
    set_seed(training_args.seed)  # the fresh classifier head of every stage starts from the same seed
    return task.load_model(model_args, labels, model_path, training_args)


def train_and_evaluate(task: SelfTrainingTask, model, tokenizer, train_dataset, eval_sets, training_args, output_dir):
    """Train one stage (teacher or student), save it; return the trained model, the job's accelerator and the
    validation / test metrics (the trainer, with its optimizer state, is let go). ``eval_sets``: per split,
    ``(dataset, compute_metrics)`` (``task.evaluation_sets``)."""
    args = copy.deepcopy(training_args)
    args.output_dir = str(output_dir)
    trainer = TricksTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=TeacherLogitsCollator(task.collator(tokenizer), tokenizer.padding_side),
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
        tricks=user_tricks(args),
    )
    train_result = trainer.train()
    exit_if_preempted(trainer, "self-training does not resume: rerun it")  # --- Preemption ---
    merge_trained_adapter(trainer)  # --peft lora --merge_lora true: the stage is saved and scored merged
    trainer.save_model()
    metrics = {"train_loss": train_result.metrics.get("train_loss"), "train_samples": len(train_dataset)}
    for split, prefix in (("validation", "eval"), ("test", "test")):
        if split in eval_sets:
            dataset, trainer.compute_metrics = eval_sets[split]
            metrics.update(trainer.evaluate(dataset, metric_key_prefix=prefix))
    trainer.save_state()  # trainer_state.json with the scores: `nlp-tricks plot` draws each stage
    return trainer.model, trainer.accelerator, metrics


def pseudo_label(
    task: SelfTrainingTask, model, accelerator, tokenizer, unlabeled, data, threshold, batch_size, desc, crf=None
):
    """The teacher's pseudo-labels for the unlabelled examples (every process gets all of them); NER with a ``crf``
    labels each sentence with its Viterbi path."""
    dataset, word_ids = task.tokenize_unlabeled(unlabeled, tokenizer, data.max_seq_length)
    logits = predict_logits(
        model,
        dataset,
        DataCollatorWithPadding(tokenizer),
        batch_size=batch_size,
        accelerator=accelerator,
        desc=desc,
    )
    return task.pseudo_labels(logits, word_ids, threshold, crf=crf)


def pseudo_label_accuracy(task: SelfTrainingTask, pseudo, hidden_gold: list, labels: list[str]) -> float | None:
    """Accuracy of the kept pseudo-labels against the held-out gold (per text, or per word for NER)."""
    if not pseudo.indices:
        return None
    return task.pseudo_label_accuracy(pseudo, hidden_gold, labels)


def student_dataset(task: SelfTrainingTask, tokenizer, labelled, pseudo_ex, pseudo, label2id, data, soft: bool):
    """Labelled + pseudo-labelled training examples; with ``soft``, each carries ``teacher_logits``."""
    examples = [*labelled, *pseudo_ex]  # the labelled examples may be a dataset (Arrow), the pseudo-labelled a list
    dataset = task.tokenize(examples, tokenizer, label2id, data, train=True)
    if not soft:
        return dataset
    teacher = [None] * len(labelled) + list(pseudo.logits)
    column = task.teacher_logits(examples, teacher, dataset, tokenizer, label2id, data)
    return Dataset.from_dict({**dataset.to_dict(), "teacher_logits": [c.tolist() for c in column]})


# ---- Results ------------------------------------------------------------------------------------------------------


def format_table(task: SelfTrainingTask, rounds: list[dict]) -> str:
    """One row per round and model: pseudo-labels kept and the task's validation / test metrics."""
    keys = task.table_metrics
    header = ["round", "model", "pseudo-labels kept", *keys]
    rows = []
    for r in rounds:
        kept = f"{r['pseudo_labels']['kept']}/{r['pseudo_labels']['unlabeled']}"
        for role in ("teacher", "student"):
            values = [f"{r[role][k]:.4f}" if r[role].get(k) is not None else "-" for k in keys]
            rows.append([str(r["round"]), role, kept if role == "student" else "-", *values])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def train_teacher(task: SelfTrainingTask, data, data_args, model_args, training_args, out: Path) -> dict:
    """Round 1's teacher, trained on the labelled data only: ``{"model", "tokenizer", "accelerator", "metrics"}``."""
    labels = data["labels"]
    label2id = {label: i for i, label in enumerate(labels)}
    model, tokenizer = build_model(
        task, resolve_model_path(model_args.model_name_or_path), model_args, labels, training_args
    )
    labelled_dataset = task.tokenize(data["labelled"], tokenizer, label2id, data_args, train=True)
    model, accelerator, metrics = train_and_evaluate(
        task,
        model,
        tokenizer,
        labelled_dataset,
        task.evaluation_sets(data["eval"], tokenizer, labels, data_args),
        training_args,
        out / "round_1" / "teacher",
    )
    return {"model": model, "tokenizer": tokenizer, "accelerator": accelerator, "metrics": metrics}


def run_round(
    r: int, task: SelfTrainingTask, teacher: dict, data, data_args, st_args, model_args, training_args, out: Path
):
    """One round: the teacher pseudo-labels, a fresh student trains on labelled + kept pseudo-labelled data.

    Returns the round's record and the student, who teaches the next round.
    """
    labels = data["labels"]
    label2id = {label: i for i, label in enumerate(labels)}
    pseudo = pseudo_label(
        task,
        teacher["model"],
        teacher["accelerator"],
        teacher["tokenizer"],
        data["unlabeled"],
        data_args,
        st_args.confidence_threshold,
        training_args.per_device_eval_batch_size,
        desc=f"round {r}: pseudo-labelling",
        crf=getattr(teacher["model"], "crf", None) if training_args.crf else None,
    )
    pseudo_ex = task.pseudo_examples(data["unlabeled"], pseudo, labels)
    pseudo_stats = {
        "unlabeled": len(data["unlabeled"]),
        "kept": len(pseudo.indices),
        "mean_confidence": float(np.nanmean(pseudo.confidence)) if len(pseudo.confidence) else None,
    }
    if data["hidden_gold"] is not None:
        pseudo_stats["accuracy_of_kept"] = pseudo_label_accuracy(task, pseudo, data["hidden_gold"], labels)

    student_path = resolve_model_path(model_args.student_model_name_or_path or model_args.model_name_or_path)
    model, tokenizer = build_model(task, student_path, model_args, labels, training_args)
    train_dataset = student_dataset(
        task, tokenizer, data["labelled"], pseudo_ex, pseudo, label2id, data_args, st_args.soft_labels
    )
    model, accelerator, metrics = train_and_evaluate(
        task,
        model,
        tokenizer,
        train_dataset,
        task.evaluation_sets(data["eval"], tokenizer, labels, data_args),
        training_args,
        out / f"round_{r}" / "student",
    )
    record = {"round": r, "teacher": teacher["metrics"], "student": metrics, "pseudo_labels": pseudo_stats}
    return record, {"model": model, "tokenizer": tokenizer, "accelerator": accelerator, "metrics": metrics}


def main() -> None:
    data_args, st_args, model_args, training_args = start_recipe(
        (SelfTrainingDataArguments, SelfTrainingArguments, SelfTrainingModelArguments, TricksArguments),
        "self_training",
        RECIPE_DEFAULTS,
        dependent_defaults=("task", TASK_DEFAULTS),
        description=__doc__,
        # A teacher or student trained with --crf stays a CRF.
        saved_crf_models=("model_name_or_path", "student_model_name_or_path"),
        reads=("model_name_or_path", "student_model_name_or_path", "tokenizer_name"),
        resumes=False,  # self-training does not resume: a stopped run is rerun from its start
    )
    task = TASKS[data_args.task]
    out = Path(training_args.output_dir)

    # ---- Data: read everything (and fail on bad input) before any training ----
    data = setup_data(task, data_args)
    check_label_arguments(training_args, data["labels"])
    if training_args.crf and not task.supports_crf:
        raise DataError(None, None, "--crf true is for --task ner (a CRF over the words of a sentence)")
    if training_args.span_head is not None:
        raise DataError(
            None, None, f"--span_head {training_args.span_head}: self-training pseudo-labels tags, not spans"
        )
    if st_args.soft_labels and (training_args.crf or training_args.class_weights is not None):
        raise DataError(
            None,
            None,
            "--soft_labels true distils per-token logits; it does not combine with --crf or --class_weights",
        )

    # ---- Round 1's teacher on the labelled data, then teacher -> student rounds ----
    teacher = train_teacher(task, data, data_args, model_args, training_args, out)
    rounds = []
    for r in range(1, st_args.rounds + 1):
        record, teacher = run_round(r, task, teacher, data, data_args, st_args, model_args, training_args, out)
        rounds.append(record)

    if is_main_process():
        results = {
            "task": data_args.task,
            "labelled": len(data["labelled"]),
            "unlabeled": len(data["unlabeled"]),
            "confidence_threshold": st_args.confidence_threshold,
            "soft_labels": st_args.soft_labels,
            "distill_temperature": training_args.distill_temperature if st_args.soft_labels else None,
            "distill_alpha": training_args.distill_alpha if st_args.soft_labels else None,
            "rounds": rounds,
        }
        write_json_atomic(out / "self_training_results.json", results)
        print(format_table(task, rounds), flush=True)
        print_summary(
            rounds[-1]["student"],  # the headline: the last round's student, the model a user takes
            out,
            model_dir=out / f"round_{len(rounds)}" / "student",
            metrics_file="self_training_results.json",
            predict_script=str(Path(sys.argv[0]).with_name(f"{data_args.task}.py")),
            predict_data_flags={f.name for f in dataclasses.fields(DataArguments)},
        )


if __name__ == "__main__":
    run_recipe(main)
