"""How much of the CPUs other processes used while this one measured the machine's speed.

selfspec measures a few things once per machine and keeps them in its cache: the kernel plan of a model's linear
layers (cpu_kernels/linear_kernels.py) and a model's verify cost curve (decode/adaptive.py). A measurement taken
while another process works (a compile, a training run, a second decode) is not this machine's speed, and kept, it
misleads every later decode: a plan measured beside a C++ build on a 2-core AMD EPYC (Zen 4) padded one row to
width 1 where width 2 runs 2.2x faster there, and left plain decoding at 20 tokens/s instead of 28
(docs/journal/2026-12-04-busy-plan.md). So a measurement watches the machine (:class:`OthersLoad`) and is kept only
when the others were quiet.

Linux's ``/proc/stat`` gives the CPUs' busy and total time, this process's own CPU time (all its threads) comes from
``os.times()``: the others' share is their busy time over the CPUs' total. Where ``/proc/stat`` cannot be read, or
the window was too short to tell, the share is unknown and the measurement is kept, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BUSY_SHARE = 0.2  # others using a fifth of all CPU time: one other process busy on 40% of one of 2 cores
MIN_TICKS = 20  # a window shorter than this many clock ticks over all CPUs (0.1 s of 2 CPUs): too coarse to tell


@dataclass(frozen=True)
class CpuTimes:
    """Clock ticks: every CPU's busy and total time since boot, and this process's own CPU time."""

    busy: float
    total: float
    own: float


def cpu_times() -> CpuTimes | None:
    """The CPUs' times now, or None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [float(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user and nice]
    total = sum(values[:8])
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    own = os.times()
    return CpuTimes(busy=total - idle, total=total, own=(own.user + own.system) * ticks)


def others_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share of all CPUs' time between two readings that other processes used (0..1), or None when unknown."""
    if before is None or after is None or after.total - before.total < MIN_TICKS:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / (after.total - before.total)))


class OthersLoad:
    """A ``with`` block watched for other processes' CPU use: ``share`` after it (None: unknown), ``quiet`` whether
    a measurement taken inside it is this machine's own speed."""

    def __init__(self) -> None:
        self.share: float | None = None
        self._before: CpuTimes | None = None

    def __enter__(self) -> "OthersLoad":
        self._before = cpu_times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = others_share(self._before, cpu_times())

    @property
    def quiet(self) -> bool:
        return self.share is None or self.share < BUSY_SHARE

    def describe(self) -> str:
        return "unknown" if self.share is None else f"{self.share:.0%}"


__all__ = ["BUSY_SHARE", "CpuTimes", "OthersLoad", "cpu_times", "others_share"]
