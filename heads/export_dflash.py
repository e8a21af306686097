"""DFlash heads in the form vLLM loads (``--speculative-config '{"method": "dflash", "model": <folder>}'``).

Facts the mapping rests on (vLLM 0.32: ``model_executor/models/qwen3_dflash.py``, ``config/speculative.py``,
``v1/worker/gpu_model_runner.py``; z-lab's DFlash checkpoints have the same layout):

- ``architectures: [DFlashDraftModel]`` is registered to ``DFlashQwen3ForCausalLM`` for any target that captures
  auxiliary hidden states (Llama and Qwen do); the config is a Qwen3 config of the draft layers (``model_type:
  qwen3``, ``num_hidden_layers`` = the drafter's layers, the target's head sizes and rope).
- ``dflash_config.target_layer_ids`` name target layers whose *outputs* feed ``fc`` (vLLM captures the input of
  layer id + 1), as ours do; ``dflash_config.mask_token_id`` is the id fed to the mask slots.
- Weights carry no ``model.`` prefix (the loader adds it): ``fc.weight`` [H, nH], ``hidden_norm.weight``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``norm.weight``, ``lm_head.weight`` [Vd, H]; with a reduced vocabulary ``d2t`` (an offset: target id = draft id +
  d2t[id]; ``t2d`` is skipped) and ``draft_vocab_size`` in the config. Without ``embed_tokens`` the target's
  embedding is shared.
- The mask slots' input is the embedding of ``mask_token_id``, replaced by the vector in ``mask_embedding.pt``
  (``{"mask_token_id": id, "embedding": [H]}``) when the folder has one: that is where our learned mask vector goes.
- The draft layers attend non-causally unless the config says ``is_causal`` / ``dflash_config.causal`` or names a
  sliding-window layer type: none is written.
- On a target whose every layer slides, vLLM gives the target's window to every layer without one of its own, the
  draft layers' too (:func:`selfspec.core.archs.whole_context_window`); there ``dflash_config`` declares them sliding
  (``use_swa``) over a window as long as any context (``swa_window_size``), and non-causal (``causal: false``, which
  ``use_swa`` alone would not change, but says it outright).
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.core.archs import whole_context_window

DFLASH_ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"


def dflash_to_vllm(drafter: nn.Module) -> tuple[dict, dict[str, torch.Tensor], dict[str, object]]:
    """(config.json, weights, other files by name) of a :class:`selfspec.heads.dflash.DFlashHeads` for vLLM."""
    cfg = drafter.config
    layer = cfg.layer_config().to_dict()
    vd = cfg.effective_draft_vocab_size
    config = {
        **{k: layer[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                                 "attention_bias", "rope_parameters") if k in layer},
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": vd,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }

    window = whole_context_window(drafter.target.config)
    if window is not None:  # every target layer slides: vLLM would give the draft layers the target's window
        config["dflash_config"].update(use_swa=True, swa_window_size=window, causal=False)
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:  # the key vLLM versions before transformers' rope_parameters read
        config["rope_theta"] = rope["rope_theta"]
    skip = ("d2t", "t2d", "mask_embedding")
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith(skip)}
    if vd != cfg.vocab_size:
        state["d2t"] = drafter.d2t
    mask = {"mask_token_id": cfg.mask_token_id, "embedding": drafter.mask_embedding.detach().float().cpu().clone()}
    return config, state, {MASK_EMBEDDING_FILE: mask}
