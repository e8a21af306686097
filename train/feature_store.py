"""An offline store of the target's per-token features, written once and read every epoch (``features=store``).

Training drafters on a frozen target spends most of its time in the target's forward. When the same examples are
seen more than once (several epochs, several runs with other heads settings), run the target once, keep what the
drafter reads (last hidden states, optionally the target's top-k logits) on disk, and train from there.

Layout (one folder per store)::

    <store>/meta.json                    identity (target fingerprint, data digest, fields), sizes, shard list
    <store>/<split>/shard-00000.safetensors
        input_ids [N] int32, labels [N] int32   N = the shard's tokens, examples back to back
        offsets [n + 1] int64                  example i is tokens offsets[i]:offsets[i + 1]
        <field> [N, ...]                       each field the extract function returns (e.g. hidden [N, H])

The folder is written under a temporary name unique to the build (``.<store>.tmp-XXXXXXXX``, with a ``build.json``
naming what it is built for), each shard written whole and renamed, meta.json last, and the folder renamed when
complete, so a store is never read half-made. A killed build resumes: the next build of the same store (same identity
and ``examples_per_shard``) takes the killed one's temporary folder and computes only the shards missing from it.

Identity: the target (its embedding digest and name), the tokenizer (its vocabulary's digest), the stored dtype, the
fields (which hidden-state layers, teacher logits, ...) and each split's token ids. A store of hidden states serves
any run that reads a subset of its layers (one store of the union of EAGLE-3's and DFlash's layers serves both). An
existing store that matches is reused and nothing is run. One that does not match is named and refused in one line
when the user named it (``feature_store.dir=``; ``feature_store.rebuild=true`` rebuilds it, ``selfspec-features``
builds it), and rebuilt when it is the run's own ``<run_dir>/features``, replacing the old folder only when selfspec
made it (its ``.selfspec`` marker, selfspec.core.folders): a folder of the user's is refused, or moved to
``<store>.bak-<date-time>`` with ``feature_store.overwrite=true``. Builds of one store take a file lock
(``.<store>.lock`` beside it): a second process building or reading the same store waits, then reuses what the first
built.

Several processes. ``selfspec-features`` (train/features.py) builds a store once, for every later run; under
``accelerate launch`` (engine=hf) each of its ranks writes every world_size-th shard and the main one publishes the
folder. A training run under ``accelerate launch`` never builds on every rank: rank 0 opens the store, builds it
alone if it is missing (the other ranks wait on the process group's key-value store, not a collective, so a long
build does not time out), and every rank then reads the same folder (shared storage across nodes): each reads the
examples of its share of every global batch (train/loaders.py), which together are the one-process order.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list
from filelock import FileLock, Timeout
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from selfspec.core import folders
from selfspec.core.config import CONF_DIR, cfg_get, compose, to_dict
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.core.layers import decoder_of
from selfspec.core.target import fingerprint
from selfspec.core.target_parts import drop_rest, load_rest
from selfspec.core.vllm_env import (PLUGINS_DIR, VllmSession, VllmSettings, hidden_states_engine, llm_kwargs,
                                    replica_env, served_model, visible_gpus, vllm_available)
from selfspec.train.data import IGNORE_INDEX, target_inputs

FORMAT = 1
META_NAME = "meta.json"
KIND = "feature-store"  # the store folder's kind in its selfspec marker
STORE_KEYS = ("dir", "dtype", "batch_size", "examples_per_shard")  # what cfg.feature_store must set for features=store

Extract = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class FeatureStoreError(SelfspecError, RuntimeError):
    """A feature store is missing, incomplete, or does not fit the run."""


@dataclass
class FeatureSource:
    """Where a training method's target features come from: ``features: online`` (the target runs as training runs)
    or ``features: store`` (an offline store set up by ``cfg.feature_store``, see :meth:`open_store`)."""

    kind: str  # online | store
    settings: dict[str, Any]  # cfg.feature_store
    run_dir: Path
    model: dict[str, Any] | None = None  # cfg.model: what feature_store.engine=vllm serves
    max_length: int | None = None  # cfg.data.max_length: the longest example (vLLM's max_model_len)
    data: dict[str, Any] | None = None  # cfg.data: for the selfspec-features command that builds this run's store

    @classmethod
    def from_cfg(cls, cfg: Any) -> "FeatureSource":
        out = cls(kind=str(cfg_get(cfg, "features", "online")), settings=to_dict(cfg_get(cfg, "feature_store")),
                  run_dir=Path(str(cfg_get(cfg, "run_dir", "."))), model=to_dict(cfg_get(cfg, "model")),
                  max_length=cfg_get(cfg_get(cfg, "data", {}) or {}, "max_length", None),
                  data=to_dict(cfg_get(cfg, "data")))
        if out.kind not in ("online", "store"):
            raise SettingError(f"features={out.kind!r}: use online or store.")
        if out.engine not in ("hf", "vllm"):
            raise SettingError(f"feature_store.engine={out.engine!r}: use hf (the target's forward here) or vllm.")
        missing = [f"feature_store.{k}" for k in STORE_KEYS if k not in out.settings]
        if out.kind == "store" and missing:
            raise SettingError(f"features=store needs {', '.join(missing)} (conf/medusa.yaml and conf/eagle.yaml set "
                               "them).")
        return out

    @property
    def online(self) -> bool:
        return self.kind == "online"

    @property
    def engine(self) -> str:
        """Who runs the target's forward to build the store: ``hf`` (here) or ``vllm`` (vLLM's venv)."""
        return str(self.settings.get("engine") or "hf")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the store keeps features in (``feature_store.dtype``)."""
        return getattr(torch, str(self.settings["dtype"]))

    @property
    def build_batch_size(self) -> int:
        """Examples per extract call while building: ``feature_store.vllm.batch_size`` for vLLM, else
        ``feature_store.batch_size``."""
        if self.engine == "vllm":
            return int((self.settings.get("vllm") or {}).get("batch_size") or self.settings["batch_size"])
        return int(self.settings["batch_size"])

    def open_store(self, datasets: Mapping[str, Any], target: Any, accelerator: Any, collate_fn: Callable,
                   extract: Extract, fields: Mapping[str, Any], build: bool = False):
        """The loop's ``(train, eval or None, collate_fn)`` read from the store at ``feature_store.dir`` (default
        ``<run_dir>/features``), built first with ``extract`` when missing (rank 0 alone under several processes).

        ``fields``: what the stored features depend on besides the target, the tokenizer, the data and the dtype
        (which layers, how many teacher logits, ...). A store built for something else is refused by name when the
        user named it (``feature_store.dir``) unless ``feature_store.rebuild=true``, and rebuilt when it is the run's
        own. ``build``: the ``selfspec-features`` command's own call (train/features.py): every rank writes its
        share of the shards; else (training) rank 0 builds alone and the others wait.
        No engine starts (and the target's other layers are not loaded) unless a shard is to be computed. Every
        process must call this.
        """
        splits = {"train": datasets["train"]}
        if datasets.get("eval") is not None and len(datasets["eval"]) > 0:
            splits["eval"] = datasets["eval"]
        fp = fingerprint(target.model)
        # the config's hash too: two targets with the same embeddings and name but other layers make other features
        identity = {"target": fp["digest"], "target_config": fp.get("config_sha256"), "target_name": target.name,
                    "tokenizer": tokenizer_digest(target.tokenizer), "dtype": str(self.dtype), **fields}
        if self.engine == "vllm" and not isinstance(extract, HiddenStatesExtract):
            raise FeatureStoreError(
                f"feature_store.engine=vllm captures the target's hidden states only; this store keeps "
                f"{fields.get('fields', 'other fields')} beyond them (e.g. heads.loss=kl's teacher logits: "
                "feature_store.teacher_topk=0 drops them). Use feature_store.engine=hf.")
        named = bool(self.settings.get("dir"))
        path = Path(str(self.settings["dir"])) if named else self.run_dir / "features"
        command = functools.partial(features_command, path, _hidden_layers(identity), self.settings, self.model,
                                    self.data)  # for a refusal's message only
        engine = EngineExtract(self, extract, target)  # starts nothing until a shard is to be computed
        try:
            store = ensure_feature_store(
                path, splits, engine, identity, collate_fn,
                batch_size=self.build_batch_size, examples_per_shard=int(self.settings["examples_per_shard"]),
                device=accelerator.device if accelerator is not None else input_device(target.model),
                accelerator=accelerator,
                overwrite=bool(self.settings.get("overwrite") or False),
                refuse_other=named and not bool(self.settings.get("rebuild") or False),
                build_on="all" if build else "main", command=command,
            )
        finally:
            engine.close()
        pad = functools.partial(collate_features, pad_token_id=target.tokenizer.pad_token_id)
        return store["train"], store.get("eval"), pad


