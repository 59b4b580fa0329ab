"""Preemption-safe training: a signal or a time budget stops training after a whole optimizer step, with one complete
checkpoint written at that step, on every process at the same step.

Spot instances, Kubernetes, SLURM, Kaggle and Colab end jobs with SIGTERM (SLURM's ``--signal`` can send SIGUSR1)
and a grace period, or at a fixed wall-clock limit. :class:`PreemptionCallback` turns either into a graceful stop:

- The signal handler only sets a flag. At the next step boundary (``on_step_end``: after the optimizer step, the
  scheduler step and the EMA update) the flag of every process is combined (one all-reduce of one number, ``max``),
  and if any process has it, every process sets ``control.should_save`` and ``control.should_training_stop``: the
  Trainer's own ``_save_checkpoint`` then writes ``checkpoint-N`` for the step just finished (model, optimizer,
  scheduler, every process's RNG, ``trainer_state.json`` with the data position and the tricks' state; TricksTrainer
  adds the EMA), ``trainer_state.json`` last, and training ends. An evaluation due at that step is skipped: the grace
  period is for the checkpoint.
- A deadline (``max_time``) stops training the same way when the next step, the evaluation or save due with it, and
  the final checkpoint would not fit before it: estimated from the measured step, evaluation and save times.

Upstream's ``enable_jit_checkpoint`` handler saves from inside the step (``on_pre_optimizer_step``, labelled with the
previous step) and on its own process only; :func:`install_preemption` replaces it.
:attr:`PreemptionCallback.stopped_by` tells the caller that training stopped early (TricksTrainer:
``trainer.preempted``); recipes then exit with :data:`PREEMPTED_EXIT_CODE`. See docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import signal
import threading
import time
from collections import deque

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PreemptionCallback",
    "describe_stop",
    "install_preemption",
    "parse_duration",
    "process_start_time",
    "set_time_budget",
]

logger = logging.getLogger(__name__)

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the run is neither finished (0) nor
# broken (1), and unlike 143 (128 + SIGTERM, what a shell reports for a process SIGTERM killed) it also covers the
# time budget and says that a complete checkpoint was written.
PREEMPTED_EXIT_CODE = 75

# The signals that mean "you are about to be stopped": SIGTERM (Kubernetes, Docker, SLURM at the time limit, spot
# reclaims), SIGUSR1 (SLURM's --signal=USR1@seconds ahead of the time limit). Not on Windows.
PREEMPTION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))

# The stop code each process contributes to the all-reduce (max wins): 0 none, 1 the deadline, else 1 + the signal
# number, so a signal outranks the deadline and SIGTERM (15) outranks SIGUSR1 (10).
_DEADLINE_CODE = 1

# Until a checkpoint save has been timed: this many bytes per second written, plus a fixed cost.
_GUESSED_SAVE_BYTES_PER_SECOND = 100e6
_GUESSED_SAVE_OVERHEAD = 1.0

_DURATION_RE = re.compile(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")

# The process-wide deadline set by set_time_budget (recipes' --max_time): every PreemptionCallback without its own
# deadline uses it, so a recipe that trains several models in turn (self-training) stops within one budget.
_process_deadline: float | None = None


# ---- Time budget ----------------------------------------------------------------------------------------------------


def parse_duration(text: str | float | int) -> float:
    """Seconds in a duration written as ``8h45m``, ``30m``, ``90s``, ``1d2h``, ``1.5h`` or a plain number of seconds.

    Raises ``ValueError`` (naming the value and the accepted forms) for anything else, and for a duration that is
    not positive.
    """
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        value = text.strip().lower()
        try:
            seconds = float(value)
        except ValueError:
            match = _DURATION_RE.fullmatch(value)
            if not value or match is None:
                raise ValueError(
                    f"{text!r} is not a duration; write it as 8h45m, 30m, 90s or a number of seconds"
                ) from None
            days, hours, minutes, secs = (float(g) if g else 0.0 for g in match.groups())
            seconds = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{text!r}: a time budget must be a positive duration")
    return seconds


def process_start_time() -> float:
    """When this process started (``time.time()`` scale): a wall-clock budget counts the imports and data loading
    too. ``time.time()`` now where the start cannot be read."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or the process table unreadable
        return time.time()


def set_time_budget(max_time: str | float | None, start: float | None = None) -> float | None:
    """Set (or with ``None`` clear) the process-wide deadline: ``start`` (default: when this process started) plus
    ``max_time`` (a duration :func:`parse_duration` reads). Returns the deadline (``time.time()`` scale).

    Every :class:`PreemptionCallback` without a deadline of its own stops training gracefully before it.
    """
    global _process_deadline
    if max_time is None:
        _process_deadline = None
    else:
        _process_deadline = (process_start_time() if start is None else start) + parse_duration(max_time)
    return _process_deadline


