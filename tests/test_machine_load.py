"""cpu_kernels/machine_load.py: other processes' share of the CPUs while selfspec measures the machine's speed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from selfspec.cpu_kernels import machine_load
from selfspec.cpu_kernels.machine_load import BUSY_SHARE, MIN_TICKS, CpuTimes, OthersLoad, others_share


def test_the_others_share_is_their_busy_time_over_all_cpus_time_less_this_process_own():
    before = CpuTimes(busy=100.0, total=1000.0, own=20.0)
    # 400 ticks passed over all CPUs, 200 of them busy, 100 of those this process's own: others used 100 / 400
    assert others_share(before, CpuTimes(busy=300.0, total=1400.0, own=120.0)) == pytest.approx(0.25)
    # all the busy time this process's own: nobody else
    assert others_share(before, CpuTimes(busy=300.0, total=1400.0, own=220.0)) == 0.0
    # too short a window to tell, or no reading (not Linux): unknown
    assert others_share(before, CpuTimes(busy=110.0, total=1000.0 + MIN_TICKS - 1, own=20.0)) is None
    assert others_share(None, before) is None and others_share(before, None) is None


def test_an_unknown_share_counts_as_quiet_and_a_busy_one_does_not(monkeypatch):
    monkeypatch.setattr(machine_load, "cpu_times", lambda: None)
    with OthersLoad() as load:
        pass
    assert load.share is None and load.quiet and load.describe() == "unknown"
    readings = iter([CpuTimes(0.0, 0.0, 0.0), CpuTimes(busy=600.0, total=1000.0, own=100.0)])
    monkeypatch.setattr(machine_load, "cpu_times", lambda: next(readings))
    with OthersLoad() as load:
        pass
    assert load.share == pytest.approx(0.5) and not load.quiet and load.describe() == "50%"


@pytest.mark.skipif(machine_load.cpu_times() is None, reason="needs Linux's /proc/stat")
def test_processes_spinning_on_every_cpu_make_the_machine_busy():
    n = os.cpu_count() or 1
    spin = "import time\nend = time.perf_counter() + 0.8\nwhile time.perf_counter() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        time.sleep(0.1)  # they have started
        with OthersLoad() as load:
            time.sleep(0.5)  # this process idle: the busy time is theirs
    finally:
        for p in procs:
            p.wait()
    assert load.share is not None and load.share > BUSY_SHARE and not load.quiet


@pytest.mark.skipif(machine_load.cpu_times() is None, reason="needs Linux's /proc/stat")
def test_this_process_own_work_is_not_counted_as_the_others():
    start = machine_load.cpu_times()
    end = time.perf_counter() + 0.4
    while time.perf_counter() < end:
        pass
    after = machine_load.cpu_times()
    # whatever else runs beside the test, this process's own spinning is in ``own``, not in the others' time
    assert after.own - start.own >= 0.3 * os.sysconf("SC_CLK_TCK")
    assert after.busy - start.busy >= after.own - start.own - 2  # its ticks are among the CPUs' busy ones
