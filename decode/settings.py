"""The decode settings, read once from a composed conf/decode/decode.yaml into a :class:`DecodeSettings`, and the
target's settings they name (:class:`~selfspec.core.target.TargetSettings`).

Every decode default is written in conf/ only (conf/decode/decode.yaml for the session, each family's conf file for
its ``draft.*`` settings and conf/decode/hybrid.yaml for the hybrid's, bench.yaml and serve_check.yaml for those
scripts): a key the composed config lacks is an error that names it (:func:`required`), never a default written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from omegaconf import OmegaConf

from selfspec.core.config import CONF_DIR, MISSING, cfg_get, compose, to_dict, to_plain
from selfspec.core.embedded import EMBEDDED
from selfspec.core.target import TargetSettings
from selfspec.cpu_kernels.linear_kernels import KERNELS
from selfspec.decode.types import DecodeSetupError
from selfspec.decode.verify import Sampling

MODEL_CONFIGS = CONF_DIR / "model"
DECODE_CONFIGS = CONF_DIR / "decode"


def required(cfg: Any, keys: Sequence[str]) -> dict:
    """``cfg``'s values of ``keys`` as plain values, each read once. A key the config lacks (or leaves ``???``) is an
    error that names it."""
    values = {k: cfg_get(cfg, k, MISSING) for k in keys}
    missing = [k for k, v in values.items() if isinstance(v, str) and v == MISSING]
    unset = [k for k in missing if _left_unset(cfg, k)]
    if unset:  # ``???`` in the config: the user's to give
        raise DecodeSetupError(f"{unset[0]} is not set: give {unset[0]}=... on the command line.")
    if missing:
        raise DecodeSetupError(f"Missing decode setting(s) {missing}: compose the config from conf/decode/ "
                               "(decode.yaml, or bench.yaml for the benchmark; selfspec.decode.settings.decode_config() in "
                               "code) rather than writing one of its own.")
    return {k: to_plain(v) for k, v in values.items()}


def _left_unset(cfg: Any, key: str) -> bool:
    """Whether ``cfg`` has ``key`` and leaves it ``???``."""
    try:
        return OmegaConf.is_config(cfg) and OmegaConf.is_missing(cfg, key)
    except Exception:  # no such key
        return False


def number(key: str, value: Any, kind: type) -> Any:
    """Setting ``key``'s ``value`` as ``kind`` (int or float), refused in one line when it is not a number
    (``max_new_tokens=abc``)."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number"
        raise DecodeSetupError(f"{key}={value!r} is not {what}.") from None


def decode_config(overrides: dict | None = None) -> Any:
    """conf/decode/decode.yaml with ``overrides`` merged in: a whole decode config for code that sets a few keys."""
    return OmegaConf.merge(OmegaConf.load(DECODE_CONFIGS / "decode.yaml"), overrides or {})


SESSION_KEYS = ("heads", "drafter", "draft", "random_heads", "model", "target", "device", "dtype", "acceptance", "temperature",
                "top_k", "top_p", "linear_kernel", "max_new_tokens", "stop", "seed", "chat", "system_prompt", "learn",
                "learner", "heads_check")


@dataclass(frozen=True)
class DecodeSettings:
    """What a session decodes under (conf/decode/decode.yaml says what each does), read once from the composed config
    by :meth:`from_config`; the code past it reads these fields, never the config."""

    heads: str | None  # a heads folder, ``random`` (untrained heads of the family) or None (no heads)
    family: str | None  # ``drafter=``: a registry entry (decode/registry.py); None: the heads' own
    draft: dict  # the ``draft.*`` settings given (the null ones left out: those keep the saved or default value)
    random_heads: dict  # heads=random's options
    model: Any  # ``model=``: a name in conf/model/, a hub id or folder, or a model config; None: the heads' target
    target: dict  # ``model.KEY=`` / ``target.KEY=``: settings over that target's model config
    device: str | None  # None: the model config's
    dtype: str | None  # None: the model config's
    sampling: Sampling
    linear_kernel: str
    max_new_tokens: int
    stop: list[str]
    seed: int
    chat: bool
    system_prompt: str | None
    learn: bool  # the heads learn from the requests they decode (train/online.py)
    learner: dict  # learn=true's settings (selfspec.train.online.LearnSettings)
    heads_check: str = "full"  # full: heads of another checkpoint are refused | shape: only of another shape

    @classmethod
    def from_config(cls, cfg: Any) -> "DecodeSettings":
        c = required(cfg, SESSION_KEYS)
        kernel = str(c["linear_kernel"])
        if kernel not in KERNELS:
            raise DecodeSetupError(f"linear_kernel={kernel!r}: use one of {', '.join(KERNELS)}.")
        n = {k: number(k, c[k], kind) for k, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                                                       ("max_new_tokens", int), ("seed", int))}
        return cls(
            heads=None if c["heads"] in (None, "none", "null") else str(c["heads"]),
            family=None if c["drafter"] is None else str(c["drafter"]),
            draft={k: v for k, v in (c["draft"] or {}).items() if v is not None},  # plain values (required)
            random_heads=dict(c["random_heads"] or {}), model=c["model"], target=dict(c["target"] or {}),
            device=c["device"], dtype=c["dtype"],
            sampling=Sampling(acceptance=str(c["acceptance"]), temperature=n["temperature"], top_k=n["top_k"],
                              top_p=n["top_p"]),
            linear_kernel=kernel, max_new_tokens=n["max_new_tokens"],
            stop=[str(s) for s in (c["stop"] or [])],
            seed=n["seed"], chat=bool(c["chat"]), system_prompt=c["system_prompt"],
            learn=bool(c["learn"]), learner=dict(c["learner"] or {}), heads_check=str(c["heads_check"]),
        )

    def target_settings(self, heads_config: dict | None) -> TargetSettings:
        """The settings of the target to decode with (:func:`resolve_target_config`)."""
        return resolve_target_config(self.model, heads_config, self.device, self.dtype, self.target)


