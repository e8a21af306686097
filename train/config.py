"""Training settings: ``cfg.trainer`` as a checked :class:`TrainerConfig`, the check every family's settings
dataclass goes through (:func:`settings_from_cfg`), the frozen target's dtype while training (:func:`training_dtype`)
and the resolved config written next to a run's outputs (:func:`write_resolved_config`).

Defaults live in conf/ only: the dataclasses here declare their fields without defaults, and a missing key is named.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from selfspec.core.config import to_dict
from selfspec.core.errors import SettingError
from selfspec.core.runtime import native_bf16

TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}  # -> transformers' names


@dataclass
class TrainerConfig:
    """``cfg.trainer``. Its defaults, and what each setting does, are in conf/trainer/default.yaml, the only place
    they are written: every field is required here. Steps are optimizer steps; batch_size is per device."""

    max_steps: int
    max_minutes: float | None  # null: no time budget; else the run's length sized to fit it (train/budget.py)
    batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    weight_decay: float
    adam_betas: tuple[float, float]
    adam_eps: float
    lr_scheduler: str  # cosine | linear | constant, each after a linear warmup
    warmup_steps: int
    max_grad_norm: float | None  # null: no clipping
    mixed_precision: str | None  # no | bf16 | fp16 | auto (bf16 where the device multiplies it natively, else no) |
    # null (from the accelerate config, default no)
    target_dtype: str  # the frozen target's dtype while training: auto | float32 | bfloat16 | float16
    seed: int
    eval_every: int  # 0: evaluate only at the end
    eval_max_examples: int | None  # cap on eval examples (the first ones of the eval split)
    save_every: int  # 0: no checkpoints
    keep_last: int | None  # null: keep every checkpoint
    log_every: int
    resume: Any  # false | true (latest of this run) | path of a checkpoint or run folder
    overwrite: bool  # a fresh run may delete the checkpoints an earlier run left in the same run_dir
    num_workers: int
    hold_freed_memory: bool  # glibc: freed blocks stay in the process for reuse (selfspec.core.runtime.hold_freed_memory)
    packing: bool  # each batch's examples packed into rows of pack_length tokens (selfspec.train.data.collate_packed)
    pack_length: int | None  # null: data.max_length

    @classmethod
    def from_cfg(cls, cfg: Any) -> "TrainerConfig":
        out = settings_from_cfg(cls, cfg, group="trainer")
        out.adam_betas = tuple(out.adam_betas)  # type: ignore[assignment]
        problems = []
        if out.max_steps < 1:
            problems.append(f"trainer.max_steps={out.max_steps} must be >= 1")
        if out.max_minutes is not None and not out.max_minutes > 0:
            problems.append(f"trainer.max_minutes={out.max_minutes} must be > 0 (or null: no time budget)")
        if out.batch_size < 1 or out.gradient_accumulation_steps < 1:
            problems.append("trainer.batch_size and trainer.gradient_accumulation_steps must be >= 1")
        if out.lr_scheduler not in SCHEDULERS:
            problems.append(f"trainer.lr_scheduler={out.lr_scheduler!r}: use one of {sorted(SCHEDULERS)}")
        if out.mixed_precision not in (None, "no", "bf16", "fp16", "auto"):
            problems.append(f"trainer.mixed_precision={out.mixed_precision!r}: use no, bf16, fp16, auto or null")
        elif out.mixed_precision == "auto":  # a CPU without AVX512-BF16 or AMX emulates bf16, far slower than float32
            out.mixed_precision = "bf16" if native_bf16("cuda" if torch.cuda.is_available() else "cpu") else "no"
        if out.pack_length is not None and out.pack_length < 1:
            problems.append(f"trainer.pack_length={out.pack_length} must be >= 1 (or null: data.max_length)")
        if out.target_dtype not in TARGET_DTYPES:
            problems.append(f"trainer.target_dtype={out.target_dtype!r}: use one of {', '.join(TARGET_DTYPES)}")
        if problems:
            raise SettingError("; ".join(problems) + ".")
        return out


def settings_from_cfg(cls: type, cfg: Any, group: str = "heads") -> Any:
    """A settings dataclass from a config group, refusing keys it does not know (a typo would otherwise be ignored)
    and naming the fields without a default that the group does not set (its conf/ yaml sets them)."""
    data = to_dict(cfg)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SettingError(f"Unknown {group} option(s) {unknown}; known: {sorted(known)}.")
    missing = sorted(name for name, f in known.items()
                     if name not in data and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise SettingError(f"Missing {group} option(s) {missing}: conf/{group}/ holds their defaults; compose the "
                         "config from conf/, or give every one.")
    wrong = [f"{group}.{name}={value!r} is not {_TYPE_NAMES[typ]}" for name, value in data.items()
             for typ in [_SIMPLE_TYPES.get(str(known[name].type))] if typ and not _fits(value, typ)]
    if wrong:
        raise SettingError("; ".join(wrong) + ".")
    return cls(**data)


# A field annotated with one of these must hold that type (bool is not taken for a number, an int is for a float).
_SIMPLE_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "int | None": int, "float | None": float}
_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def _fits(value: Any, typ: type) -> bool:
    if value is None:
        return True  # optional fields; required ones are checked where they are used
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def training_dtype(target_dtype: str, device: torch.device | str, model_dtype: str = "auto",
                   trains_target: bool = False) -> str:
    """The dtype the frozen target runs in while a drafter trains (``trainer.target_dtype``): ``auto`` is bfloat16
    where it is native (:func:`selfspec.core.runtime.native_bf16`), else the model config's own dtype, which a method training
    weights inside the target (``trains_target``: Medusa-2's LoRA) also keeps. Only the teacher's hidden states and
    logits are computed in it: the drafter's weights stay float32 (trainer.mixed_precision sets its autocast)."""
    if target_dtype != "auto":
        return target_dtype
    return "bfloat16" if native_bf16(device) and not trains_target else model_dtype


def write_resolved_config(cfg: Any, run_dir: Path) -> Path:
    """``<run_dir>/config.yaml``: the config with every interpolation resolved, written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    text = OmegaConf.to_yaml(cfg, resolve=True) if OmegaConf.is_config(cfg) else OmegaConf.to_yaml(to_dict(cfg))
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


__all__ = ["SCHEDULERS", "TARGET_DTYPES", "TrainerConfig", "settings_from_cfg", "training_dtype",
           "write_resolved_config"]
