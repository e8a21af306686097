"""The types the engine and every drafter share: what a step reads and writes, and the Drafter protocol.

The engine (decode/engine.py) and the drafters (decode/drafters.py, decode/eagle_drafter.py, ...) both import this
module (and decode/step.py, the step's shared pieces, which imports this one) and not each other. Here too: what
is done to a draft on its way to verification (:func:`truncate_draft`, :func:`on_device`, :class:`DepthControl`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from transformers import DynamicCache

from selfspec.decode.tree import Tree, single_node_tree
from selfspec.decode.verify import Verdict
from selfspec.core.errors import SelfspecError


class DecodeSetupError(SelfspecError, ValueError):
    """The decode config asks for something that cannot be run; the message says what to change."""


@dataclass
class ForwardOutput:
    """What a target forward gives the verifier and the drafter (batch dimension dropped)."""

    logits: torch.Tensor  # [N, V] (prefill: [1, V], the last prompt position only)
    hidden_states: tuple[torch.Tensor, ...]  # num_layers + 1 tensors [N, H]; [-1] is after the final norm

    @property
    def hidden(self) -> torch.Tensor:
        """[N, H] the last layer's output after the final norm: the input of the LM head."""
        return self.hidden_states[-1]


@dataclass
class Draft:
    """A drafter's proposal: tokens laid out on a tree."""

    tokens: torch.Tensor  # [N] long on the target's device; tokens[0] is the root == state.next_token
    tree: Tree  # on the same device
    probs: torch.Tensor | None = None  # [N, V] distribution node i's token was drafted from; None: deterministic


@dataclass
class DecodeState:
    """Where decoding stands between steps."""

    cache: DynamicCache  # `length` positions in every layer
    prompt_ids: torch.Tensor  # [T] long
    length: int  # positions in the cache: the prompt + every emitted token except the last
    next_token: int  # the last emitted token, not yet in the cache: the root of the next tree
    hidden: torch.Tensor  # [H] last-layer hidden state at position length - 1 (the one that chose next_token)
    new_tokens: list[int] = field(default_factory=list)  # emitted tokens, next_token last
    steps: int = 0  # target forwards after the prefill
    done: bool = False
    finish_reason: str | None = None  # eos | length | stop | context

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_ids.shape[0])


def root_only(state: DecodeState, device: torch.device) -> Draft:
    """The root alone: a plain decoding step."""
    return Draft(tokens=torch.tensor([state.next_token], device=device), tree=single_node_tree().to(device))


@dataclass(frozen=True)
class Beside:
    """What another drafter already put in a hybrid tree, for a depth policy weighing its own drafter beside it
    (decode/hybrid.py): its ``nodes`` (the root included), the tokens it is expected to yield (``expected``, the
    target's own included) and the chance that its first level misses (``miss``), the steps on which the other
    drafter's chain is the one that can add tokens. The root alone: 1 node, 1 token, always a miss."""

    nodes: int = 1
    expected: float = 1.0
    miss: float = 1.0


ROOT = Beside()


class DepthPolicy(Protocol):
    """How deep the next draft may go (decode/adaptive.py: :class:`~selfspec.decode.adaptive.AdaptiveDepth`); 0 skips
    drafting and runs a plain step. Every step is reported back. :class:`DepthControl` is what calls it."""

    def choose(self, max_depth: int, beside: Beside = ROOT) -> int:
        """A depth in 0..max_depth for the next draft, in a tree that already holds ``beside`` (a hybrid's other
        drafter's nodes; a policy may ignore it)."""

    def expected(self, depth: int) -> float:
        """The tokens a step whose draft reaches ``depth`` is expected to yield, the target's own included (a hybrid
        weighs the suffix drafter's candidates beside them)."""

    def observe(self, asked: int, draft: Draft, accepted: int | None, draft_seconds: float) -> None:
        """The draft verified after asking for depth ``asked``, how many drafted nodes were accepted (None: a step
        whose acceptance does not count, its draft's size and time still do), and the seconds drafting took (propose
        and commit hooks)."""


