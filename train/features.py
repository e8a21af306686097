"""Build a feature store once, by its own command, for every later training run that reads it.

    selfspec-features model=llama8b feature_store.dir=/shared/stores/llama8b        # = python scripts/build_features.py
    selfspec-features ... feature_store.engine=vllm feature_store.vllm.tensor_parallel_size=2 \
        feature_store.vllm.data_parallel_size=4                                      # one vLLM engine per 2 GPUs
    selfspec-features ... feature_store.device_map=auto                              # HF, a target over several GPUs
    accelerate launch --num_processes 8 scripts/build_features.py ...                # HF, a replica per GPU

The store (train/feature_store.py) is the one a training run with the same model and data settings reads with
``features=store feature_store.dir=DIR``: the hidden states of the union of the layers the ``read_by`` families read
(EAGLE-3's and DFlash's by default, one set for both) or of ``layers``, and the last one, in ``feature_store.dtype``.
Such a run opens it and starts no engine; under ``accelerate launch`` every rank reads the same folder.

Engines: ``feature_store.engine=hf`` runs the target here, on ``model.device`` or spread over the GPUs with
``feature_store.device_map`` (from_pretrained's), and under ``accelerate launch`` as one replica per process, each
writing every world_size-th shard. ``feature_store.engine=vllm`` runs one engine for the machine in vLLM's venv
(``feature_store.vllm.*``: tensor and pipeline parallel within an engine, ``data_parallel_size`` engines on their own
GPUs); this process holds only the target's embeddings, final norm and LM head (core/target_parts.py).

A build that is killed resumes from the shards it wrote when the same command runs again; the store appears under its
name only when complete. A store at ``feature_store.dir`` built for something else is rebuilt (when selfspec made it);
one that matches is left as it is.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from selfspec.core.config import MISSING, cfg_get, to_dict
from selfspec.core.errors import SettingError
from selfspec.core.families import FAMILIES
from selfspec.core.target import TargetSettings, load_target
from selfspec.core.target_parts import load_target_parts
from selfspec.core.vllm_env import vllm_available
from selfspec.train.data import build_dataset, collate
from selfspec.train.feature_store import FeatureSource, hidden_states_extract, hidden_states_fields


def layer_readers() -> list[str]:
    """The families whose rows say they read target layers beside the last (``reads_layers``): ``read_by``'s
    default, EAGLE-3 and DFlash."""
    return [name for name, family in FAMILIES.items() if family.reads_layers]


def run(cfg: Any) -> dict[str, Any]:
    """Build (or find complete) the store ``cfg`` describes (conf/features.yaml); returns {"dir", "layers",
    "train", "eval", "wall_s"} (the splits as :class:`~selfspec.train.feature_store.FeatureDataset`)."""
    started = time.perf_counter()
    settings = to_dict(cfg_get(cfg, "feature_store"))
    if settings.get("dir") in (None, "", MISSING):
        raise SettingError("feature_store.dir is not set: give the store's folder, feature_store.dir=DIR (on storage "
                           "every node shares, for a training run on several).")
    data = cfg_get(cfg, "data", {}) or {}
    source = FeatureSource(kind="store", settings=settings, run_dir=Path(str(cfg_get(cfg, "run_dir", "."))),
                           model=to_dict(cfg_get(cfg, "model")), max_length=cfg_get(data, "max_length", None),
                           data=to_dict(data))
    if source.engine not in ("hf", "vllm"):
        raise SettingError(f"feature_store.engine={source.engine!r}: use hf (the target's forward here) or vllm.")
    accelerator = _accelerator(source)
    if source.engine == "vllm":  # before anything loads (a training run checks it only when it must build)
        reason = vllm_available((settings.get("vllm") or {}).get("venv"))
        if reason:
            raise SettingError(f"feature_store.engine=vllm: {reason}")
    target = _load_target(cfg, source, accelerator)
    datasets = _load_datasets(cfg, target.tokenizer, accelerator)
    layers = store_layers(cfg, target.model)
    extract = hidden_states_extract(target.model, layers, source.dtype)
    collate_fn = functools.partial(collate, pad_token_id=target.tokenizer.pad_token_id)
    train, evaluation, _ = source.open_store(datasets, target, accelerator, collate_fn, extract,
                                             {"fields": hidden_states_fields(layers)}, build=True)
    wall = time.perf_counter() - started
    if accelerator is None or accelerator.is_main_process:
        print(f"[selfspec] selfspec-features: the store at {settings['dir']} holds the hidden states of layers "
              f"{layers} and the last one ({wall:.1f} s). Train from it with the same model= and data settings: "
              f"train/eagle.py heads=eagle3 features=store feature_store.dir={settings['dir']} (or train/dflash.py "
              "...); no engine starts there.", file=sys.stderr)
    return {"dir": Path(str(settings["dir"])), "layers": layers, "train": train, "eval": evaluation, "wall_s": wall}


def _accelerator(source: Any):
    """None for one process; under ``accelerate launch`` / torchrun (engine=hf only) accelerate's state of the
    processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if source.engine == "vllm":
        raise SettingError("feature_store.engine=vllm runs one engine for the machine: start selfspec-features as one "
                           "process (not under accelerate launch or torchrun) and spread it over the GPUs with "
                           "feature_store.vllm.tensor_parallel_size / pipeline_parallel_size / data_parallel_size.")
    if source.settings.get("device_map") is not None:
        raise SettingError("feature_store.device_map spreads one target over the GPUs of one process: start "
                           "selfspec-features as one process (not under accelerate launch or torchrun), or drop "
                           "device_map for a replica of the target per process.")

    # the processes (rank, device, barriers), nothing of training's settings; without a GPU, accelerate sees the
    # launch as distributed (gloo) only with cpu=True (train/accelerator.py)
    return PartialState(cpu=not torch.cuda.is_available())


