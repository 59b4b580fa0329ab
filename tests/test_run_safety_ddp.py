"""Run safety under 2-process DDP (tests/scripts/run_safety_ddp.py): a NaN loss on one process stops both at the
same step; a folder another run holds is refused on both; the main process alone holds the lock of a free folder."""

import json

import pytest

from nlp_tricks.runtime.lock import lock_output_dir
from recipe_helpers import launch_ddp_script


@pytest.mark.slow  # 2 processes (gloo on CPU), three short runs: ~1 min on 2 shared cores
def test_every_process_takes_the_same_decision(tmp_path):
    with lock_output_dir(tmp_path / "held"):  # this (pytest) process is the other run
        launch_ddp_script("run_safety_ddp.py", tmp_path)
    reports = [json.loads((tmp_path / f"report_rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2
        # Only rank 1's loss was NaN (its gradients finite): rank 0 stopped at the same step all the same.
        assert report["diverged"].startswith("TrainingDivergedError: training diverged at step 3: the loss is nan")
        assert report["diverged_step"] == 3 and report["steps_when_diverged"] == 3, f"rank {rank}"
        assert report["busy"].startswith(f"OutputDirBusyError: {tmp_path / 'held'} is in use by another run"), rank
        assert report["free_error"] is None and report["free_steps"] == 5
        assert report["lock_seen_while_training"] is True
    assert reports[0]["lock_left_after"] is False
    assert not (tmp_path / "diverged" / "checkpoint-3").exists()
