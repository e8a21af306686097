"""Target architectures: the one place that knows how they differ.

Two things differ between the decoder-only architectures selfspec drafts for, as far as drafting and verifying go:

- **Which layers slide.** Mistral slides every layer over a window; Gemma 3 and gpt-oss alternate sliding and full
  layers (``config.layer_types``); Llama, Qwen3, Phi-3 (by default) and DeepSeek-V3 attend to everything. The engine
  keeps a full cache for every layer and builds its own masks, so :func:`attention_mask_for` gives each kind of layer
  its own mask, cut to its window, in the form the model's ``forward`` takes (one tensor when every layer is alike, a
  dict by layer type otherwise: transformers' own ``causal_mask_mapping``).
- **How a tiny random copy is built** for tests and dry runs (:data:`TINY_ARCHS`): each row is the architecture's
  real transformers config class with the few settings that make its peculiarity show in a 4-layer, 64-wide model
  (a window of 8 positions, 4 experts, MLA's low-rank keys, logit soft-capping, attention sinks).

Everything else (q/k norms, q/k/v biases, fused projections, MoE routing, MLA, sinks, soft-capping, scaled
embeddings) lives inside the model's own ``forward`` and needs nothing from us. Adding an architecture is a row in
:data:`TINY_ARCHS` and a row in the tests' matrix (tests/test_archs.py), and its name in the ``ARCHS`` of one of the
serving matrix's files (tests/test_serving_archs*.py, which fail without it): they check it in vLLM's CPU build and
expect every export served, unless the refusal is recorded there.

Drafters that run or build layers outside the model's forward read what they need here too (below), and
:func:`llama_layer_fields` gives the shape of a plain dense Llama layer for a target (EAGLE's draft layer, a Llama
layer whatever the target, as SGLang and vLLM build it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from selfspec.core.kv import additive_mask
from selfspec.core.layers import decoder_of

FULL = "full_attention"
SLIDING = "sliding_attention"


def plain_head(head_dim: int) -> dict[str, Any]:
    return {"head_dim": head_dim}


def mla_head(head_dim: int) -> dict[str, Any]:
    """Multi-head latent attention's query/key head: half rotated, half not; values as wide."""
    return {"qk_rope_head_dim": head_dim // 2, "qk_nope_head_dim": head_dim // 2, "v_head_dim": head_dim}


@dataclass(frozen=True)
class TinyArch:
    """A tiny random model of one architecture: its transformers config class and what differs from the shared
    shape (hidden 64, 4 layers, 4 query heads on 2 key/value heads, vocabulary 320). Every row builds at any shape
    ``build_tiny`` asks for: ``head`` turns the head size (hidden / heads unless given: 16 by default, 32 for vLLM's
    CPU attention) into the config's settings, and alternating layer types run over all the layers."""

    config_class: str
    extra: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None  # one the architecture needs (gpt-oss has no sdpa attention)
    head: Callable[[int], dict[str, Any]] = plain_head
    alternating: bool = False  # sliding and full layers alternate, sliding first (Gemma 3, gpt-oss)

    def config_kwargs(self, num_hidden_layers: int, head_dim: int) -> dict[str, Any]:
        """What this architecture's config takes beyond the shared shape, for a model of that many layers and that
        head size."""
        layers = {"layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(num_hidden_layers)]}
        return {**self.head(head_dim), **self.extra, **(layers if self.alternating else {})}


WINDOW = 8  # the tiny sliding windows: prompts of 4-30 tokens and 20 new ones cross it

TINY_ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("LlamaConfig"),
    "qwen2": TinyArch("Qwen2Config"),  # q/k/v biases
    "qwen3": TinyArch("Qwen3Config"),  # q/k norms
    "qwen3_moe": TinyArch("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mistral": TinyArch("MistralConfig", {"sliding_window": WINDOW}),  # every layer slides
    "gemma3": TinyArch("Gemma3TextConfig", {
        "sliding_window": WINDOW, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        head=lambda d: {"head_dim": d, "query_pre_attn_scalar": d}, alternating=True),
    "gpt_oss": TinyArch("GptOssConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
        # attention sinks: transformers has eager (and kernels) attention for them
        attn_implementation="eager", alternating=True),
    "phi3": TinyArch("Phi3Config"),  # fused qkv and gate/up projections
    "deepseek_v2": TinyArch("DeepseekV2Config", {  # MLA without a query low rank (V2-Lite), softmax routing
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 32, "n_shared_experts": 1}, head=mla_head),
    "deepseek_v3": TinyArch("DeepseekV3Config", {  # MLA attention, shared + routed experts after a dense layer
        "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 32, "n_shared_experts": 1,
        # what transformers' DeepSeek-V3 always does and its real config.json names (vLLM reads them; without them
        # it routes by softmax and has no router bias to load)
        "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, head=mla_head),
}


def text_config(config):
    """The decoder's config (a multimodal config's text part)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


UNBOUNDED_CONTEXT = 1 << 30  # the context limit of a config that sets no max_position_embeddings


def context_limit(config) -> int:
    """The longest sequence (prompt + new tokens) a target of ``config`` takes: its text config's
    ``max_position_embeddings``, or :data:`UNBOUNDED_CONTEXT` where it sets none. The engine stops there, the cost
    curve, a layer stack's probe and a serve check fit in it, and vLLM's ``max_model_len`` is kept within it.
    Sliding-window layers need no limit of their own: the engine keeps every layer's full cache and cuts each sliding
    layer's mask to its window."""
    return int(getattr(text_config(config), "max_position_embeddings", None) or UNBOUNDED_CONTEXT)


def layer_kinds(config) -> list[str]:
    """Each decoder layer's attention kind, :data:`FULL` or :data:`SLIDING`, as the model's own forward picks its
    mask: ``config.layer_types`` where the config has them, else every layer slides when ``sliding_window`` is set
    (Mistral, Phi-3, Qwen3-MoE with ``use_sliding_window``)."""
    config = text_config(config)
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return [SLIDING if k == SLIDING else FULL for k in kinds[:n]]
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    return [SLIDING if sliding else FULL] * n


def sliding_window(config) -> int | None:
    """The window of the sliding layers (None when no layer slides): a query at position p sees keys at positions
    p - window + 1 .. p, as transformers' ``sliding_window_overlay`` has it."""
    return int(text_config(config).sliding_window) if SLIDING in layer_kinds(config) else None


def attention_mask_for(config, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask(s) a model's forward takes for queries at ``query_positions`` [q] over keys at
    ``key_positions`` [k], ``allowed`` [q, k] (bool: a tree's ancestry over the cache) where every layer attends
    fully. Sliding layers also drop keys outside their window. One [1, 1, q, k] tensor when all layers are of one
    kind; else a dict by kind, which the models with mixed layers take as their mask mapping."""
    kinds = set(layer_kinds(config))
    masks = {}
    for kind in kinds:
        ok = allowed
        if kind == SLIDING:
            ok = ok & (query_positions[:, None] - key_positions[None, :] < sliding_window(config))
        masks[kind] = additive_mask(ok, dtype)[None, None]
    return masks.popitem()[1] if len(masks) == 1 else masks


def mask_of_layer(masks: torch.Tensor | dict[str, torch.Tensor], config, layer: int) -> torch.Tensor:
    """The mask that layer ``layer`` reads from :func:`attention_mask_for`'s result (a caller running layers one
    by one)."""
    return masks if isinstance(masks, torch.Tensor) else masks[layer_kinds(config)[layer]]


# --- running a target's pieces outside its own forward ----------------------------------------------------------------
# What a drafter that runs the target's layers one by one (layer-skip), copies one of them (a layer-skip adapter),
# builds layers like them (DFlash), puts LoRA on them (Medusa-2) or reads the target's distribution from its last
# hidden state needs to know, read from the model itself where it can be (signatures, module names), so a new
# architecture that follows the transformers conventions needs no row here.

RESIDUAL_OUTPUTS = ("o_proj", "down_proj")  # a decoder layer's projections that write into the residual stream:
# attention's output, and the MLP's (or every expert's, shared ones included, as 3D parameters) down projection


def layer_position_embeddings(decoder, hidden: torch.Tensor, position_ids: torch.Tensor,
                              layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rotary (cos, sin) that each decoder layer in ``layers`` reads at ``position_ids`` [B, q], as the model's
    own forward computes them: one shared rotary embedding, or one per layer type (Gemma 3: full and sliding layers
    rotate with different bases), where the rotary embedding's ``forward`` takes a ``layer_type``."""
    rotary = decoder.rotary_emb
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        shared = rotary(hidden, position_ids=position_ids)
        return [shared for _ in layers]
    types = text_config(decoder.config).layer_types
    by_type = {t: rotary(hidden, position_ids, layer_type=t) for t in {types[i] for i in layers}}
    return [by_type[types[i]] for i in layers]


def position_embeddings_in(rotary, dtype: torch.dtype):
    """A layer's rotary embeddings for hidden states of ``dtype``: (cos, sin) cast to it, or DeepSeek-V2's complex
    frequencies (one tensor, which its attention applies in float) as they are."""
    return rotary if isinstance(rotary, torch.Tensor) else tuple(r.to(dtype) for r in rotary)


def output_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The target's logits from its LM head's output, as its forward returns them: soft-capped
    (``final_logit_softcapping``: Gemma 2 and 3) where the config says so, else unchanged."""
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def residual_outputs(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters (weights and biases) of a decoder layer's :data:`RESIDUAL_OUTPUTS`: zeroed, the layer adds
    nothing to the residual stream (a norm after them, as Gemma 3's post-norms, maps zero to zero). Empty when the
    layer names them otherwise."""
    return [(name, p) for name, p in layer.named_parameters()
            if any(part.startswith(out) for out in RESIDUAL_OUTPUTS for part in name.split(".")[-2:])]


def attention_linear_names(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers inside each decoder layer's attention (the child module whose name has
    ``attn``): q/k/v/o for most, ``qkv_proj``/``o_proj`` for Phi-3's fused projection, MLA's low-rank
    ``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/``kv_b_proj``/``o_proj`` for DeepSeek-V3. Empty when the layers
    have no such child."""
    names = set()
    for layer in decoder_of(model).layers:
        for child_name, child in layer.named_children():
            if "attn" in child_name:
                names |= {n.split(".")[-1] for n, m in child.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def rope_parameters(config) -> dict:
    """The rotary parameters of the target's full-attention layers (a config whose layer types rotate differently,
    as Gemma 3's, keeps one set per type), or of every layer."""
    config = text_config(config)
    params = getattr(config, "rope_parameters", None)
    if not params:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    if all(isinstance(v, dict) for v in params.values()):
        return dict(params.get(FULL) or next(iter(params.values())))
    return dict(params)


# --- a Llama layer for a target ---------------------------------------------------------------------------------------


def dense_mlp_width(config) -> int:
    """The width of one dense MLP doing a target's per-token MLP work: ``intermediate_size`` for a dense target; for
    a mixture of experts, the experts a token is routed to (``num_experts_per_tok``) and the shared ones side by side,
    each ``moe_intermediate_size`` wide (``intermediate_size`` where the config has no separate expert width: gpt-oss,
    Mixtral). Qwen3-30B-A3B: 8 x 768 = 6144 and DeepSeek-V3: (8 + 1) x 2048 = 18432, each its own dense layers'
    ``intermediate_size``; gpt-oss-20b: 4 x 2880 = 11520."""
    config = text_config(config)
    routed = getattr(config, "num_experts_per_tok", None)
    experts = any(getattr(config, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not routed or not experts:
        return int(config.intermediate_size)
    width = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    shared = int(getattr(config, "n_shared_experts", None) or 0) * width
    shared += int(getattr(config, "shared_expert_intermediate_size", None) or 0)  # Qwen2-MoE's one wide shared expert
    return int(routed) * width + shared


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a plain attention layer for a target: the target's own; for
    multi-head latent attention (DeepSeek-V3: keys and values come from one low-rank latent, queries and keys are
    wider than values) heads of the value width ``v_head_dim`` spanning the hidden size, sharing 8 key/value heads
    (the largest divisor of the heads up to 8): SpecForge's DeepSeek-V3 drafter, 56 heads of 128 on 8."""
    config = text_config(config)
    if getattr(config, "kv_lora_rank", None):
        head_dim = int(config.v_head_dim)
        heads = max(1, config.hidden_size // head_dim)
        return heads, max(d for d in range(1, min(heads, 8) + 1) if heads % d == 0), head_dim
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads, kv_heads, int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def llama_layer_fields(config) -> dict[str, Any]:
    """The ``LlamaConfig`` fields (besides ``hidden_size``) of one dense Llama decoder layer for a target: its hidden
    size, attention shape (:func:`attention_shape`), RMS-norm eps and full-attention rope (:func:`rope_parameters`,
    without a partial rotation, ``partial_rotary_factor`` of Phi-3 variants: a Llama layer rotates its whole head), a
    SiLU-gated MLP of :func:`dense_mlp_width`, no biases, full attention."""
    config = text_config(config)
    heads, kv_heads, head_dim = attention_shape(config)
    return {
        "intermediate_size": dense_mlp_width(config),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(config, "rms_norm_eps", None) or 1e-6),
        "max_position_embeddings": context_limit(config),
        "rope_parameters": {k: v for k, v in rope_parameters(config).items() if k != "partial_rotary_factor"},
        "attention_bias": False,
        "mlp_bias": False,
    }


def whole_context_window(target_config) -> int | None:
    """Where every layer of the target slides (Mistral), the window a served drafter's layers must declare to see the
    whole context, as selfspec's drafter does; None where the target has a full layer.

    vLLM sets ``CacheConfig.sliding_window`` only when every layer of the target slides (``vllm/engine/arg_utils.py``),
    and every attention layer without a window of its own takes it (``Attention.__init__``: ``per_layer_sliding_window``
    first, else the cache config's), the drafter's too. A drafter layer that declares itself sliding over a window as
    long as any context (the target's ``max_position_embeddings``, which bounds vLLM's ``max_model_len``) keeps its own,
    and so attends to every position, as it was trained to."""
    if set(layer_kinds(target_config)) != {SLIDING}:
        return None
    return context_limit(target_config)
