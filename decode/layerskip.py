"""Layer-skip self-speculation: draft with the target's own first E layers and an exit, verify with the rest.

The target is unmodified: its decoder layers, rotary embedding, final norm and LM head are run from the model's own
modules on the shared transformers ``DynamicCache`` (:class:`LayerStack`). Llama and Qwen2 decoder stacks are
supported; any other architecture gets a clear error.

Each step (:class:`LayerSkipDrafter`), with the root r = ``state.next_token`` at position p = ``state.length``:

1. **Draft** a chain: run layers 0..E-1 on r at p (their KV rows are written to the cache), read the exit on the
   layer-E hidden state, take its top token d1 if the exit's probability of it reaches ``threshold``; then layers
   0..E-1 on d1 at p + 1, and so on, up to ``max_depth`` tokens. Layers 0..E-1 now hold rows for every chain token
   they ran on, and the drafter keeps those tokens' layer-E hidden states.
2. **Verify without recomputation** (:meth:`LayerSkipDrafter.verify_forward`, which the engine calls instead of a
   full forward): layers 0..E-1 run only on the chain tokens the draft has not run them on (the last drafted token,
   when drafting stopped at ``max_depth``); layers E..L-1 run on the whole chain from the kept layer-E states; the
   final norm and LM head give the logits the verifier reads.
3. **Commit** (the engine's): every layer now holds ``state.length + N`` rows, so the usual commit keeps the accepted
   prefix and leaves every layer at the committed length.

Mid-step, layers hold different lengths: each layer's attention mask is built for its own cache length.

The exit is ``(norm, lm_head)``: the target's own final norm and LM head (training-free, ``drafter=layerskip``), or
a trained exit (heads/layerskip.py). Drafts are deterministic (``probs=None``), so greedy and sampling verification
stay lossless.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from decode.cache import layer_lengths
from decode.tree import chain_tree
from decode.types import DecodeSetupError, DecodeState, Draft, DrafterBase, ForwardOutput
from decode.verify import Verdict
from heads.kv import additive_mask

SUPPORTED = ("llama", "qwen2")


class LayerStack:
    """The target's decoder stack, run a range of layers at a time on the shared cache."""

    def __init__(self, model: nn.Module):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED:
            raise DecodeSetupError(
                f"Layer-skip drafting runs the decoder layers of {', '.join(SUPPORTED)} models; this target is "
                f"{model_type!r}. Use another drafter (medusa, eagle3, suffix) for it."
            )
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.lm_head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [q] -> input embeddings [1, q, H]."""
        return self.decoder.embed_tokens(tokens[None])

    def run(self, hidden: torch.Tensor, start: int, stop: int, positions: torch.Tensor, cache) -> torch.Tensor:
        """Layers start..stop-1 on ``hidden`` [1, q, H] at ``positions`` [q] (a causal chain after each layer's
        cached rows, which it extends): the hidden state entering layer ``stop``."""
        q = hidden.shape[1]
        position_ids = positions[None]
        rotary = self.decoder.rotary_emb(hidden, position_ids=position_ids)
        lengths = layer_lengths(cache)
        masks: dict[int, torch.Tensor] = {}  # by cached length: one per group of layers that hold the same rows
        for i in range(start, stop):
            past = lengths[i] if i < len(lengths) else 0
            if past not in masks:
                allowed = torch.ones(q, past + q, dtype=torch.bool, device=hidden.device)
                allowed[:, past:] = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
                masks[past] = additive_mask(allowed, hidden.dtype)[None, None]
            hidden = self.layers[i](hidden, attention_mask=masks[past], position_ids=position_ids, cache=cache,
                                    use_cache=True, position_embeddings=rotary)
        return hidden


class LayerSkipDrafter(DrafterBase):
    """Drafts a chain with layers 0..``exit_layer``-1 and an exit (``norm``, ``lm_head``; the target's own when
    None); stops when the exit's top probability falls below ``threshold`` or at ``max_depth`` tokens.
    ``token_map``: the exit head's rows are these target ids (a reduced exit vocabulary)."""

    draft_forward_per_level = True  # one pass over the first layers per drafted token (decode/bench.py's draft cost)

    def __init__(self, model: nn.Module, exit_layer: int, threshold: float = 0.5, max_depth: int = 6,
                 norm: nn.Module | None = None, lm_head: nn.Module | None = None,
                 token_map: torch.Tensor | None = None):
        self.stack = LayerStack(model)
        if not 1 <= exit_layer < self.stack.num_layers:
            raise DecodeSetupError(f"draft.exit_layer={exit_layer}: exit after a layer in 1..{self.stack.num_layers - 1}"
                                   f" (this target has {self.stack.num_layers} layers).")
        if not 0.0 <= threshold <= 1.0 or max_depth < 0:
            raise DecodeSetupError(f"draft.threshold={threshold} must be in [0, 1] and draft.max_depth={max_depth} "
                                   ">= 0.")
        self.exit_layer, self.threshold, self.max_depth = exit_layer, threshold, max_depth
        self.norm = norm if norm is not None else self.stack.decoder.norm
        self.lm_head = lm_head if lm_head is not None else self.stack.lm_head
        self.token_map = token_map
        self._rows: list[torch.Tensor] = []  # layer-E hidden states [1, H] of the chain tokens layers 0..E-1 ran on

    def modules(self) -> Sequence[nn.Module]:
        return (self.norm, self.lm_head)

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._rows = []

    def _exit(self, hidden: torch.Tensor) -> tuple[int, float]:
        """Layer-E hidden [1, 1, H] -> (the exit's top token as a target id, its probability)."""
        logits = self.lm_head(self.norm(hidden))[0, -1].float()
        probs = torch.softmax(logits, dim=-1)
        p, token = probs.max(dim=-1)
        token = int(token) if self.token_map is None else int(self.token_map[token])
        return token, float(p)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        device = state.prompt_ids.device
        tokens, self._rows = [state.next_token], []
        depth = min(self.max_depth, max_depth)
        while len(tokens) - 1 < depth:
            position = torch.tensor([state.length + len(tokens) - 1], device=device)
            hidden = self.stack.run(self.stack.embed(torch.tensor(tokens[-1:], device=device)), 0, self.exit_layer,
                                    position, state.cache)
            self._rows.append(hidden[0])
            token, p = self._exit(hidden)
            if p < self.threshold:
                break
            tokens.append(token)
        return Draft(tokens=torch.tensor(tokens, device=device), tree=chain_tree(len(tokens) - 1).to(device))

    @torch.no_grad()
    def verify_forward(self, model: nn.Module, state: DecodeState, draft: Draft) -> ForwardOutput:
        """The verify forward over the drafted chain, running layers 0..E-1 only where the draft did not."""
        n, done = draft.tree.num_nodes, len(self._rows)
        if int(draft.tree.max_depth) != n - 1 or done > n:
            raise RuntimeError("LayerSkipDrafter verifies its own chain drafts only.")
        device = draft.tokens.device
        positions = torch.arange(state.length, state.length + n, device=device)
        parts = [torch.cat(self._rows, dim=0)[None]] if done else []  # [1, done, H]
        if done < n:
            fresh = self.stack.embed(draft.tokens[done:])
            parts.append(self.stack.run(fresh, 0, self.exit_layer, positions[done:], state.cache))
        hidden = self.stack.run(torch.cat(parts, dim=1), self.exit_layer, self.stack.num_layers, positions,
                                state.cache)
        final = self.stack.decoder.norm(hidden)[0]  # [N, H]
        self._rows = []
        return ForwardOutput(logits=self.stack.lm_head(final), hidden_states=(final,))

    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        self._rows = []


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
            probs = torch.softmax(lm_head(norm(out.hidden_states[e][0][labelled])).float(), dim=-1)
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