class EngineExtract:
    """The extract function a store is built with, chosen on its first call (so a run whose store exists starts no
    engine and loads nothing more): ``feature_store.engine=vllm``'s :class:`VllmHiddenStates`, or the HF target's
    ``extract`` (through :class:`WholeTargetExtract` where the trainer holds only parts of the target)."""

    def __init__(self, source: FeatureSource, extract: Extract, target: Any):
        self.source, self.extract, self.target = source, extract, target
        self.engine: Any = None

    def __call__(self, batch: dict[str, torch.Tensor]):
        if self.engine is None:
            self.engine = self._start()
        return self.engine(batch)

    def _start(self):
        source = self.source
        if source.engine == "vllm":
            reason = vllm_available(source.settings.get("vllm", {}).get("venv"))
            if reason:
                raise FeatureStoreError(f"feature_store.engine=vllm: {reason}")
            return VllmHiddenStates(self.extract, source.model, source.settings.get("vllm") or {}, source.max_length,
                                    source.run_dir / "features-vllm.log")
        if self.target.parts is not None:  # the trainer holds parts of the target
            return WholeTargetExtract(self.extract, self.target)  # (core/target_parts.py): the rest is loaded
        return self.extract

    def close(self) -> None:
        if isinstance(self.engine, (VllmHiddenStates, WholeTargetExtract)):  # the HF extract holds nothing to close
            self.engine.close()
        self.engine = None


class HiddenStatesExtract:
    """The extract function of a store of the target's hidden states: ``hidden`` [B, T, H], the last one (after the
    final norm, what the LM head reads), and with ``layers`` ``aux`` [B, T, len(layers), H], those layers' (index i:
    the input of decoder layer i, 0 the embeddings), both in ``dtype``. One forward over the batch, padded or packed,
    with the LM head on the last position only. :func:`stored_hidden_states` reads them back; feature_store.engine=vllm
    computes the same fields in vLLM (:class:`VllmHiddenStates`)."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int] | None, dtype: torch.dtype):
        self.model, self.layers, self.dtype = model, list(layers or []), dtype

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.model(input_ids=batch["input_ids"], **target_inputs(batch), output_hidden_states=True,
                         use_cache=False, logits_to_keep=1)
        fields = {"hidden": out.hidden_states[-1].to(self.dtype)}
        if self.layers:
            fields["aux"] = torch.stack([out.hidden_states[i] for i in self.layers], dim=2).to(self.dtype)
        return fields


def hidden_states_extract(model: torch.nn.Module, layers: Sequence[int] | None, dtype: torch.dtype) -> Extract:
    """:class:`HiddenStatesExtract` of ``model``'s ``layers`` (and its last hidden state) in ``dtype``."""
    return HiddenStatesExtract(model, layers, dtype)


