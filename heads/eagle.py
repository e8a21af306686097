"""EAGLE-style drafters: one decoder layer that works in the target's feature space.

Two variants share one module, :class:`EagleHeads`:

``eagle`` (EAGLE-1)
    The feature ``f_t`` is the target's last hidden state at position t *after* its final norm (what the target's LM
    head reads; ``out.hidden_states[-1]`` of a Hugging Face CausalLM). The draft reads ``(f_t, token t+1)`` and
    predicts ``f_{t+1}``; its logits are the target's frozen LM head applied to the predicted feature directly (no
    extra norm: the predicted feature lives in the post-norm space it regresses onto), so they predict token t+2.
    Trained by smooth-L1 on features plus KL-to-target (or cross-entropy) on logits.

``eagle3`` (EAGLE-3)
    The input feature fuses the hidden states entering three target layers (low / mid / high; ``layer_ids``, by
    default ``[2, L//2, L-3]``, index i = ``out.hidden_states[i]``, the input of layer i) through ``fuse`` (3H -> H,
    no bias). The draft has its own final ``norm`` and its own ``lm_head`` over a reduced draft vocabulary (the most
    frequent tokens of the training data; ``d2t`` / ``t2d`` buffers with SGLang's convention, see
    :func:`selfspec.heads.vocab.build_draft_vocab`). No feature regression: trained only on tokens, with unrolled test-time steps in which
    the draft reads its own previous output feature.

The draft layer is ONE transformers ``LlamaDecoderLayer`` whatever the target, as SGLang, vLLM and SpecForge build
EAGLE drafters: the target's hidden size, attention heads and head dim, RMS-norm eps and rope, a dense SiLU MLP (for
a mixture-of-experts target as wide as the experts a token passes through) and no biases; the fields are
:func:`selfspec.core.archs.llama_layer_fields` of the target, saved in ``EagleConfig.draft_layer``. It attends to everything
the drafter's own masks allow (no sliding window) and has its own rotary embedding from those fields (float32
whatever the drafter's dtype). Its norms and the eagle3 ``embed_norm``, ``feature_norm`` and ``norm`` are Llama RMS
norms, the last three starting from the scale of the target's final norm (:func:`selfspec.core.layers.rms_norm_scale`). Heads
saved before the draft layer was a Llama layer had a layer of the target's own class: for a Llama target that is the
same layer and they load unchanged (:func:`build_eagle_heads`), for any other they are refused with what to retrain.
Two layouts put the token embedding and the feature into the layer (``EagleConfig.layout``):

``fc`` (the default, both variants)
    ``fc`` over ``[embedding, feature]`` (2H -> H, the order EAGLE uses) feeds the unmodified layer (its own input
    norm, attention, residual over the projected input). eagle3 first normalises embedding and feature separately
    (``embed_norm``, ``feature_norm``). EAGLE-1 with ``input_norm=False`` drops the layer's input norm (EAGLE-1 as
    published, and vLLM's ``EagleLlamaForCausalLM`` with ``fc_bias=False``: :mod:`selfspec.heads.export`).

``midlayer`` (eagle3 only: EAGLE-3 as published, SGLang's ``LlamaForCausalLMEagle3``, vLLM speculators'
``Eagle3Speculator``)
    The layer's q/k/v projections are widened to read ``[embed_norm(embedding), feature_norm(feature)]`` (2H) and the
    residual stream is the feature itself: ``h = feature + attn(...)``, ``out = h + mlp(post_attention_layernorm(h))``
    (the layer's own input norm is dropped: ``embed_norm`` and ``feature_norm`` take its place). Weights map one to
    one onto those implementations' checkpoints (:mod:`selfspec.heads.export`). Not the default: with the same steps it has
    learned more slowly than ``fc``, above all on the unrolled steps (SmolLM2: docs/journal/; the tests' tiny
    models likewise), so it is the layout to choose when the heads must be served by SGLang or vLLM.

Used, not owned: the target's token embedding matrix (its rows as they are: an embedding module that scales its
output, Gemma's, is read unscaled, as the engines' drafters read it) and (``eagle``) its LM head are reached through a
reference kept out of ``state_dict()`` and ``parameters()``.

The draft has its own KV cache (a transformers ``DynamicCache``, layer 0). Every call takes explicit position ids and
an additive float 4D mask ``[B, 1, q, past + q]`` (0 = may attend, dtype minimum elsewhere); :func:`selfspec.core.layers.causal_mask`
builds the plain one. The losses are pure functions in :mod:`selfspec.heads.eagle_loss`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from selfspec.core.archs import llama_layer_fields, output_logits, text_config
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.core.kv import additive_mask, cache_length
from selfspec.core.layers import causal_mask, decoder_of, init_linears, rms_norm_scale, shift_left
from selfspec.core.target import cache_kwarg
from selfspec.heads.vocab import install_draft_vocab

VARIANTS = ("eagle", "eagle3")
LAYOUTS = ("fc", "midlayer")


@dataclass
class EagleConfig:
    variant: str = "eagle"  # "eagle" | "eagle3"
    hidden_size: int = 0  # the target's; filled by from_target
    vocab_size: int = 0  # the target's
    layer_ids: list[int] | None = None  # eagle3: the target layers whose input hidden states are fused
    draft_vocab_size: int | None = None  # size of the draft vocabulary (None = the target's): eagle3's own LM head;
    # eagle's logits are the target LM head's rows of its draft tokens (a large vocabulary's head costs most of a step)
    fc_bias: bool = True  # bias of the 2H -> H input projection (EAGLE-1 has one)
    init_layer_from: int | None = None  # copy the weights of this target layer into the draft layer (None = random)
    layout: str = "fc"  # "fc" | "midlayer" (eagle3 only): how embedding and feature enter the layer
    input_norm: bool = True  # fc layout: the layer's own input norm over the projected input (False: none, EAGLE-1's)
    draft_layer: dict | None = None  # the draft layer's LlamaConfig fields (selfspec.core.archs.llama_layer_fields of the target)

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise SettingError(f"Unknown EAGLE variant {self.variant!r}; use one of {VARIANTS}.")
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
        if self.layout not in LAYOUTS:
            raise SettingError(f"Unknown EAGLE layout {self.layout!r}; use one of {LAYOUTS}.")
        if self.layout == "midlayer" and self.variant != "eagle3":
            raise SettingError("layout='midlayer' (EAGLE-3's widened q/k/v) is for variant='eagle3'; EAGLE-1 uses 'fc'.")
        if self.layout == "midlayer" and not self.input_norm:
            raise SettingError("input_norm=False is for layout='fc'; midlayer's embed_norm and feature_norm replace the "
                               "layer's input norm already.")
        if self.variant == "eagle3" and self.layer_ids is not None and len(self.layer_ids) != 3:
            raise SettingError(f"eagle3 fuses exactly 3 target layers (low, mid, high); got layer_ids={self.layer_ids}.")

    @property
    def effective_draft_vocab_size(self) -> int:
        if self.draft_vocab_size is None:
            return self.vocab_size
        return min(int(self.draft_vocab_size), self.vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target: nn.Module, **kwargs) -> EagleConfig:
        """A config for ``target`` (sizes from its config; eagle3 layer ids defaulted from its depth)."""
        tcfg = target.config
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        cfg = cls(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, **kwargs)
        if cfg.variant == "eagle3" and cfg.layer_ids is None:
            cfg.layer_ids = default_layer_ids(tcfg.num_hidden_layers)
        if cfg.draft_layer is None:
            cfg.draft_layer = llama_layer_fields(tcfg)
        return cfg

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The draft layer's config: one Llama layer of :attr:`draft_layer`'s fields."""
        config = LlamaConfig(hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_hidden_layers=1,
                             **self.draft_layer)
        config._attn_implementation = attn_implementation
        return config


