"""DFlash block drafters: a few decoder layers that draft a whole block of tokens in one forward.

The drafter reads the frozen target's hidden states and a block of inputs, and predicts every token of the block at
once (DFlash, z-lab 2026; the layout of their checkpoints and of vLLM's ``DFlashQwen3ForCausalLM``):

- **Context.** The outputs of a few target layers (``target_layer_ids``, DFlash's convention: layer ``i``'s output is
  ``out.hidden_states[i + 1]`` of a Hugging Face CausalLM) are concatenated and fused, ``hidden_norm(fc(...))``
  (nH -> H, no bias), one context vector per position whose token the target has already read.
- **Block.** The last emitted token ``x_p`` (its position p) and ``block_size - 1`` mask slots at p+1, p+2, ...,
  whose input is one learned vector (``mask_embedding``). Position k of the block predicts ``x_{p+k}``.
- **Layers.** Qwen3-style decoder layers (q/k norms, gated MLP), the form vLLM loads for every target. Queries come
  from the block only. Every layer's keys and values are its own projections of the context (no input norm) followed
  by those of the block, so the context enters each layer directly and does not change from layer to layer. A block
  sees every context position before p and all of its own positions (non-causal inside the block): one forward
  drafts the block.
- **Output.** ``lm_head(norm(h))`` over the reduced draft vocabulary (``d2t`` / ``t2d`` as EAGLE-3's:
  :func:`selfspec.heads.vocab.build_draft_vocab`), initialised from the target's LM head rows.

Used, not owned: the target's token embedding, reached through a reference kept out of ``state_dict()``.

:func:`block_mask` is the attention mask training uses for many blocks of one sequence at once;
:func:`dflash_block_loss` is the pure loss over the block positions, with DFlash's weight per position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      apply_rotary_pos_emb)

from selfspec.core.archs import context_limit, rope_parameters, text_config
from selfspec.core.layers import init_linears
from selfspec.heads.eagle import default_layer_ids
from selfspec.core.errors import SettingError
from selfspec.heads.vocab import install_draft_vocab


@dataclass
class DFlashConfig:
    """The drafter's shape. Sizes of attention and MLP are the target's (the drafter's hidden size must be the
    target's: it reads the target's embeddings); ``from_target`` fills them."""

    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 1
    block_size: int = 4  # the block: the last emitted token and block_size - 1 drafted positions
    target_layer_ids: list[int] | None = None  # outputs of these target layers (hidden_states[i + 1]) are fused
    num_target_layers: int = 0  # the target's depth
    mask_token_id: int = 0  # the id vLLM feeds to the mask slots (its embedding replaced by ``mask_embedding``)
    draft_vocab_size: int | None = None  # None: the target's vocabulary
    layer: dict = field(default_factory=dict)  # Qwen3Config fields of the layers (heads, head_dim, MLP, norms, rope)

    def __post_init__(self):
        if self.block_size < 2:
            raise SettingError(f"block_size={self.block_size}: a block drafts block_size - 1 tokens; use 2 or more.")
        if self.num_layers < 1:
            raise SettingError(f"num_layers={self.num_layers}: a DFlash drafter has at least one layer.")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            if self.num_target_layers and not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
                raise SettingError(f"target_layer_ids {self.target_layer_ids} name layers outside the target's "
                                   f"0..{self.num_target_layers - 1}.")
            if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
                raise SettingError(f"target_layer_ids {self.target_layer_ids} repeat a layer; serving engines capture "
                                   "each layer once.")

    @property
    def effective_draft_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else min(int(self.draft_vocab_size), self.vocab_size)

    @property
    def feature_layers(self) -> list[int]:
        """Indices into a target's ``out.hidden_states`` of the fused layers (layer i's output: i + 1)."""
        return [i + 1 for i in self.target_layer_ids]

    def layer_config(self) -> Qwen3Config:
        return Qwen3Config(hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                           num_hidden_layers=self.num_layers, **self.layer)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target: nn.Module, **kwargs) -> "DFlashConfig":
        """A config for ``target``: its sizes, rope (its full-attention layers', selfspec.core.archs.rope_parameters) and norm
        eps; ``target_layer_ids`` defaulted from its depth."""
        t = text_config(target.config)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        heads = t.num_attention_heads
        layer = dict(
            num_attention_heads=heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
            intermediate_size=t.intermediate_size,
            rms_norm_eps=t.rms_norm_eps,
            max_position_embeddings=context_limit(t),
            rope_parameters=rope_parameters(t),
            attention_bias=False,
            hidden_act="silu",
        )
        cfg = cls(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_target_layers=t.num_hidden_layers,
                  layer=layer, **kwargs)
        if cfg.target_layer_ids is None:
            cfg.target_layer_ids = default_target_layer_ids(t.num_hidden_layers)
        return cfg


def default_target_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high features: the outputs of the layers just before EAGLE-3's three reads
    (:func:`selfspec.heads.eagle.default_layer_ids`, the inputs of layers 2, L//2 and L-3), so one feature store serves both
    families. SmolLM2 (30 layers): [1, 14, 26]. The last layer is never among them (vLLM does not capture it)."""
    if num_layers <= 3:
        return list(range(max(num_layers - 1, 1)))
    return sorted({i - 1 for i in default_layer_ids(num_layers)})


# --- the module --------------------------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's followed by the block's (queries: the block only)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        return proj(x).view(*x.shape[:-1], n, self.head_dim).transpose(1, 2)  # [B, n, S, hd]

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] at positions whose (cos, sin) is ``rope`` -> roped keys and values [B, kv_heads, S, hd]."""
        k = self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads))
        k, _ = apply_rotary_pos_emb(k, k, *rope)
        return k, self._heads(x, self.v_proj, self.num_kv_heads)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] (the block's), ``context_kv`` this layer's context keys/values [B, kv, C, hd], ``mask`` bool
        [B|1, 1, Q, C + Q] (True: may attend; None: everything) -> [B, Q, H]."""
        q = self.q_norm(self._heads(x, self.q_proj, self.num_heads))
        k, v = self.keys_values(x, rope)
        q, _ = apply_rotary_pos_emb(q, q, *rope)
        k, v = torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer over the block: ``h = x + attn(norm(x), context)``, ``out = h + mlp(norm(h))``."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, rope, context_kv, mask):
        h = x + self.self_attn(self.input_layernorm(x), rope, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHeads(nn.Module):
    """The block drafter. Parameter names are those of DFlash checkpoints (``fc``, ``hidden_norm``, ``layers.{i}``,
    ``norm``, ``lm_head``; ``mask_embedding`` is vLLM's ``mask_embedding.pt``), so the export renames nothing."""

    def __init__(self, config: DFlashConfig, target: nn.Module, d2t: torch.Tensor | None = None):
        super().__init__()
        t = target.config
        if config.hidden_size != t.hidden_size or config.vocab_size != t.vocab_size:
            raise SettingError(f"DFlashConfig(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}) does "
                               f"not match the target ({t.hidden_size}, {t.vocab_size}): heads for another model?")
        if config.target_layer_ids is None:
            config.target_layer_ids = default_target_layer_ids(t.num_hidden_layers)
        self.config = config
        lc = config.layer_config()
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=lc.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(lc) for _ in range(config.num_layers))
        self.norm = Qwen3RMSNorm(h, eps=lc.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(lc)
        vd = config.effective_draft_vocab_size
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        embed = target.get_input_embeddings()
        mask_id = torch.tensor([config.mask_token_id], device=embed.weight.device)
        self.mask_embedding = nn.Parameter(embed(mask_id)[0].detach().clone().float())  # as the block's tokens
        # enter (an embedding module may scale its rows: Gemma 3)
        init_linears(self, getattr(t, "initializer_range", 0.02))
        self.set_draft_vocab(d2t if d2t is not None else torch.zeros(vd, dtype=torch.long),
                             init_lm_head_from=target.get_output_embeddings())
        self.to(embed.weight.device)
        self._target = [target]  # used, never owned: kept out of state_dict() and parameters()

    # -- target and vocabulary ---------------------------------------------------------------------------------------

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the target's ``out.hidden_states`` the context reads (layer i's output: i + 1)."""
        return self.config.feature_layers

    def target_features(self, hidden_states, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's hidden states (``out.hidden_states``: L + 1 tensors [..., N, H]) -> the context's input
        [..., n, n_layers * H] in the drafter's dtype: its target layers' outputs concatenated, ``rows`` picked (all
        when None)."""
        dtype = self.fc.weight.dtype
        return torch.cat([(hidden_states[i] if rows is None else hidden_states[i][rows]).to(dtype)
                          for i in self.feature_layers], dim=-1)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def set_draft_vocab(self, d2t: torch.Tensor, init_lm_head_from: nn.Module | None = None) -> None:
        """Install a draft vocabulary (``d2t`` from :func:`selfspec.heads.vocab.build_draft_vocab`; zeros: the first ids),
        optionally copying the matching rows of the target's LM head into the draft LM head."""
        install_draft_vocab(self, d2t, init_lm_head_from)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-100 where outside the draft vocabulary; -100 stays -100)."""
        draft_of = torch.cumsum(self.t2d.long(), 0) - 1
        ids = target_ids.clamp(min=0)
        return torch.where((target_ids >= 0) & self.t2d[ids], draft_of[ids], torch.full_like(target_ids, -100))

    # -- forward -------------------------------------------------------------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n * H] (the target layers' outputs, concatenated in ``target_layer_ids`` order) -> [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of ``context`` [B, C, H] at ``positions`` [B, C]: [B, kv, C, hd] each."""
        rope = self.rotary(context, positions)
        return [layer.self_attn.keys_values(context, rope) for layer in self.layers]

    def block_inputs(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """[B, A] tokens at the blocks' first positions -> the blocks' inputs [B, A * block_size, H]: each token's
        embedding, then ``block_size - 1`` mask vectors."""
        embed = self.target.get_input_embeddings()(first_tokens).to(self.mask_embedding.dtype)  # [B, A, H]
        b, a, h = embed.shape
        masks = self.mask_embedding.expand(b, a, self.block_size - 1, h)
        return torch.cat([embed[:, :, None], masks], dim=2).reshape(b, a * self.block_size, h)

    def forward(self, block: torch.Tensor, positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """block [B, Q, H] inputs at ``positions`` [B, Q]; ``mask`` bool [B|1, 1, Q, C + Q] -> hidden [B, Q, H]."""
        x = block.to(self.fc.weight.dtype)
        rope = self.rotary(x, positions)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, rope, kv, mask)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of block hidden states [..., H] -> [..., Vd]. Training, which gathers a different
        number of rows every step, pads them (:func:`selfspec.core.runtime.rows_through`); decoding's few rows are not."""
        return self.lm_head(self.norm(hidden))


# --- training pieces (pure) --------------------------------------------------------------------------------------------


def block_mask(anchors: torch.Tensor, context_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """The attention mask of many blocks of one sequence drafted at once, bool [B, 1, A * bs, T + A * bs].

    ``anchors`` [B, A] the blocks' first positions (-1: no block); ``context_valid`` [B, T] bool (real tokens).
    Block a's queries see context positions j < anchors[a] that are real tokens, and every position of block a
    (non-causal), nothing of another block. A block with no anchor sees only itself (its loss is masked)."""
    b, a = anchors.shape
    t = context_valid.shape[1]
    q_block = torch.arange(a, device=anchors.device).repeat_interleave(block_size)  # [A*bs] block of each query
    sees_context = torch.arange(t, device=anchors.device)[None, None, :] < anchors[:, q_block, None]  # [B, Q, T]
    sees_context = sees_context & context_valid[:, None, :].bool()
    same_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([sees_context, same_block], dim=2)[:, None]


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """DFlash's weight of block position k = 1 .. bs-1: exp(-(k - 1) / gamma) (position 0 is the given token, 0).
    Errors early in the block cut everything after them, so the first positions weigh most."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones(block_size, device=device)
    w[0] = 0.0
    return w


def sample_anchors(labels: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, count] block starts per sequence, ascending, -1 padded: positions p whose next token (p + 1) is trained
    (labels != -100), drawn without replacement (all of them when fewer than ``count``)."""
    trainable = torch.zeros_like(labels, dtype=torch.bool)
    trainable[:, :-1] = labels[:, 1:] != -100
    scores = torch.rand(labels.shape, generator=generator, device="cpu" if generator is not None else labels.device)
    scores = scores.to(labels.device).masked_fill(~trainable, -1.0)
    k = min(count, labels.shape[1])
    top, idx = scores.topk(k, dim=1)
    anchors = torch.where(top >= 0, idx, torch.full_like(idx, -1))
    anchors = anchors.masked_fill(anchors < 0, labels.shape[1]).sort(dim=1).values  # -1s last after sorting
    return anchors.masked_fill(anchors == labels.shape[1], -1)


def block_targets(anchors: torch.Tensor, labels: torch.Tensor, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each block position's prediction is scored: (b, a, k) index tensors [N] of the trained positions,
    k >= 1, with anchor p + k inside the sequence and labels[p + k] != -100. The teacher row is position p + k - 1
    (the target's own prediction of token p + k)."""
    bsz, a = anchors.shape
    t = labels.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [B, A, bs]
    ok = (anchors[:, :, None] >= 0) & (k >= 1) & (pos < t)
    ok = ok & (labels.gather(1, pos.clamp(0, t - 1).reshape(bsz, -1)).reshape(pos.shape) != -100)  # -1: no anchor
    return ok.nonzero(as_tuple=True)


def earlier_all(scored: tuple[torch.Tensor, ...], values: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """For each scored block position (b, a, k) of :func:`block_targets` [N], whether ``values`` [N] (bool, one per
    scored position) holds at every earlier drafted position of its block, 1 .. k - 1 (an unscored one counts as
    False; position 1 has none: True). ``shape``: (B, A, block_size)."""
    b, a, k = scored
    dense = torch.zeros(shape, dtype=torch.bool, device=values.device)
    dense[b, a, k] = values.bool()
    ok = torch.ones(shape, dtype=torch.bool, device=values.device)
    ok[:, :, 2:] = dense[:, :, 1:-1].to(torch.int8).cumprod(dim=-1).bool()
    return ok[b, a, k]


def on_greedy_path(scored: tuple[torch.Tensor, ...], greedy: torch.Tensor, data: torch.Tensor,
                   shape: tuple[int, int, int]) -> torch.Tensor:
    """bool [N]: whether the text's tokens before scored block position (b, a, k) inside its block (anchor + 1 ..
    anchor + k - 1) are the target's greedy tokens there, ``greedy`` [N] and ``data`` [N] at each scored position in
    one id space. Decoding accepts position k only on that path (the verified tokens are the target's own), so only
    there is the target's prediction at k, conditioned on the text, what a draft is verified against."""
    return earlier_all(scored, greedy == data, shape)


def chain_on_path(scored: tuple[torch.Tensor, ...], hits: torch.Tensor, on_path: torch.Tensor,
                  shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts behind a decode-like chain estimate, per block position k = 0 .. bs - 1 ([bs] each, float64):
    positions where decoding would verify k (its block on the target's greedy path before k, :func:`on_greedy_path`,
    and the draft right at every earlier position) and, of those, where the draft is right at k (``hits`` [N]).
    Their ratio is the acceptance at k given everything before k was accepted."""
    b, a, k = scored
    reached = on_path & earlier_all(scored, hits, shape)
    bs = shape[2]
    zeros = torch.zeros(bs, dtype=torch.float64, device=hits.device)
    return (zeros.index_add(0, k, (reached & hits.bool()).double()), zeros.index_add(0, k, reached.double()))


def retrieval_hits(input_ids: torch.Tensor, valid: torch.Tensor, min_match: int, max_match: int = 8) -> torch.Tensor:
    """Where copying from the text itself would have been right, bool [B, T]: ``hit[b, j]`` when the tokens before j
    end with an n-gram (``min_match <= n``) that occurred earlier in the row and the token after its longest earlier
    occurrence (n capped at ``max_match``; of the longest, the most recent) is ``input_ids[b, j]``. The suffix drafter
    proposes exactly that continuation at decode time (decode/suffix.py), so these are the positions where a hybrid
    step is already won without the trained drafter. ``valid`` [B, T] bool: real tokens (padding never matches).

    Cost: ``max_match`` boolean [B, T, T] passes (B = 8, T = 384: about 1M elements each)."""
    if min_match < 1 or max_match < min_match:
        raise SettingError(f"retrieval match lengths: need 1 <= min_match ({min_match}) <= max_match ({max_match}).")
    bsz, t = input_ids.shape
    valid = valid.bool()
    earlier = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril(-1)  # [t, s]: s < t
    eq = input_ids[:, :, None] == input_ids[:, None, :]  # [B, t, s]
    eq = eq & valid[:, :, None] & valid[:, None, :] & earlier
    run = eq
    length = eq.to(torch.uint8)  # the match length of the texts ending at t and at s, capped at max_match
    for _ in range(max_match - 1):
        shifted = torch.zeros_like(run)
        shifted[:, 1:, 1:] = run[:, :-1, :-1]
        run = eq & shifted
        if not run.any():
            break
        length += run.to(torch.uint8)
    latest = torch.arange(t, device=input_ids.device, dtype=torch.int32)
    score = length.to(torch.int32) * t + latest  # the longest match first, then the latest
    score = score.masked_fill(length < min_match, -1)
    best, s = score.max(dim=2)  # [B, t] the chosen earlier end s (< t) of each position t's longest match
    predicted = input_ids.gather(1, (s + 1).clamp(max=t - 1))  # the token that followed it: the prediction for t + 1
    hit = torch.zeros_like(valid)
    hit[:, 1:] = (best[:, :-1] >= 0) & (predicted[:, :-1] == input_ids[:, 1:]) & valid[:, 1:]
    return hit


def dflash_block_loss(logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, token_loss: str,
                      num_items: torch.Tensor | float) -> torch.Tensor:
    """The weighted loss over N scored block positions. ``logits`` [N, Vd] the draft's; ``teacher`` [N, Vd] the
    target's logits over the draft vocabulary (``kl``: KL(target || draft) of the target's distribution renormalised
    over the draft vocabulary) or [N] long draft ids of the target's own tokens (``ce``; -100: not scored);
    ``weights`` [N] each position's weight. The weighted sum divided by ``num_items``: the sum of weights over an
    optimizer step (a scalar tensor; 1.0 for the sum itself, e.g. an evaluation's)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    if token_loss == "kl":
        tlogp = F.log_softmax(teacher.float(), dim=-1)
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    elif token_loss == "ce":
        keep = teacher != -100
        per = -logp.gather(1, teacher.clamp(min=0)[:, None])[:, 0] * keep
        weights = weights * keep
    else:
        raise SettingError(f"token_loss={token_loss!r}: use kl or ce.")
    total = (per * weights).sum()
    return total / (num_items.clamp(min=1e-6) if torch.is_tensor(num_items) else max(float(num_items), 1e-6))


# --- save / load ---------------------------------------------------------------------------------------------------------


def build_dflash_heads(head_config: dict, target_model: nn.Module | None) -> DFlashHeads:
    """selfspec.heads.io builder for head type ``dflash``: rebuild the module from its saved config."""
    if target_model is None:
        raise ValueError("DFlash heads read the target's embeddings: load them with the target, "
                         "heads.load(path, target=...).")
    return DFlashHeads(DFlashConfig(**head_config), target_model)


__all__ = [
    "DFlashConfig", "DFlashHeads", "block_mask", "block_targets", "build_dflash_heads", "chain_on_path",
    "default_target_layer_ids", "dflash_block_loss", "earlier_all", "on_greedy_path", "position_weights",
    "retrieval_hits", "sample_anchors",
]
