"""Export trained heads in the formats serving engines load.

==============  ===============================================  ==============================================
format          loads in                                         heads
==============  ===============================================  ==============================================
``vllm``        vLLM's Medusa (``MedusaModel``)                   Medusa-1 (Medusa-2: see below)
``eagle``       vLLM's EAGLE-1 (``EagleLlamaForCausalLM``)        eagle with ``fc_bias=false``, ``input_norm=false``
``eagle3``      SGLang and vLLM (``LlamaForCausalLMEagle3``,      eagle3 with ``layout=midlayer``
                EAGLE-3's own checkpoint form)
``speculators`` vLLM speculators (``Eagle3Speculator``)           eagle3 with ``layout=midlayer``
``dflash``      vLLM's DFlash (``DFlashQwen3ForCausalLM``)         dflash, on any target vLLM captures layers of
``selfspec``    selfspec (``heads.load``); a copy of the folder   all
==============  ===============================================  ==============================================

Which heads export to which format is their family's row (core/families.py: ``exports``, and the ``head_config``
values those need, ``export_needs``). ``auto`` picks the family's first export (``vllm`` for Medusa heads, ``eagle``
and ``eagle3`` for EAGLE heads of those shapes, ``dflash`` for DFlash heads) and refuses the rest, naming the format
that fits (the DFlash mapping and its facts:
heads/export_dflash.py). Each exported folder has ``config.json`` and ``model.safetensors`` and is written atomically.

The EAGLE formats are for heads of any target: the draft layer is a Llama layer whatever the target
(:mod:`selfspec.heads.eagle`), and its config is written from the fields saved with the heads (``draft_layer``: heads, head
dim, MLP width, norm eps, rope), beside the target's vocabulary and token ids. Whether an engine serves the target is
that engine's matter: vLLM 0.32 captures EAGLE-3 features only from targets that implement its ``SupportsEagle3``
(Llama and the models built on its code such as Mistral and Phi-3, Qwen2/3, Qwen3-MoE, DeepSeek-V2/V3, gpt-oss and
more; Gemma 3 not), and EAGLE-1 features from those implementing ``SupportsEagle``.

Facts the mappings rely on (from those projects' sources):

- vLLM Medusa: config ``model_type: medusa``, ``num_heads``, ``num_hidden_layers`` (residual blocks per head),
  ``medusa_fc_bias``; weights ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight``; with
  ``original_lm_head: true`` the heads share ``lm_heads.0.weight`` (how our ``shared_lm_head`` is written). A reduced
  draft vocabulary is ``truncated_vocab_size`` < ``vocab_size`` with a ``token_map`` tensor (draft id -> target id):
  vLLM builds its LM heads with ``truncated_vocab_size`` rows (slicing fuller ones by the map) and scatters their
  logits into a full vocabulary of -inf at the map's ids. vLLM's
  config reader renames any key holding "num" and "heads" to ``num_heads``, so no other such key is written.
- EAGLE-1 (vLLM ``EagleLlamaForCausalLM``, ``llama_eagle.py``): a Llama config with ``num_hidden_layers: 1``;
  weights ``fc.weight`` [H, 2H] (no bias: vLLM builds ``fc`` without one) over ``[embedding, feature]``,
  ``layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*}`` (layer 0's input norm is an identity),
  no final norm and no LM head (the target's is shared, as our EAGLE-1 logits are); the feature is the target's
  last hidden state after its final norm, what vLLM's Llama returns.
- EAGLE-3 (SGLang ``LlamaForCausalLMEagle3``): a Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size``,
  ``tie_word_embeddings: false``; weights ``fc.weight`` [H, 3H], ``midlayer.{input_layernorm (embedding side),
  hidden_norm (feature side), self_attn.{q,k,v}_proj [., 2H], self_attn.o_proj, post_attention_layernorm, mlp.*}``,
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (target id = draft id + d2t[id]), ``t2d``. SGLang's
  ``eagle_aux_hidden_state_layer_ids`` name layer *outputs* (it captures the input of layer id + 1); our
  ``layer_ids`` name layer inputs, so the ids written are ours minus one (only when they differ from the default
  [2, L//2, L-3] inputs, which SGLang assumes without them).
- speculators: ``architectures: [Eagle3Speculator]``, ``speculators_model_type: eagle3``, the layer's Llama config in
  ``transformer_layer_config``, ``speculators_config`` (algorithm, proposal methods, verifier), top-level
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's indexing (the input of layer j, as ours), ``norm_before_residual:
  false`` (the residual is the un-normalised feature, as ours); weights as above with ``layers.0.`` for ``midlayer.``.

The target's token embedding is included as ``embed_tokens.weight`` unless ``include_embeddings=False`` (both
engines can share the target's instead).

Checked: tests/test_serving.py loads every vLLM format in real vLLM (the CPU build, 0.32) and asserts it decodes
losslessly and accepts, per draft position, exactly what selfspec's engine accepts with the same heads
(docs/serving.md, where the vLLM facts below were found); tests/test_export.py runs each exported folder through those
engines' model code written out in plain tensor operations; with speculators installed (0.9.0 checked), its own
``Eagle3DraftModel`` loads the ``speculators`` export and drafts the same tokens. SGLang has no CPU build and was not
run.

vLLM facts the mappings rest on (vLLM 0.32, read in its source and seen in runs): its Medusa loader refuses a
``token_map`` under its default strict weight check (:func:`medusa_vocab`); its Llama captures EAGLE-3's hidden states
in ascending layer order, each layer once, as the input of layer j (:func:`served_layer_ids`); it reads a top-level
``eagle_aux_hidden_state_layer_ids`` before ``eagle_config``'s (:func:`eagle3_to_sglang`); ``d2t`` is an offset
(target id = draft id + d2t[id]) and ``t2d`` is skipped at load; speculators' ``norm_before_residual`` defaults to
true when absent, so it is written false.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from selfspec.core import folders
from selfspec.core.errors import SelfspecError
from selfspec.core.families import FAMILIES
from selfspec.heads.eagle import engine_layer_ids, serving_form
from selfspec.heads.export_dflash import dflash_to_vllm
from selfspec.core.archs import text_config, whole_context_window
from selfspec.heads.io import _unwrap_target, heads_dir, load_heads, read_heads_config

FORMATS = ("auto", "vllm", "eagle", "eagle3", "speculators", "dflash", "selfspec")


class ExportError(SelfspecError, ValueError):
    """Heads cannot be exported in the asked format; the message says which format fits or what to retrain."""


def resolve_format(fmt: str, head_type: str, head_config: dict) -> str:
    """``auto`` -> the serving format for these heads (their family's first export, core/families.py); an explicit
    format is checked against their family's ``exports`` and the ``head_config`` values those need
    (``export_needs``). ``selfspec`` fits any heads."""
    if fmt not in FORMATS:
        raise ExportError(f"format={fmt!r}: use one of {', '.join(FORMATS)}.")
    if head_type not in FAMILIES:
        raise ExportError(f"{head_type!r} heads are of no family: one of {', '.join(FAMILIES)}.")
    if fmt == "selfspec":
        return fmt
    family = FAMILIES[head_type]
    exports = list(family.exports)
    keep = "export format=selfspec (a copy of the folder, for selfspec's own decoder)"
    if not exports:
        raise ExportError(f"{head_type} heads have no serving-engine format: {keep}.")
    needs = " ".join(f"heads.{k}={_override(v)}" for k, v in family.export_needs.items())
    fmt = exports[0] if fmt == "auto" else fmt  # an auto that does not fit falls through to the explanation below
    if fmt not in exports:
        raise ExportError(f"format={fmt} does not fit these {head_type} heads: use format={' or '.join(exports)}"
                          + (f" (for heads trained with {needs})." if needs else "."))
    if not served_exports(head_type, head_config):
        form = serving_config(head_config)
        held = ", ".join(f"{k}={_override(form.get(k))}" for k in family.export_needs)
        raise ExportError(
            f"These {head_type} heads ({held}) have no serving-engine format: {', '.join(exports)} need heads "
            f"trained with {needs}, as the engines load them. Retrain with `selfspec-train {head_type} {needs}`, or "
            f"{keep}.")
    return fmt


def serving_config(head_config: dict) -> dict:
    """A saved ``head_config`` with the EAGLE serving fields it does not record read as EagleConfig's defaults
    (heads/eagle.py:serving_form): what a family's ``export_needs`` are checked against."""
    return {**head_config, **serving_form(head_config)}


def served_exports(head_type: str, head_config: dict) -> list[str]:
    """The serving-engine formats heads of ``head_type`` saved with ``head_config`` export to: their family's
    ``exports`` where the heads hold what those need, else none (serve/serving.py's formats and the check above)."""
    family = FAMILIES.get(head_type)
    return list(family.exports) if family is not None and family.exportable(serving_config(head_config)) else []


def _override(value: Any) -> str:
    """``value`` as a command line's override writes it (``false``, ``midlayer``)."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


# --- vLLM Medusa ------------------------------------------------------------------------------------------------------


MEDUSA_VOCABS = ("auto", "full", "draft")
VLLM_TOKEN_MAP_FLAG = {"model_loader_extra_config": {"enable_weights_track": False}}


def medusa_vocab(heads: nn.Module, vocab: str) -> str:
    """Which vocabulary a vLLM Medusa export drafts over: ``full`` (the target's whole LM head, no ``token_map``) or
    ``draft`` (the heads' reduced vocabulary as vLLM's ``truncated_vocab_size`` + ``token_map``).

    vLLM 0.32's Medusa loader refuses every checkpoint with a ``token_map``: its ``load_weights`` makes the map a
    parameter but never reports it loaded, so the strict check that follows fails ("Following weights were not
    initialized from checkpoint: {'token_map'}"). Such a folder loads only with
    ``LLM(..., model_loader_extra_config={"enable_weights_track": False})`` (docs/serving.md). So ``auto`` writes the
    full vocabulary wherever it can: heads that share the target's LM head (the default) draft over all of its rows,
    which costs vLLM a full-vocabulary projection per head (selfspec's engine keeps the reduced one). Heads with LM
    heads of their own keep only the draft vocabulary's rows, so they can only be written with the map."""
    if vocab not in MEDUSA_VOCABS:
        raise ExportError(f"vocab={vocab!r}: use one of {', '.join(MEDUSA_VOCABS)}.")
    token_map = heads.token_map
    if token_map is None:
        return "full"
    if vocab == "auto":
        return "full" if heads.lm_heads is None else "draft"
    if vocab == "full" and heads.lm_heads is not None:
        raise ExportError(
            "These Medusa heads have LM heads of their own over a reduced draft vocabulary: only those rows were "
            "trained, so they have no full-vocabulary form. Export vocab=draft (vLLM's token_map; vLLM 0.32 loads it "
            "with model_loader_extra_config={\"enable_weights_track\": false}), or retrain with "
            "heads.shared_lm_head=true."
        )
    return vocab


def medusa_to_vllm(heads: nn.Module, target_lm_head: nn.Module, head_config: dict,
                   vocab: str = "auto") -> tuple[dict, dict]:
    """Medusa heads -> (config.json dict, state dict) of vLLM's Medusa model (``vocab``: :func:`medusa_vocab`). With
    the draft vocabulary, each LM head has ``truncated_vocab_size`` rows and ``token_map`` (draft id -> target id)
    is what vLLM scatters their logits through."""
    cfg = heads.config
    vocab = medusa_vocab(heads, vocab)
    token_map = heads.token_map if vocab == "draft" else None
    rows = (lambda w: w) if token_map is None else (lambda w: w[token_map.to(w.device)].contiguous())  # noqa: E731
    state = {}
    for h, block in enumerate(heads.blocks):
        for i, res in enumerate(block):
            state[f"blocks.{h}.layers.{i}.weight"] = res.linear.weight
            state[f"blocks.{h}.layers.{i}.bias"] = res.linear.bias
    if heads.lm_heads is None:  # shared: the target's LM head, written once
        state["lm_heads.0.weight"] = rows(target_lm_head.weight)
    else:
        for h, lm_head in enumerate(heads.lm_heads):
            state[f"lm_heads.{h}.weight"] = rows(lm_head.weight)
    if token_map is not None:
        state["token_map"] = token_map
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "truncated_vocab_size": cfg.vocab_size if token_map is None else int(token_map.numel()),
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": heads.lm_heads is None,
    }
    return config, state


# --- EAGLE-3 -----------------------------------------------------------------------------------------------------------


def _llama_layer_config(drafter: nn.Module, draft_vocab_size: int, dtype: torch.dtype) -> dict:
    """The draft layer's Llama config, one layer, from the fields saved with the heads (``draft_layer``), with the rope
    fields both transformers 4 and 5 readers understand; vocabulary and token ids are the target's."""
    tc = text_config(drafter.target.config)
    layer = drafter.config.draft_layer
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ExportError("These heads' draft layer has biases (heads saved before the draft layer was a Llama layer "
                          "of its own, for a Llama target with biases); the EAGLE formats have none. Use "
                          "format=selfspec, or retrain the heads.")
    rope = dict(layer["rope_parameters"])
    theta = rope.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" \
        else None
    d = tc.to_dict()
    return {
        "model_type": "llama",
        "hidden_size": tc.hidden_size,
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "hidden_act": layer["hidden_act"],
        "rms_norm_eps": layer["rms_norm_eps"],
        "max_position_embeddings": layer["max_position_embeddings"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": tc.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "bos_token_id": d.get("bos_token_id"),
        "eos_token_id": d.get("eos_token_id"),
        "pad_token_id": d.get("pad_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
        **_whole_context_fields(drafter.target.config),
    }


def _whole_context_fields(target_config) -> dict:
    """The one-layer Llama config fields that keep a drafter's layer attending to the whole context on a target whose
    every layer slides (:func:`whole_context_window`; vLLM's ``llama.py`` takes a layer's window from
    ``sliding_window`` where ``layer_types`` marks it sliding); none elsewhere."""
    window = whole_context_window(target_config)
    return {} if window is None else {"layer_types": ["sliding_attention"], "sliding_window": window}


def served_layer_ids(layer_ids: list[int]) -> list[int]:
    """The fused layers as the engines capture them. vLLM's Llama appends each captured hidden state in layer order,
    once per layer (``_maybe_add_hidden_state``: ``if layer_idx in aux_hidden_state_layers``), so the fused feature is
    always [low, mid, high] in ascending layer order and a layer named twice is captured once."""
    if len(set(layer_ids)) != len(layer_ids):
        raise ExportError(
            f"layer_ids {layer_ids} name a layer twice (EAGLE-3's default on a target this shallow); vLLM captures each "
            "layer once, so it would feed the drafter fewer features than it was trained on. Retrain with three "
            "different layers (heads.layer_ids=[low,mid,high]), or export format=selfspec."
        )
    return sorted(layer_ids)


def fused_weight_in_layer_order(fc: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """``fc.weight`` [H, 3H] with its column blocks moved from ``layer_ids`` order to ascending layer order."""
    blocks = fc.chunk(len(layer_ids), dim=1)
    order = sorted(range(len(layer_ids)), key=lambda i: layer_ids[i])
    return torch.cat([blocks[i] for i in order], dim=1)


def eagle3_state(drafter: nn.Module, layer_prefix: str, include_embeddings: bool) -> dict[str, torch.Tensor]:
    """A midlayer EAGLE-3 drafter's weights under the published names (``layer_prefix``: ``midlayer.`` for
    SGLang's form, ``layers.0.`` for speculators'), the fused layers in ascending order (:func:`served_layer_ids`)."""
    if drafter.config.layout != "midlayer":
        raise ExportError("Only eagle3 drafters with layout=midlayer have the published EAGLE-3 weights.")
    layer_ids = list(drafter.config.layer_ids)
    served_layer_ids(layer_ids)
    state = {
        "fc.weight": fused_weight_in_layer_order(drafter.fuse.weight, layer_ids),
        layer_prefix + "input_layernorm.weight": drafter.embed_norm.weight,
        layer_prefix + "hidden_norm.weight": drafter.feature_norm.weight,
        "norm.weight": drafter.norm.weight,
        "lm_head.weight": drafter.lm_head.weight,
        "d2t": drafter.d2t,
        "t2d": drafter.t2d,
    }
    for name, value in drafter.layer.state_dict().items():
        state[layer_prefix + name] = value
    if include_embeddings:
        state["embed_tokens.weight"] = drafter.target.get_input_embeddings().weight
    return state


def eagle3_to_sglang(drafter: nn.Module, include_embeddings: bool = True) -> tuple[dict, dict]:
    """Midlayer EAGLE-3 drafter -> (config, state) of ``LlamaForCausalLMEagle3`` (SGLang, vLLM).

    The two engines read the fused layers' ids differently: vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids``
    first, as the input of layer j (ours), and SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids`` as the output
    of layer j (ours minus one; vLLM reads that key too, but only without the top-level one). Both are written when
    the layers are not the ones the engines assume without them (selfspec.heads.eagle.engine_layer_ids)."""
    tc = drafter.target.config
    config = {"architectures": ["LlamaForCausalLMEagle3"],
              **_llama_layer_config(drafter, drafter.lm_head.out_features, drafter.dtype)}
    layer_ids = served_layer_ids(list(drafter.config.layer_ids))
    if layer_ids != engine_layer_ids(tc.num_hidden_layers):
        if min(layer_ids) < 1:
            raise ExportError(f"layer_ids {layer_ids} include the embeddings (0), which SGLang cannot capture.")
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids]}
    return config, eagle3_state(drafter, "midlayer.", include_embeddings)


def eagle_to_vllm(drafter: nn.Module, include_embeddings: bool = True) -> tuple[dict, dict]:
    """An EAGLE-1 drafter with an fc without bias and a layer without input norm -> (config, state) of vLLM's
    ``EagleLlamaForCausalLM``. A draft vocabulary (the target LM head's rows the drafter's logits use in selfspec) is
    not exported: vLLM's EAGLE-1 drafts over the target's whole head, which the drafter's features are trained for."""
    if drafter.config.variant != "eagle" or drafter.config.fc_bias or drafter.config.input_norm:
        raise ExportError("Only EAGLE-1 drafters with fc_bias=false and input_norm=false have vLLM's EAGLE-1 form.")
    config = {"architectures": ["EagleLlamaForCausalLM"],
              **_llama_layer_config(drafter, drafter.config.vocab_size, drafter.dtype)}
    del config["draft_vocab_size"]  # the target's vocabulary: the target's LM head is shared
    if "layer_types" in config:  # vLLM's EAGLE-1 numbers its layer after the target's (start_layer_id); its Llama
        # layer reads layer_types at that number less target_layer_count, which EAGLE-3's model sets and EAGLE-1's not
        config["target_layer_count"] = int(text_config(drafter.target.config).num_hidden_layers)
    state = {"fc.weight": drafter.fc.weight}
    for name, value in drafter.layer.state_dict().items():
        state["layers.0." + name] = value
    if include_embeddings:
        state["embed_tokens.weight"] = drafter.target.get_input_embeddings().weight
    return config, state


def eagle3_to_speculators(drafter: nn.Module, verifier: str | None, speculative_tokens: int = 3,
                          include_embeddings: bool = True) -> tuple[dict, dict]:
    """Midlayer EAGLE-3 drafter -> (config, state) of vLLM speculators' ``Eagle3Speculator``."""
    tc = drafter.target.config
    layer = _llama_layer_config(drafter, drafter.lm_head.out_features, drafter.dtype)
    vd = layer.pop("draft_vocab_size")
    layer["architectures"] = ["LlamaForCausalLM"]
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": vd,
        "norm_before_residual": False,
        "target_hidden_size": tc.hidden_size,
        "eagle_aux_hidden_state_layer_ids": served_layer_ids(list(drafter.config.layer_ids)),
        "torch_dtype": layer["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(tc, "architectures", None) or [])},
        },
    }
    return config, eagle3_state(drafter, "layers.0.", include_embeddings)


# --- the whole export ---------------------------------------------------------------------------------------------------


def export_heads(
    heads_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    target: Any,
    fmt: str = "auto",
    include_embeddings: bool = True,
    dtype: torch.dtype | None = None,
    repo: str | None = None,
    vocab: str = "auto",
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    heads_check: str = "full",
    overwrite: bool = False,
) -> tuple[Path, str]:
    """Export the heads folder ``heads_path`` (trained for ``target``, a ``selfspec.core.target.Target`` or HF model) into
    ``out_dir`` in format ``fmt``, with a model card (README.md; ``repo``: the Hub repo it names in its serving
    commands); returns (the folder, the format used). Heads of another target are refused. ``vocab``: the Medusa
    export's vocabulary (:func:`medusa_vocab`). ``speculators`` only: ``verifier``, the target's hub id or folder
    written for ``vllm serve <folder>`` to load (default: the one the heads record), and ``speculative_tokens``
    (default: the EAGLE tree depth saved with the heads). ``heads_check``: ``shape`` exports heads of another
    checkpoint of the target with a warning (core/target.py:check_fingerprint). ``out_dir`` is replaced only when it
    is missing, empty or an export selfspec wrote; anything else is refused, or with ``overwrite`` moved to
    ``<name>.bak-<YYYYmmdd-HHMMSS>`` first (selfspec.core.folders)."""
    heads_path = heads_dir(heads_path)
    meta = read_heads_config(heads_path)
    fmt = resolve_format(fmt, meta["head_type"], meta.get("head_config", {}))
    folders.in_the_way(out_dir, "export", overwrite, setting="out")  # before any work
    if fmt == "selfspec":
        load_heads(heads_path, target=target, heads_check=heads_check)  # whole, and trained for this target

        def copy(tmp: Path) -> None:
            shutil.copytree(heads_path, tmp, dirs_exist_ok=True)
            (tmp / "README.md").write_text(model_card(meta, fmt, repo))

        return _write(out_dir, copy, overwrite), fmt
    if meta.get("adapter"):
        raise ExportError(
            "These are Medusa-2 heads: they fit the LoRA-adapted target, not the base model a server would load. "
            "Export format=selfspec (heads and adapter), or merge the adapter into the target and serve that."
        )
    loaded = load_heads(heads_path, target=target, heads_check=heads_check)
    module = loaded.module
    model, name = _unwrap_target(target)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    files: dict[str, object] = {}  # other files the format has (DFlash: vLLM's mask embedding)
    if fmt == "vllm":
        config, state = medusa_to_vllm(module, base.get_output_embeddings(), meta.get("head_config", {}), vocab)
    elif fmt == "eagle":
        config, state = eagle_to_vllm(module, include_embeddings)
    elif fmt == "eagle3":
        config, state = eagle3_to_sglang(module, include_embeddings)
    elif fmt == "dflash":
        config, state, files = dflash_to_vllm(module)
    else:
        tree = meta.get("tree") or {}
        config, state = eagle3_to_speculators(module, verifier or meta.get("base_model") or name,
                                              int(speculative_tokens or tree.get("depth") or 3), include_embeddings)
    return _write_converted(out_dir, fmt, meta, config, state, files, dtype, repo, overwrite), fmt


def _write_converted(out_dir, fmt: str, meta: dict, config: dict, state: dict, files: dict, dtype, repo,
                     overwrite: bool = False) -> Path:
    """Write a converted checkpoint: ``config.json`` (with what the heads were), ``model.safetensors`` (floats cast to
    ``dtype`` if given), the model card and the format's other ``files`` (``torch.save``d), atomically."""
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu()
             .contiguous().clone() for k, v in state.items()}
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["selfspec"] = {"head_type": meta["head_type"], "base_model": meta.get("base_model"),
                          "target_fingerprint": meta.get("target_fingerprint")}

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(meta, fmt, repo, token_map="token_map" in state))
        for name, obj in files.items():
            torch.save(obj, tmp / name)

    return _write(out_dir, write, overwrite)


def model_card(meta: dict, fmt: str, repo: str | None = None, token_map: bool = False) -> str:
    """A README.md for the exported folder (the Hub shows it): what the heads are, for which target, how they were
    trained and evaluated, and how to serve them."""
    base = meta.get("base_model") or "the target model"
    where = repo or "<this folder or Hub repo>"
    depth = int((meta.get("tree") or {}).get("depth") or 3)
    serve = {
        "vllm": f"""vllm serve {base} --speculative-config '{{"method": "medusa", "model": "{where}", "num_speculative_tokens": {meta.get("num_heads") or 4}}}'"""
        + ("""  \\\n    --model-loader-extra-config '{"enable_weights_track": false}'  # vLLM <= 0.32 and a token_map"""
           if token_map else ""),
        "eagle": f"""vllm serve {base} --speculative-config '{{"method": "eagle", "model": "{where}", "num_speculative_tokens": {depth}}}'""",
        "eagle3": f"""vllm serve {base} --speculative-config '{{"method": "eagle3", "model": "{where}", "num_speculative_tokens": {depth}}}'
python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {where} --speculative-num-steps {depth}""",
        "speculators": f"""vllm serve {where}""",
        "dflash": f"""vllm serve {base} --speculative-config '{{"method": "dflash", "model": "{where}", "num_speculative_tokens": {int((meta.get("head_config") or {}).get("block_size") or 8) - 1}}}'""",
        "selfspec": f'python decode/run.py heads={where} prompt="Write a haiku about the sea."',
    }[fmt]
    lines = [
        "---",
        "tags: [speculative-decoding, selfspec, " + {"medusa": "medusa", "dflash": "dflash"}.get(meta["head_type"], "eagle")
        + "]",
        f"base_model: {base}" if meta.get("base_model") else None,
        "---",
        "",
        f"# {meta['head_type']} drafter for {base}",
        "",
        f"Trained with selfspec on the frozen target `{base}` and exported as `{fmt}`. Drafts are verified by the "
        "target, so its output does not change.",
        "",
        "```bash",
        serve,
        "```",
        "",
    ]
    facts = {k: meta[k] for k in ("steps", "data", "eval", "draft_vocab_coverage") if meta.get(k) is not None}
    if facts:
        lines += ["## Training", "", "```json", json.dumps(facts, indent=2, default=str), "```", ""]
    return "\n".join(line for line in lines if line is not None)


def _write(out_dir: str | os.PathLike, fill, overwrite: bool = False) -> Path:
    """Fill a temporary sibling of ``out_dir`` and move it into place (a reader never sees half a folder); only an
    export selfspec wrote is replaced (selfspec.core.folders.replace_dir)."""
    out = Path(out_dir)
    tmp = folders.temp_dir(out, "export")
    try:
        fill(tmp)
        folders.replace_dir(tmp, out, overwrite, kind="export", setting="out")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def push_to_hub(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str | None = None) -> str:
    """Upload an exported folder to the Hugging Face Hub (creating the model repo if needed); returns its URL."""
    # deferred: the Hub client only for push_to_hub
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                          ignore_patterns=[folders.MARKER],  # selfspec's marker stays local
                          commit_message=commit_message or "Upload drafter heads exported by selfspec")
    except Exception as err:  # network, auth, permissions: say what to do, keep the local folder
        raise ExportError(
            f"Could not push {folder} to the Hub repo {repo_id!r} ({type(err).__name__}: {err}). The exported folder "
            "is kept; log in with `huggingface-cli login` (or set HF_TOKEN) and check the network, then run again "
            "or upload the folder by hand."
        ) from err
    return str(url)
