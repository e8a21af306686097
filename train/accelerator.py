"""The accelerator a training run uses (:func:`make_accelerator`), with the settings it must agree on
(:func:`check_accumulation`), the launches it refuses (:func:`check_launch`, :func:`check_processes`), and what
distributed configs need to run on CPU: the DeepSpeed workaround (:func:`skip_deepspeed_shm_op`) and FSDP2 over gloo
(:func:`fsdp_over_gloo`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import (DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
                              InitProcessGroupKwargs)

from selfspec.core.errors import SettingError
from selfspec.train.config import TrainerConfig


def make_accelerator(tc: TrainerConfig, run_dir: Path):
    """An ``accelerate.Accelerator`` for ``tc``: accumulation over ``tc.gradient_accumulation_steps`` micro-batches,
    ``tc.mixed_precision``, the schedule stepped once per optimizer step; fresh settings even when an earlier run in
    this process made one."""
    check_launch(tc)
    # Several processes without a GPU: accelerate sees torchrun on CPU as distributed (gloo) only with cpu=True, and
    # DeepSpeed on CPU (cpu=False) counts its processes only when the gloo backend is named. FSDP on CPU: see
    # fsdp_over_gloo (a launched process, even one alone, so that it runs sharded as the config says).
    world, launched, gpu = _world_size(), "LOCAL_RANK" in os.environ, torch.cuda.is_available()
    deepspeed, fsdp = _env_flag("ACCELERATE_USE_DEEPSPEED"), _env_flag("ACCELERATE_USE_FSDP")
    multi_cpu = world > 1 and not gpu
    deepspeed_on_cpu = deepspeed and launched and not gpu
    fsdp_on_cpu = fsdp and not deepspeed and launched and not gpu
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else []
    if deepspeed_on_cpu:
        skip_deepspeed_shm_op()
    # accelerate keeps its settings in process-wide singletons: a second run in the same process (tests, benchmarks)
    # would silently inherit the first one's mixed precision and accumulation. The process group itself is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    _undo_fsdp_over_gloo()
    fsdp_plugin = None
    if fsdp_on_cpu:
        fsdp_plugin = FullyShardedDataParallelPlugin()  # from the config, as accelerate reads it on GPUs
    accelerator = Accelerator(
        cpu=(multi_cpu or fsdp_on_cpu) and not deepspeed,
        kwargs_handlers=handlers,
        fsdp_plugin=fsdp_plugin,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=tc.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        mixed_precision=tc.mixed_precision,
        # The schedule counts optimizer steps, whatever the number of processes.
        step_scheduler_with_optimizer=False,
        project_dir=str(run_dir),
    )
    if fsdp_plugin is not None:
        fsdp_over_gloo(accelerator, fsdp_plugin)
    if deepspeed:
        _no_zero3_init(accelerator)
    check_processes(accelerator)
    return accelerator


def _no_zero3_init(accelerator) -> None:
    """``zero3_init_flag: false`` (every shipped config): models are built whole, and ``prepare`` shards only the
    drafter, so a frozen target run outside the DeepSpeed engine stays whole on every rank. accelerate nonetheless
    points transformers at its ZeRO-3 config whatever the flag, and transformers then builds every later model (the
    target, loaded next) already partitioned by ``deepspeed.zero.Init``: its forward outside the engine fails on
    empty weights. Unpointed here, as the flag says."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and not plugin.zero3_init_flag:
        # deferred: transformers' DeepSpeed integration, only for a DeepSpeed run
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        plugin.dschf = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(tc: TrainerConfig) -> None:
    """Refuse, before any process group starts, a distributed config this machine cannot run as it says: DeepSpeed
    not installed, more processes on this machine than it has GPUs, FSDP1 or fp16 without a GPU."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED") and importlib.util.find_spec("deepspeed") is None:
        raise SettingError(
            "The accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED), which is not installed here: "
            "pip install deepspeed, or launch with conf/accelerate/ddp.yaml or fsdp.yaml instead."
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus and "LOCAL_RANK" in os.environ and local > gpus:
        machines = max(1, _world_size() // local)
        raise SettingError(
            f"accelerate launch started {local} processes on this machine, which has {gpus} GPU(s), one per "
            f"process: launch with --num_processes {gpus * machines} (the GPUs of all {machines} machine(s)), "
            "not the config's num_processes."
        )
    if gpus:
        return
    if (_env_flag("ACCELERATE_USE_FSDP") and "LOCAL_RANK" in os.environ
            and os.environ.get("FSDP_VERSION", "1") != "2"):
        raise SettingError(
            "FSDP1 (fsdp_version: 1 in the accelerate config) runs on GPUs only here, and this machine has none: "
            "set fsdp_version: 2 (as conf/accelerate/fsdp.yaml does: FSDP2 runs on CPU over gloo)."
        )
    precision = tc.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "fp16":
        raise SettingError(
            "fp16 mixed precision needs a GPU, and this machine has none: set trainer.mixed_precision=bf16 or "
            "trainer.mixed_precision=no (or --mixed_precision no for accelerate launch)."
        )


def check_processes(accelerator) -> None:
    """Refuse a run whose accelerator is not what the launch asked for: torch.distributed's processes not all in it
    (each would train its own unsynchronised copy into the same run folder), or DeepSpeed/FSDP dropped."""
    world, kind = _world_size(), accelerator.distributed_type
    if world > 1 and (accelerator.num_processes != world or kind == DistributedType.NO):
        raise SettingError(
            f"{world} processes were launched (WORLD_SIZE={world}) but the accelerator runs {kind.name} with "
            f"{accelerator.num_processes} process(es): each would train its own copy into one run folder. Launch "
            "with conf/accelerate/ddp.yaml (or torchrun --nproc_per_node N), or run one process."
        )
    wanted = (DistributedType.DEEPSPEED if _env_flag("ACCELERATE_USE_DEEPSPEED") else
              DistributedType.FSDP if _env_flag("ACCELERATE_USE_FSDP") else None)
    if wanted is not None and kind != wanted and "LOCAL_RANK" in os.environ:
        raise SettingError(
            f"The accelerate config asks for {wanted.name}, but the accelerator runs {kind.name} on this machine: "
            "launch with conf/accelerate/ddp.yaml instead, or on a machine with GPUs."
        )


def fsdp_over_gloo(accelerator, plugin) -> None:
    """FSDP on CPU: accelerate turns FSDP on for GPUs only, and on CPU it silently drops the plugin (every process
    then trains unsharded and unsynchronised). torch's FSDP2 (``fully_shard``) runs over gloo, so the accelerator is
    switched to FSDP here as accelerate does on GPUs: ``prepare`` shards the module with ``fully_shard``,
    ``save_state`` and ``get_state_dict`` gather it. Both of accelerate's state singletons are set (an
    ``AcceleratorState()`` made later copies the process state's type); :func:`_undo_fsdp_over_gloo` restores the
    process state for the next run."""
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP


def _undo_fsdp_over_gloo() -> None:
    """The process state back to MULTI_CPU after :func:`fsdp_over_gloo` (accelerate itself never sets FSDP there)."""
    if PartialState._shared_state.get("distributed_type") == DistributedType.FSDP:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU


def check_accumulation(accelerator, tc: TrainerConfig) -> None:
    """A DeepSpeed config that sets its own gradient accumulation must agree with the trainer's."""
    if accelerator.gradient_accumulation_steps != tc.gradient_accumulation_steps:
        raise SettingError(
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
    # deferred: DeepSpeed (slow to import) only for a DeepSpeed run
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


__all__ = ["check_accumulation", "check_launch", "check_processes", "fsdp_over_gloo", "make_accelerator",
           "skip_deepspeed_shm_op"]
