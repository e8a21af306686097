"""Training checkpoints: atomic folders under ``<run_dir>/checkpoints/step-NNNNNNNN``, the last k kept.

A checkpoint is ``accelerator.save_state`` (drafter weights, optimizer, scheduler, grad scaler, every rank's RNG
states; DeepSpeed/FSDP write their own sharded files) plus ``trainer_state.json`` (step, data position, counters).
All ranks write into ``.tmp-step-NNNNNNNN``; after a barrier the main process renames it into place, so a folder
named ``step-*`` is always complete and a run killed while saving leaves the previous checkpoint intact.

Only trainable parameters are stored for the drafter: a Medusa-2 drafter holds the whole frozen target, which the run
reloads from its source anyway. accelerate's own checkpoints go through ``register_trainable_state_hooks``; DeepSpeed's
(ZeRO-2/3) are written with ``exclude_frozen_parameters`` and read back non-strictly (:func:`engine_kwargs`); FSDP's
hold the prepared module, which for every family but Medusa-2 is the drafter alone. Several processes need a shared
filesystem.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from selfspec.core import folders
from selfspec.core.errors import SelfspecError

PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
STATE_NAME = "trainer_state.json"
_NAME = re.compile(r"^step-(\d+)$")


class CheckpointError(SelfspecError, RuntimeError):
    """A checkpoint cannot be found or does not fit this run."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir`` as (step, folder), oldest first; temporary folders are ignored."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = _NAME.match(child.name)
        if match and (child / STATE_NAME).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: Any, ckpt_dir: str | os.PathLike) -> Path | None:
    """``resume``: false/None (start fresh), true (latest checkpoint of this run, fresh if none) or a folder."""
    if resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("false", "no", "")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "yes", "latest")):
        return latest_checkpoint(ckpt_dir)
    path = Path(str(resume)).expanduser()
    if path.is_dir() and not (path / STATE_NAME).is_file():
        latest = latest_checkpoint(path)  # a checkpoints/ folder or a run folder
        latest = latest or latest_checkpoint(path / "checkpoints")
        if latest is None:
            raise CheckpointError(
                f"trainer.resume={resume}: {path} holds no complete checkpoint (step-*/{STATE_NAME})."
            )
        return latest
    if not (path / STATE_NAME).is_file():
        raise CheckpointError(
            f"trainer.resume={resume}: no checkpoint there. Give a checkpoint folder (…/checkpoints/step-NNNNNNNN), "
            "a run folder, or trainer.resume=true for this run's latest."
        )
    return path


def save_checkpoint(accelerator, ckpt_dir: str | os.PathLike, step: int, state: dict[str, Any],
                    keep_last: int | None) -> Path:
    """Write a checkpoint of the prepared objects plus ``state`` atomically; keep the newest ``keep_last``.

    Every process must call this (it has barriers).
    """
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / f"{TMP_PREFIX}{step:08d}"
    if accelerator.is_main_process:
        folders.enter(ckpt_dir, "checkpoints")
        folders.discard(tmp, "checkpoint")  # a killed run's; a folder selfspec did not make is refused below
        folders.claim(tmp, "checkpoint")
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), **engine_kwargs(accelerator, "save"))
    if accelerator.is_main_process:
        with open(tmp / STATE_NAME, "w") as f:
            json.dump({"step": step, **state}, f, indent=2)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # the same step saved before (a resumed run) is replaced, when selfspec wrote it
        folders.replace_dir(tmp, final, kind="checkpoint", key="trainer.overwrite")
        prune_checkpoints(ckpt_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep_last: int | None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (None or <= 0 keeps all), and stale temp folders:
    only folders selfspec made (their ``.selfspec`` marker, selfspec.core.folders), never anything else there."""
    ckpt_dir = Path(ckpt_dir)
    for child in ckpt_dir.glob(f"{TMP_PREFIX}*"):
        folders.discard(child, "checkpoint")
    if not keep_last or keep_last <= 0:
        return
    for _, folder in list_checkpoints(ckpt_dir)[:-keep_last]:
        folders.discard(folder, "checkpoint")


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore the prepared objects and RNG states from ``path``; returns its trainer state (step, data position)."""
    path = Path(path)
    if not (path / STATE_NAME).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_NAME}).")
    accelerator.load_state(str(path), **engine_kwargs(accelerator, "load"))
    return json.loads((path / STATE_NAME).read_text())


def engine_kwargs(accelerator, what: str) -> dict[str, Any]:
    """What ``save_state``/``load_state`` pass on to DeepSpeed's engine: leave the frozen parameters (Medusa-2's
    target) out of the checkpoint, and load it without them (they keep the values the run loaded). Nothing for the
    other engines."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return {}
    return {"exclude_frozen_parameters": True} if what == "save" else {"load_module_strict": False}


# --- drafter weights: trainable parameters only ----------------------------------------------------------------------


def _weights_file(folder: Path, index: int) -> Path:
    return folder / ("model.safetensors" if index == 0 else f"model_{index}.safetensors")


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def register_trainable_state_hooks(accelerator) -> None:
    """Make ``save_state``/``load_state`` store and restore only trainable parameters of the prepared models.

    No effect under DeepSpeed or FSDP, which checkpoint through their own engines.
    """

    def save_hook(models, weights, output_dir):
        for i, (model, state) in enumerate(zip(models, weights)):
            names = _trainable_names(model)
            weights[i] = {k: v for k, v in state.items() if k in names}

    def load_hook(models, input_dir):
        for i, model in enumerate(models):
            file = _weights_file(Path(input_dir), i)
            if not file.is_file():
                raise CheckpointError(f"{input_dir} has no {file.name}: incomplete checkpoint.")
            state = load_file(str(file), device=str(next(model.parameters()).device))
            names = _trainable_names(model)
            if set(state) != names:
                missing, extra = sorted(names - set(state)), sorted(set(state) - names)
                raise CheckpointError(
                    f"Checkpoint {input_dir} does not fit this drafter (missing {missing[:5]}, unexpected "
                    f"{extra[:5]}): it was written with another heads/model configuration. Resume with the same "
                    "config, or start a new run (another run_name)."
                )
            model.load_state_dict(state, strict=False)
        models.clear()  # loaded here; accelerate must not load them again

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
