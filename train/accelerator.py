"""The accelerator a training run uses (:func:`make_accelerator`), with the settings it must agree on
(:func:`check_accumulation`) and the DeepSpeed workaround that several processes on CPU need
(:func:`skip_deepspeed_shm_op`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from selfspec.train.config import TrainerConfig


def make_accelerator(tc: TrainerConfig, run_dir: Path):
    """An ``accelerate.Accelerator`` for ``tc``: accumulation over ``tc.gradient_accumulation_steps`` micro-batches,
    ``tc.mixed_precision``, the schedule stepped once per optimizer step; fresh settings even when an earlier run in
    this process made one."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    # Several processes without a GPU: accelerate sees torchrun on CPU as distributed (gloo) only with cpu=True, and
    # DeepSpeed on CPU (cpu=False) counts its processes only when the gloo backend is named.
    multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if multi_cpu and deepspeed else []
    if multi_cpu and deepspeed:
        skip_deepspeed_shm_op()
    # accelerate keeps its settings in process-wide singletons: a second run in the same process (tests, benchmarks)
    # would silently inherit the first one's mixed precision and accumulation. The process group itself is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(
        cpu=multi_cpu and not deepspeed,
        kwargs_handlers=handlers,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=tc.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        mixed_precision=tc.mixed_precision,
        # The schedule counts optimizer steps, whatever the number of processes.
        step_scheduler_with_optimizer=False,
        project_dir=str(run_dir),
    )


def check_accumulation(accelerator, tc: TrainerConfig) -> None:
    """A DeepSpeed config that sets its own gradient accumulation must agree with the trainer's."""
    if accelerator.gradient_accumulation_steps != tc.gradient_accumulation_steps:
        raise ValueError(
            "The accelerate/DeepSpeed config sets gradient_accumulation_steps="
            f"{accelerator.gradient_accumulation_steps} but trainer.gradient_accumulation_steps="
            f"{tc.gradient_accumulation_steps}: set it in one place only (leave it out of the DeepSpeed config; "
            "it is filled from the trainer)."
        )


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed on CPU from building its shared-memory all-reduce op when it starts its process group.

    The op serves only tensor-parallel inference (``inference_all_reduce``), which training never calls; DeepSpeed
    nonetheless compiles it with the C++ toolchain when the process group starts (a compiler needed, seconds to
    minutes), maps 66 MB of /dev/shm per rank, and spins until every rank's segment exists, so a rank that cannot
    make one holds the others forever. Training all-reduces through gloo either way. DeepSpeed keeps its op table
    in a module-level dict once probed, so marking the op as not compatible there is enough.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


__all__ = ["check_accumulation", "make_accelerator", "skip_deepspeed_shm_op"]