class Drafter(Protocol):
    """What the engine calls. ``state`` is read-only to a drafter.

    The contract is :meth:`propose` and :meth:`on_commit` (plus :meth:`start` and :meth:`modules`); the attributes
    after them are optional capabilities, declared with their defaults on :class:`DrafterBase`, which a family
    overrides when it offers them."""

    verify_forward: Callable[..., ForwardOutput] | None
    verify_share: float
    max_draft_depth: int | None

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        """After the prompt's forward: ``prefill.hidden_states`` are [T, H] for every prompt position (a drafter
        with its own KV cache fills it here); ``state.next_token`` is the first new token."""

    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        """Tokens over a tree whose root (tokens[0]) is ``state.next_token``. Nodes deeper than ``max_depth`` are
        dropped by the engine (they could not all be emitted); a drafter may use it to skip work."""

    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        """After each commit: ``verdict.path`` are the accepted node ids (root first) of ``draft``, their target
        features are ``out.hidden_states[layer][verdict.path]``, and ``state.next_token`` is the target's new token.
        A drafter with its own cache keeps it in step here (drop rejected rows, append the accepted ones)."""

    def modules(self) -> Sequence[torch.nn.Module]:
        """The neural modules the drafter runs (the engine gives their linear layers its small-batch kernels)."""

    def draft_nodes(self, depth: int) -> int | None:
        """Tree nodes (the root included) of a draft cut to ``depth``, when known before drafting; else None."""

    def depth_control(self, control: DepthControl) -> DepthControl:
        """The engine's ``control`` (its depth policy and step clock) at the start of a decode; returns the one the
        engine applies to the whole draft."""


class DrafterBase:
    """No-op hooks, no modules, and every optional capability at its default; subclasses implement ``propose``.

    Optional capabilities (override what the family offers):

    - ``verify_forward(model, state, draft, head=None) -> ForwardOutput``: replaces the engine's one target forward
      over the tree (decode/layerskip.py: the draft already ran the first layers on its tokens). It must leave every
      cache layer with ``state.length + N`` rows, as that forward would, and return at least the final hidden
      states; ``head``, when the engine passes one (greedy verification on a CPU), gives the logits from them
      (cpu_kernels/greedy_head.py: exact in their argmax only).
      None (the default): one target forward over the tree (decode/step.py:tree_forward).
    - ``verify_share``: the share of a full target forward that verifying a draft runs (adaptive depth scales the
      verify cost curve by it); 1 unless ``verify_forward`` skips work its draft already did.
    - ``max_draft_depth``: the deepest draft it proposes (a static tree's depth, a dynamic tree's or chain's
      levels); None when it does not say (adaptive depth then learns it from the first draft).
    - ``draft_nodes(depth)``: how many tree nodes (the root included) a draft cut to ``depth`` holds, when the
      family knows it before drafting (a static tree, a dynamic tree's budget, a block); None when it does not.
      Adaptive depth weighs each depth's verify cost by it from the first step, instead of guessing a chain.
    - ``depth_control(control)``: the engine's depth control (its policy and step clock) at the start of each
      decode; the default returns it, and the engine applies the policy to every draft. A drafter that applies it
      to a part of its draft instead (decode/hybrid.py: to its trained drafter's part, beside the suffix drafter's
      nodes) keeps it and returns one without a policy on the same clock.
    """

    verify_forward: Callable[..., ForwardOutput] | None = None
    verify_share: float = 1.0
    max_draft_depth: int | None = None

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        return None

    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        return None

    def modules(self) -> Sequence[torch.nn.Module]:
        return ()

    def draft_nodes(self, depth: int) -> int | None:
        return None

    def depth_control(self, control: DepthControl) -> DepthControl:
        return control

    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        raise NotImplementedError


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