SERVING_FORM = ("fc_bias", "input_norm", "layout")  # the fields that decide which serving engine loads EAGLE heads


def serving_form(head_config: dict) -> dict[str, Any]:
    """A saved ``head_config``'s :data:`SERVING_FORM` fields, each :class:`EagleConfig`'s default where it records none
    (heads of another family, or saved before the field): what heads/export.py and serve/serving.py read to tell which
    serving engine's format the heads have."""
    defaults = {f.name: f.default for f in fields(EagleConfig)}
    return {k: head_config.get(k, defaults[k]) for k in SERVING_FORM}


def engine_layer_ids(num_layers: int) -> list[int]:
    """The layers vLLM and SGLang fuse when a checkpoint names none: the inputs of layers 2, L//2 and L-3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high choice: the engines' (:func:`engine_layer_ids`) where those are three different
    layers in ascending order; on a target too shallow for that (fewer than 7 layers), three different layers spread
    over the stack at 1/4, 1/2 and 3/4, since the engines capture each layer once, in layer order."""
    ids = engine_layer_ids(num_layers)
    if ids == sorted(set(ids)) and len(ids) == 3:
        return ids
    if num_layers <= 3:  # too few layers for three different ones past the embeddings
        return [min(i, num_layers - 1) for i in range(3)]
    return [round(num_layers * f) for f in (0.25, 0.5, 0.75)]  # 4..6 layers: three different ones


