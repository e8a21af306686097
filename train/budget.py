"""A time budget for a training run (``trainer.max_minutes``): the step count sized from the run's own pace.

A recipe written as a step count takes an hour on one machine and two on a slower one (the same 2-core VM trained at
very different paces on two days: docs/benchmarks.md, training throughput). With ``trainer.max_minutes`` the budget
covers the whole run
from the start of :func:`train.loop.train`: loading the target and data, building a feature store, the steps, their
evaluations and checkpoints, the final evaluation. ``trainer.max_steps`` stays the cap.

1. **Sizing.** After :data:`PROBE_STEPS` steps past this process's first :data:`WARMUP_STEPS` (whose one-off costs would
   count too much), :func:`fitting_steps` sizes the run from the pace of those steps (checkpoints included, evaluations
   not), the time left, and an evaluation's estimated cost (one training step's time per evaluation batch: an evaluation
   runs forwards only, so this errs long). The learning-rate schedule is rebuilt for that count once, early, so it still
   warms up and decays in full, and the count is recorded in every checkpoint: a resumed run trains to the same count,
   as the run would have that was never stopped (a run killed before its sizing sizes itself when resumed).
2. **The hard stop.** Should the machine slow down afterwards, the run stops at the first step that ends past the
   budget (:meth:`TimeBudget.spent`): it evaluates, checkpoints and saves its heads there, with the schedule's tail
   untrained, and says so. A resumed run's clock starts with its own process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# A process's first WARMUP_STEPS steps are left out of the pace (its allocator, caches and the feature store's first
# reads from disk make them slow: on the DFlash hour recipe they ran well below the pace of the steps after them and of
# the whole run, docs/journal/2026-12-01-figures-from-code.md); the next PROBE_STEPS steps size the run (a small share
# of that recipe's hour).
WARMUP_STEPS = 50
PROBE_STEPS = 100


def now() -> float:
    """The budget's clock (seconds; ``time.perf_counter``)."""
    return time.perf_counter()


def fitting_steps(step: int, left_s: float, step_s: float, eval_s: float, eval_every: int, cap: int) -> int:
    """The last step a run now at ``step`` can reach within ``left_s`` seconds when a step takes ``step_s`` and an
    evaluation ``eval_s`` (one every ``eval_every`` steps before the last, and one at the end; 0: only at the end),
    at most ``cap`` and at least ``step``."""
    lo, hi = 0, max(cap - step, 0)  # the largest n in [lo, hi] whose cost fits (the cost grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _cost(step, mid, step_s, eval_s, eval_every) <= left_s:
            lo = mid
        else:
            hi = mid - 1
    return step + lo


def _cost(step: int, n: int, step_s: float, eval_s: float, eval_every: int) -> float:
    last = step + n
    evals = 1 + ((last - 1) // eval_every - step // eval_every if eval_every else 0)
    return n * step_s + evals * eval_s


@dataclass
class TimeBudget:
    """``trainer.max_minutes`` for one process: its clock (:func:`now`) started at ``started``, the start of the run.
    :meth:`observe` after every optimizer step says whether the run is to be sized now."""

    seconds: float
    started: float
    first_step: int | None = None  # this process's first step
    probe_from: tuple[int, float] | None = None  # (step, clock) where the probe's steps start
    eval_seconds: float = 0.0  # time spent in evaluations since probe_from
    sized: bool = False  # the count is set (by this process, or recorded in the checkpoint it resumed from)
    probe: dict = field(default_factory=dict)  # what sizing measured, for its message

    def elapsed(self) -> float:
        return now() - self.started

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def observe(self, step: int) -> bool:
        """Called after optimizer step ``step``: True when the probe's steps are done and the run is not sized yet."""
        if self.sized:
            return False
        if self.first_step is None:
            self.first_step = step
        if self.probe_from is None:
            if step - self.first_step + 1 >= WARMUP_STEPS:
                self.probe_from, self.eval_seconds = (step, now()), 0.0
            return False
        return step - self.probe_from[0] >= PROBE_STEPS

    def size(self, step: int, cap: int, eval_batches: int, eval_every: int) -> int:
        """The step count that fits (:func:`fitting_steps`), from the probe's pace; marks the run sized."""
        first, t0 = self.probe_from
        step_s = max(now() - t0 - self.eval_seconds, 0.0) / (step - first)
        eval_s = eval_batches * step_s
        left = self.seconds - self.elapsed()
        self.sized = True
        self.probe = {"step_s": step_s, "eval_s": eval_s, "left_s": left}
        return fitting_steps(step, left, step_s, eval_s, eval_every, cap)


__all__ = ["PROBE_STEPS", "TimeBudget", "WARMUP_STEPS", "fitting_steps"]
