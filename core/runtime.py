"""Runtime tuning shared by training and decoding: what the machine and its allocators need, not what is computed.

- :func:`native_bf16`: whether a device multiplies bfloat16 natively (else bf16 is emulated and slower);
- :func:`hold_freed_memory` / :func:`release_held_memory`: glibc's allocator keeps freed blocks for reuse, and gives
  their pages back on request;
- :func:`rows_through`: a row-wise function (an LM head) over rows padded to repeating shapes, which keeps oneDNN's
  per-shape caches on CPU from growing without bound;
- :func:`peak_memory` / :func:`peak_memory_bytes`: peak memory of a block, or of the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch


# --- bfloat16 ---------------------------------------------------------------------------------------------------------


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: CUDA, or a CPU with AVX512-BF16 or AMX (where a bf16 GEMM
    runs faster than a float32 one: docs/benchmarks.md, training throughput; without them PyTorch emulates bf16 and it
    is slower)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # absent from older PyTorch builds
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


# --- glibc's allocator ------------------------------------------------------------------------------------------------


@functools.cache
def _glibc():
    """glibc's C library, or None (not Linux, or another C library: musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def hold_freed_memory() -> bool:
    """Keep memory the process frees for its own reuse (glibc's allocator; elsewhere nothing changes): no block is
    served by mmap and the heap is never trimmed. A training step allocates and frees the same large tensors (logits,
    their softmax and gradients) every step; by default glibc maps each block over 32 MB afresh and returns it on
    free, so the kernel zeroes those pages again every step. Those tensors change size from step to step (the
    number of trained positions), so freed blocks do not always fit the next ones and the heap keeps growing: call
    :func:`release_held_memory` every so often. Returns whether the settings took."""
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1)) \
        and bool(libc.mallopt(m_top_pad, 2**28))


def release_held_memory() -> bool:
    """Give the pages of every free block back to the kernel (glibc's ``malloc_trim(0)``, which also releases whole
    free pages inside the heap, not only at its top); the blocks stay reusable. Returns whether any was released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# --- repeating shapes for CPU matrix products -------------------------------------------------------------------------


ROW_BUCKET = 128  # rows of a gathered matrix product are padded to a multiple of this (see rows_through)


def rows_through(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, multiple: int = ROW_BUCKET
                 ) -> torch.Tensor:
    """``fn(rows)`` for a row-wise ``fn`` (an LM head), with the rows [N, ...] zero-padded to a multiple of
    ``multiple`` and the result cut back to N rows: the same values and gradients. Training gathers the positions it
    trains on, so N changes every step; bfloat16 matrix products on CPU (oneDNN) keep kernels and buffers for each
    shape they meet, and a 1,550-step run grew by gigabytes until the kernel killed it. Padded, the shapes repeat."""
    n, extra = rows.shape[0], -rows.shape[0] % multiple
    if not extra:
        return fn(rows)
    return fn(torch.cat([rows, rows.new_zeros((extra, *rows.shape[1:]))]))[:n]


# --- peak memory ------------------------------------------------------------------------------------------------------


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since the last reset (:func:`peak_memory`) or the start of the process: CUDA's max allocated bytes
    on a GPU, else the process's peak resident set (VmHWM on Linux, ``ru_maxrss`` elsewhere)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict]:
    """Peak memory of the block in ``out["bytes"]`` (:func:`peak_memory_bytes` after resetting the peak: CUDA's
    peak statistics, or on Linux the process's VmHWM through /proc/self/clear_refs); None where the peak cannot be
    reset."""
    out: dict = {"bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resettable = True
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            resettable = True
        except OSError:
            resettable = False
    yield out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if resettable:
        out["bytes"] = peak_memory_bytes(device)


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


__all__ = ["ROW_BUCKET", "hold_freed_memory", "native_bf16", "peak_memory", "peak_memory_bytes",
           "release_held_memory", "rows_through"]
