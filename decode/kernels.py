"""Linear layers that stay cheap for the few rows speculative decoding feeds them on a CPU.

A tree-verify forward runs every linear layer of the target on N rows (the tree's nodes), and a drafter runs its
layers on a handful of rows per step. With N = 1 PyTorch takes a matrix-vector kernel that reads each weight once;
from N = 2 on it calls the BLAS ``sgemm`` as ``x @ W.T``, and on the CPUs measured (MKL, AVX2) a forward over 2..16
rows then costs about twice a one-row forward (docs/benchmarks.md, the cost curve): the GEMM handles the large weight
as the operand it packs, an extra pass over memory the weight-bound forward pays in full. Computing the same product
as ``(W @ x.T).T`` makes the small activation the packed operand and streams the weight once, and padding the rows
to a multiple of 4 (8 above 8) keeps it on the BLAS's fastest widths: a forward over 2..4 rows then costs about what
one row costs, and one over 16 rows about 1.6x (docs/benchmarks.md).

:func:`small_batch_linears` swaps every plain ``nn.Linear`` of the given modules to :class:`SmallBatchLinear` (same
parameters, same state dict) for the duration of a ``with`` block and swaps them back after. The results are the
same products in another summation order (float rounding differs at the last bits, as between any two BLAS kernels).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from heads.errors import SettingError

MAX_ROWS = 64  # above this the ordinary x @ W.T kernel is as good (compute bound)
KERNELS = ("auto", "torch", "small_batch")


def padded_rows(rows: int) -> int:
    """Rows rounded up to a multiple of 4 (of 8 above 8): the widths the BLAS kernels run fastest on the CPUs
    measured (an 8-float AVX2 register); a forward over 3 or 6 rows otherwise costs more than one over 4 or 8."""
    return -(-rows // 4) * 4 if rows <= 8 else -(-rows // 8) * 8


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` computing ``(W @ x.T).T`` when the input has 2..MAX_ROWS rows on a CPU (see the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if not (1 < rows <= MAX_ROWS) or x.device.type != "cpu" or grad:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        padded = padded_rows(rows)
        if padded != rows:
            x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
        y = torch.mm(self.weight, x2.t()).t()[:rows]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_small_batch(kernel: str, device: torch.device | str) -> bool:
    """Whether ``linear_kernel=kernel`` means the small-batch linears on ``device`` (auto: on CPUs only)."""
    if kernel not in KERNELS:
        raise SettingError(f"linear_kernel={kernel!r}: use one of {', '.join(KERNELS)}.")
    return kernel == "small_batch" or (kernel == "auto" and torch.device(device).type == "cpu")


@contextmanager
def small_batch_linears(*modules: nn.Module | None, enabled: bool = True) -> Iterator[int]:
    """Within the block, every plain ``nn.Linear`` under ``modules`` is a :class:`SmallBatchLinear`; yields how many
    were swapped. Subclasses of ``nn.Linear`` (quantized, LoRA, ...) are left alone."""
    swapped: list[nn.Module] = []
    if enabled:
        for module in modules:
            if module is None:
                continue
            for sub in module.modules():
                if type(sub) is nn.Linear:  # a module reached twice is already swapped: no longer a plain nn.Linear
                    sub.__class__ = SmallBatchLinear
                    swapped.append(sub)
    try:
        yield len(swapped)
    finally:
        for sub in swapped:
            sub.__class__ = nn.Linear
