"""Layer-skip self-speculation: draft with the target's own first E layers and an exit, verify with the rest.

The target is unmodified: its decoder layers, rotary embedding, final norm and LM head are run from the model's own
modules on the shared transformers ``DynamicCache`` (:class:`LayerStack`), each layer with the mask and rotary
embedding of its kind (core/archs.py), so every architecture there runs; a target whose layers, run one by one, do
not give its forward's logits gets a clear error (:func:`check_layer_stack`).

Each step (:class:`LayerSkipDrafter`), with the root r = ``state.next_token`` at position p = ``state.length``:

1. **Draft** a chain: run layers 0..E-1 on r at p (their KV rows are written to the cache), read the exit on the
   layer-E hidden state, take its top token d1 if the exit's probability of it reaches ``threshold``; then layers
   0..E-1 on d1 at p + 1, and so on, up to ``max_depth`` tokens. Layers 0..E-1 now hold rows for every chain token
   they ran on, and the drafter keeps those tokens' layer-E hidden states.
2. **Verify without recomputation** (:meth:`LayerSkipDrafter.verify_forward`, which the engine calls instead of a
   full forward): layers 0..E-1 run only on the tree nodes the draft has not run them on (the last drafted token,
   when drafting stopped at ``max_depth``, and in a hybrid (decode/hybrid.py) the suffix drafter's nodes, after the
   chain), under the tree's mask; layers E..L-1 run on every node from the kept layer-E states; the final norm and
   LM head give the logits the verifier reads. A step with no draft is the model's own forward over the tree.
3. **Commit** (the engine's): every layer now holds ``state.length + N`` rows, so the usual commit keeps the accepted
   prefix and leaves every layer at the committed length.

Mid-step, layers hold different lengths: each layer's attention mask is built for its own cache length.

The exit is the target's own final norm and LM head (training-free, ``drafter=layerskip``), or a trained exit
(heads/layerskip.py, ``python train/layerskip.py``): a head over a possibly reduced vocabulary, or an adapter block
and a head. An adapter attends over earlier positions, so the drafter keeps its KV cache: rows for the prompt at the
start (with the prefill), a row per drafted token, and after each commit the rows of the accepted tokens only
(computed from the verify pass's layer-E states where drafting had not run them), lazily: at the next propose, in one
batch, so a drafter whose drafting adaptive depth has switched off costs next to nothing. Drafts are deterministic
(``probs=None``), so greedy and sampling verification stay lossless.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Sequence

import torch
from torch import nn

from selfspec.decode.cache import Backlog, layer_lengths, new_cache
from selfspec.decode.step import synchronize, tree_forward
from selfspec.decode.tree import chain_tree, tree_position_ids
from selfspec.decode.types import DecodeSetupError, DecodeState, Draft, DrafterBase, ForwardOutput
from selfspec.decode.verify import Verdict
from selfspec.core.archs import (attention_mask_for, context_limit, layer_position_embeddings, mask_of_layer,
                                 output_logits, sliding_window)
from selfspec.core.kv import cache_length, crop_cache
from selfspec.core.target import cache_kwarg
from selfspec.cpu_kernels.greedy_head import GreedyHead
from selfspec.cpu_kernels.linear_kernels import measured_decoding_kernels

DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")  # what the stack runs of the target's decoder


class LayerStack:
    """The target's decoder stack, run a range of layers at a time on the shared cache: its embedding, each layer
    with the mask and rotary embedding of its kind (core/archs.py: sliding layers' masks cut to their window, a
    rotary embedding per layer type where the model has them), its final norm and its LM head (with the model's
    soft-capping). Checked once per model against the model's own forward (:func:`check_layer_stack`)."""

    def __init__(self, model: nn.Module):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        missing = [part for part in DECODER_PARTS if getattr(decoder, part, None) is None]
        if missing:
            raise LayerStackError(
                f"Layer-skip drafting runs the target's decoder a layer at a time; this target "
                f"({type(model).__name__}) has no decoder with {', '.join(missing)}. Use another drafter "
                "(medusa, dflash, suffix) for it.")
        self.model = model
        self.config = model.config
        self.decoder = decoder
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.lm_head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype
        check_layer_stack(self)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [q] -> input embeddings [1, q, H]."""
        return self.decoder.embed_tokens(tokens[None])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits [..., V] of the hidden state leaving its last layer [..., H] (or an exit's read of an
        earlier one): final norm, LM head and the model's own soft-capping."""
        return output_logits(self.config, self.lm_head(self.decoder.norm(hidden)))

    def run(self, hidden: torch.Tensor, start: int, stop: int, positions: torch.Tensor, cache,
            ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """Layers start..stop-1 on ``hidden`` [1, q, H] at ``positions`` [q], after each layer's cached rows (which
        it extends): the hidden state entering layer ``stop``. ``ancestors`` [q, k] (bool, k >= q): which of each
        layer's last k positions, these q rows included, each row may attend (tree nodes whose first k - q are
        cached); every earlier row is seen by all (a sliding layer's within its window). None: a causal chain after
        the cache. A layer's cached rows sit at positions 0 .. past - 1: the committed ones, then the chain rows
        this step drafted, one position each."""
        q = hidden.shape[1]
        if ancestors is None:
            ancestors = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
        position_ids = positions[None]
        rotary = layer_position_embeddings(self.decoder, hidden, position_ids, range(start, stop))
        lengths = layer_lengths(cache)
        masks: dict[int, torch.Tensor | dict] = {}  # by cached length: one per group of layers that hold the same rows
        for i in range(start, stop):
            past = lengths[i] if i < len(lengths) else 0
            if past not in masks:
                allowed = torch.ones(q, past + q, dtype=torch.bool, device=hidden.device)
                allowed[:, past + q - ancestors.shape[1]:] = ancestors
                keys = torch.cat([torch.arange(past, device=hidden.device), positions])
                masks[past] = attention_mask_for(self.config, allowed, positions, keys, hidden.dtype)
            out = self.layers[i](hidden, attention_mask=mask_of_layer(masks[past], self.config, i),
                                 position_ids=position_ids, cache=cache, use_cache=True,
                                 position_embeddings=rotary[i - start])
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


class LayerStackError(DecodeSetupError):
    """The target's decoder cannot be run a layer at a time as its own forward runs it."""


_CHECKED_STACKS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def check_layer_stack(stack: LayerStack) -> None:
    """Raise :class:`LayerStackError` unless the stack, run over a probe longer than any sliding window, gives the
    logits of the model's own forward: an architecture whose forward does more than embed, run each layer with its
    mask and rotary embedding, norm and project (and soft-cap) would be verified wrongly. Once per model."""
    model = stack.model
    if model in _CHECKED_STACKS:
        return
    device = stack.lm_head.weight.device
    vocab = int(stack.lm_head.weight.shape[0])
    length = min(2 * (sliding_window(stack.config) or 4) + 3, context_limit(stack.config))
    tokens = (vocab // 3 + torch.arange(length, device=device) * 7) % vocab  # ordinary tokens
    try:
        cache = new_cache()
        mine = stack.logits(stack.run(stack.embed(tokens), 0, stack.num_layers,
                                      torch.arange(length, device=device), cache))[0]
        theirs = model(input_ids=tokens[None]).logits[0]
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError) as err:
        raise LayerStackError(
            f"Layer-skip drafting runs the target's decoder layers one by one, and this target "
            f"({type(model).__name__}) failed so: {err}. Use another drafter (medusa, dflash, suffix) for it.") from err
    # Compared with the spread of the logits, so the check holds in any dtype: a missed step (a scaling, a norm, a
    # cap, a mask) moves them by about that much.
    err, spread = float((mine.float() - theirs.float()).abs().max()), float(theirs.float().std())
    if not err <= 0.05 * spread:
        raise LayerStackError(
            f"Layer-skip drafting runs the target's decoder layers one by one, but for this target "
            f"({type(model).__name__}) that does not give its forward's logits (they differ by {err:.3g}, against a "
            f"spread of {spread:.3g}): its forward does more than embed, run each layer, norm and project. Use "
            "another drafter (medusa, dflash, suffix) for it.")
    _CHECKED_STACKS[model] = True


class LayerSkipDrafter(DrafterBase):
    """Drafts a chain with layers 0..``exit_layer``-1 and an exit; stops when the exit's top probability falls below
    ``threshold`` or at ``max_depth`` tokens. ``exit``: a trained exit (heads/layerskip.py: a head, or an adapter
    block and a head, possibly over a reduced vocabulary); None reads the target's own final norm and LM head.
    ``exit_layer`` None: the trained exit's own layer."""

    def __init__(self, model: nn.Module, exit_layer: int | None, threshold: float, max_depth: int,
                 exit: nn.Module | None = None):
        self.stack = LayerStack(model)
        if exit is not None:
            if exit_layer not in (None, exit.exit_layer):
                raise DecodeSetupError(f"draft.exit_layer={exit_layer}, but these heads are an exit trained after "
                                       f"layer {exit.exit_layer}: leave draft.exit_layer unset (or train an exit "
                                       f"for layer {exit_layer}).")
            exit_layer = exit.exit_layer
        if exit_layer is None or not 1 <= exit_layer < self.stack.num_layers:
            raise DecodeSetupError(f"draft.exit_layer={exit_layer}: exit after a layer in 1..{self.stack.num_layers - 1}"
                                   f" (this target has {self.stack.num_layers} layers).")
        if not 0.0 <= threshold <= 1.0 or max_depth < 0:
            raise DecodeSetupError(f"draft.threshold={threshold} must be in [0, 1] and draft.max_depth={max_depth} "
                                   ">= 0.")
        self.exit_layer, self.threshold, self.max_depth = exit_layer, threshold, max_depth
        self.exit = exit
        self._tokens: list[int] = []  # this step's chain, root first
        self._rows: list[torch.Tensor] = []  # layer-E hidden states [1, H] of the chain tokens layers 0..E-1 ran on
        self._chain: torch.Tensor | None = None  # layer-E states [N, H] of the chain verify_forward ran
        # An adapter exit attends over earlier positions: its own cache, one row per committed position (drafting
        # adds rows for the chain; a commit keeps those of accepted tokens). Rows it lacks are computed lazily: the
        # committed layer-E states wait in a backlog until the next propose runs the adapter over all of them at
        # once, so while adaptive depth has drafting off the exit costs nothing.
        self._adapter_cache = None
        self._backlog = Backlog()  # layer-E states [n, H] of committed positions the adapter cache lacks

    def modules(self) -> Sequence[nn.Module]:
        return (self.exit,) if self.exit is not None else (self.stack.decoder.norm, self.stack.lm_head)

    @property
    def max_draft_depth(self) -> int:
        return int(self.max_depth)

    @property
    def verify_share(self) -> float:
        """The share of a full forward that verifying a drafted chain runs: drafting already ran layers 0..E-1 on the
        chain, so the verify pass runs layers E..L-1 and the LM head. By weight count, what a memory-bound forward
        reads (adaptive depth scales the verify cost curve by it; drafting's own time is measured)."""
        count = lambda modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
        first = count(self.stack.layers[:self.exit_layer])
        return 1.0 - first / (count(self.stack.layers) + self.stack.lm_head.weight.numel())

    @property
    def _adapted(self) -> bool:
        return self.exit is not None and self.exit.adapter is not None

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._rows, self._chain = [], None
        if self._adapted:
            self._adapter_cache = new_cache()
            self._backlog = Backlog()
            self._backlog.add(prefill.hidden_states[self.exit_layer].to(self.stack.dtype))
            # the prompt's rows now, with the prefill: left to the first draft, their cost (a batch the prompt's
            # length) was timed as that draft's, and adaptive depth, judging one-token drafts by it, stopped drafting
            self._catch_up()

    def _catch_up(self) -> None:
        """The adapter over every committed position its cache lacks, in one batch."""
        taken = self._backlog.take()
        if taken is not None:
            start, (rows,) = taken  # [n, H]
            positions = torch.arange(start, start + rows.shape[0], device=rows.device)
            self.exit.features(rows[None], positions[None], cache=self._adapter_cache)

    def _exit(self, hidden: torch.Tensor, position: int) -> tuple[int, float]:
        """Layer-E hidden [1, 1, H] at ``position`` -> (the exit's top token as a target id, its probability)."""
        if self.exit is None:
            logits = self.stack.logits(hidden)[0, -1].float()
        else:
            position_ids = torch.tensor([[position]], device=hidden.device)
            logits = self.exit.logits(self.exit.features(hidden, position_ids, cache=self._adapter_cache))[0, -1]
        p, token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        token = int(token) if self.exit is None else int(self.exit.to_target_ids(token))
        return token, float(p)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        device = state.prompt_ids.device
        tokens, self._rows = [state.next_token], []
        self._tokens = tokens  # the chain, root first: verify_forward checks the tree starts with it
        depth = min(self.max_depth, max_depth)
        if self._adapted and depth > 0:
            self._catch_up()
        while len(tokens) - 1 < depth:
            position = state.length + len(tokens) - 1
            hidden = self.stack.run(self.stack.embed(torch.tensor(tokens[-1:], device=device)), 0, self.exit_layer,
                                    torch.tensor([position], device=device), state.cache)
            self._rows.append(hidden[0])
            token, p = self._exit(hidden, position)
            if p < self.threshold:
                break
            tokens.append(token)
        return Draft(tokens=torch.tensor(tokens, device=device), tree=chain_tree(len(tokens) - 1).to(device))

    @torch.no_grad()
    def verify_forward(self, model: nn.Module, state: DecodeState, draft: Draft,
                       head: GreedyHead | None = None) -> ForwardOutput:
        """The verify forward over a tree whose first nodes are the chain this step drafted (more nodes may follow:
        a hybrid's suffix proposals, :mod:`selfspec.decode.hybrid`), running layers 0..E-1 only on the nodes the draft did not
        run them on: layers 0..E-1 on those, under the tree's mask over the chain rows already cached; then layers
        E..L-1 on every node from its layer-E state; the final norm and LM head give the verifier's logits (``head``:
        greedy verification's LM head, cpu_kernels/greedy_head.py, as the engine's own forward reads it)."""
        n, done = draft.tree.num_nodes, len(self._rows)
        if done > n or (done and (draft.tree.depth[:done].tolist() != list(range(done))
                                  or draft.tokens[:done].tolist() != self._tokens[:done])):
            raise RuntimeError("LayerSkipDrafter verifies trees whose first nodes are the chain it drafted.")
        if not done:  # no draft this step (adaptive depth chose not to): the model's own forward over the tree
            out = tree_forward(model, state, draft, head=head)
            self._chain = out.hidden_states[self.exit_layer]  # layer-E states [N, H], for the adapter
            return ForwardOutput(logits=out.logits, hidden_states=(out.hidden_states[-1],))
        positions = tree_position_ids(draft.tree, state.length)[0]
        ancestors = draft.tree.ancestor_mask  # [N, N]
        parts = [torch.cat(self._rows, dim=0)[None]]  # [1, done, H]
        if done < n:
            fresh = self.stack.embed(draft.tokens[done:])
            parts.append(self.stack.run(fresh, 0, self.exit_layer, positions[done:], state.cache, ancestors[done:]))
        chain = torch.cat(parts, dim=1)
        self._chain = chain[0]
        hidden = self.stack.run(chain, self.exit_layer, self.stack.num_layers, positions, state.cache, ancestors)
        final = self.stack.decoder.norm(hidden)[0]  # [N, H]
        logits = output_logits(self.stack.config, self.stack.lm_head(final)) if head is None else head.logits(final)
        return ForwardOutput(logits=logits, hidden_states=(final,))

    @torch.no_grad()
    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        drafted, self._rows = len(self._rows), []
        chain, self._chain = self._chain, None
        if not self._adapted:
            return
        path = verdict.path  # root first: positions start .. start + len(path) - 1 are now committed
        start = state.length - len(path)
        keep = 0  # accepted nodes whose adapter rows drafting wrote: the chain's nodes 0..drafted-1, from the root
        while keep < min(drafted, len(path)) and path[keep] == keep:
            keep += 1
        if drafted:  # drafting caught up first, then wrote rows for the chain: keep the accepted ones
            crop_cache(self._adapter_cache, start + keep)
            self._backlog.start = start + keep
        if keep < len(path):  # accepted nodes the adapter has not seen: their layer-E states from the verify pass
            if chain is None:
                raise RuntimeError("LayerSkipDrafter's commit follows its own verify_forward only.")
            self._backlog.add(chain[path[keep:]], at=start + keep)
        assert cache_length(self._adapter_cache) == self._backlog.start and self._backlog.end == state.length


# --- how often an exit agrees with the final layer ---------------------------------------------------------------------


@torch.no_grad()
def exit_agreement(model: nn.Module, examples, thresholds: Sequence[float] = (0.5, 0.8),
                   norm: nn.Module | None = None, lm_head: nn.Module | None = None) -> list[dict]:
    """Per exit layer E (1..L-1), over the labelled positions of ``examples`` (``input_ids`` and ``labels``, -100 =
    unlabelled): how often the exit's top token on layer E's hidden state equals the full model's (``agreement``),
    and per confidence threshold, the share of positions where the exit's top probability reaches it and how often
    it is right there. The exit is (``norm``, ``lm_head``), the target's own final ones by default."""
    stack = LayerStack(model)
    norm = norm if norm is not None else stack.decoder.norm
    lm_head = lm_head if lm_head is not None else stack.lm_head
    layers = stack.num_layers
    agree = torch.zeros(layers)
    confident = {t: torch.zeros(layers) for t in thresholds}
    right = {t: torch.zeros(layers) for t in thresholds}
    total = 0
    for example in examples:
        ids = torch.as_tensor(example["input_ids"])[None].to(stack.lm_head.weight.device)
        labelled = torch.as_tensor(example["labels"]).to(ids.device) != -100
        out = model(input_ids=ids, output_hidden_states=True)
        final = out.logits[0].argmax(-1)[labelled]
        total += int(labelled.sum())
        for e in range(1, layers):
            logits = output_logits(stack.config, lm_head(norm(out.hidden_states[e][0][labelled])))
            probs = torch.softmax(logits.float(), dim=-1)
            p, top = probs.max(dim=-1)
            agree[e] += float((top == final).sum())
            for t in thresholds:
                sure = p >= t
                confident[t][e] += float(sure.sum())
                right[t][e] += float((top[sure] == final[sure]).sum())
    return [{"exit_layer": e, "agreement": float(agree[e]) / max(total, 1), "positions": total,
             **{f"share_p>={t}": float(confident[t][e]) / max(total, 1) for t in thresholds},
             **{f"right_p>={t}": float(right[t][e]) / max(float(confident[t][e]), 1.0) for t in thresholds}}
            for e in range(1, layers)]


# --- what an exit costs, and what it should gain ------------------------------------------------------------------------


@torch.no_grad()
def measure_layer_costs(model: nn.Module, exits: dict[int, nn.Module], cache_length: int = 128,
                        repeats: int = 15, linear_kernel: str = "auto") -> dict:
    """This machine's cost of drafting one token with each exit: layers 0..E-1 on one token over a
    ``cache_length``-token cache, then the exit (with its own cache for an adapter), as a share of one full
    one-token forward (medians of ``repeats``, sizes interleaved), with the linear layers decoding runs
    (``linear_kernel``, selfspec.cpu_kernels.linear_kernels). -> {"forward_ms", "layers": {E: share of the forward in
    layers 0..E-1}, "draft": {E: (layers + exit) / forward}}."""
    with measured_decoding_kernels(model, *exits.values(), linear_kernel=linear_kernel):
        return _measure_layer_costs(model, exits, cache_length, repeats)


def _measure_layer_costs(model: nn.Module, exits: dict[int, nn.Module], cache_length: int, repeats: int) -> dict:
    stack = LayerStack(model)
    device = stack.lm_head.weight.device
    vocab = int(stack.lm_head.weight.shape[0])
    prompt = torch.arange(cache_length, device=device) * 7919 % vocab
    cache = new_cache()
    out = model(input_ids=prompt[None], use_cache=True, output_hidden_states=True, **{cache_kwarg(model): cache})
    adapter_caches = {}
    for e, module in exits.items():
        if getattr(module, "adapter", None) is not None:
            adapter_caches[e] = new_cache()
            module.features(out.hidden_states[e].to(stack.dtype), cache=adapter_caches[e])
    token = prompt[-1:]
    position = torch.tensor([cache_length], device=device)
    # the one-token forward's mask and positions, as the engine passes them (a sliding layer's cut to its window:
    # the engine's cache keeps every row, so the model's own masks would not fit it)
    sees_all = torch.ones(1, cache_length + 1, dtype=torch.bool, device=device)
    keys = torch.arange(cache_length + 1, device=device)
    one = {"attention_mask": attention_mask_for(stack.config, sees_all, position, keys, stack.dtype),
           "position_ids": position[None]}
    times: dict = {"forward": [], **{("layers", e): [] for e in exits}, **{("exit", e): [] for e in exits}}

    def clock() -> float:
        synchronize(device)
        return time.perf_counter()

    for r in range(repeats + 1):
        t0 = clock()
        model(input_ids=token[None], use_cache=True, **one, **{cache_kwarg(model): cache})
        t1 = clock()
        crop_cache(cache, cache_length)
        if r:
            times["forward"].append(t1 - t0)
        for e, module in exits.items():
            t0 = clock()
            hidden = stack.run(stack.embed(token), 0, e, position, cache)
            t1 = clock()
            adapter_cache = adapter_caches.get(e)
            module.logits(module.features(hidden, position[None], cache=adapter_cache))
            t2 = clock()
            for layer, grown in zip(cache.layers, layer_lengths(cache)):  # layers 0..e-1 only grew
                layer.crop(cache_length - grown)
            if adapter_cache is not None:
                crop_cache(adapter_cache, cache_length)
            if r:
                times[("layers", e)].append(t1 - t0)
                times[("exit", e)].append(t2 - t1)
    forward = statistics.median(times["forward"])
    layers = {e: statistics.median(times[("layers", e)]) / forward for e in exits}
    return {"forward_ms": forward * 1e3, "layers": layers,
            "draft": {e: layers[e] + statistics.median(times[("exit", e)]) / forward for e in exits}}


def best_chain(share: Sequence[float], right: Sequence[float], thresholds: Sequence[float], max_depth: int,
               draft_cost: float, layer_share: float, curve) -> dict:
    """The threshold and chain length with the most expected tokens per unit of time, against plain decoding (one
    token per one-token forward), from an exit's measured rates. Per threshold t: ``share[t]`` of positions where
    the exit's top probability reaches t, ``right[t]`` where it does and equals the target's token. Taking the
    positions of a chain as independent, a chain of at most d tokens runs the draft sum_{i<d} share^i times (each at
    ``draft_cost``, a share of one forward), drafts sum_{i=1..d} share^i tokens, gets sum_{i=1..d} right^i of them
    accepted, and its verify pass runs the last ``1 - layer_share`` of the target over the chain
    (``curve.cost(nodes)`` scaled) plus the first layers on the last token when the chain reached d.
    -> {"threshold", "depth", "tokens_per_step", "speedup"} of the best chain (a speedup under 1: drafting with
    this exit does not pay here; adaptive depth then switches it off while decoding)."""
    best = {"threshold": float(thresholds[0]), "depth": 1, "tokens_per_step": 1.0, "speedup": 0.0}
    for t, s, a in zip(thresholds, share, right):
        for d in range(1, max_depth + 1):
            runs = sum(s**i for i in range(d))
            drafted = sum(s**i for i in range(1, d + 1))
            tokens = 1.0 + sum(a**i for i in range(1, d + 1))
            seconds = runs * draft_cost + (1.0 - layer_share) * curve.cost(1.0 + drafted) + layer_share * s**d
            if tokens / seconds > best["speedup"]:
                best = {"threshold": float(t), "depth": d, "tokens_per_step": tokens, "speedup": tokens / seconds}
    return best


# --- what decode/families.py registers for the layerskip family ------------------------------------------------------


def layerskip_from_settings(heads: nn.Module | None, target, settings: dict) -> LayerSkipDrafter:
    layers = int(target.model.config.get_text_config(decoder=True).num_hidden_layers)
    exit_layer = settings["exit_layer"]
    if exit_layer in (None, "auto"):  # a trained exit's own layer; training-free: half the layers
        exit_layer = None if heads is not None else max(1, layers // 2)
    return LayerSkipDrafter(target.model, exit_layer=None if exit_layer is None else int(exit_layer),
                            threshold=float(settings["threshold"]), max_depth=int(settings["max_depth"]), exit=heads)
