"""A target with only some of its tensors in memory: what a store-fed training run reads of it.

A drafter trained from a feature store (``features=store``, train/feature_store.py) never runs the target: the store
holds its hidden states. What the training still reads is the target's input embeddings (the drafter's token
inputs, the store's identity and the heads' fingerprint), its final norm (EAGLE's norms start from its scale) and its
LM head (the teacher's logits, the draft LM head's first rows), and a decoder layer only where the drafter is started
from one (EAGLE's ``heads.init_layer_from``, DFlash's ``heads.init_from_layer``). :func:`load_target_parts` builds
the model on the meta device and materialises those tensors alone, so the trainer's memory does not grow with the
target's depth::

    target = load_target_parts(cfg.model, layers=[])   # a Target: embeddings, final norm and LM head in memory
    load_rest(target)                                  # the whole model, in place (building a store here)
    drop_rest(target)                                  # back to the parts

Where the tensors come from:

- a checkpoint of safetensors files (``model.source=hub`` without a GGUF file, a local folder or a hub id, and
  ``model=smollm2``'s converted folder): each tensor is read alone from its file (safetensors' ``safe_open``) and
  cast to the target's dtype as ``from_pretrained`` casts it; no other tensor is read. The model's buffers (rotary
  frequencies, an embedding scale) are computed as its constructor computes them.
- anything else (``model.source=tiny``, a GGUF file, ``*.bin`` weights, a quantized checkpoint, a tensor under
  another name in the checkpoint): the whole target is loaded as :func:`selfspec.core.target.load_target` loads it
  and every other tensor dropped at once. The tensors kept are the same; the process's peak memory holds the whole
  target that once (a tiny target is small by construction). A note says so.

The tensors kept equal the whole target's exactly (tests/test_target_parts.py). Every other parameter stays on the
meta device: running the model raises, so a caller that must run it calls :func:`load_rest` first.
"""

from __future__ import annotations