# --- masks -----------------------------------------------------------------------------------------------------------


def unrolled_step_mask(key_padding: torch.Tensor, step: int, dtype: torch.dtype,
                       segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mask of unrolled training step ``step`` over the keys of steps 0..step: [B, 1, T, (step + 1) T].

    Step 0's keys are the real prefix: query t sees keys s <= t (not padding). Each later step's keys at index t are
    the draft's own earlier guesses on the path of t, so query t sees only index t in those blocks (a chain through
    the steps, exactly what the dynamic tree shows the draft at test time). With ``segment_ids`` [B, T] (a packed
    batch, selfspec.train.data.collate_packed) step 0's keys are further limited to query t's own example.
    """
    bsz, length = key_padding.shape
    idx = torch.arange(length, device=key_padding.device)
    causal = (idx[None, :] <= idx[:, None])[None] & key_padding.bool()[:, None, :]  # [B, T, T]
    if segment_ids is not None:
        causal = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
    diag = torch.eye(length, dtype=torch.bool, device=key_padding.device).expand(bsz, length, length)
    allowed = torch.cat([causal] + [diag] * step, dim=-1)  # [B, T, (step+1) T]
    return additive_mask(allowed[:, None], dtype)


def _widen_qkv(layer: LlamaDecoderLayer, hidden: int) -> None:
    """``midlayer``: q/k/v projections that read 2H (embedding and feature side by side); the input norm goes."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
    del layer.input_layernorm


def draft_attn_implementation(target_config) -> str:
    """The draft layer's attention: the target's where a Llama layer takes an additive 4D mask with it (eager,
    sdpa), else sdpa (the drafter's tree masks are arbitrary, which flash kernels cannot take)."""
    impl = getattr(target_config, "_attn_implementation", None)
    return impl if impl in ("eager", "sdpa") else "sdpa"


def _norm(hidden: int, eps: float, scale: torch.Tensor | None) -> LlamaRMSNorm:
    """A Llama RMS norm whose scale starts at ``scale`` (None: ones)."""
    norm = LlamaRMSNorm(hidden, eps=eps)
    if scale is not None:
        with torch.no_grad():
            norm.weight.copy_(scale)
    return norm


# --- the draft module ------------------------------------------------------------------------------------------------


