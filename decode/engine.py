"""The speculative decoding loop: one verifier and one commit for every drafter. Batch size 1.

::

    state = prefill(model, prompt_ids)                       # cache the prompt, pick the first token
    while not done:
        draft = drafter.propose(state, max_depth)           # tokens over a tree, root = the last emitted token
        out = tree_forward(model, state, draft)             # one target forward over the whole tree
        verdict = verify(out.logits, draft.tokens, draft.tree, sampling)   # accepted branch + the target's token
        state = commit(state, draft, verdict, out)          # keep the accepted KV rows, drop the rest
        drafter.on_commit(state, draft, verdict, out)       # drafters with their own state follow the commit

The target is an unmodified Hugging Face CausalLM. Tree attention goes in through an additive 4D mask and explicit
position ids over a ``DynamicCache``; the next step's hidden state comes out of the same forward
(``output_hidden_states``), so each step costs exactly one target forward. Tree state travels as arguments, never
as attributes of the model.

Counting: the prefill forward emits the first token; every later forward (a "step") emits the accepted drafted
tokens plus one token from the target, so 1 .. depth + 1 tokens. ``tau`` is the mean number of tokens per step.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Callable, Protocol, Sequence

import torch

from selfspec.cpu_kernels.attention import GQA_SDPA
from selfspec.decode.cache import commit_kv, new_cache
from selfspec.cpu_kernels.greedy_head import GreedyHead, greedy_head
from selfspec.cpu_kernels.linear_kernels import decoding_kernels, measured_row_plan, measured_row_plans, use_small_batch
from selfspec.decode.step import StepClock, synchronize, tree_forward
from selfspec.decode.tree import Tree, single_node_tree
from selfspec.decode.types import (DecodeSetupError, DecodeState, DepthControl, DepthPolicy, Draft, Drafter,
                                   ForwardOutput)
from selfspec.decode.verify import Sampling, Verdict, verify
from selfspec.core.archs import context_limit
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.core.target import cache_kwarg

TREE_MASK_ATTENTION = ("sdpa", "eager", GQA_SDPA)  # GQA_SDPA: sdpa inside a decode (cpu_kernels/attention.py)


class Observer(Protocol):
    """What :meth:`SpeculativeDecoder.generate` shows an observer (train/online.py:Recorder): the prompt ids and the
    prefill's output, then each step's draft, verdict and verify output after the commit. An observer may also have
    ``between_steps()``, called after each step once its tokens are emitted and its drafting time is observed: work
    there (train/online.py's learning every N tokens) counts in ``DecodeStats.learn_s``, not as drafting."""

    def start(self, prompt_ids: torch.Tensor, out: ForwardOutput) -> None: ...

    def commit(self, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None: ...


class TreeAttentionError(SelfspecError, RuntimeError):
    """The target cannot run a tree-masked forward (no 4D attention mask or no explicit position ids)."""


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forwards after the prefill
    drafted: int = 0  # drafted nodes verified (tree size - 1, summed over steps)
    accepted: int = 0  # drafted nodes accepted
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafter: propose + commit hooks
    verify_s: float = 0.0  # target forward + acceptance + KV commit
    learn_s: float = 0.0  # an observer's work between steps (learning every N tokens), inside total_s
    total_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted by each step (bonus included)
    drafted_per_step: list[int] = field(default_factory=list)  # drafted nodes each step verified
    accepted_per_step: list[int] = field(default_factory=list)  # of those, accepted (before EOS / budget cuts)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward after the prefill, the target's own token included."""
        return sum(self.accept_lengths) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for per_step in ("accept_lengths", "drafted_per_step", "accepted_per_step"):
            d.pop(per_step)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens (EOS included when it ended the answer)
    finish_reason: str  # eos | length | stop | context
    stats: DecodeStats


# --- target checks --------------------------------------------------------------------------------------------------

_CHECKED_MODELS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def check_tree_attention(model: torch.nn.Module) -> None:
    """Raise TreeAttentionError unless the model gives tree nodes the logits of their own branch.

    Checks the attention implementation, then runs a 5-token probe once per model: two siblings after a short
    prefix must get the same logits as plain forwards over their own branches.
    """
    if model in _CHECKED_MODELS:
        return
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in TREE_MASK_ATTENTION:
        raise TreeAttentionError(
            f"The target uses attn_implementation={impl!r}, which cannot take a tree attention mask (a 4D additive "
            f"mask). Load it with attn_implementation='sdpa' (or 'eager'), e.g. model.attn_implementation=sdpa."
        )
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    base = vocab // 3  # ordinary tokens: special tokens can carry outsized activations and noisier logits
    prefix = (base + torch.tensor([0, 1], device=device)) % vocab
    tokens = (base + torch.tensor([2, 3, 4], device=device)) % vocab  # root, two children of the root
    tree = Tree.from_parents([-1, 0, 0]).to(device)
    try:
        with torch.no_grad():
            cache = new_cache()
            model(input_ids=prefix[None], use_cache=True, **{cache_kwarg(model): cache})
            state = DecodeState(cache=cache, prompt_ids=prefix, length=2, next_token=int(tokens[0]),
                                hidden=torch.empty(0))
            out = tree_forward(model, state, Draft(tokens=tokens, tree=tree))
            ref_a = model(input_ids=torch.cat([prefix, tokens[:2]])[None]).logits[0, -1]
            ref_b = model(input_ids=torch.cat([prefix, tokens[[0, 2]]])[None]).logits[0, -1]
            sees_sibling = model(input_ids=torch.cat([prefix, tokens])[None]).logits[0, -1]  # b after a: wrong
    except (TypeError, ValueError, RuntimeError, IndexError) as err:
        raise TreeAttentionError(
            f"The target ({type(model).__name__}) failed on a forward with a 4D attention mask, explicit "
            f"position_ids and a DynamicCache: {err}\nTree verification needs a Hugging Face CausalLM that takes "
            "all three (Llama, Qwen2, Mistral and most decoder-only models do, with attn_implementation sdpa/eager)."
        ) from err
    # Compared with how far a misread mask moves the logits, so the check holds in any dtype.
    err = max(float((out.logits[1] - ref_a).abs().max()), float((out.logits[2] - ref_b).abs().max()))
    gap = float((sees_sibling - ref_b).abs().max())
    if not err <= 0.1 * gap:
        raise TreeAttentionError(
            f"The target ({type(model).__name__}, attn_implementation={impl}) ignores or misreads the 4D tree "
            f"attention mask: a tree node's logits differ from a plain forward over its branch by {err:.3g} (a "
            f"node that sees its sibling differs by {gap:.3g}). Use attn_implementation=sdpa or eager, and a model "
            "whose forward passes attention_mask and position_ids through unchanged."
        )
    _CHECKED_MODELS[model] = True


# --- the loop as small functions ------------------------------------------------------------------------------------


def prefill(
    model: torch.nn.Module, prompt_ids: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[DecodeState, ForwardOutput]:
    """prompt_ids [T] -> state with the prompt cached and the first token chosen; and the prompt's forward output
    (logits [1, V] of the last position, hidden states [T, H] of every position)."""
    cache = new_cache()
    out = model(input_ids=prompt_ids[None], use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **{cache_kwarg(model): cache})
    fwd = ForwardOutput(logits=out.logits[0], hidden_states=tuple(h[0] for h in out.hidden_states))
    root = torch.zeros(1, dtype=torch.long, device=prompt_ids.device)
    first = verify(fwd.logits, root, single_node_tree().to(prompt_ids.device), sampling, generator=generator)
    state = DecodeState(
        cache=cache, prompt_ids=prompt_ids, length=len(prompt_ids), next_token=first.next_token,
        hidden=fwd.hidden[-1], new_tokens=[first.next_token],
    )
    return state, fwd


def commit(state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> DecodeState:
    """Keep the accepted branch's KV rows (in place) and move the root to the target's new token."""
    commit_kv(state.cache, state.length, verdict.path)
    last = verdict.path[-1]
    return replace(
        state,
        length=state.length + len(verdict.path),
        next_token=verdict.next_token,
        hidden=out.hidden[last],  # [H] the hidden state that chose next_token
        steps=state.steps + 1,
    )


@dataclass(frozen=True)
class StopRule:
    """When an answer ends."""

    max_new_tokens: int
    context: int  # prompt + new tokens may not exceed this
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, needed for stop strings

    def budget(self, state: DecodeState) -> int:
        """How many tokens the next step may still emit (>= 1 while not done)."""
        room = self.context - state.prompt_length
        return min(self.max_new_tokens, room) - len(state.new_tokens)

    def first_stop(self, tokens: list[int], start: int, prompt_length: int) -> tuple[int, str | None]:
        """tokens: every new token so far, the ones from ``start`` just emitted.
        Returns (how many tokens to keep, why decoding ends; None while it goes on)."""
        room = self.context - prompt_length
        window = 4 * max((len(s) for s in self.stop_strings), default=0) + 8  # tokens that can hold a stop string
        for i in range(start, len(tokens)):
            if tokens[i] in self.eos_token_ids:
                return i + 1, "eos"
            if self.stop_strings and self.decode is not None:
                text = self.decode(tokens[max(0, i + 1 - window) : i + 1])
                if any(s in text for s in self.stop_strings):
                    return i + 1, "stop"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
            if i + 1 >= room:
                return i + 1, "context"
        return len(tokens), None


def settle(state: DecodeState, emitted: list[int], rule: StopRule) -> tuple[DecodeState, list[int]]:
    """Append a step's emitted tokens, cut at EOS / a stop string / the budget, and mark the state done if so.
    Returns the new state and the tokens kept from ``emitted`` (what a stream shows)."""
    start = len(state.new_tokens)
    tokens = state.new_tokens + emitted
    keep, reason = rule.first_stop(tokens, start, state.prompt_length)
    return replace(state, new_tokens=tokens[:keep], done=reason is not None, finish_reason=reason), tokens[start:keep]


# --- the engine -----------------------------------------------------------------------------------------------------


def default_eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """EOS ids the target's generation config names (what HF generate stops on)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))


class SpeculativeDecoder:
    """Decode with a drafter and one tree-verify forward of the target per step. Batch size 1.

    ``model``: an unmodified Hugging Face CausalLM (sdpa or eager attention). ``drafter``: anything implementing
    :class:`selfspec.decode.types.Drafter`. ``eos_token_ids``: defaults to the model's generation config.
    ``decode``: token ids -> text, needed for stop strings (e.g. ``tokenizer.decode``).
    ``linear_kernel``: ``auto`` (the small-batch linears of :mod:`selfspec.cpu_kernels.linear_kernels` on a CPU,
    PyTorch's own elsewhere), ``small_batch`` or ``torch``; the model is swapped to them only while :meth:`generate`
    runs, padding rows as this machine's measured plan says
    (:func:`selfspec.cpu_kernels.linear_kernels.measured_row_plan`; the drafter's weights in another dtype, as its plan
    for them says: :func:`selfspec.cpu_kernels.linear_kernels.measured_row_plans`).
    ``depth_policy``: chooses each step how deep the draft may go (0: a plain step, the drafter not called), from what
    drafts of each depth earned so far (decode/adaptive.py); None lets every draft go as deep as the budget allows.
    The engine applies it to every draft, or hands it to a drafter that applies it to a part of its draft
    (``drafter.depth_control``: a hybrid, to its trained drafter's part), with the step's clock either way.
    ``greedy_head``: with the small-batch kernels and greedy acceptance, the engine's tree forward reads the LM head
    in bfloat16 with the float32 argmax kept exactly, where that is faster on this machine
    (cpu_kernels/greedy_head.py); False: the model's own head always.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        drafter: Drafter,
        eos_token_ids: Sequence[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        linear_kernel: str = "auto",
        depth_policy: DepthPolicy | None = None,
        greedy_head: bool = True,
    ):
        check_tree_attention(model)
        self.model = model
        self.drafter = drafter
        self.depth_policy = depth_policy
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else default_eos_ids(model)
        self.decode = decode
        self.device = next(model.parameters()).device
        self.linear_kernel = linear_kernel
        self.small_batch = use_small_batch(linear_kernel, self.device)
        self.row_plan = measured_row_plan(model) if self.small_batch else None  # this machine's widths, cached
        # the drafter's weights in another dtype (a bfloat16 decode form) take a plan measured on them
        self.row_plans = measured_row_plans(model, *drafter.modules()) if self.small_batch else {}
        self.greedy_head = greedy_head

    def prompt_tensor(self, prompt_ids: "Sequence[int] | torch.Tensor") -> torch.Tensor:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise DecodeSetupError(
                f"Batch size 1 only: got prompt ids of shape {tuple(ids.shape)}; decode one prompt at a time."
            )
        if ids.numel() == 0:
            raise DecodeSetupError("The prompt is empty: give at least one token (a chat template adds several).")
        limit = context_limit(self.model.config)
        if ids.numel() >= limit:
            raise DecodeSetupError(
                f"The prompt has {ids.numel()} tokens but the target's context is {limit}: shorten the prompt "
                "(leave room for at least one new token)."
            )
        return ids.to(self.device)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: "Sequence[int] | torch.Tensor",
        max_new_tokens: int = 256,
        sampling: Sampling = Sampling(),
        stop: Sequence[str] = (),
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        timings: bool = False,
        observer: Observer | None = None,
    ) -> DecodeResult:
        """Decode one prompt ([T] or [1, T] ids). ``on_tokens`` gets each step's new tokens as they are accepted.
        ``timings``: the stats' split between prefill, drafting and verifying is measured after the device's queued
        work (on a GPU a wait per split; without it the split is a host-side reading and only ``total_s`` is
        exact). ``observer``: sees the prefill's and every commit's forward output (train/online.py's recorder keeps
        the committed positions' hidden states); its time counts as drafting, but for its ``between_steps``
        (``stats.learn_s``)."""
        clock = StepClock(self.device, sync=timings or self.depth_policy is not None)
        with decoding_kernels(self.model, *self.drafter.modules(), plan=self.row_plan, plans=self.row_plans):
            head = self._head(sampling)
            return self._generate(prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens, clock, head, observer)

    def _head(self, sampling: Sampling) -> GreedyHead | None:
        """Greedy verification's bfloat16 LM head (cpu_kernels/greedy_head.py) if this decode can use it: the
        small-batch kernels, greedy acceptance, and a head that pays on this machine (timed once per model, before
        the decode's clock starts). A drafter's own verify forward (layer-skip's) reads it too."""
        if not (self.greedy_head and self.small_batch and sampling.acceptance == "greedy"):
            return None
        return greedy_head(self.model)

    def _verify_forward(self, head: GreedyHead | None) -> Callable[[torch.nn.Module, DecodeState, Draft],
                                                                   ForwardOutput]:
        """The verify forward: the drafter's own when it has one (a layer-skip drafter runs only the layers its draft
        did not), else one target forward over the tree; with ``head``, greedy verification's LM head, either way."""
        forward = self.drafter.verify_forward if self.drafter.verify_forward is not None else tree_forward
        return forward if head is None else partial(forward, head=head)

    def _generate(self, prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens, clock, head,
                  observer=None) -> DecodeResult:
        if max_new_tokens < 1:
            raise SettingError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        if stop and self.decode is None:
            raise ValueError("Stop strings need a decode function: SpeculativeDecoder(..., decode=tokenizer.decode).")
        ids = self.prompt_tensor(prompt_ids)
        rule = StopRule(max_new_tokens, context_limit(self.model.config), self.eos_token_ids, tuple(stop), self.decode)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stats = DecodeStats(prompt_tokens=len(ids))
        control = self.drafter.depth_control(DepthControl(self.depth_policy, clock))

        synchronize(self.device)
        t_start = time.perf_counter()
        state, out = prefill(self.model, ids, sampling, generator)
        first = state.new_tokens
        state, kept = settle(replace(state, new_tokens=[]), first, rule)
        t_prefill = clock()
        self.drafter.start(state, out)
        if observer is not None:
            observer.start(ids, out)
        stats.prefill_s = t_prefill - t_start
        stats.draft_s += clock() - t_prefill
        if on_tokens and kept:
            on_tokens(kept)

        between_steps = getattr(observer, "between_steps", None)
        fits = head is not None and head.fits(self.model, out.hidden[-1:], out.logits)  # logits = lm_head(h)?
        verify_forward = self._verify_forward(head if fits else None)
        while not state.done:
            t0 = clock()
            depth, draft = control.draft(self.drafter, state, rule.budget(state) - 1, self.device)
            if int(draft.tokens[0]) != state.next_token:
                raise RuntimeError(
                    f"{type(self.drafter).__name__}.propose returned a tree whose root is token {int(draft.tokens[0])}"
                    f"; the root must be state.next_token ({state.next_token})."
                )
            t1 = clock()
            out = verify_forward(self.model, state, draft)
            verdict = verify(out.logits, draft.tokens, draft.tree, sampling, draft.probs, generator)
            state = commit(state, draft, verdict, out)
            t2 = clock()
            self.drafter.on_commit(state, draft, verdict, out)
            if observer is not None:
                observer.commit(draft, verdict, out)
            t3 = clock()

            emitted = draft.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
            state, kept = settle(state, emitted, rule)
            control.observe(depth, draft, len(verdict.path) - 1, (t1 - t0) + (t3 - t2))
            stats.draft_s += (t1 - t0) + (t3 - t2)
            stats.verify_s += t2 - t1
            stats.drafted += draft.tree.num_nodes - 1
            stats.accepted += len(verdict.path) - 1
            stats.accept_lengths.append(len(kept))
            stats.drafted_per_step.append(draft.tree.num_nodes - 1)
            stats.accepted_per_step.append(len(verdict.path) - 1)
            if on_tokens and kept:
                on_tokens(kept)
            if between_steps is not None and not state.done:
                t4 = clock()
                between_steps()
                stats.learn_s += clock() - t4

        synchronize(self.device)
        stats.total_s = time.perf_counter() - t_start
        stats.steps = state.steps
        stats.new_tokens = len(state.new_tokens)
        return DecodeResult(tokens=state.new_tokens, finish_reason=state.finish_reason or "length", stats=stats)