# ---- The callback ---------------------------------------------------------------------------------------------------


class PreemptionCallback(TrainerCallback):
    """Stops training after a whole optimizer step, with a complete checkpoint of that step, on a preemption signal
    (``signals``, installed while training runs) or before a ``deadline``; every process stops after the same step.

    Args:
        signals (`tuple`, defaults to SIGTERM and SIGUSR1): the signals that request the stop; ``()`` for none.
        deadline (`float`, *optional*): a ``time.time()`` by which training should have stopped and saved; default:
            the process-wide one of :func:`set_time_budget`, if any.
        margin (`float`, defaults to 1.25): the estimated time of the next step and the final save is multiplied by
            it before it is compared with the time left.

    After ``train()``: :attr:`stopped_by` is ``None`` (training ran to its end) or what stopped it (``"SIGTERM"``,
    ``"SIGUSR1"``, ``"max_time"``), and :attr:`stop_step` the step of the checkpoint written.
    """

    def __init__(self, signals: tuple = PREEMPTION_SIGNALS, deadline: float | None = None, margin: float = 1.25):
        self.signals = tuple(signals)
        self.deadline = deadline
        self.margin = margin
        self.stopped_by: str | None = None
        self.stop_step: int | None = None
        # The code of the first signal received since the handlers were installed (set by the handler only).
        self._received = 0
        self._previous_handlers: dict = {}
        self._active = False  # whether step boundaries check and combine (the same on every process)
        self._step_started: float | None = None
        self._step_times: deque[float] = deque(maxlen=20)
        self._eval_time = 0.0
        self._save_time: float | None = None
        self._mark: float | None = None  # the last step boundary, evaluation or save
        self._deadline: float | None = None  # this train() call's: `deadline`, else the process-wide one
        self._stash_best: str | None = None
        self._model_bytes = 0
        # The cost of combining the flag across processes, for docs/checkpoints.md.
        self.sync_seconds = 0.0
        self.syncs = 0

    # -- signal handlers --

    def _handle(self, signum, frame):
        # Only set a flag: the step in progress finishes, and the save happens at its boundary, in the main loop.
        if not self._received:
            self._received = 1 + signum

    def install_signal_handlers(self) -> None:
        """Install the handlers for :attr:`signals` (remembering the previous ones). Only from the main thread,
        where Python runs signal handlers; elsewhere a warning says signals keep their current handling."""
        if not self.signals or self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("training runs outside the main thread: preemption signals cannot be caught there")
            return
        # Reset here, not at on_train_begin: a signal during the setup before it (a checkpoint loading) counts.
        self._received = 0
        for signum in self.signals:
            self._previous_handlers[signum] = signal.signal(signum, self._handle)

    def restore_signal_handlers(self) -> None:
        """Put back the handlers that were there before :meth:`install_signal_handlers`."""
        previous, self._previous_handlers = self._previous_handlers, {}
        for signum, handler in previous.items():
            # None: the previous handler was not installed from Python; the default is the best approximation.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    @contextlib.contextmanager
    def signal_handlers(self):
        """Within: the preemption signals are caught; after (also when training raised), handled as before."""
        self.install_signal_handlers()
        try:
            yield
        finally:
            self.restore_signal_handlers()

    # -- events --

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.stopped_by = None
        self.stop_step = None
        self._stash_best = None
        self._step_times.clear()
        self._eval_time = 0.0
        self._save_time = None
        self._mark = None
        self.sync_seconds = 0.0
        self.syncs = 0
        self._deadline = self.deadline if self.deadline is not None else _process_deadline
        # Decided from the arguments and the budget only, so that every process takes part in the all-reduce.
        self._active = bool(self.signals) or self._deadline is not None
        if self.signals:
            self.install_signal_handlers()
        # Before the workers start (when the epoch's iteration begins).
        self._protect_workers(kwargs.get("train_dataloader"))
        if model is not None:
            self._model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self._active and args.save_only_model:
            logger.warning(
                "save_only_model=True: a preemption checkpoint holds no optimizer, scheduler or RNG state, so "
                "resuming from it is not the uninterrupted run"
            )

    def _protect_workers(self, loader) -> None:
        # accelerate's loaders wrap a torch DataLoader (`base_dataloader`), whose attributes start the workers.
        loader = getattr(loader, "base_dataloader", loader)
        if self.signals and loader is not None and getattr(loader, "num_workers", 0) > 0:
            if not isinstance(loader.worker_init_fn, _WorkerIgnoresSignals):
                loader.worker_init_fn = _WorkerIgnoresSignals(self.signals, loader.worker_init_fn)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self._step_started is not None:
            self._step_times.append(now - self._step_started)
        self._mark = now
        if not self._active:
            return
        code = self._received
        if not code and self._deadline is not None and self._too_late(args, state):
            code = _DEADLINE_CODE
        code = self._combine(code, args)
        if not code:
            return
        self.stopped_by = "max_time" if code == _DEADLINE_CODE else signal.Signals(code - 1).name
        self.stop_step = state.global_step
        control.should_evaluate = False
        control.should_save = True
        control.should_training_stop = True
        logger.warning(
            f"{self.stopped_by}: stopping after step {state.global_step} and saving checkpoint-{state.global_step}"
        )

    def on_evaluate(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self._mark is not None:
            self._eval_time = max(self._eval_time, now - self._mark)
        self._mark = now

    def on_save(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self._mark is not None:
            self._save_time = now - self._mark
        self._mark = now
        if self.stopped_by is None:
            return
        # Upstream's end of training would load the best checkpoint and, with save_total_limit=1, delete every
        # other one: this one too. The run is being stopped, so neither; the state is put back at on_train_end.
        self._stash_best, state.best_model_checkpoint = state.best_model_checkpoint, None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # train() returns (and a recipe exits) only once every process has written its part: a launcher kills
            # the other processes as soon as one exits non-zero.
            torch.distributed.barrier()

    def on_train_end(self, args, state, control, **kwargs):
        if self._stash_best is not None:
            state.best_model_checkpoint, self._stash_best = self._stash_best, None
        self.restore_signal_handlers()

    # -- helpers --

    def _combine(self, code: int, args) -> int:
        """The largest stop code over all processes (one all-reduce of one number); this process's alone otherwise."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return code
        if torch.distributed.get_world_size() < 2:
            return code
        start = time.perf_counter()
        flag = torch.tensor([code], dtype=torch.int32, device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        code = int(flag.item())
        self.sync_seconds += time.perf_counter() - start
        self.syncs += 1
        return code

    def _too_late(self, args, state) -> bool:
        """Whether the next step (with an evaluation and a save due at it) and then a checkpoint save would end
        after the deadline, each estimated from this run's measurements, times :attr:`margin`."""
        save = self._save_time
        if save is None:
            save = _GUESSED_SAVE_OVERHEAD + 4 * self._model_bytes / _GUESSED_SAVE_BYTES_PER_SECOND
        upcoming = max(self._step_times, default=0.0)
        following = state.global_step + 1
        if args.eval_strategy == IntervalStrategy.STEPS and state.eval_steps and following % state.eval_steps == 0:
            upcoming += self._eval_time
        if args.save_strategy == SaveStrategy.STEPS and state.save_steps and following % state.save_steps == 0:
            upcoming += save
        return time.time() + self.margin * (upcoming + save) > self._deadline


class _WorkerIgnoresSignals:
    """A data-loader ``worker_init_fn``: the worker ignores the preemption signals, then runs the loader's own.

    Workers belong to the main process, which ends them. A signal sent to the whole process group (SLURM, a
    terminal) would otherwise kill them (torch's worker handler re-raises SIGTERM's default action), and the main
    process would fail on its next batch instead of saving. Runs after torch installs that handler.
    """

    def __init__(self, signals: tuple, init_fn=None):
        self.signals = signals
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        if self.init_fn is not None:
            self.init_fn(worker_id)


def install_preemption(trainer, deadline: float | None = None) -> PreemptionCallback:
    """Add a :class:`PreemptionCallback` to ``trainer`` (any ``transformers.Trainer``) in place of upstream's
    ``enable_jit_checkpoint`` handler, and return it.

    The signals are caught when ``trainer.args.enable_jit_checkpoint`` is set; a ``deadline`` (or the process-wide
    one of :func:`set_time_budget`) applies either way.
    """
    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "JITCheckpointCallback":
            manager = getattr(callback, "jit_manager", None)
            if manager is not None:
                previous = manager._original_sigterm_handler
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            trainer.callback_handler.remove_callback(callback)
    signals = PREEMPTION_SIGNALS if trainer.args.enable_jit_checkpoint else ()
    callback = PreemptionCallback(signals=signals, deadline=deadline)
    trainer.add_callback(callback)
    return callback


def describe_stop(callback: PreemptionCallback, resume_hint: str = "rerun with --resume_from_checkpoint true") -> str:
    """The one line a script prints when training was stopped early (``stopped by SIGTERM at step 7; ...``)."""
    reason = callback.stopped_by
    if reason == "max_time":
        reason = "--max_time"
    return f"stopped by {reason} at step {callback.stop_step}; {resume_hint}"