class EagleHeads(nn.Module):
    """One draft decoder layer over (feature, next-token embedding); see the module docstring.

    ``target``: the frozen Hugging Face CausalLM it drafts for (its embedding, rotary embedding and, for ``eagle``,
    LM head are used in place). ``d2t``: eagle3's draft vocabulary (:func:`selfspec.heads.vocab.build_draft_vocab`); None keeps the first
    ``draft_vocab_size`` ids until :meth:`set_draft_vocab` (or a loaded state dict) sets one.
    """

    def __init__(self, config: EagleConfig, target: nn.Module, d2t: torch.Tensor | None = None):
        super().__init__()
        tcfg = target.config
        if config.hidden_size != tcfg.hidden_size or config.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"EagleConfig(hidden_size={config.hidden_size}, vocab_size={config.vocab_size}) does not match the "
                f"target (hidden_size={tcfg.hidden_size}, vocab_size={tcfg.vocab_size}); "
                "build it with EagleConfig.from_target(target, ...)."
            )
        self.config = config
        base = decoder_of(target)
        hidden = config.hidden_size
        if config.draft_layer is None:
            config.draft_layer = llama_layer_fields(tcfg)
        layer_config = config.llama_config(draft_attn_implementation(tcfg))
        eps = layer_config.rms_norm_eps
        final_scale = rms_norm_scale(base.norm, hidden)  # the draft's norms start as the target's final norm
        if config.variant == "eagle3":
            if config.layer_ids is None:
                config.layer_ids = default_layer_ids(tcfg.num_hidden_layers)
            bad = [i for i in config.layer_ids if not 0 <= i < tcfg.num_hidden_layers]
            if bad:
                raise ValueError(
                    f"layer_ids {config.layer_ids} name layers outside the target's 0..{tcfg.num_hidden_layers - 1}."
                )
            self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
            self.embed_norm = _norm(hidden, eps, final_scale)
            self.feature_norm = _norm(hidden, eps, final_scale)
        if config.layout == "fc":
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)

        self.layer = LlamaDecoderLayer(layer_config, layer_idx=0)
        # Not a submodule: casting the drafter to bfloat16 would round its frequencies (positions off by whole turns
        # far into a sequence); its float32 buffers only follow the drafter's device (forward).
        self._rotary = [LlamaRotaryEmbedding(layer_config)]
        if config.layout == "midlayer":
            _widen_qkv(self.layer, hidden)
        elif not config.input_norm:
            self.layer.input_layernorm = nn.Identity()
        init_linears(self, getattr(tcfg, "initializer_range", 0.02))
        if config.init_layer_from is not None:
            self._init_layer_from(base.layers, config.init_layer_from)

        if config.variant == "eagle3":
            self.norm = _norm(hidden, eps, final_scale)
            self._register_vocab(config, d2t)
            self.lm_head = nn.Linear(hidden, config.effective_draft_vocab_size, bias=False)
            self.set_draft_vocab(self.d2t if d2t is None else d2t, init_lm_head_from=target.get_output_embeddings())
        elif config.draft_vocab_size is not None:  # eagle: the target LM head's draft rows (logits), no head of its own
            self._register_vocab(config, d2t)
            self.set_draft_vocab(self.d2t if d2t is None else d2t)
        self._rows: tuple[tuple, tuple] | None = None  # (key, the LM head's draft rows): draft_rows
        for p in self.parameters():
            p.requires_grad_(True)
        self.to(next(target.parameters()).device)  # new layers beside the copied norms: all on the target's device
        # Used, never owned: kept out of state_dict() and parameters().
        self._target = [target]

    def _register_vocab(self, config: EagleConfig, d2t: torch.Tensor | None) -> None:
        """The ``d2t`` / ``t2d`` buffers of a draft vocabulary; zeros in ``d2t`` (identity over the first ids) until
        :meth:`set_draft_vocab` (or a loaded state dict) sets one."""
        vd = config.effective_draft_vocab_size
        if d2t is not None and d2t.shape != (vd,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}; expected ({vd},) (the draft vocabulary size).")
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def has_draft_vocab(self) -> bool:
        """Whether it drafts over a draft vocabulary (``d2t`` / ``t2d``): eagle3 always, eagle with a draft_vocab_size."""
        return "d2t" in self._buffers

    def _init_layer_from(self, layers: nn.ModuleList, index: int) -> None:
        """Copy target layer ``index``'s weights into the draft layer. The target's layer must have a Llama layer's
        parameters of the draft's shape (a Llama or Mistral target's; a Qwen2 target's projection biases are left
        out, the draft layer has none); ``midlayer``: its q/k/v weights go to the feature half of the widened
        projections (the embedding half keeps its random init), its input norm is not used."""
        if not -len(layers) <= index < len(layers):
            raise SettingError(f"init_layer_from={index}: the target has layers 0..{len(layers) - 1} (-1: the last).")
        source = layers[index]
        mine, theirs = self.layer.state_dict(), source.state_dict()
        skipped = {"input_layernorm.weight"} - set(mine)  # midlayer's and input_norm=False's dropped input norm
        skipped |= {k for k in theirs if k.endswith(".bias")}
        widened = {f"self_attn.{p}_proj.weight" for p in "qkv"} if self.config.layout == "midlayer" else set()
        differ = sorted((set(mine) ^ set(theirs)) - skipped) or [
            k for k, v in theirs.items() if k in mine and mine[k].shape != v.shape
            and not (k in widened and mine[k].shape == (v.shape[0], 2 * v.shape[1]))]
        if differ:
            raise SettingError(
                f"init_layer_from={index}: the target's layer ({type(source).__name__}) is not a Llama layer of the "
                f"draft layer's shape (these parameters differ: {', '.join(differ)}), so its weights have no place "
                "in the draft's Llama layer. Start the draft layer at random: heads.init_layer_from=null."
            )
        with torch.no_grad():
            for name, value in theirs.items():
                if name not in mine:
                    continue
                if mine[name].shape == value.shape:
                    mine[name].copy_(value)
                else:  # [out, 2H] <- [out, H]
                    mine[name][:, value.shape[1]:].copy_(value)

    @property
    def dtype(self) -> torch.dtype:
        """The draft's parameter dtype."""
        return self.layer.post_attention_layernorm.weight.dtype

    # -- target and vocabulary ---------------------------------------------------------------------------------------

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    @property
    def variant(self) -> str:
        return self.config.variant

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the target's ``out.hidden_states`` that :meth:`target_features` reads (-1: the last entry,
        after the final norm)."""
        return [-1] if self.variant == "eagle" else list(self.config.layer_ids)

    def set_draft_vocab(self, d2t: torch.Tensor, init_lm_head_from: nn.Module | None = None) -> None:
        """Install a draft vocabulary (``d2t`` from :func:`selfspec.heads.vocab.build_draft_vocab`); eagle3: optionally
        copying the matching rows of the target's LM head into the draft LM head."""
        if not self.has_draft_vocab:
            raise ValueError("this drafter has no draft vocabulary: build it with a draft_vocab_size")
        install_draft_vocab(self, d2t, init_lm_head_from if self.variant == "eagle3" else None)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target ids (identity without a draft vocabulary)."""
        if not self.has_draft_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -100 for ids outside the draft vocabulary (and for -100)."""
        if not self.has_draft_vocab:
            return target_ids
        lookup = torch.cumsum(self.t2d.long(), 0) - 1  # rank of a kept id among kept ids = its draft id
        safe = target_ids.clamp(min=0)
        out = lookup[safe]
        return torch.where((target_ids >= 0) & self.t2d[safe], out, torch.full_like(out, -100))

    def draft_token_ids(self) -> torch.Tensor:
        """[Vd] the target ids of the draft vocabulary, in draft id order."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def teacher_logits(self, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target logits [..., V] -> (the same restricted to the draft vocabulary [..., Vd], in_vocab [...]) where
        in_vocab says the target's top token is a draft token (EAGLE-3 trains only on those positions). Logits
        already over the draft vocabulary alone ([..., Vd], heads.loss.teacher_vocab=draft) pass as they are, every
        row in vocabulary: the target's top token outside it cannot be told from them."""
        if not self.has_draft_vocab or target_logits.shape[-1] == self.d2t.numel():
            return target_logits, torch.ones(target_logits.shape[:-1], dtype=torch.bool, device=target_logits.device)
        ids = self.draft_token_ids()
        in_vocab = self.t2d[target_logits.argmax(-1)]
        return target_logits[..., ids.to(target_logits.device)], in_vocab

    # -- forward -----------------------------------------------------------------------------------------------------

    def target_features(self, hidden_states) -> torch.Tensor:
        """The target's hidden states -> step-0 draft features [B, T, H].

        ``hidden_states``: anything indexed by the layer indices in :attr:`feature_layers` giving [B, T, H]: the
        target's ``out.hidden_states`` (L + 1 tensors) or a dict {index: tensor} (e.g. from a feature store)."""
        return self.fuse_features([hidden_states[i] for i in self.feature_layers])

    def fuse_features(self, selected: list[torch.Tensor]) -> torch.Tensor:
        """The hidden states at :attr:`feature_layers` (each [B, T, H]) -> step-0 draft features [B, T, H]."""
        dtype = self.dtype
        if self.variant == "eagle":
            return selected[0].to(dtype)
        return self.fuse(torch.cat([h.to(dtype) for h in selected], dim=-1))

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """features [B, q, H] (of positions t), input_ids [B, q] (tokens t+1), position_ids [B, q] -> [B, q, H],
        the predicted features of positions t+1. ``attention_mask`` [B|1, 1, q, past + q] additive; None = causal
        over ``cache``. The new keys/values are appended to ``cache`` (a DynamicCache) when one is given."""
        dtype = self.dtype
        # the embedding matrix's rows, as the engines' drafters read them (Gemma's embedding scales its output by
        # sqrt(H) inside the module; their drafters and ours read it unscaled)
        emb = F.embedding(input_ids, self.target.get_input_embeddings().weight).to(dtype)
        features = features.to(dtype)
        if attention_mask is None:
            attention_mask = causal_mask(input_ids.shape[1], cache_length(cache), dtype, features.device)
        attention_mask = attention_mask.to(dtype)
        position_embeddings = self.position_embeddings(features, position_ids)
        if self.config.layout == "midlayer":
            x = torch.cat([self.embed_norm(emb), self.feature_norm(features)], dim=-1)  # [B, q, 2H]
            attn = self.layer.self_attn(
                hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                position_ids=position_ids, **{cache_kwarg(self.layer.self_attn): cache},
            )[0]
            h = features + attn
            return h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        if self.variant == "eagle3":
            emb, features = self.embed_norm(emb), self.feature_norm(features)
        x = self.fc(torch.cat([emb, features], dim=-1))
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            **{cache_kwarg(self.layer): cache},
            position_embeddings=position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out

    def position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer's rotary (cos, sin) [B, q, head_dim] at ``position_ids`` [B, q], in ``x``'s dtype, computed
        from float32 frequencies."""
        rotary = self._rotary[0]
        if rotary.inv_freq.device != x.device:
            rotary.to(x.device)
        return rotary(x, position_ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft features [..., H] -> logits over the draft vocabulary [..., Vd] (eagle: the target's LM head, or its
        draft rows alone with a draft vocabulary, soft-capped where the target's logits are,
        :func:`selfspec.core.archs.output_logits`)."""
        if self.variant == "eagle":
            lm_head = self.target.get_output_embeddings()
            x = features.to(lm_head.weight.dtype)
            if not self.has_draft_vocab:
                return output_logits(self.target.config, lm_head(x))
            weight, bias = self.draft_rows(lm_head)
            return output_logits(self.target.config, F.linear(x, weight, bias))
        return self.lm_head(self.norm(features))

    def draft_rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (frozen) target LM head's rows (and bias) of the draft tokens, gathered once and again only when
        the head's weight or ``d2t`` is another tensor or changed in place (a new vocabulary, a loaded state dict)."""
        weight, d2t = lm_head.weight, self.d2t
        key = (weight.data_ptr(), weight.device, weight._version, d2t.data_ptr(), d2t.device, d2t._version)
        if self._rows is None or self._rows[0] != key:
            rows = self.draft_token_ids().to(weight.device)
            bias = lm_head.bias[rows].detach() if getattr(lm_head, "bias", None) is not None else None
            self._rows = (key, (weight[rows].detach(), bias))
        return self._rows[1]

    def unrolled_forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int = 1,
        key_padding: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training forward with ``steps`` unrolled test-time steps.

        features [B, T, H]: step-0 features (target features, maybe noised) of positions 0..T-1;
        input_ids [B, T]: the sequence x_0..x_{T-1}. Index t of step j reads token x_{t+j+1} at position t+j
        (the draft's guess of feature t+j for j > 0) and returns [B, T, H] per step, predicting feature t+j+1 /
        token t+j+2. Inputs past the sequence end read token 0; their losses are masked by the loss functions.
        A packed batch gives ``segment_ids`` and ``position_ids`` [B, T] (selfspec.train.data.collate_packed): attention stays
        within each example and positions restart in each; an index whose tokens run into the next example is not
        trained on (see :func:`drafter_loss`).
        """
        bsz, length = input_ids.shape
        if key_padding is None:
            key_padding = torch.ones_like(input_ids, dtype=torch.bool)

        cache = DynamicCache()
        positions = position_ids
        if positions is None:
            positions = (torch.cumsum(key_padding.long(), -1) - 1).clamp(min=0)  # [B, T] (left padding safe)
        outputs = []
        current = features
        for step in range(steps):
            tokens = shift_left(input_ids, step + 1, fill=0)
            mask = unrolled_step_mask(key_padding, step, self.dtype, segment_ids)
            current = self(current, tokens, positions + step, mask, cache)
            outputs.append(current)
        return outputs


# --- save / load ------------------------------------------------------------------------------------------------------


def build_eagle_heads(head_config: dict, target_model: nn.Module | None) -> EagleHeads:
    """selfspec.heads.io builder for head types ``eagle`` and ``eagle3``: rebuild the module from its saved config. Heads saved
    without ``layout`` are fc; heads saved without ``draft_layer`` had a layer of the target's own class
    (:func:`saved_draft_layer`)."""
    if target_model is None:
        raise ValueError(
            "EAGLE heads use the target's embeddings (and EAGLE-1 its LM head): load them with the target, "
            "heads.load(path, target=...)."
        )
    head_config = dict(head_config)
    if head_config.get("draft_layer") is None:
        head_config["draft_layer"] = saved_draft_layer(head_config, target_model)
    return EagleHeads(EagleConfig(**head_config), target_model)


class OldDraftLayerError(SelfspecError, ValueError):
    """EAGLE heads saved with a draft layer of the target's own class, which is not a Llama layer."""


def saved_draft_layer(head_config: dict, target_model: nn.Module) -> dict:
    """The draft layer of heads saved before it was a Llama layer whatever the target: it was a layer of the target's
    own class built from the target's config. For a Llama target that is the Llama layer of the target's own fields,
    which these heads load into unchanged; any other class is refused (its weights do not fit a Llama layer)."""
    layer = decoder_of(target_model).layers[0]
    if type(layer) is not LlamaDecoderLayer:
        raise OldDraftLayerError(
            f"These {head_config.get('variant', 'eagle')} heads were saved by an earlier selfspec, whose EAGLE draft "
            f"layer was the target's own layer class ({type(layer).__name__}); the draft layer is now a Llama layer "
            "for every target (what SGLang and vLLM serve), which their weights do not fit. Retrain them with the same "
            "settings (python train/eagle.py heads=... model=...). Heads for Llama targets load unchanged."
        )
    tcfg = text_config(target_model.config)
    names = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
             "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias")
    return {name: getattr(tcfg, name) for name in names}
