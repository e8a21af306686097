"""The DFlash drafter for the decode engine: one forward of a DFlash block drafter (heads/dflash.py) drafts a chain.

The drafter keeps its own context: every layer's keys and values of the fused target features, one row per position
whose token the target has read, so after each commit it covers positions 0 .. ``state.length - 1``:

- ``start``: the prompt's features (from the prefill forward) at positions 0 .. T-1;
- ``on_commit``: the accepted branch's features (the root and the accepted drafted nodes, which the verify forward
  returned) at the positions they were committed to; rejected nodes never enter it;
- ``propose``: one drafter forward over the block ``[state.next_token, mask x (block_size - 1)]`` at positions
  ``state.length ..``, which sees the whole context and the whole block (no mask), and position k's argmax drafts
  the token k ahead.

As EAGLE's draft cache (decode/eagle_drafter.py), the context is caught up lazily: ``start`` and ``on_commit`` keep
the features, and the next ``propose`` projects everything kept since the last one in one batch, so steps on which
adaptive depth has drafting off cost nothing.

**The decode form** (:class:`BlockForward`). A proposal reads every drafter weight once for four rows, so on a CPU its
cost is the bytes of its weights (mostly the draft LM head) and the calls around them. Decoding runs the drafter's
own arithmetic (the module's forward; a test holds them equal) on a copy of its weights made for it, as serving
engines do:

- each layer's ``q/k/v`` and ``gate/up`` projections as one product each (vLLM's merged linears), and ``k/v`` as one
  for the context's catch-up;
- the context's keys and values in one cache layer per drafter layer, the engine's own (decode/cache.py:
  :class:`GrowingLayer`, rows written in place into buffers with room): a commit appends its rows, and a proposal
  appends the block's keys and values for its attention and crops them off again, instead of concatenating the
  whole context each time;
- the weights in ``dtype``: by default (``draft.dtype=auto``) bfloat16 where the CPU multiplies it natively
  (:func:`selfspec.core.runtime.native_bf16`), which halves the bytes a proposal reads; the drafter trains under bfloat16
  autocast. A proposal of the SmolLM2 hour recipe's drafter, timed between target forwards on a 2-core AMD EPYC
  (Zen 5), was fastest in this form in bfloat16 (docs/journal/2026-12-01-figures-from-code.md).

The copy is made again when the module's parameters change (training, a new load). The draft's precision never
touches losslessness: verification keeps or rejects each drafted token against the target's own output.

With ``top_k`` > 1 the draft is a small tree: the chain, plus the first position's next ``top_k - 1`` tokens as the
chain head's siblings (leaves). Drafts are deterministic (argmax / top-k), so the engine verifies them with
point-mass draft probabilities (``probs=None``), lossless for sampling as well as greedy decoding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from selfspec.decode.cache import Backlog, CacheError, GrowingLayer
from selfspec.decode.tree import Tree
from selfspec.decode.types import DecodeState, Draft, DrafterBase, ForwardOutput, root_only
from selfspec.decode.verify import Verdict
from selfspec.heads.dflash import DFlashConfig, DFlashHeads
from selfspec.core.errors import SettingError
from selfspec.core.runtime import native_bf16

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: keys, values [1, kv_heads, C, head_dim]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_dtype(setting: str | None, heads: nn.Module) -> torch.dtype:
    """``draft.dtype``: ``auto`` (bfloat16 for float32 weights on a device that multiplies it natively, else the
    weights' own dtype), ``own`` (the weights' own: what a serving engine drafts in, the target's), ``float32``,
    ``bfloat16`` or ``float16``."""
    own = next(heads.parameters()).dtype
    if setting == "own":
        return own
    if setting in (None, "auto"):
        device = next(heads.parameters()).device
        return torch.bfloat16 if own == torch.float32 and native_bf16(device) else own
    if setting not in DTYPES:
        raise SettingError(f"draft.dtype={setting!r}: use auto, own, {', '.join(DTYPES)}.")
    return DTYPES[setting]


def chain_with_siblings(root: int, chain: torch.Tensor, siblings: torch.Tensor,
                        trees: dict | None = None) -> Draft:
    """The chain [d] under the root, then ``siblings`` [s] of its first node (the root's later children). ``trees``:
    the trees made so far, by shape (a drafter proposes a few shapes over and over), read and added to."""
    d, s = int(chain.numel()), int(siblings.numel())
    tokens = torch.cat([torch.tensor([root], device=chain.device), chain, siblings])
    tree = None if trees is None else trees.get((d, s, chain.device))
    if tree is None:
        tree = Tree.from_parents([-1, *range(d), *([0] * s)]).to(chain.device)
        if trees is not None:
            trees[(d, s, chain.device)] = tree
    return Draft(tokens=tokens, tree=tree)


def _roped(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, n, hd] rotated by the positions' (cos, sin) [1, n, hd] (transformers' apply_rotary_pos_emb)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _fused(weights: list[torch.Tensor], dtype: torch.dtype) -> nn.Linear:
    """One bias-free linear whose weight stacks ``weights`` (rows), in ``dtype``."""
    w = torch.cat([t.detach() for t in weights]).to(dtype)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=dtype)
    linear.weight = nn.Parameter(w, requires_grad=False)
    return linear


class BlockLayer(nn.Module):
    """One drafter layer's weights in the decode form (module docstring)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        if any(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
            raise SettingError("DFlash drafter layers have no attention biases (vLLM's layout); these heads do.")
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv = _fused([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dtype)
        self.kv = _fused([a.k_proj.weight, a.v_proj.weight], dtype)
        self.o = _fused([a.o_proj.weight], dtype)
        self.gate_up = _fused([m.gate_proj.weight, m.up_proj.weight], dtype)
        self.down = _fused([m.down_proj.weight], dtype)
        self.act = m.act_fn
        self.norms = {name: (norm.weight.detach().to(dtype), norm.variance_epsilon) for name, norm in (
            ("input", layer.input_layernorm), ("post", layer.post_attention_layernorm), ("q", a.q_norm),
            ("k", a.k_norm))}

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.norms[name]
        return F.rms_norm(x, weight.shape, weight, eps)

    def keys_values(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows x [n, H] -> roped keys and values [1, kv_heads, n, hd] (DFlashAttention.keys_values)."""
        n = x.shape[0]
        k, v = self.kv(x).view(n, 2 * self.kv_heads, self.head_dim).transpose(0, 1)[None].split(self.kv_heads, 1)
        return _roped(self.norm("k", k), *rope), v

    def forward(self, x: torch.Tensor, rope, context: GrowingLayer) -> torch.Tensor:
        """The block x [Q, H] after the ``context``'s keys and values -> [Q, H]. The block's own keys and values are
        written after the context's rows for the attention and cropped off again (the next commit's go there)."""
        q_len, nh, nkv = x.shape[0], self.heads, self.kv_heads
        qkv = self.qkv(self.norm("input", x)).view(q_len, nh + 2 * nkv, self.head_dim).transpose(0, 1)[None]
        q, k, v = qkv.split([nh, nkv, nkv], dim=1)
        q, k = _roped(self.norm("q", q), *rope), _roped(self.norm("k", k), *rope)
        keys, values = context.update(k, v)
        context.crop(-q_len)
        out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=nkv != nh)
        h = x + self.o(out[0].transpose(0, 1).reshape(q_len, -1))
        gate, up = self.gate_up(self.norm("post", h)).chunk(2, dim=-1)
        return h + self.down(self.act(gate) * up)


class BlockForward(nn.Module):
    """A DFlash drafter's decode form: its weights in ``dtype``, projections merged, and its context's keys and
    values in cache layers (module docstring)."""

    def __init__(self, drafter: DFlashHeads, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.block_size = dtype, drafter.block_size
        self.fc = _fused([drafter.fc.weight], dtype)
        self.hidden_norm = (drafter.hidden_norm.weight.detach().to(dtype), drafter.hidden_norm.variance_epsilon)
        self.layers = nn.ModuleList(BlockLayer(layer, dtype) for layer in drafter.layers)
        self.final_norm = (drafter.norm.weight.detach().to(dtype), drafter.norm.variance_epsilon)
        self.lm_head = _fused([drafter.lm_head.weight], dtype)
        self.mask = drafter.mask_embedding.detach().to(dtype)
        self._used = (drafter.rotary, drafter.target.get_input_embeddings())  # the module's, not copied or owned
        self._context = [GrowingLayer() for _ in self.layers]  # every layer's context keys and values

    @property
    def length(self) -> int:
        """Context positions read."""
        return self._context[0].get_seq_length()

    def reset(self) -> None:
        for cache in self._context:
            cache.reset()

    def extend(self, features: torch.Tensor, start: int) -> None:
        """Append the context rows of ``features`` [n, n_layers * H] at positions ``start`` .. (= ``length``)."""
        if start != self.length:
            raise CacheError(f"context rows for position {start} appended after {self.length} rows.")
        n = features.shape[0]
        weight, eps = self.hidden_norm
        context = F.rms_norm(self.fc(features.to(self.dtype)), weight.shape, weight, eps)
        rope = self._used[0](context, torch.arange(start, start + n, device=context.device)[None])
        for layer, cache in zip(self.layers, self._context):
            cache.update(*layer.keys_values(context, rope))

    def context_kv(self) -> ContextKV:
        """Every layer's context keys and values [1, kv, length, hd]."""
        return [(cache.keys, cache.values) for cache in self._context]

    def logits(self, token: int, rows: int) -> torch.Tensor:
        """Draft-vocabulary logits [rows, Vd] of block positions 1 .. rows, the block ``[token, mask ...]`` at
        positions ``length ..``."""
        start = self.length
        embedded = self._used[1](torch.tensor([token], device=self.mask.device))  # the module: some scale (Gemma 3)
        x = torch.cat([embedded.to(self.dtype), self.mask.expand(self.block_size - 1, -1)])
        rope = self._used[0](x, torch.arange(start, start + self.block_size, device=self.mask.device)[None])
        for layer, cache in zip(self.layers, self._context):
            x = layer(x, rope, cache)
        weight, eps = self.final_norm
        return self.lm_head(F.rms_norm(x[1 : 1 + rows], weight.shape, weight, eps))


class DFlashBlockDrafter(DrafterBase):
    """DFlash block drafts (module docstring): a chain of up to ``block_size - 1`` tokens from one drafter forward,
    with the first position's ``top_k - 1`` next tokens as siblings of the chain's first node. ``dtype``: the decode
    form's (:func:`draft_dtype`; None: the module's own)."""

    def __init__(self, heads: DFlashHeads, top_k: int, dtype: torch.dtype | None = None):
        if not isinstance(heads, DFlashHeads):
            raise TypeError(f"DFlashBlockDrafter drafts with DFlash heads (selfspec.heads.dflash.DFlashHeads), got "
                            f"{type(heads).__name__}.")
        if top_k < 1:
            raise SettingError(f"DFlash top_k={top_k}: 1 drafts a chain, more adds the first position's next tokens.")
        self.drafter = heads.eval()
        self.top_k = int(top_k)
        self.dtype = dtype or next(heads.parameters()).dtype
        self._form: BlockForward | None = None
        self._made_from: tuple | None = None  # the parameters' identity and versions the decode form was made from
        self._backlog = Backlog()  # committed features [n, n_layers * H] the context has not read
        self._trees: dict = {}  # the draft trees made so far, by shape

    def _fresh_form(self) -> BlockForward:
        """The decode form, made again when the module's parameters changed since it was made."""
        made_from = tuple((p.data_ptr(), p._version) for p in self.drafter.parameters())
        if self._form is None or made_from != self._made_from:
            self._form = BlockForward(self.drafter, self.dtype)
            self._made_from = made_from
        return self._form

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self._fresh_form(),)

    @property
    def kv(self) -> ContextKV:
        """Every layer's context keys and values, as read so far [1, kv, C, hd]."""
        return self._form.context_kv() if self._form is not None else []

    @property
    def max_draft_depth(self) -> int:
        return self.drafter.block_size - 1

    def draft_nodes(self, depth: int) -> int:
        """The root, the chain cut to ``depth`` and the first position's ``top_k - 1`` siblings."""
        depth = min(max(depth, 0), self.max_draft_depth)
        return 1 + depth + (self.top_k - 1 if depth > 0 else 0)

    @property
    def context_length(self) -> int:
        """Positions the context covers, read or kept to be read."""
        return self._backlog.end

    def _catch_up(self) -> None:
        """Project every feature kept since the last propose and append it to the context, in one batch."""
        taken = self._backlog.take()
        if taken is not None:
            start, (features,) = taken
            self._form.extend(features, start)

    @torch.no_grad()
    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._fresh_form().reset()
        self._backlog = Backlog()
        self._backlog.add(self.drafter.target_features(prefill.hidden_states))

    @torch.no_grad()
    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        path = torch.tensor(verdict.path, device=out.hidden.device)  # accepted node ids, root first
        self._backlog.add(self.drafter.target_features(out.hidden_states, path), at=state.length - len(path))

    def _block_logits(self, state: DecodeState, depth: int) -> torch.Tensor:
        """Draft-vocabulary logits [depth, Vd] of block positions 1 .. depth after the context's state.length rows."""
        self._catch_up()
        if self._form.length != state.length:  # extend keeps the context at the backlog's end
            raise CacheError(f"the DFlash context covers {self._form.length} positions, the target's cache "
                             f"{state.length}: the drafter missed a start or a commit.")
        return self._form.logits(state.next_token, depth).float()  # (argmax in bfloat16 is slower on a CPU)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        depth = min(self.max_draft_depth, max_depth)
        device = state.hidden.device
        if depth <= 0:
            return root_only(state, device)
        logits = self._block_logits(state, depth)  # [depth, Vd]
        chain = logits.argmax(dim=-1)  # [depth] draft ids
        siblings = chain[:0]
        if self.top_k > 1:  # the first position's top-k: its best heads the chain (one tie-break for both)
            top = logits[0].topk(min(self.top_k, logits.shape[-1])).indices  # [k]
            chain[0], siblings = top[0], top[1:]
        to_target = self.drafter.draft_to_target
        return chain_with_siblings(state.next_token, to_target(chain).to(device), to_target(siblings).to(device),
                                   self._trees)


# --- what decode/families.py registers for the dflash family ---------------------------------------------------------


def dflash_from_settings(heads: DFlashHeads, target, settings: dict) -> DFlashBlockDrafter:
    return DFlashBlockDrafter(heads, top_k=int(settings["top_k"]), dtype=draft_dtype(settings["dtype"], heads))


def dflash_chain(k: int) -> dict:
    """The draft settings that propose what vLLM's DFlash drafts: the whole block as a chain (``k`` is the block less
    its first slot: :func:`dflash_served_depth`), in the heads' dtype, the target's, as vLLM drafts."""
    return {"dtype": "own"}


def dflash_served_depth(meta: dict, k: int) -> int:
    """Tokens vLLM's DFlash drafts a step, whatever ``k``: the drafter's own block less its first slot (vLLM fills
    1 + k query slots, and the block attends non-causally, so a shorter block drafts other tokens than selfspec's whole
    block cut short: the two propose the same only with the heads' own block); ``k`` where the block is not saved."""
    block = (meta.get("head_config") or {}).get("block_size")
    return int(block) - 1 if block else k


def random_dflash_heads(model: nn.Module, seed: int = 0, **_) -> DFlashHeads:
    """An untrained DFlash block drafter for ``model`` (dry runs: its drafts are rarely accepted)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DFlashHeads(DFlashConfig.from_target(model), model)
    param = next(model.parameters())
    return heads.to(device=param.device, dtype=param.dtype).eval()
