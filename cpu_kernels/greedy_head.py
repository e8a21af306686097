"""Greedy verification's LM head in bfloat16, with the float32 argmax kept exactly.

Greedy verification reads one thing from the target's logits: each node's argmax. On a CPU the LM head is a large
share of a decode forward's weight traffic (SmolLM2-135M: 28M of its 135M weights), and a CPU with native bfloat16
products reads it in half the bytes. :class:`GreedyHead` computes the head
in bfloat16, bounds each logit's error, and computes again in float32 only the vocabulary rows that could still be
the argmax:

- ``approx = fl_bf16(bf16(h) . bf16(W_r))`` (operands rounded to nearest, products accumulated in float32, the result
  rounded to bfloat16) is within ``c * |h| * |W_r|`` of the exact logit ``h . W_r``: each operand's rounding
  contributes a relative ``u = 2**-8`` per product, float32 accumulation over ``H`` products at most
  ``gamma_H = H 2**-24 / (1 - H 2**-24)`` of the sum of their magnitudes, and the output's rounding ``u`` of the
  result; Cauchy-Schwarz turns the sum of magnitudes into ``|h| |W_r|`` (:func:`error_factor`). The bound holds for
  any summation order, so for any kernel that accumulates in float32 (oneDNN's, PyTorch's). A float32 product of the
  same row is within ``gamma_H |h| |W_r|`` of the exact logit too, so ``radius = (c + gamma_H) |h| |W_r|`` bounds
  the distance between the approximation and any float32 kernel's logit.
- The row norms ``|W_r|`` are computed once, in float64 and rounded up; each position's ``|h|`` per step. Every row
  whose upper bound ``approx + radius`` reaches the largest lower bound ``max(approx - radius)`` is a *candidate*. A
  row outside has a float32 logit below that lower bound, which some candidate's float32 logit reaches: the float32
  argmax is a candidate. The candidates' logits are computed again in float32 and written over their
  approximations.
- So the returned row's argmax is a float32 product's: the candidates hold float32 values, and every other entry
  holds an approximation below the largest of them. Ties resolve to the lowest index, as ``argmax`` does. Between
  two float32 kernels (this one's and the model's own) logits differ at the last bits, as between any two BLAS
  kernels; greedy output stays the target's (the engine's tests compare with HF ``generate``).

Only the argmax is exact: the other logits are not the model's, so the head serves greedy verification only
(sampling needs the whole distribution): the engine's own tree forward (:func:`selfspec.decode.step.tree_forward`)
reads it, and so does a drafter's own verify forward (layer-skip's). It is used where it pays: the first time a
model's head is read on a machine, one bfloat16 product (with its bound) is timed against the float32 one, and taken
only if clearly faster (``SPEEDUP``), as on a CPU with native bfloat16 products (AVX-512 BF16, AMX). A model whose
logits are not its ``lm_head`` applied to its last hidden state (a soft cap, a scale) is left alone: the engine
checks that on the prefill, once per head (:meth:`GreedyHead.fits`).

On SmolLM2-135M on a 2-core AMD EPYC (Zen 5) the head ran faster this way for one row and for a tree's rows, and so
did a decode step, timed interleaved on and off (docs/journal/2026-12-01-figures-from-code.md).
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.cpu_kernels.linear_kernels import _packed_product, can_pack, pack_weight

BF16_UNIT = 2.0 ** -8  # bfloat16's unit roundoff, round to nearest (8 significant bits)
FP32_UNIT = 2.0 ** -24
MARGIN = 1.0 + 2.0 ** -10  # on the radius: covers the float32 rounding of the norms and of approx +- radius
SPEEDUP = 0.8  # used where the bfloat16 head with its bound takes at most this share of the float32 head's time
TIMING_REPEATS = 7


def error_factor(hidden_size: int) -> float:
    """``c + gamma_H``, where ``|fl_bf16(bf16(h) . bf16(w)) - h . w| <= c |h| |w|`` for vectors of ``hidden_size``
    with float32 accumulation in any order, and ``gamma_H |h| |w|`` bounds a float32 product's own error (module
    doc): ``c`` is ``(1+u)^2 - 1`` for the rounded operands, ``gamma_H (1+u)^2`` for the accumulation, and ``u (1 +
    both)`` for the rounded result."""
    n = hidden_size * FP32_UNIT
    if n >= 0.5:
        raise ValueError(f"hidden size {hidden_size} is too large for the float32 accumulation bound.")
    gamma = n / (1 - n)
    operands = (1 + BF16_UNIT) ** 2 - 1
    accumulated = operands + gamma * (1 + BF16_UNIT) ** 2
    return accumulated + BF16_UNIT * (1 + accumulated) + gamma


class GreedyHead:
    """An LM head's weight ``[V, H]`` (float32) read in bfloat16, with the float32 argmax kept (module doc)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"GreedyHead needs a float32 [vocab, hidden] weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}.")
        weight = weight.detach()
        self.weight = weight
        low = weight.to(torch.bfloat16)
        self.packed = pack_weight(low) if can_pack(low) else None
        self.low = None if self.packed is not None else low
        self.norms = (weight.double().norm(dim=1) * (1 + 2.0 ** -40)).float()  # [V], rounded up from float64
        self.max_norm = float(self.norms.max())
        self.factor = error_factor(weight.shape[1]) * MARGIN
        self.candidates = 0  # candidate rows recomputed, summed over positions (for tests and reports)
        self.positions = 0
        self.reads_model: bool | None = None  # the model's logits are this head on its last hidden state (fits)

    def fits(self, model: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> bool:
        """Whether ``model``'s logits are its head on its last hidden state (:func:`matches_model` on one forward's
        ``hidden`` and ``logits``, a prefill's), checked once."""
        if self.reads_model is None:
            self.reads_model = matches_model(model, hidden, logits)
        return self.reads_model

    def approximate(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32: the bfloat16 product."""
        low = hidden.to(torch.bfloat16)
        y = _packed_product(low, self.packed) if self.packed is not None else F.linear(low, self.low)
        return y.float()

    def scale(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, 1]: each position's radius per unit of row norm."""
        return self.factor * hidden.norm(dim=1, keepdim=True)

    def radius(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V]: the bound on the distance between each approximate logit and a float32 one."""
        return self.scale(hidden) * self.norms

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] float32 -> [N, V] float32 whose row argmaxes are the float32 product's (module doc).

        A first, cheap filter keeps the rows within ``2 scale max|W_r|`` of a position's largest approximation
        (``radius_r = scale |W_r|``): a row below that has an upper bound under the largest approximation's lower
        bound. Among those rows (they include every row whose lower bound is the largest), the floor and the
        candidates are computed with each row's own radius."""
        approx = self.approximate(hidden)
        scale = self.scale(hidden)  # [N, 1]
        wide = approx.amax(dim=1, keepdim=True) - 2 * self.max_norm * scale  # [N, 1]
        if not bool(torch.isfinite(wide).all()):  # an overflow or a NaN: no bound to trust
            return F.linear(hidden, self.weight)
        near = (approx >= wide).any(dim=0).nonzero()[:, 0]  # [R'] rows any position keeps
        values, radius = approx[:, near], scale * self.norms[near]  # [N, R']
        floor = (values - radius).amax(dim=1, keepdim=True)  # [N, 1]: the largest lower bound
        candidate = values + radius >= floor  # [N, R']
        rows = near[candidate.any(dim=0)]  # [R] any position's candidates
        approx[:, rows] = F.linear(hidden, self.weight[rows])  # float32 values are right for every position
        self.candidates += int(candidate.sum())
        self.positions += hidden.shape[0]
        return approx


def plain_head(model: nn.Module) -> nn.Linear | None:
    """``model``'s ``lm_head`` if it is an ``nn.Linear`` without bias, else None."""
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) and head.bias is None else None


def matches_model(model: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether ``logits`` ([N, V], a forward's) are the model's ``lm_head`` applied to ``hidden`` ([N, H], its last
    hidden state), bit for bit: no soft cap, scale or bias the head would miss."""
    head = plain_head(model)
    if head is None:
        return False
    with torch.no_grad():
        return torch.equal(head(hidden), logits)


def _median_seconds(fn, repeats: int = TIMING_REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_HEADS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, GreedyHead | None]]" = weakref.WeakKeyDictionary()


def greedy_head(model: nn.Module) -> GreedyHead | None:
    """The :class:`GreedyHead` for ``model``'s LM head if it pays on this machine (kept while the model lives, made
    again if the weight changes), else None: not a float32 ``nn.Linear`` without bias on a CPU, or its bfloat16
    product with the bound not at most ``SPEEDUP`` of its own product's time (one row, timed once)."""
    head = plain_head(model)
    if head is None:
        return None
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    key = (weight.data_ptr(), tuple(weight.shape), weight._version if not weight.is_inference() else 0)
    kept = _HEADS.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    greedy = GreedyHead(weight)
    with torch.no_grad():
        x = torch.randn(1, weight.shape[1])
        bf16 = _median_seconds(lambda: greedy.logits(x))
        fp32 = _median_seconds(lambda: head(x))  # the model's own product, as decoding runs it
    greedy.candidates = greedy.positions = 0
    chosen = greedy if bf16 <= SPEEDUP * fp32 else None
    _HEADS[model] = (key, chosen)
    return chosen
