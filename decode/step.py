"""The pieces of a decode step that the engine and the drafters share: one target forward over a draft's tree, a
draft cut to a depth and moved to the target's device, the step's clock (:class:`StepClock`), and
:class:`DepthControl`, the one place a depth policy is applied. The engine (decode/engine.py) and the drafters
(decode/hybrid.py, decode/layerskip.py, ...) import this module and decode/types.py, not each other."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.decode.tree import tree_attention_mask, tree_position_ids
from selfspec.decode.types import DecodeState, Draft, ForwardOutput
from selfspec.core.target import cache_kwarg

if TYPE_CHECKING:
    from selfspec.cpu_kernels.greedy_head import GreedyHead


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that wall-clock timings are honest; a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tree_forward(model: torch.nn.Module, state: DecodeState, draft: Draft,
                 head: "GreedyHead | None" = None) -> ForwardOutput:
    """One target forward over the draft's N tokens on top of the cache (which grows by N rows). ``head``: greedy
    verification's LM head (cpu_kernels/greedy_head.py): the model computes no logits (``logits_to_keep`` selects none),
    and the returned ones come from ``head`` on its last hidden state, exact in their argmax only."""
    dtype = next(model.parameters()).dtype
    mask = tree_attention_mask(draft.tree, state.length, dtype if dtype.is_floating_point else torch.float32,
                               model.config)
    keep = {} if head is None else {"logits_to_keep": torch.empty(0, dtype=torch.long, device=draft.tokens.device)}
    out = model(
        input_ids=draft.tokens[None],  # [1, N]
        attention_mask=mask,  # [1, 1, N, length + N], or a dict of them by layer kind
        position_ids=tree_position_ids(draft.tree, state.length),  # [1, N]
        use_cache=True,
        **{cache_kwarg(model): state.cache},
        output_hidden_states=True,
        **keep,
    )
    hidden = tuple(h[0] for h in out.hidden_states)
    logits = out.logits[0] if head is None else head.logits(hidden[-1])
    return ForwardOutput(logits=logits, hidden_states=hidden)


@dataclass(frozen=True)
class StepClock:
    """Wall-clock readings within a step; ``sync``: each after the device's queued work, for an honest split between
    drafting and verifying (a GPU waits at each, so only when timings are asked for or a depth policy reads them)."""

    device: torch.device
    sync: bool

    def __call__(self) -> float:
        if self.sync:
            synchronize(self.device)
        return time.perf_counter()