class VllmHiddenStates:
    """The fields of a :class:`HiddenStatesExtract`, computed by vLLM (``feature_store.engine=vllm``): its
    ``extract_hidden_states`` method captures the inputs of the store's layers and the last layer's output in one
    prefill per example (core/vllm_plugins/selfspec_hidden_states.py writes them), and the target's own final norm
    turns that output into ``hidden`` here. Returns one tensor per example (no padding). The engine starts on the
    first batch and stops with :meth:`close`."""

    def __init__(self, extract: HiddenStatesExtract, model_cfg: Mapping[str, Any] | None, settings: Mapping[str, Any],
                 max_length: int | None, log_path: Path):
        self.layers, self.dtype = extract.layers, extract.dtype
        self.model_cfg, self.settings, self.log_path = dict(model_cfg or {}), dict(settings), log_path
        self.max_model_len = None if max_length is None else int(max_length) + 1  # and the one token generated
        config = extract.model.config.get_text_config(decoder=True)
        self.last = int(config.num_hidden_layers)
        self.norm = decoder_of(extract.model).norm
        self.model_dtype = extract.model.dtype
        self.session = None
        self.calls = 0

    def _start(self, max_model_len: int) -> None:
        settings = VllmSettings.from_config({"batch_size": 1, **self.settings})
        path, _ = served_model(self.model_cfg)
        kwargs = llm_kwargs(settings, path, str(self.model_dtype).removeprefix("torch."), max_model_len, 0)
        self.tmp = Path(tempfile.mkdtemp(prefix="selfspec-hidden-"))
        kwargs.update(hidden_states_engine([*self.layers, self.last], self.tmp))
        self.session = VllmSession(kwargs, settings.venv, replica_env(settings, visible_gpus()),
                                   log_path=self.log_path, timeout=settings.timeout, pythonpath=[str(PLUGINS_DIR)])
        print(f"[selfspec] feature store: vLLM {self.session.vllm_version} up in {self.session.init_s:.1f} s, "
              f"capturing layers {self.layers} and the last (log: {self.log_path})", file=sys.stderr)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        lengths = batch["attention_mask"].sum(-1).tolist()
        rows = [batch["input_ids"][r, :n].tolist() for r, n in enumerate(lengths)]
        if self.session is None:
            self._start(self.max_model_len)
        paths = [str(self.tmp / f"{self.calls}-{r}.safetensors") for r in range(len(rows))]
        self.calls += 1
        self.session.generate([{"prompt_token_ids": ids, "max_tokens": 1, "temperature": 0.0, "top_p": 1.0,
                                "seed": None, "stop_token_ids": [], "hidden_states_path": path}
                               for ids, path in zip(rows, paths)])
        out: dict[str, list[torch.Tensor]] = {"hidden": [], **({"aux": []} if self.layers else {})}
        for ids, path in zip(rows, paths):
            states = load_file(path)["hidden_states"]  # [n, layers + 1, H]
            os.remove(path)
            if states.shape[0] != len(ids):
                raise FeatureStoreError(f"vLLM returned hidden states for {states.shape[0]} tokens of an example of "
                                        f"{len(ids)}: see {self.log_path}.")
            with torch.no_grad():
                last = self.norm(states[:, -1].to(self.norm.weight.device, self.model_dtype))
            out["hidden"].append(last.to("cpu", self.dtype))
            if self.layers:
                out["aux"].append(states[:, :-1].to(self.dtype))
        return out

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.session = None


class WholeTargetExtract:
    """An extract function run on the whole target where the trainer holds only parts of it (a store-fed run,
    selfspec.core.target_parts): the first batch loads the rest of the target in place, :meth:`close` drops it again,
    so a run that builds its store holds the whole target while it builds, and trains with the parts. Never called
    when the store exists already."""

    def __init__(self, extract: Extract, target: Any):
        self.extract, self.target, self.loaded = extract, target, False

    def __call__(self, batch: dict[str, torch.Tensor]):
        if not self.loaded:
            print("[selfspec] feature store: building it runs the whole target; loading its decoder layers until it "
                  "is built.", file=sys.stderr)
            load_rest(self.target)
            self.loaded = True
        return self.extract(batch)

    def close(self) -> None:
        if self.loaded:
            drop_rest(self.target)
            self.loaded = False


def hidden_states_fields(layers: Sequence[int] | None) -> str:
    """The ``fields`` identity of a :func:`hidden_states_extract` store of ``layers``. Every family that reads the
    last hidden state and the same layers (EAGLE-3's inputs of layers i, DFlash's outputs of layers i - 1) names it
    the same, so one store serves them all (the name is the one EAGLE's stores were first written with)."""
    return "eagle-last-hidden" + (f"+layers{list(layers)}" if layers else "")


def target_hidden_states(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], layers: Sequence[int] | None):
    """The target's hidden states for ``batch``, indexable by layer index as ``out.hidden_states`` and by -1 (the
    last, after the final norm: what the LM head reads): read from a :func:`hidden_states_extract` store's batch, or
    from an online forward of the decoder stack (no LM head) under no_grad."""
    with torch.no_grad():
        if "hidden" in batch:
            return stored_hidden_states(batch, layers)
        out = model.get_decoder()(input_ids=batch["input_ids"], **target_inputs(batch), output_hidden_states=True,
                                  use_cache=False)
        return out.hidden_states


