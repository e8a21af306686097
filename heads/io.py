"""Save and load trained drafter heads as a self-describing folder, for any head type.

A heads folder holds:

- ``config.json``: ``head_type`` (a family of core/families.py that has heads), ``head_config`` (what the builder
  needs to rebuild the module), how the target was loaded (``model``: source, folder or hub id, revision, dtype,
  attention, chat template; decode, export, serve-check and bench load it so), the target it was trained on
  (``base_model`` and ``target_fingerprint`` from
  ``selfspec.core.target.fingerprint``: its shape, the sha256 of embedding rows per dtype, the checkpoint's
  ``revision`` and ``config_sha256``), shape facts (``hidden_size``, ``vocab_size``, ``num_heads``, ``num_layers``), and
  whatever the trainer adds (``data``, ``steps``, ``eval`` metrics, ...); ``weights_sha256`` guards the weights file.
- ``model.safetensors``: the module's ``state_dict``.
- ``adapter/`` (Medusa-2 only): a peft LoRA adapter of the target, trained jointly with the heads. Loading with a
  target applies it (merged into the target's weights by default) because the heads only fit the adapted target.

A folder is written into a temporary sibling and renamed into place, so a reader never sees half a folder. It carries
selfspec's marker (``.selfspec``, selfspec.core.folders): saving replaces only a heads folder selfspec wrote, never a
folder of the user's.

Head types are the families of core/families.py that have heads: heads/families.py registers each one's builder
``build(head_config: dict, target_model | None) -> nn.Module``, so ``load_heads`` works without the caller importing
anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.core import folders
from selfspec.core.config import to_plain
from selfspec.core.errors import SelfspecError
from selfspec.core.families import FAMILIES
from selfspec.core.target import Target, TargetMismatchError, check_fingerprint, fingerprint
from selfspec.heads.families import HEADS, HeadBuilder

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"
FORMAT_VERSION = 1


class HeadsLoadError(SelfspecError, RuntimeError):
    """A heads folder is missing, incomplete or corrupt; the message says which file and what to do."""


def head_builder(name: str) -> HeadBuilder:
    """The builder of head type ``name``: what heads/families.py registers for that family of the table."""
    if name not in FAMILIES or name not in HEADS:
        known = ", ".join(n for n in FAMILIES if n in HEADS)
        raise HeadsLoadError(f"Unknown head type {name!r}; known types: {known}. A new type is a family row "
                             "(core/families.py: `families:` in its conf file) and its heads builder in "
                             "selfspec/heads/families.py's HEADS.")
    return HEADS[name]


@dataclass
class LoadedHeads:
    module: nn.Module  # the heads, frozen, eval mode, on the target's device and dtype when a target was given
    config: dict[str, Any]  # everything in config.json
    adapter: Path | None = None  # the LoRA adapter folder saved with the heads (Medusa-2), else None
    target: nn.Module | None = None  # the model to decode with: the given target, adapter applied if there is one
    path: Path | None = field(default=None, repr=False)


def _unwrap_target(target: Any) -> tuple[nn.Module | None, str | None]:
    """(model, name) from a selfspec.core.target.Target, a Hugging Face model or a peft model."""
    if target is None:
        return None, None
    if isinstance(target, Target):
        return target.model, target.name
    return target, getattr(getattr(target, "config", None), "_name_or_path", None) or None


def _base_model(model: nn.Module) -> nn.Module:
    """The plain transformers model under a peft wrapper (fingerprints describe the base)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def save_heads(
    path: str | os.PathLike,
    module: nn.Module,
    head_type: str,
    config: dict[str, Any],
    target_model: Any,
    extra_meta: dict[str, Any] | None = None,
    adapter: nn.Module | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    adapter_state_dict: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write heads into folder ``path`` (replacing it atomically); returns the folder. Only a missing or empty
    folder, or a heads folder selfspec wrote, is replaced (``selfspec.core.folders.replace_dir``); anything else is
    refused, or with ``overwrite`` moved to ``<name>.bak-<YYYYmmdd-HHMMSS>`` first.

    ``config``: the head config (what the type's builder takes, e.g. ``MedusaConfig.to_dict()``).
    ``target_model``: the target they were trained on (``Target``, HF model or peft model); recorded by fingerprint.
    ``extra_meta``: more keys for config.json (data, steps, eval metrics, training config).
    ``adapter``: a peft model whose adapter is saved in ``adapter/`` (Medusa-2).
    ``state_dict`` / ``adapter_state_dict``: weights to write instead of the modules' own (e.g. gathered from
    ZeRO-3 shards); the adapter's is the peft model's full state dict, from which peft keeps the adapter.
    """
    head_builder(head_type)  # refuse to write a type nobody can load
    path = Path(path)
    model, name = _unwrap_target(target_model)
    if model is None:
        raise ValueError("save_heads needs the target model the heads were trained on (to record its fingerprint).")
    base = _base_model(model)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "head_type": head_type,
        "base_model": name or getattr(base.config, "_name_or_path", None),
        "target_fingerprint": fingerprint(base),
        "hidden_size": config.get("hidden_size", base.config.hidden_size),
        "vocab_size": config.get("vocab_size", base.config.vocab_size),
        "num_heads": config.get("num_heads"),
        "num_layers": config.get("num_layers"),
        "head_config": dict(config),
        "adapter": None,
    }
    settings = target_model.settings if isinstance(target_model, Target) else None
    tiny = getattr(base, "tiny_spec", None)
    if settings:  # how the target was loaded (core/target.py load_settings): decode loads it the same way
        meta["model"] = dict(settings)
    elif tiny is not None:  # a target built in code (selfspec.core.target.build_tiny): how to build it again
        meta["model"] = {"source": "tiny", "dtype": "float32", "device": "cpu", "tiny": dict(tiny),
                         "attn_implementation": getattr(base.config, "_attn_implementation", None) or "sdpa"}
    meta.update(extra_meta or {})

    folders.in_the_way(path, "heads", overwrite)  # before any work: a folder selfspec may not replace is refused
    tmp = folders.temp_dir(path, "heads")
    try:
        state = state_dict if state_dict is not None else module.state_dict()
        state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"head_type": head_type})
        meta["weights_sha256"] = _sha256(tmp / WEIGHTS_NAME)
        if adapter is not None:
            adapter.save_pretrained(str(tmp / ADAPTER_DIR), state_dict=adapter_state_dict)
            meta["adapter"] = ADAPTER_DIR
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(_jsonable(meta), f, indent=2)
        folders.replace_dir(tmp, path, overwrite, kind="heads")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return to_plain(x)


def heads_dir(path: str | os.PathLike) -> Path:
    """The heads folder ``path`` names: itself, or the ``heads/`` folder of a training run's folder
    (``outputs/<run_name>`` for ``outputs/<run_name>/heads``)."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() and (path / "heads" / CONFIG_NAME).is_file():
        return path / "heads"
    return path


def read_heads_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a heads folder (or of a run folder's heads/), with clear errors for a missing or broken one."""
    path = heads_dir(path)
    if not path.is_dir():
        raise HeadsLoadError(
            f"No heads folder at {path}. Give the folder a training run wrote (outputs/<run_name>/heads)."
        )
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise HeadsLoadError(f"{path} has no {CONFIG_NAME}: not a heads folder, or an incomplete copy. Copy it again.")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise HeadsLoadError(f"{cfg_file} is not valid JSON ({err}): the folder is corrupt; copy it again.") from err
    if not isinstance(config, dict) or "head_type" not in config:
        raise HeadsLoadError(f"{cfg_file} has no head_type: not a heads config written by selfspec.")
    return config


def load_heads(
    path: str | os.PathLike,
    target: Any = None,
    merge_adapter: bool = True,
    verify_weights: bool = True,
    heads_check: str = "full",
) -> LoadedHeads:
    """Load a heads folder; with ``target`` (``Target`` or HF model) check it is the model they were trained on
    (``heads_check``: ``full``, the exact checkpoint, or ``shape``, its shape only; core/target.py:check_fingerprint).

    Raises ``HeadsLoadError`` for a missing or corrupt folder and ``selfspec.core.target.TargetMismatchError`` for heads of
    another target. If the folder has a LoRA adapter (Medusa-2) and a target is given, the adapter is applied to
    that target **in place** (merged into its weights when ``merge_adapter``, else left as a peft model) and the
    result is ``LoadedHeads.target``; decode with that model, not the plain target.
    """
    path = heads_dir(path)
    config = read_heads_config(path)
    model, _ = _unwrap_target(target)
    if model is not None:
        stored = config.get("target_fingerprint")
        if not stored:
            raise HeadsLoadError(f"{path / CONFIG_NAME} has no target_fingerprint; cannot check the target.")
        check_fingerprint(stored, _base_model(model), what=f"The heads in {path}", heads_check=heads_check)

    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise HeadsLoadError(f"{path} has no {WEIGHTS_NAME}: the folder is incomplete; copy or train it again.")
    if verify_weights and config.get("weights_sha256") and _sha256(weights) != config["weights_sha256"]:
        raise HeadsLoadError(
            f"{weights} does not match the checksum in {CONFIG_NAME}: the file is corrupt or was replaced. "
            "Copy the folder again."
        )
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadsLoadError(f"{weights} cannot be read ({err}): the file is corrupt; copy it again.") from err

    module = head_builder(config["head_type"])(config.get("head_config", {}), model)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise HeadsLoadError(f"{weights} does not fit a {config['head_type']} module built from its config: {err}")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)

    adapter_dir = path / config["adapter"] if config.get("adapter") else None
    if adapter_dir is not None and not adapter_dir.is_dir():
        raise HeadsLoadError(f"{path} should hold a LoRA adapter in {adapter_dir.name}/ but it is missing; copy again.")
    run_model = model
    if model is not None:
        if adapter_dir is not None:
            run_model = apply_adapter(model, adapter_dir, merge=merge_adapter)
        param = next(run_model.parameters())
        module.to(device=param.device, dtype=param.dtype)
        if hasattr(module, "attach_target_lm_head"):  # shared LM head: point at the (possibly merged) target's
            module.attach_target_lm_head(_base_model(run_model).get_output_embeddings())
    return LoadedHeads(module=module, config=config, adapter=adapter_dir, target=run_model, path=path)


def apply_adapter(model: nn.Module, adapter_dir: str | os.PathLike, merge: bool = True) -> nn.Module:
    """Apply a saved peft adapter to ``model`` (in place); merged into the weights and frozen when ``merge``."""
    # deferred: peft (slow to import) only for a Medusa-2 adapter
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    if not merge:
        return peft_model
    merged = peft_model.merge_and_unload()
    merged.eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged


__all__ = [
    "HeadsLoadError",
    "LoadedHeads",
    "TargetMismatchError",
    "apply_adapter",
    "head_builder",
    "heads_dir",
    "load_heads",
    "read_heads_config",
    "save_heads",
]


def reinitialize(heads: torch.nn.Module, heads_config: dict, target: torch.nn.Module, seed: int = 0) -> None:
    """Give ``heads`` (a loaded heads folder's module) the weights its family builds them with before any training,
    in place: the same shape, layers and draft vocabulary (buffers such as a draft-to-target token map are kept, and a
    draft LM head starts from the target's rows of that vocabulary, as training starts it), no learned weight. What a
    learner started "from untrained heads" of the same make starts from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = head_builder(heads_config["head_type"])(heads_config.get("head_config", {}), target)
    params = {name for name, _ in heads.named_parameters()}
    state = {k: v for k, v in fresh.state_dict().items() if k in params}
    with torch.no_grad():
        heads.load_state_dict(state, strict=False)
        # a reduced draft vocabulary is kept, and its LM head restarts from the target's rows of it
        if hasattr(heads, "set_draft_vocab") and hasattr(heads, "d2t"):
            heads.set_draft_vocab(heads.d2t.clone(), init_lm_head_from=target.get_output_embeddings())