# --- the target -------------------------------------------------------------------------------------------------------


def target_config_from_heads(heads_config: dict) -> dict:
    """A model config for the target a heads folder records: ``model``, how the trainer loaded it (its source,
    folder or hub id, revision, dtype, attention and chat template; heads/io.py), else (heads saved before that was
    recorded) ``base_model`` + fingerprint: an embedded model, a tiny model, or a hub id / local folder."""
    if isinstance(heads_config.get("model"), dict):
        return dict(heads_config["model"])
    name = heads_config.get("base_model")
    if not name:
        raise DecodeSetupError("The heads' config.json names no base_model: pass the target with model=NAME.")
    embedded = [e.source for e in EMBEDDED.values() if e.hub_id == name]
    if embedded:
        return {"source": embedded[0]}
    if str(name).startswith("tiny-"):
        fp = heads_config.get("target_fingerprint", {})
        tiny = {"arch": str(name)[5:]}
        tiny.update({k: fp[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k in fp})
        return {"source": "tiny", "dtype": "float32", "device": "cpu", "tiny": tiny}
    return {"source": "hub", "name_or_path": name}


def model_config(model: Any) -> dict:
    """``model=``: a config dict, a name in conf/model/ (smollm2, tiny, ...), or a hub id / local folder."""
    if not isinstance(model, str):
        return to_dict(model)
    named = MODEL_CONFIGS / f"{model}.yaml"
    if "/" not in model and named.is_file():
        return to_dict(OmegaConf.load(named))
    return {"source": "hub", "name_or_path": model}


def model_settings() -> set[str]:
    """The keys a model config may set: those of the entries of conf/model/ (what ``model.KEY=`` may name)."""
    return {str(k) for path in MODEL_CONFIGS.glob("*.yaml") for k in OmegaConf.load(path).keys()}


def resolve_target_config(model: Any, heads_config: dict | None, device: str | None = None,
                          dtype: str | None = None, target: dict | None = None) -> TargetSettings:
    """The settings of the target to load: ``model=`` wins; else the heads' target; else (random heads, vanilla) the
    embedded SmolLM2. ``target``'s settings (``model.KEY=VALUE``) are set over that config (a tiny model's ``tiny``
    recipe key by key), then ``device`` and ``dtype`` where given; what it still leaves out is
    conf/model/defaults/target.yaml's (:meth:`TargetSettings.from_config`)."""
    model = to_plain(model)
    if model is not None:
        model_cfg = model_config(model)
    else:
        model_cfg = target_config_from_heads(heads_config) if heads_config else {"source": "smollm2"}
    known = model_settings()
    for key, value in to_dict(target).items():
        if key not in known:
            raise DecodeSetupError(f"model.{key} is not a setting of a model config (conf/model/): use one of "
                                   f"{', '.join(sorted(known))}.")
        if key == "tiny" and isinstance(value, dict):
            value = {**dict(model_cfg.get("tiny") or {}), **value}
        model_cfg[key] = value
    model_cfg.update({k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None})
    return TargetSettings.from_config(model_cfg)


def target_config_from_overrides(overrides: list[str]) -> TargetSettings:
    """The target conf/decode/decode.yaml names under command-line ``overrides`` (its ``model``, ``device``,
    ``dtype``): for scripts that need a target and no drafter (scripts/kernel_plan.py, scripts/engine_ceiling.py)."""
    cfg = compose("decode", overrides, config_dir=DECODE_CONFIGS)
    c = required(cfg, ("model", "target", "device", "dtype"))
    return resolve_target_config(c["model"], None, c["device"], c["dtype"], c["target"])