def stored_hidden_states(batch: Mapping[str, torch.Tensor], layers: Sequence[int] | None) -> dict[int, torch.Tensor]:
    """The hidden states a batch of a :func:`hidden_states_extract` store holds, by layer index as in the target's
    ``out.hidden_states``: {-1: the last [B, T, H], layer: [B, T, H] for each of ``layers``}."""
    states = {-1: batch["hidden"]}
    for j, i in enumerate(layers or []):
        states[i] = batch["aux"][:, :, j]
    return states


def dataset_digest(dataset: Any) -> str:
    """A content hash of a dataset's input_ids and labels (cheap for Arrow-backed Hugging Face datasets)."""
    digest = hashlib.sha256()
    table = getattr(dataset, "data", None)
    if table is not None and hasattr(table, "column") and getattr(dataset, "_indices", None) is None:
        for name in ("input_ids", "labels"):
            if name in dataset.column_names:
                column = table.column(name).combine_chunks()
                digest.update(name.encode())
                digest.update(column.offsets.to_numpy().tobytes())
                digest.update(column.values.to_numpy().tobytes())
    else:
        for example in dataset:
            digest.update(torch.as_tensor(example["input_ids"], dtype=torch.int64).numpy().tobytes())
            digest.update(torch.as_tensor(example.get("labels", []), dtype=torch.int64).numpy().tobytes())
    digest.update(str(len(dataset)).encode())
    return digest.hexdigest()[:20]