def _load_target(cfg: Any, source: Any, accelerator: Any):
    """The target the store is built from: for vLLM only its parts this process reads (embeddings, final norm and LM
    head, on the CPU); for HF the whole of it, on this process's device or spread by ``feature_store.device_map``."""
    settings = TargetSettings.from_config(cfg_get(cfg, "model"))
    if source.engine == "vllm":
        return load_target_parts(settings.replace(device="cpu"), [])
    device_map = source.settings.get("device_map")
    if accelerator is not None:
        settings = settings.replace(device=str(accelerator.device))
    if device_map is not None:
        settings = settings.replace(device_map=device_map)
    return load_target(settings)


def _load_datasets(cfg: Any, tokenizer: Any, accelerator: Any):
    first = accelerator.main_process_first() if accelerator is not None else nullcontext()
    with first:  # the main process tokenizes and caches; the others load the cache
        return build_dataset(cfg.data, tokenizer, verbose=accelerator is None or accelerator.is_main_process)


def store_layers(cfg: Any, model: Any) -> list[int]:
    """The hidden-state layers the store keeps: ``layers`` as given, or with ``layers: auto`` the union of the layers
    each family of ``read_by`` reads (its row's ``reads_layers``: EAGLE-3 the inputs of ``model.draft_layers.eagle3``,
    else of its rule from the layer count, heads/families.py's ``DEFAULT_LAYERS``; DFlash the outputs of
    ``model.draft_layers.dflash`` or its rule, i.e. those indices + 1), sorted. A family that reads the last hidden
    state alone adds nothing: the store keeps that one anyway."""
    from selfspec.heads.families import DEFAULT_LAYERS  # the heads' modules import torch: not for a setting's check

    num = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    layers = cfg_get(cfg, "layers", "auto")
    if layers is None or layers == "auto":
        families = cfg_get(cfg, "read_by", layer_readers()) or []
        if isinstance(families, str):
            families = [families]
        draft = to_dict(cfg_get(cfg_get(cfg, "model", {}), "draft_layers"))
        trained = [n for n, f in FAMILIES.items() if f.trains]
        chosen: set[int] = set()
        for family in families:
            if family not in trained:
                raise SettingError(f"read_by: {family!r} is not one of {', '.join(trained)}.")
            reads = FAMILIES[family].reads_layers
            if reads is None:
                continue
            shift = 1 if reads == "outputs" else 0  # hidden-state index i is the input of layer i, the output of i - 1
            chosen |= {int(i) + shift for i in (draft.get(family) or DEFAULT_LAYERS[family](num))}
        return sorted(chosen)
    if isinstance(layers, (str, int)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise SettingError(f"layers={layers!r}: auto, or a list of hidden-state indices such as [2,16,29].")
    bad = [i for i in layers if not 0 <= i <= num]
    if bad:
        raise SettingError(f"layers={list(layers)}: {bad} outside 0..{num}, the hidden-state indices of this "
                           f"{num}-layer target (i: the input of decoder layer i).")
    return sorted(set(int(i) for i in layers))


__all__ = ["run", "store_layers"]