import gc
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from accelerate import init_empty_weights
from huggingface_hub import hf_hub_download
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from selfspec.core.layers import decoder_of
from selfspec.core.embedded import EMBEDDED
from selfspec.core.target import (
    Target,
    TargetLoadError,
    TargetSettings,
    attention_for,
    freeze,
    load_settings,
    load_target,
    resolve_device,
    resolve_dtype,
    set_chat_template,
    text_only,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


@dataclass
class TargetParts:
    """How a :class:`~selfspec.core.target.Target` holds only parts (its ``parts``): what was kept and how to load the
    rest."""

    settings: TargetSettings  # the settings it was loaded with, device and dtype resolved
    kept: list[str]  # the names of the materialised parameters (named_parameters(remove_duplicate=False))
    layers: list[int]  # the decoder layers among them
    checkpoint: "_Checkpoint | None" = None  # where each tensor is read from (None: from a whole load)
    keys: dict[str, str] = field(default_factory=dict)  # parameter name -> its checkpoint key
    whole: bool = False  # load_rest() materialised everything else (until drop_rest())

    def describe(self, model: nn.Module) -> str:
        """"embeddings, final norm, LM head (, layer i): 67.1 M of 121.6 M parameters, 256.0 MiB"."""
        names = ["embeddings", "final norm", "LM head"] + [f"layer {i}" for i in self.layers]
        kept = set(self.kept)
        seen: dict[int, tuple[int, int, bool]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            seen.setdefault(id(p), (p.numel(), p.element_size(), name in kept))
        held = sum(n for n, _, k in seen.values() if k)
        size = sum(n * s for n, s, k in seen.values() if k)
        total = sum(n for n, _, _ in seen.values())
        millions = lambda n: f"{n / 1e6:,.1f}" if n >= 1e6 else f"{n / 1e6:.2g}"  # noqa: E731
        return f"{', '.join(names)}: {millions(held)} M of {millions(total)} M parameters, {size / 2**20:,.1f} MiB"


def part_names(model: nn.Module, layers: Sequence[int] = ()) -> list[str]:
    """The parameters of ``model``'s input embeddings, final norm, LM head and decoder ``layers``, by name (every
    name a tied parameter has)."""
    base = decoder_of(model)
    modules = [model.get_input_embeddings(), getattr(base, "norm", None), model.get_output_embeddings()]
    modules += [base.layers[i] for i in layers]
    ids = {id(p) for m in modules if m is not None for p in m.parameters()}
    return [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids]


def layer_indices(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """``layers`` as indices 0..num_layers-1 (-1: the last); one out of range is left out (the caller that reads it
    refuses it with its own message)."""
    out = []
    for i in layers or ():
        j = int(i) + num_layers if int(i) < 0 else int(i)
        if 0 <= j < num_layers and j not in out:
            out.append(j)
    return sorted(out)


def load_target_parts(settings: TargetSettings | Any, layers: Sequence[int] = ()) -> Target:
    """The target ``settings`` describe (as :func:`selfspec.core.target.load_target` takes them), built on the meta
    device with only its input embeddings, final norm, LM head and decoder ``layers`` materialised, on its device and
    in its dtype; frozen, eval mode. Its ``parts`` say what it holds (:class:`TargetParts`)."""
    asked = TargetSettings.from_config(settings)  # what the heads record (load_settings): the dtype as asked ("auto")
    if asked.config_only:
        return load_target(asked)  # refused there, with its message
    device = resolve_device(asked.device)
    dtype = resolve_dtype(asked.dtype, device)
    resolved = asked.replace(device=str(device), dtype=str(dtype).removeprefix("torch."))
    source = asked.source
    checkpoint = None
    if source in EMBEDDED:
        checkpoint = _Checkpoint.find(str(EMBEDDED[source].ensure()))
    elif source == "hub" and not asked.gguf_file and asked.name_or_path:
        checkpoint = _Checkpoint.find(str(asked.name_or_path))
    why = "model.source=tiny builds it in code" if source == "tiny" else "its weights are not safetensors files"
    if checkpoint is not None:
        target, why = _from_checkpoint(resolved, checkpoint, layers, device, dtype)
        if target is not None:
            target.settings = load_settings(asked, target.settings["attn_implementation"])
            return target
    print(f"[selfspec] target parts: {why}, so the whole target is loaded once and all but its embeddings, final norm "
          "and LM head dropped (the process's peak memory holds it that once).", file=sys.stderr)
    target = load_target(resolved)
    wanted = layer_indices(layers, len(decoder_of(target.model).layers))
    kept = part_names(target.model, wanted)
    _drop(target.model, kept)
    target.parts = TargetParts(settings=resolved, kept=kept, layers=wanted)
    if source != "tiny":
        target.settings = load_settings(asked, target.settings["attn_implementation"])
    gc.collect()
    return target


def load_rest(target: Target) -> None:
    """Materialise every parameter ``target`` does not hold yet, in place: it is the whole model until
    :func:`drop_rest`. Read from its checkpoint where its parts were, else from a whole load of it."""
    parts = target.parts
    if parts is None or parts.whole:
        return
    model = target.model
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    device = torch.device(parts.settings.device)
    dtype = resolve_dtype(parts.settings.dtype, device)
    if parts.checkpoint is not None:
        read = _keys_to_read(model, missing, parts.keys, parts.checkpoint)
        if isinstance(read, str):
            raise TargetLoadError(f"Could not load the rest of target {parts.checkpoint.name_or_path!r}: {read}.")
        tensors = parts.checkpoint.read(list(read.values()))
        _materialise(model, {n: tensors[k] for n, k in read.items()}, device, dtype)
    else:
        whole = load_target(parts.settings).model
        tensors = dict(whole.named_parameters(remove_duplicate=False))
        _materialise(model, {n: tensors[n].detach() for n in missing}, device, dtype)
        del whole, tensors
    parts.whole = True
    gc.collect()


def drop_rest(target: Target) -> None:
    """Back to the parts after :func:`load_rest`: every other parameter to the meta device, its memory freed."""
    parts = target.parts
    if parts is None or not parts.whole:
        return
    _drop(target.model, parts.kept)
    parts.whole = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- reading a checkpoint's tensors one by one ------------------------------------------------------------------


class _Checkpoint:
    """The safetensors files of a local folder or a hub id: which file holds each tensor, read one at a time."""

    def __init__(self, name_or_path: str, files: dict[str, str], local: Path | None):
        self.name_or_path, self.files, self.local = name_or_path, files, local

    @classmethod
    def find(cls, name_or_path: str) -> "_Checkpoint | None":
        """The checkpoint's index (``model.safetensors.index.json``, or the tensor names of one
        ``model.safetensors``); None when it has neither (other weights, no such folder, no network)."""
        local = Path(name_or_path).expanduser()
        try:
            if local.is_dir():
                index, single = local / SAFETENSORS_INDEX, local / SAFETENSORS_SINGLE
                index = index if index.is_file() else None
                single = single if single.is_file() else None
                root = local
            else:
                index = single = None
                try:
                    index = Path(hf_hub_download(name_or_path, SAFETENSORS_INDEX))
                except Exception:  # noqa: BLE001 - no index in the repo (or no network): the single file
                    single = Path(hf_hub_download(name_or_path, SAFETENSORS_SINGLE))
                root = None
            if index is not None:
                return cls(name_or_path, dict(json.loads(index.read_text())["weight_map"]), root)
            if single is not None:
                # read at the call: tests/test_target_parts.py counts the tensors read through safetensors.safe_open
                from safetensors import safe_open

                with safe_open(str(single), framework="pt") as f:
                    keys = list(f.keys())
                checkpoint = cls(name_or_path, {k: SAFETENSORS_SINGLE for k in keys}, root)
                checkpoint._paths = {SAFETENSORS_SINGLE: single}
                return checkpoint
        except Exception:  # noqa: BLE001 - any failure: the whole load, which says what is wrong
            return None
        return None

    def path(self, file: str) -> Path:
        known = getattr(self, "_paths", {})
        if file in known:
            return known[file]
        if self.local is not None:
            return self.local / file

        return Path(hf_hub_download(self.name_or_path, file))

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``keys`` (on the CPU, as stored), each read alone from its file."""
        # read at the call: tests/test_target_parts.py counts the tensors read through safetensors.safe_open
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        out = {}
        for file, names in by_file.items():
            with safe_open(str(self.path(file)), framework="pt", device="cpu") as f:
                for key in names:
                    out[key] = f.get_tensor(key)
        return out


def _from_checkpoint(settings: TargetSettings, checkpoint: _Checkpoint, layers: Sequence[int], device: torch.device,
                     dtype: torch.dtype) -> tuple[Target | None, str]:
    """(the parts of ``checkpoint``'s model, "") or (None, why they cannot be read alone)."""
    name = checkpoint.name_or_path
    try:
        config = AutoConfig.from_pretrained(name)
    except OSError as err:
        return None, f"its config could not be read ({err})"
    if getattr(config, "quantization_config", None):
        return None, "its checkpoint is quantized"
    attn = attention_for(config, settings.attn_implementation)
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):  # buffers computed, on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    key_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}  # the checkpoint's names
    model = text_only(model)
    keys = {n: key_of[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    wanted = layer_indices(layers, len(decoder_of(model).layers))
    kept = part_names(model, wanted)
    read = _keys_to_read(model, kept, keys, checkpoint)
    if isinstance(read, str):
        return None, read
    tensors = checkpoint.read(list(read.values()))
    _materialise(model, {n: tensors[k] for n, k in read.items()}, device, dtype)
    for module in model.modules():  # buffers as model.to(device, dtype) leaves them
        for key, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[key] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(name)
    except OSError:
        pass  # none in the checkpoint: the one from_config made
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:
        raise TargetLoadError(f"Could not load the tokenizer of target {name!r}: {err}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    freeze(model)
    set_chat_template(tokenizer, settings.chat_template)
    source = settings.source
    target = Target(model=model, tokenizer=tokenizer, name=EMBEDDED[source].hub_id if source in EMBEDDED else name,
                    settings=load_settings(settings, attn))
    target.parts = TargetParts(settings=settings, kept=kept, layers=wanted, checkpoint=checkpoint, keys=keys)
    return target, ""


def _keys_to_read(model: nn.Module, names: Sequence[str], keys: dict[str, str],
                  checkpoint: _Checkpoint) -> dict[str, str] | str:
    """{parameter name: the checkpoint key to read it from} for ``names``, one per tensor (tied parameters are read
    under any of their names the checkpoint has), or why one cannot be read."""
    params = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(id(params[n]), []).append(n)
    read = {}
    for group in groups.values():
        found = [keys[n] for n in group if keys[n] in checkpoint.files]
        if not found:
            return f"its checkpoint has no tensor {keys[group[0]]!r}"
        read[group[0]] = found[0]
    return read


# --- materialising and dropping parameters ----------------------------------------------------------------------


def _materialise(model: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
    """Put ``tensors`` (by parameter name) in place of ``model``'s parameters, on ``device`` and, floating point, in
    ``dtype``; frozen. A tied parameter is set once under all its names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    replaced: dict[int, nn.Parameter] = {}
    for name, tensor in tensors.items():
        old = params[name]
        if id(old) in replaced:
            continue
        if tuple(tensor.shape) != tuple(old.shape):
            raise TargetLoadError(f"The checkpoint's {name} has shape {tuple(tensor.shape)}, the model's "
                                  f"{tuple(old.shape)}.")
        value = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        replaced[id(old)] = nn.Parameter(value, requires_grad=False)
    _swap(model, params, replaced)


def _drop(model: nn.Module, kept: Sequence[str]) -> None:
    """Every parameter of ``model`` not named in ``kept`` to the meta device (its memory freed with it)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    keep = {id(params[n]) for n in kept}
    replaced = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                for p in params.values() if id(p) not in keep and not p.is_meta}
    _swap(model, params, replaced)


def _swap(model: nn.Module, params: dict[str, nn.Parameter], replaced: dict[int, nn.Parameter]) -> None:
    for name, old in params.items():
        if id(old) in replaced:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = replaced[id(old)]


__all__ = ["TargetParts", "drop_rest", "layer_indices", "load_rest", "load_target_parts", "part_names"]
