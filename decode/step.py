"""The pieces of a decode step that the engine and the drafters share: one target forward over a draft's tree, a
draft cut to a depth and moved to the target's device, the step's clock (:class:`StepClock`), and
:class:`DepthControl`, the one place a depth policy is applied. The engine (decode/engine.py) and the drafters
(decode/hybrid.py, decode/layerskip.py, ...) import this module and decode/types.py, not each other."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from selfspec.decode.tree import tree_attention_mask, tree_position_ids
from selfspec.decode.types import ROOT, Beside, DecodeState, DepthPolicy, Draft, Drafter, ForwardOutput, root_only
from selfspec.core.target import cache_kwarg

if TYPE_CHECKING:
    from selfspec.decode.greedy_head import GreedyHead


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that wall-clock timings are honest; a no-op on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tree_forward(model: torch.nn.Module, state: DecodeState, draft: Draft,
                 head: "GreedyHead | None" = None) -> ForwardOutput:
    """One target forward over the draft's N tokens on top of the cache (which grows by N rows). ``head``: greedy
    verification's LM head (decode/greedy_head.py): the model computes no logits (``logits_to_keep`` selects none),
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


def truncate_draft(draft: Draft, max_depth: int) -> Draft:
    """Drop nodes deeper than max_depth (keeps token budgets and positions inside their limits)."""
    if draft.tree.max_depth <= max_depth:
        return draft
    keep = (draft.tree.depth <= max_depth).nonzero()[:, 0]  # [N'] ascending
    return Draft(
        tokens=draft.tokens[keep], tree=draft.tree.truncate(max_depth),
        probs=draft.probs[keep] if draft.probs is not None else None,
    )


def on_device(draft: Draft, device: torch.device) -> Draft:
    """The draft on the target's device (a no-op when the drafter already put it there)."""
    if draft.tokens.device == device and draft.tree.device == device:
        return draft
    probs = draft.probs.to(device) if draft.probs is not None else None
    return Draft(tokens=draft.tokens.to(device), tree=draft.tree.to(device), probs=probs)


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


@dataclass(frozen=True)
class DepthControl:
    """A drafter's drafts under a depth policy: where the policy chooses how deep a draft goes, the draft is cut to
    that depth, and the policy hears how the draft did. The engine (decode/engine.py) owns one per decode, over its
    drafter, and hands it to a drafter that applies it to a part of its draft (``Drafter.depth_control``: a hybrid,
    decode/hybrid.py, to its trained drafter's part). ``policy`` None: every draft as deep as the budget allows.
    ``clock``: what a draft's seconds are read with for the policy (the engine's :class:`StepClock`, which waits for
    the device's queued work whenever a policy reads the times)."""

    policy: DepthPolicy | None
    clock: Callable[[], float] = time.perf_counter

    def draft(self, drafter: Drafter, state: DecodeState, room: int, device: torch.device,
              beside: Beside = ROOT) -> tuple[int, Draft]:
        """(the depth asked, the draft cut to it on ``device``); ``room``: the tokens left after the target's own;
        ``beside``: what another drafter already put in the tree (a hybrid's suffix nodes), which the policy weighs
        the draft against. At depth 0 the drafter is not called: the root alone, a plain step."""
        depth = room if self.policy is None else min(room, self.policy.choose(room, beside))
        draft = drafter.propose(state, max_depth=depth) if depth > 0 else root_only(state, device)
        return depth, on_device(truncate_draft(draft, depth), device)

    def expected(self, depth: int) -> float:
        """Tokens a step whose draft reaches ``depth`` is expected to yield, the target's own included (1 without a
        policy or a draft)."""
        return 1.0 if self.policy is None or depth == 0 else self.policy.expected(depth)

    def observe(self, asked: int, draft: Draft, accepted: int | None, draft_seconds: float) -> None:
        if self.policy is not None:
            self.policy.observe(asked, draft, accepted, draft_seconds)