def store_identity(splits: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """What a store must match to be reused: the caller's ``extra`` (target, tokenizer, fields, dtype) and each
    split's digest."""
    return {"format": FORMAT, **dict(extra), "splits": {name: dataset_digest(ds) for name, ds in splits.items()}}


def tokenizer_digest(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (every token and its id, added ones included): the same tokenizer
    loaded from another folder or hub id has the same digest."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's input ids go: its input embedding's device (the first GPU of a ``device_map`` target); the
    CPU for one on the meta device (a target of parts, whose store vLLM computes)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


_HIDDEN_FIELDS = re.compile(r"(eagle|layerskip|medusa)-last-hidden(?:\+layers\[([0-9, -]*)\])?")


def _hidden_layers(identity: Mapping[str, Any]) -> list[int] | None:
    """The layers of a store of hidden states alone (:class:`HiddenStatesExtract`'s fields, whichever family named
    it: EAGLE's and DFlash's, layer-skip's, Medusa's without teacher logits), [] for the last hidden state alone;
    None for a store of other fields."""
    fields = identity.get("fields")
    match = _HIDDEN_FIELDS.fullmatch(fields) if isinstance(fields, str) else None
    if match is None or (match.group(1) == "medusa" and identity.get("teacher_topk")):
        return None
    return [int(i) for i in (match.group(2) or "").split(",") if i.strip()]


IDENTITY_NAMES = {"format": "store format", "target": "target", "target_name": "target", "tokenizer": "tokenizer",
                  "target_config": "target config", "dtype": "dtype", "fields": "fields", "teacher_topk": "teacher logits"}


def store_mismatch(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What keeps a store (its recorded identity ``stored``) from serving a run that needs ``wanted``: (what differs,
    how) pairs, none when it serves. A store of hidden states serves a run that reads a subset of its layers; one
    written before the tokenizer was recorded is matched on its token ids (the data digests) alone."""
    stored, wanted = _plain(stored), _plain(wanted)
    out: list[tuple[str, str]] = []
    skip = {"splits"} | {k for k in ("tokenizer", "target_config") if k not in stored}
    have, need = _hidden_layers(stored), _hidden_layers(wanted)
    if have is not None and need is not None:
        skip |= {"fields", "teacher_topk"}
        missing = [i for i in need if i not in have]
        if missing:
            out.append(("layer set", f"it holds the hidden states of layers {have}, this run reads {need} "
                                     f"({missing} missing)"))
    if (stored.get("target"), stored.get("target_name")) != (wanted.get("target"), wanted.get("target_name")):
        out.append(("target", f"it was built for {stored.get('target_name')} (weights {stored.get('target')}), this "
                              f"run's is {wanted.get('target_name')} ({wanted.get('target')})"))
    skip |= {"target", "target_name"}
    for key in sorted(set(stored) | set(wanted), key=lambda k: (k not in IDENTITY_NAMES, k)):
        if key in skip or stored.get(key) == wanted.get(key):
            continue
        what = {"tokenizer": "vocabulary", "dtype": "features in", "format": "format",
                "target_config": "the target's config hash"}.get(key, key)
        out.append((IDENTITY_NAMES.get(key, key), f"{what} {stored.get(key)}, this run's {wanted.get(key)}"))
    changed = [name for name, digest in wanted.get("splits", {}).items()
               if (stored.get("splits") or {}).get(name) != digest]
    if changed:
        out.append(("data", f"the token ids of its {' and '.join(changed)} split{'s' * (len(changed) > 1)} differ "
                            "(other data, data.* settings, chat template or tokenizer)"))
    return out


def mismatch_message(path: Path, differs: list[tuple[str, str]],
                     command: str | Callable[[], str | None] | None) -> str:
    """One line: which of the store's identity differs, how, and the fix (``command``, or a function that makes it:
    the ``selfspec-features`` command that builds the run's store)."""
    if callable(command):
        try:
            command = command()
        except Exception:  # noqa: BLE001 - a hint only: the message goes out without it
            command = None
    names = list(dict.fromkeys(name for name, _ in differs))
    how = "; ".join(f"{name}: {detail}" for name, detail in differs)
    build = f"rebuild it with `{command}`, " if command else ""
    return (f"Feature store feature_store.dir={path} was built for another {' and '.join(names)} ({how}): {build}"
            "give feature_store.rebuild=true to rebuild it in this run, or point feature_store.dir at another "
            "folder.")


def _not_finite(field: str, values: torch.Tensor) -> str:
    """The one line a store refuses non-finite values with: what overflowed and the dtype to build it in."""
    if values.dtype == torch.float16:
        return (f"The target's {field} states overflow float16 (past its 65,504; Gemma's intermediate states do): "
                "build the store with feature_store.dtype=bfloat16 (or float32).")
    return (f"The target's {field} states are not finite in {str(values.dtype).removeprefix('torch.')}: the target "
            "itself gives inf or nan on this data; check it decodes these examples (model.dtype=float32).")


def features_command(path: str | os.PathLike, layers: Sequence[int] | None, settings: Mapping[str, Any],
                     model: Mapping[str, Any] | None = None, data: Mapping[str, Any] | None = None) -> str | None:
    """The ``selfspec-features`` command (train/features.py) that builds the store a run reads (:func:`build_command`);
    None for a store of other fields than hidden states (only a training run builds those)."""
    if layers is None:
        return None
    return build_command(path, layers, settings, model, data)


# --- the command that builds a run's store -----------------------------------------------------------------------


def build_command(path: str | os.PathLike, layers: Sequence[int], settings: Mapping[str, Any],
                  model: Mapping[str, Any] | None = None, data: Mapping[str, Any] | None = None) -> str:
    """The ``selfspec-features`` command that builds the store a training run reads at ``path``: its model and data
    options (Hydra's choices, or the conf/model and conf/data entries they match), every model.* and data.* setting
    that differs from those entries', the engine's, ``layers``, the dtype and the folder."""
    choices = _choices(model or {}, data or {})
    args = [f"{group}={option}" for group, option in choices.items()]
    try:
        base = to_dict(compose("features", [*args, "feature_store.dir=x"]))
    except Exception:  # noqa: BLE001 - a hint: without the base config, the options alone
        base = None
    if base is not None:
        args += _differing("model", base.get("model") or {}, model or {})
        args += _differing("data", base.get("data") or {}, data or {})
    engine = str(settings.get("engine") or "hf")
    if engine != "hf":
        args.append(f"feature_store.engine={engine}")
        if base is not None:
            args += _differing("feature_store.vllm", base["feature_store"].get("vllm") or {},
                               dict(settings.get("vllm") or {}))
    args += [f"layers=[{','.join(str(int(i)) for i in layers)}]", f"feature_store.dtype={settings.get('dtype')}",
             f"feature_store.dir={_value(str(path))}"]
    return "selfspec-features " + " ".join(args)


def _choices(model: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, str]:
    """{"model": option, "data": option}: Hydra's choices where Hydra composed this run, else the entries of
    conf/model/ and conf/data/ whose source (and name_or_path) the settings match."""
    try:
        if HydraConfig.initialized():
            chosen = HydraConfig.get().runtime.choices
            found = {g: str(chosen[g]) for g in ("model", "data") if chosen.get(g)}
            if len(found) == 2:
                return found
    except Exception:  # noqa: BLE001 - fall back to matching the entries
        pass

    out = {}
    for group, mine, keys in (("model", model, ("source", "name_or_path")), ("data", data, ("source",))):
        for file in sorted((CONF_DIR / group).glob("*.yaml")):
            entry = OmegaConf.load(file)
            if all(entry.get(k) == mine.get(k) for k in keys):
                out[group] = file.stem
                break
    return out


def _differing(prefix: str, base: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """Overrides that turn ``base`` into ``mine``: ``prefix.key=value`` where they differ, ``+prefix.key=value`` for
    a key ``base`` lacks (nested mappings key by key)."""
    out = []
    for key, value in mine.items():
        if key in base and isinstance(value, Mapping) and isinstance(base[key], Mapping) and value:
            out += _differing(f"{prefix}.{key}", base[key], value)
        elif key not in base:
            out.append(f"+{prefix}.{key}={_value(value)}")
        elif base[key] != value:
            out.append(f"{prefix}.{key}={_value(value)}")
    return out


_PLAIN = re.compile(r"[A-Za-z0-9_./:@-]+")


def _value(value: Any) -> str:
    """``value`` as a Hydra override writes it (quoted for the shell where it must be)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.fullmatch(text) and text not in ("null", "true", "false"):
        return text
    return "'\"" + text.replace("\\", "\\\\").replace('"', '\\"') + "\"'"


def ensure_feature_store(
    path: str | os.PathLike,
    splits: Mapping[str, Any],
    extract: Extract,
    identity: Mapping[str, Any],
    collate_fn: Callable[[list], dict[str, torch.Tensor]],
    batch_size: int = 8,
    examples_per_shard: int = 256,
    device: torch.device | str = "cpu",
    accelerator: Any = None,
    overwrite: bool = False,
    refuse_other: bool = False,
    build_on: str = "all",
    command: str | Callable[[], str | None] | None = None,
) -> dict[str, "FeatureDataset"]:
    """Open the store at ``path``, building it first if it is missing or (unless ``refuse_other``) was built for
    something else.

    ``splits``: name -> dataset of examples with input_ids/labels (e.g. the DatasetDict from selfspec.train.data).
    ``extract(batch)``: batch (collated, on ``device``) -> {field: [B, T, ...]} per-token features, stored in the
    dtype they come in; called only for shards still to be computed. ``identity``: what the features depend on
    (target fingerprint, tokenizer, fields, dtype, ...). ``refuse_other``: a store built for something else is a
    :class:`FeatureStoreError` naming what differs and ``command``, the fix. ``build_on``: ``all`` (each process
    writes every world_size-th shard) or ``main`` (the main process builds alone; the others wait, see
    :func:`_wait_for_main`). Every process must call this. Returns name -> :class:`FeatureDataset`.

    The main process holds the store's file lock (:func:`store_lock`) from its first look at ``path`` until every
    process has read it: another process building the same store is waited for, and its store reused. A folder at
    ``path`` that is to be rebuilt is replaced only when selfspec made it; anything else is refused before the target
    runs, or with ``overwrite`` moved to ``<name>.bak-<YYYYmmdd-HHMMSS>``.
    """
    path = Path(path)
    ident = store_identity(splits, identity)
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = accelerator is None or accelerator.is_main_process
    opening = functools.partial(_open_or_build, path, splits, extract, ident, collate_fn, batch_size,
                                examples_per_shard, device, overwrite=overwrite, refuse_other=refuse_other,
                                command=command)
    if build_on not in ("all", "main"):
        raise ValueError(f"build_on={build_on!r}: all or main")
    if build_on == "main" and world > 1:
        meta = _built_by_main(path, ident, accelerator, opening)
    else:
        with store_lock(path, is_main):
            _barrier(accelerator)  # every process looks once the main one holds the lock
            meta = opening(accelerator=accelerator)
            _barrier(accelerator)  # every process has read meta.json before another build may replace the folder
    layers = _hidden_layers(identity)
    return {name: FeatureDataset(path, name, meta, layers=layers) for name in splits}


def _open_or_build(path: Path, splits, extract, ident, collate_fn, batch_size, examples_per_shard, device,
                   accelerator=None, overwrite: bool = False, refuse_other: bool = False,
                   command: str | Callable[[], str | None] | None = None) -> dict[str, Any]:
    """The store's meta.json: the store at ``path`` when it serves ``ident``, else built (by every process of
    ``accelerator``) and published. Under the store's lock."""
    is_main = accelerator is None or accelerator.is_main_process
    meta = read_meta(path)
    differs = None if meta is None else store_mismatch(meta.get("identity") or {}, ident)
    if meta is not None and not differs:
        if is_main:
            print(f"[selfspec] feature store (reused): {describe(meta, path)}", file=sys.stderr)
        return meta
    if differs and refuse_other:
        raise FeatureStoreError(mismatch_message(path, differs, command))
    folders.in_the_way(path, KIND, overwrite, key="feature_store.overwrite", setting="feature_store.dir")
    if is_main and differs:
        print(f"[selfspec] feature store {path} was built for another "
              f"{' and '.join(dict.fromkeys(n for n, _ in differs))}: rebuilding it.", file=sys.stderr)
    _build(path, splits, extract, ident, collate_fn, batch_size, examples_per_shard, device, accelerator, overwrite)
    meta = read_meta(path)
    if meta is None:
        raise FeatureStoreError(f"Feature store {path} was not written (is the folder shared by all processes?).")
    if is_main:
        print(f"[selfspec] feature store: {describe(meta, path)}", file=sys.stderr)
    return meta


_OPENED = itertools.count()  # stores opened by this process: the same sequence on every rank
WAIT_POLL_S = 2.0  # how often a rank waiting for rank 0's build looks for its word


def _built_by_main(path: Path, ident: Mapping[str, Any], accelerator: Any, opening: Callable) -> dict[str, Any]:
    """Several processes, one build: the main process opens the store under its lock, building it alone (without
    the others) when it must, then tells the others through the process group's key-value store; they wait for that
    word by polling it (not at a collective, whose timeout a long build would pass), then read the same folder. A
    failure of the main process's is each rank's error."""
    key = f"selfspec/feature-store/{next(_OPENED)}"
    if accelerator.is_main_process:
        with store_lock(path):
            try:
                meta = opening(accelerator=None)
            except BaseException as err:
                said = str(err) if isinstance(err, SelfspecError) and str(err) else (
                    f"rank 0 failed while opening or building feature store {path} ({type(err).__name__}): see its "
                    "output.")
                _tell_ranks(key, "error:" + " ".join(said.split()), accelerator)
                raise
            _tell_ranks(key, "ok", accelerator)
            _barrier(accelerator)  # every process has read meta.json before another build may replace the folder
        return meta
    said = _wait_for_main(key, accelerator)
    if said.startswith("error:"):
        raise FeatureStoreError(said.removeprefix("error:"))
    meta = read_meta(path)
    if meta is None or store_mismatch(meta.get("identity") or {}, ident):
        raise FeatureStoreError(
            f"Feature store {path}: rank 0 opened it, but rank {accelerator.process_index} does not find it there: "
            "put feature_store.dir on storage every node shares.")
    _barrier(accelerator)
    return meta


def _rank_store():
    """The process group's key-value store (torch.distributed's default), or None where there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _tell_ranks(key: str, word: str, accelerator: Any) -> None:
    store = _rank_store()
    if store is not None:
        store.set(key, word)
    else:  # no key-value store: a collective (which a long build may time out)
        _from_main(word, accelerator)


def _wait_for_main(key: str, accelerator: Any) -> str:
    store = _rank_store()
    if store is None:
        return _from_main(None, accelerator)
    while not store.check([key]):
        time.sleep(WAIT_POLL_S)
    return store.get(key).decode()


@contextmanager
def store_lock(path: str | os.PathLike, hold: bool = True):
    """The file lock of the store at ``path`` (``.<name>.lock`` beside it), held for the block when ``hold`` (the main
    process; the others wait at its barriers). A second holder waits, and says so once."""
    if not hold:
        yield
        return

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.parent / f".{path.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[selfspec] feature store {path}: another process is building or reading it; waiting for its lock "
              f"({lock.lock_file})", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def read_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    file = Path(path) / META_NAME
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError:
        return None


def describe(meta: Mapping[str, Any], path: str | os.PathLike) -> str:
    splits = ", ".join(f"{name} {s['num_examples']:,} examples / {s['num_tokens']:,} tokens"
                       for name, s in meta["splits"].items())
    fields = ", ".join(f"{k} {v['dtype']}{v['shape']}" for k, v in meta["fields"].items())
    return f"{path}: {splits}; fields {fields}; {meta['bytes'] / 1e9:.3f} GB on disk"


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True, default=str))


BUILD_NAME = "build.json"  # in a store's temporary folder: what it is built for, so that a killed build resumes
BASE_TENSORS = ("input_ids", "labels", "offsets")  # a shard's tensors besides the extract's fields


def _build(path, splits, extract, ident, collate_fn, batch_size, examples_per_shard, device, accelerator,
           overwrite: bool = False) -> None:
    """Write every shard still missing from the build's temporary folder (this process's share of them: every
    world_size-th), then publish the folder (the main process)."""
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = rank == 0
    plan = []  # (split, shard index, start, stop) for every shard, in order
    for name, ds in splits.items():
        for s, start in enumerate(range(0, len(ds), examples_per_shard)):
            plan.append((name, s, start, min(start + examples_per_shard, len(ds))))
    tmp = _build_folder(path, splits, ident, examples_per_shard, len(plan)) if is_main else None
    tmp = _from_main(tmp, accelerator)
    _barrier(accelerator)

    mine = [p for i, p in enumerate(plan) if i % world == rank]
    todo = [p for p in mine if not (tmp / p[0] / f"shard-{p[1]:05d}.safetensors").is_file()]
    bar = tqdm(total=sum(stop - start for _, _, start, stop in mine), desc="feature store", unit="ex",
               disable=not is_main)
    bar.update(sum(stop - start for _, _, start, stop in mine) - sum(stop - start for _, _, start, stop in todo))
    for name, s, start, stop in todo:
        ds = splits[name]
        ids, labels, offsets, values = [], [], [0], {}
        for b in range(start, stop, batch_size):
            examples = [ds[i] for i in range(b, min(b + batch_size, stop))]
            batch = {k: v.to(device) for k, v in collate_fn(examples).items()}
            with torch.no_grad():
                out = extract(batch)
            lengths = batch["attention_mask"].sum(-1).tolist()
            for row, n in enumerate(lengths):
                ids.append(batch["input_ids"][row, :n].to("cpu", torch.int32))
                labels.append(batch["labels"][row, :n].to("cpu", torch.int32))
                offsets.append(offsets[-1] + n)
                for key, value in out.items():  # padded [B, T, ...], or a list of [n, ...] per example
                    chunk = value[row][:n].detach().to("cpu").contiguous()
                    if chunk.is_floating_point() and not bool(torch.isfinite(chunk).all()):
                        raise FeatureStoreError(_not_finite(key, chunk))
                    values.setdefault(key, []).append(chunk)
            bar.update(len(examples))
        tensors = {"input_ids": torch.cat(ids), "labels": torch.cat(labels),
                   "offsets": torch.tensor(offsets, dtype=torch.int64)}
        for key, chunks in values.items():
            tensors[key] = torch.cat(chunks)
        file = tmp / name / f"shard-{s:05d}.safetensors"
        partial = file.with_name(file.name + ".partial")  # whole or absent: a kill while saving leaves no shard
        save_file(tensors, str(partial), metadata={"fields": json.dumps(list(values))})
        os.chmod(partial, file.parent.stat().st_mode & 0o666)  # the folder's read bits (safetensors writes 0600)
        os.replace(partial, file)
    bar.close()
    _barrier(accelerator)

    if is_main:
        _publish(path, tmp, splits, plan, {"identity": _plain(ident), "fields": {}, "splits": {}, "bytes": 0},
                 overwrite)
    _barrier(accelerator)


def _build_folder(path: Path, splits: Mapping[str, Any], ident: Mapping[str, Any], examples_per_shard: int,
                  shards: int) -> Path:
    """The temporary folder to build the store at ``path`` in (the main process, under the store's lock): a killed
    build's of the same identity and shard size, whose shards are kept, or a new one. Any other temporary folder of
    this store is a killed build's of something else, and deleted (when selfspec made it)."""
    wanted = _plain({"identity": ident, "examples_per_shard": int(examples_per_shard)})
    resumed = None
    for stale in sorted(path.parent.glob(f".{path.name}.tmp-*")):
        try:
            recorded = json.loads((stale / BUILD_NAME).read_text())
        except (OSError, ValueError):
            recorded = None
        if resumed is None and recorded == wanted and folders.is_ours(stale, KIND) and \
                not folders.foreign_entries(stale):
            resumed = stale
        else:
            folders.discard(stale, KIND)
    if resumed is not None:
        done = sum(1 for name in splits for _ in (resumed / name).glob("shard-*.safetensors"))
        print(f"[selfspec] feature store {path}: resuming a killed build ({done} of {shards} shards written, in "
              f"{resumed})", file=sys.stderr)
        return resumed
    tmp = folders.temp_dir(path, KIND)  # a name of this build's own
    for name in splits:
        (tmp / name).mkdir(parents=True, exist_ok=True)
    (tmp / BUILD_NAME).write_text(json.dumps(wanted, indent=1))
    return tmp


def _from_main(value: Any, accelerator: Any) -> Any:
    """The main process's ``value`` on every process (the temporary folder's name)."""
    if accelerator is None or accelerator.num_processes == 1:
        return value

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def _publish(path: Path, tmp: Path, splits: Mapping[str, Any], plan: list[tuple], meta: dict[str, Any],
             overwrite: bool = False) -> None:
    """Write meta.json (every split's shards, sizes, token counts, the fields of the first shard) into the finished
    ``tmp``, last and atomically, and rename it to ``path``, replacing an older store selfspec made
    (selfspec.core.folders.replace_dir)."""
    for name, ds in splits.items():
        shards, tokens = [], 0
        for split, s, start, stop in plan:
            if split != name:
                continue
            file = tmp / name / f"shard-{s:05d}.safetensors"
            if not file.is_file():
                raise FeatureStoreError(f"Shard {file} is missing: a process could not write it.")
            meta["bytes"] += file.stat().st_size
            shards.append({"file": f"{name}/{file.name}", "start": start, "stop": stop})
        for shard in shards:
            tokens += _shard_tokens(tmp / shard["file"])
        meta["splits"][name] = {"num_examples": len(ds), "num_tokens": tokens, "shards": shards}
    name, s = plan[0][0], plan[0][1]
    meta["fields"] = _shard_fields(tmp / name / f"shard-{s:05d}.safetensors")
    for leftover in [tmp / BUILD_NAME, *tmp.glob("*/*.partial")]:
        leftover.unlink(missing_ok=True)
    written = tmp / f"{META_NAME}.tmp"
    written.write_text(json.dumps(meta, indent=1))
    os.replace(written, tmp / META_NAME)  # last: a folder with meta.json is a complete store
    folders.replace_dir(tmp, path, overwrite, kind=KIND, key="feature_store.overwrite", setting="feature_store.dir")


def _shard_fields(file: Path) -> dict[str, dict[str, Any]]:
    """{field: {dtype, shape of one token's}} of a shard, in the order the extract returned them."""
    with safe_open(str(file), framework="pt") as f:
        names = json.loads((f.metadata() or {}).get("fields") or "null") or \
            [k for k in f.keys() if k not in BASE_TENSORS]
        fields = {}
        for key in names:
            piece = f.get_slice(key)
            fields[key] = {"dtype": str(piece[0:1].dtype).removeprefix("torch."),
                           "shape": list(piece.get_shape()[1:])}
        return fields


def _shard_tokens(file: Path) -> int:
    with safe_open(str(file), framework="pt") as f:
        return int(f.get_slice("input_ids").get_shape()[0])


def _barrier(accelerator) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


class FeatureDataset(Dataset):
    """One split of a feature store: item i is {input_ids [T], labels [T], <field> [T, ...]} as tensors.

    ``layers``: the hidden-state layers the reader wants (``aux`` [T, len(layers), H] in that order) of a store that
    holds more (a union of several families' layers, :func:`store_mismatch`); None: every field as stored."""

    def __init__(self, path: str | os.PathLike, split: str, meta: Mapping[str, Any] | None = None,
                 layers: Sequence[int] | None = None):
        self.path = Path(path)
        meta = meta or read_meta(self.path)
        if meta is None or split not in meta.get("splits", {}):
            raise FeatureStoreError(f"No split {split!r} in feature store {self.path}.")
        self.split = split
        self.fields = list(meta["fields"])
        self.aux_index: list[int] | None = None  # the stored aux layers this reader keeps, in its order
        have = _hidden_layers(meta.get("identity") or {})
        if layers is not None and have is not None and list(layers) != have:
            if not layers:
                self.fields = [k for k in self.fields if k != "aux"]
            else:
                self.aux_index = [have.index(i) for i in layers]
        self.shards = meta["splits"][split]["shards"]
        self.starts = [s["start"] for s in self.shards]
        self.num_examples = meta["splits"][split]["num_examples"]
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.num_examples

    def _shard(self, s: int):
        if self._pid != os.getpid():  # a DataLoader worker: open its own handles
            self._open, self._offsets, self._pid = {}, {}, os.getpid()
        if s not in self._open:
            file = self.path / self.shards[s]["file"]
            if not file.is_file():
                raise FeatureStoreError(f"Feature store shard {file} is missing: delete {self.path} to rebuild it.")
            handle = safe_open(str(file), framework="pt")
            self._open[s] = handle
            self._offsets[s] = handle.get_tensor("offsets")
        return self._open[s], self._offsets[s]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_examples:
            raise IndexError(index)
        s = bisect.bisect_right(self.starts, index) - 1
        handle, offsets = self._shard(s)
        i = index - self.starts[s]
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        item = {"input_ids": handle.get_slice("input_ids")[lo:hi].long(),
                "labels": handle.get_slice("labels")[lo:hi].long()}
        for key in self.fields:
            item[key] = handle.get_slice(key)[lo:hi]
        if self.aux_index is not None:
            item["aux"] = item["aux"][:, self.aux_index]
        return item


def collate_features(examples: list[Mapping[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of feature-store items: input_ids/attention_mask/labels [B, T] and each field [B, T, ...]
    (zeros on pads), the same layout as ``selfspec.train.data.collate`` plus the features."""
    longest = max(len(e["input_ids"]) for e in examples)
    batch_size = len(examples)
    out = {
        "input_ids": torch.full((batch_size, longest), int(pad_token_id), dtype=torch.long),
        "attention_mask": torch.zeros((batch_size, longest), dtype=torch.long),
        "labels": torch.full((batch_size, longest), IGNORE_INDEX, dtype=torch.long),
    }
    for key, value in examples[0].items():
        if key not in out:
            out[key] = torch.zeros((batch_size, longest, *value.shape[1:]), dtype=value.dtype)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        out["attention_mask"][row, :n] = 1
        for key, value in e.items():
            out[key][row, :n] = value
    return out
