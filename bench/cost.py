"""What verifying and drafting cost on this machine: the verify cost curve of the target, and each drafter's own
draft step against one one-token target forward."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from selfspec.core.families import FAMILIES, Family
from selfspec.decode.adaptive import CURVE_SIZES, verify_cost_curve
from selfspec.bench.methods import Method
from selfspec.decode.cache import commit_kv
from selfspec.decode.drafters import VanillaDrafter
from selfspec.decode.engine import prefill
from selfspec.decode.hybrid import HybridDrafter
from selfspec.cpu_kernels.linear_kernels import decoding_kernels
from selfspec.decode.session import Session
from selfspec.decode.settings import required
from selfspec.decode.step import tree_forward
from selfspec.decode.types import Drafter, root_only


def cost_curves(base: Session, cfg: Any) -> dict:
    """The verify cost curve with PyTorch's linear layers (what HF generate runs) and, where the engine swaps them,
    with the engine's small-batch ones."""
    c = required(cfg, ("curve_sizes", "curve_cache_length", "curve_repeats"))
    sizes = [int(x) for x in (c["curve_sizes"] or CURVE_SIZES)]
    length, repeats = int(c["curve_cache_length"]), int(c["curve_repeats"])
    model = base.target.model
    curves = {"torch": verify_cost_curve(model, length, sizes, repeats)}
    if base.decoder.small_batch:
        curves["small_batch"] = verify_cost_curve(model, length, sizes, repeats, linear_kernel="small_batch")
    return {"cache_length": length, "repeats": repeats, "curves": curves}


def standalone(drafter: Drafter) -> Drafter:
    """The drafter whose own draft step a method's cost is: a hybrid's trained drafter (the suffix drafter's part
    runs no forward), else the drafter itself."""
    return drafter.inner if isinstance(drafter, HybridDrafter) else drafter


def draft_steps(family: Family, levels: int) -> int:
    """The draft steps a proposal of ``levels`` tree levels runs: one forward per level where the family's row says
    ``forward_per_level`` (EAGLE trees, layer-skip chains), one per proposal for the others (Medusa's heads, a DFlash
    block, the suffix drafter's lookup)."""
    return max(1, levels) if family.forward_per_level else 1


@torch.no_grad()
def draft_step_cost(method: Method, ids: list[int], repeats: int = 9,
                    clock: Callable[[], float] = time.perf_counter) -> dict | None:
    """What one draft step of ``method``'s drafter costs against one one-token target forward, after a prefill of
    ``ids`` (medians of ``repeats``, timed by ``clock``): a whole proposal at the drafter's full depth (no adaptive
    cut), and per draft step (one proposal for Medusa and the suffix drafter, one draft forward per level for EAGLE
    trees and layer-skip chains: :func:`draft_steps`). A hybrid's trained drafter is measured alone. None for
    HF methods and plain decoding."""
    if not method.engine:
        return None
    decoder = method.decoder
    drafter = standalone(decoder.drafter)
    if isinstance(drafter, VanillaDrafter):
        return None
    prompt = decoder.prompt_tensor(ids)
    with decoding_kernels(decoder.model, *drafter.modules(), plan=decoder.row_plan, plans=decoder.row_plans):
        state, out = prefill(decoder.model, prompt, method.session.sampling, torch.Generator().manual_seed(0))
        drafter.start(state, out)
        propose, forward = [], []
        for _ in range(repeats):
            t0 = clock()
            draft = drafter.propose(state, max_depth=64)
            t1 = clock()
            commit_kv(state.cache, state.length, [])  # rows a drafter wrote into the target's cache (layer-skip)
            tree_forward(decoder.model, state, root_only(state, decoder.device))
            t2 = clock()
            commit_kv(state.cache, state.length, [])
            propose.append(t1 - t0)
            forward.append(t2 - t1)
    levels = int(draft.tree.max_depth)
    steps = draft_steps(FAMILIES[method.family], levels)
    p, f = statistics.median(propose), statistics.median(forward)
    return {"propose_ms": 1000 * p, "forward_ms": 1000 * f, "levels": levels, "nodes": int(draft.tree.num_nodes),
            "draft_steps": steps, "step_vs_forward": p / steps / f}
