"""The k-fold runner's own flags (the recipe's go after ``--``) and what it refuses, each in one line (exit 2)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import sweep
from ablation import multi_label_requested
from ensemble_folder import TASKS
from kfold_data import REFUSED_FLAGS, given_flags
from kfold_plan import FOLD_SELECT, FOLD_STEPS

if TYPE_CHECKING:
    from kfold import KFold

RULES = ("none", "bias", "threshold", "temperature")
SOUPS = ("none", "uniform", "greedy")


def parser(description: str) -> argparse.ArgumentParser:
    """The runner's flags: the folds, the members (steps, seeds, selection, full-fit seeds), pseudo-labels, the
    student and its teacher, soups, decision rules, and the executor's flags."""
    p = argparse.ArgumentParser(
        prog="python recipes/kfold.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--recipe", required=True, choices=list(TASKS), help="the recipe each fold runs")
    p.add_argument(
        "--folds",
        type=int,
        required=True,
        help="K >= 2: how many folds (and fold models); 0: no folds, only --full_fit_seeds",
    )
    p.add_argument("--output_dir", required=True, help="where fold{k}/, the ensemble's files and results go")
    p.add_argument("--split_seed", type=int, default=42, help="seed of the shuffle that cuts the folds")
    _member_flags(p)
    p.add_argument(
        "--ensemble_vote",
        type=float,
        default=None,
        help="NER: combine the folds by entity vote instead of averaging: an entity is kept when at least "
        "this share in (0, 1] of the folds predict it (0.5: half of them)",
    )
    p.add_argument(
        "--unlabeled_file",
        default=None,
        help="unlabelled data for pseudo-labels (the self-training recipe's formats: NER .txt one sentence "
        "a line, JSON lines, or CoNLL words; classification CSV / JSON lines with --text_column)",
    )
    p.add_argument(
        "--confidence_threshold",
        type=float,
        default=0.0,
        help="pseudo-labels below this confidence in [0, 1] are dropped (a text's largest softmax "
        "probability, a sentence's smallest over its words); 0 keeps all",
    )
    p.add_argument(
        "--pseudo_label_rounds",
        type=int,
        default=1,
        help="with --unlabeled_file: rounds of fold-wise pseudo-labels after the first training (>= 1)",
    )
    p.add_argument(
        "--distill",
        default="false",
        choices=["true", "false"],
        help="true: also train one student on all the training data (and --unlabeled_file) against the "
        "ensemble's soft targets (or --teacher's), in DIR/student/",
    )
    p.add_argument(
        "--teacher",
        default=None,
        help="with --distill true: the student's teacher instead of this run's folds: a model folder, an "
        "ensemble folder or another k-fold run (out-of-fold targets for its training rows), of any "
        "architecture and tokenizer over the same labels",
    )
    _rule_flags(p)
    sweep.add_arguments(p, what="folds")
    return p


def _member_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fold_steps",
        default="match",
        choices=FOLD_STEPS,
        help="match (default): every fold trains for the single model's optimizer steps (--max_steps N, N "
        "the steps the recipe's flags take on the whole training split); epochs: the recipe's epochs over "
        "the fold's (K - 1) / K of the data, (K - 1) / K of the steps",
    )
    p.add_argument(
        "--fold_select",
        default="last",
        choices=FOLD_SELECT,
        help="last: each fold model as training ends; best: its checkpoint that scores best on its "
        "held-out fold (the out-of-fold score is then optimistic: those examples chose the checkpoint)",
    )
    p.add_argument(
        "--full_fit_seeds",
        type=int,
        default=0,
        help="N: also train N models on all the training data, each its own seed, the single model's "
        "steps, in DIR/full_fit/seed{k}/; DIR/full_fit/ is their ensemble folder",
    )
    p.add_argument(
        "--soup",
        default="none",
        choices=SOUPS,
        help="average the fold models' weights into one model in DIR/soup/ (with --folds 0, the full-fit "
        "seeds' in DIR/full_fit/soup/): uniform, or greedy (Wortsman et al. 2022: best member first, each next "
        "kept when the selection score does not drop; selected on --validation_file given after --, else on "
        "the training rows' held-out folds)",
    )


def _rule_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fit_rule",
        nargs="+",
        default=["none"],
        choices=RULES,
        help="decision rules fitted on the out-of-fold predictions, stored in DIR/decision_rule.json and "
        "applied when DIR predicts: bias (classification: per-class bias on the log-probabilities for "
        "macro-F-beta; NER tagging: per-type bias for entity F-beta), threshold (NER span head: per-type "
        "score thresholds), temperature (classification: temperature scaling for the log loss); several "
        "combine (temperature first)",
    )
    p.add_argument("--fit_beta", type=float, default=1.0, help="the beta of the F-beta the bias / threshold maximise")
    p.add_argument(
        "--fit_rule_runs",
        nargs="+",
        default=[],
        help="other k-fold runs of the same training data (other seeds): the rule is fitted on each run's "
        "out-of-fold predictions and the parameters are averaged",
    )


