"""The defaults every recipe shares (recipes/common/parsing.py `run_defaults`) that a first run meets: logging as a
share of the run from its first step, and no pinned memory without an accelerator; each one the user's flag wins."""

import pytest
from transformers import TrainingArguments

from nlp_tricks import TricksArguments

import common
from common import parsing
from ner import NerDataArguments

NER_TYPES = (NerDataArguments, common.ModelArguments, TricksArguments)


def parse(*argv):
    return parsing.parse_recipe_args(NER_TYPES, "ner", argv=list(argv))[-1]


def test_logging_is_a_share_of_the_run_from_its_first_step():
    args = parse()
    # The Trainer reads a logging_steps below 1 as that share of the run's steps (rounded up): about 50 points.
    assert args.logging_steps == parsing.LOGGING_SHARE == 0.02 and args.logging_first_step is True
    assert TrainingArguments("x", logging_steps=0.02).logging_steps == 0.02  # upstream keeps the share as given
    given = parse("--logging_steps", "7", "--logging_first_step", "false")
    assert (given.logging_steps, given.logging_first_step) == (7, False)


def test_eval_steps_of_a_steps_strategy_are_not_the_logging_share():
    # Upstream's eval_steps falls back to logging_steps: 50 evaluations a run with the share; a tenth of it instead.
    assert parse("--eval_strategy", "steps").eval_steps == parsing.EVAL_SHARE == 0.1
    assert parse("--eval_strategy", "steps", "--eval_steps", "3").eval_steps == 3
    assert parse("--eval_strategy", "steps", "--logging_steps", "4").eval_steps == 4  # upstream's rule, as given
    # Keeping the best model saves at evaluations, which a share would not divide: an evaluation at every save.
    best = ("--eval_strategy", "steps", "--save_strategy", "steps", "--load_best_model_at_end", "true")
    assert parse(*best).eval_steps == 500 and parse(*best, "--save_steps", "30").eval_steps == 30


@pytest.mark.parametrize("accelerator", [False, True])
def test_pinned_memory_is_off_without_an_accelerator_unless_asked(monkeypatch, accelerator):
    monkeypatch.setattr(parsing, "has_accelerator", lambda: accelerator)
    assert parse().dataloader_pin_memory is accelerator  # with one: the Trainer's default (True)
    assert parse("--dataloader_pin_memory", "true").dataloader_pin_memory is True
    assert parse("--dataloader_pin_memory", "false").dataloader_pin_memory is False
