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
:data:`TINY_ARCHS` and a row in the tests' matrix (tests/test_archs.py); tests/test_serving_archs.py then checks it in
vLLM's CPU build and expects every export served, unless it records the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from core.kv import additive_mask

FULL = "full_attention"
SLIDING = "sliding_attention"


def plain_head(head_dim: int) -> dict[str, Any]:
    return {"head_dim": head_dim}


@dataclass(frozen=True)
class TinyArch:
    """A tiny random model of one architecture: its transformers config class and what differs from the shared
    shape (hidden 64, 4 layers, 4 query heads on 2 key/value heads, vocabulary 320). Every row builds at any shape
    ``build_tiny`` asks for: ``head`` turns the head size (hidden / heads unless given: 16 by default, 32 for vLLM's
    CPU attention) into the config's settings, and ``layer_pattern`` repeats over the layers."""

    config_class: str
    extra: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None  # one the architecture needs (gpt-oss has no sdpa attention)
    head: Callable[[int], dict[str, Any]] = plain_head
    layer_pattern: tuple[str, ...] | None = None  # config.layer_types, repeated to the number of layers

    def settings(self, head_dim: int, num_hidden_layers: int) -> dict[str, Any]:
        """The config's settings beyond the shared shape, for a model of this head size and depth."""
        out = {**self.head(head_dim), **self.extra}
        if self.layer_pattern:
            out["layer_types"] = [self.layer_pattern[i % len(self.layer_pattern)] for i in range(num_hidden_layers)]
        return out


WINDOW = 8  # the tiny sliding windows: prompts of 4-30 tokens and 20 new ones cross it
ALTERNATING = (SLIDING, FULL)

TINY_ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("LlamaConfig"),
    "qwen2": TinyArch("Qwen2Config"),  # q/k/v biases
    "qwen3": TinyArch("Qwen3Config"),  # q/k norms
    "qwen3_moe": TinyArch("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mistral": TinyArch("MistralConfig", {"sliding_window": WINDOW}),  # every layer slides
    "gemma3": TinyArch("Gemma3TextConfig", {
        "sliding_window": WINDOW, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        head=lambda d: {"head_dim": d, "query_pre_attn_scalar": d}, layer_pattern=ALTERNATING),
    "gpt_oss": TinyArch("GptOssConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
        # attention sinks: transformers has eager (and kernels) attention for them
        layer_pattern=ALTERNATING, attn_implementation="eager"),
    "phi3": TinyArch("Phi3Config"),  # fused qkv and gate/up projections
    "deepseek_v3": TinyArch("DeepseekV3Config", {  # MLA attention, shared + routed experts after a dense layer
        "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "moe_intermediate_size": 32, "n_shared_experts": 1,
        # what transformers' DeepSeek-V3 always does and its real config.json names (vLLM reads them; without them
        # it routes by softmax and has no router bias to load)
        "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
        head=lambda d: {"qk_rope_head_dim": d // 2, "qk_nope_head_dim": d // 2, "v_head_dim": d}),
}


def text_config(config):
    """The decoder's config (a multimodal config's text part)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


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


def full_attention_rope(config) -> dict[str, Any]:
    """The rope parameters of the model's full-attention layers (the rope a drafter's own full-attention layers
    take): ``config.rope_parameters``, or its full-attention entry where a config keeps one per layer kind (Gemma 3's
    local and global rope)."""
    config = text_config(config)
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta})
    return dict(rope[FULL]) if isinstance(rope.get(FULL), dict) else rope


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