def check(p: argparse.ArgumentParser, args, recipe_flags: list[str]) -> None:
    """The runner's flags and the recipe flags it refuses, before anything runs: one line each (exit 2)."""
    args.distill = args.distill == "true"
    args.fit_rule = [] if args.fit_rule == ["none"] else args.fit_rule
    args.soup = None if args.soup == "none" else args.soup
    problems = [
        (args.folds < 0 or args.folds == 1, f"--folds {args.folds}: it must be >= 2, or 0 with --full_fit_seeds"),
        (args.folds == 0 and args.full_fit_seeds < 1, "--folds 0 trains no fold: give --full_fit_seeds N"),
        (args.full_fit_seeds < 0, f"--full_fit_seeds {args.full_fit_seeds}: it must be >= 0"),
        (bool(sweep.check_arguments(args)), sweep.check_arguments(args)),
        (
            args.ensemble_vote is not None and not 0.0 < (args.ensemble_vote or 0) <= 1.0,
            f"--ensemble_vote {args.ensemble_vote}: it must be in (0, 1]",
        ),
        (
            args.ensemble_vote is not None and args.recipe != "ner",
            "--ensemble_vote: entity voting is for --recipe ner",
        ),
        (
            not 0.0 <= args.confidence_threshold <= 1.0,
            f"--confidence_threshold {args.confidence_threshold}: it must be in [0, 1]",
        ),
        (args.pseudo_label_rounds < 1, f"--pseudo_label_rounds {args.pseudo_label_rounds}: it must be >= 1"),
        (args.folds == 0 and args.unlabeled_file, "--unlabeled_file: pseudo-labels are fold-wise; give --folds K"),
        (
            args.folds == 0 and args.distill and not args.teacher,
            "--distill true with --folds 0: the student's soft targets are out-of-fold; give --folds K or --teacher",
        ),
        (args.teacher is not None and not args.distill, "--teacher: it teaches the student; add --distill true"),
        (args.fit_rule and args.folds == 0, "--fit_rule: rules are fitted on out-of-fold predictions; give --folds"),
        (args.fit_rule_runs and not args.fit_rule, "--fit_rule_runs: give --fit_rule too"),
        (args.fit_beta <= 0, f"--fit_beta {args.fit_beta}: it must be > 0"),
        (args.fold_select == "best" and args.folds == 0, "--fold_select best: it selects on the held-out folds"),
    ]
    for bad, message in problems:
        if bad:
            p.error(message)
    _check_rules(p, args)
    _check_recipe_flags(p, args, recipe_flags)


def _check_rules(p: argparse.ArgumentParser, args) -> None:
    if len(set(args.fit_rule)) != len(args.fit_rule) or ("none" in args.fit_rule):
        p.error(f"--fit_rule {' '.join(args.fit_rule)}: give each rule once, or none alone")
    if args.recipe == "classification" and "threshold" in args.fit_rule:
        p.error("--fit_rule threshold: per-type span thresholds are for --span_head; classification takes bias")
    if args.recipe == "ner" and "temperature" in args.fit_rule:
        p.error("--fit_rule temperature: temperature scaling is for classification (one distribution per text)")
    if args.ensemble_vote is not None and args.fit_rule:
        p.error("--fit_rule with --ensemble_vote: a vote counts entities; rules adjust averaged scores")


def _check_recipe_flags(p: argparse.ArgumentParser, args, recipe_flags: list[str]) -> None:
    if recipe_flags and recipe_flags[0].endswith((".yaml", ".yml", ".json")) and not recipe_flags[0].startswith("-"):
        p.error(f"{recipe_flags[0]}: give the recipe's flags after --, not a config file")
    given = given_flags(recipe_flags)
    for name, why in REFUSED_FLAGS.items():
        if name in given:
            p.error(f"--{name} after --: {why}")
    if args.recipe == "classification" and multi_label_requested(recipe_flags):
        p.error("--multi_label: k-fold ensembles here are single-label (stratified folds, mean probabilities)")
    if args.unlabeled_file and "text_pair_column" in given:
        p.error("--unlabeled_file: pseudo-labels are for one text per example (no --text_pair_column)")
    if args.distill and "class_weights" in given:
        p.error("--distill true: the student learns soft targets (teacher_logits), which --class_weights do not weigh")


def check_parsed(p: argparse.ArgumentParser, args, run: KFold) -> None:
    """What the parsed recipe flags do not combine with (every fold trains; a span head's scores are no
    probabilities and cannot be distilled; selection needs evaluation)."""
    training_args = run.training_args
    if training_args.do_train is False:
        p.error("--do_train false after --: every fold trains")
    span_head = training_args.span_head if args.recipe == "ner" else None
    if span_head is not None and args.distill:
        p.error(
            f"--distill true with --span_head {span_head}: a student distils per-token soft targets "
            "(teacher_logits), which a span head does not take; drop --distill"
        )
    if span_head is not None and args.confidence_threshold > 0:
        p.error(
            f"--confidence_threshold {args.confidence_threshold} with --span_head {span_head}: span scores are "
            "not probabilities, so a span model's pseudo-labels keep every sentence; leave it at 0"
        )
    if span_head is None and "threshold" in args.fit_rule:
        p.error("--fit_rule threshold: per-type span thresholds need --span_head after --; tagging takes bias")
    if span_head is not None and "bias" in args.fit_rule:
        p.error(f"--fit_rule bias with --span_head {span_head}: a span head takes per-type thresholds (threshold)")
    if args.soup == "greedy" and not args.folds and run.data_args.validation_file is None:
        p.error(
            "--soup greedy with --folds 0: the seed models saw every training row; give --validation_file after -- "
            "to select on, or --soup uniform"
        )
