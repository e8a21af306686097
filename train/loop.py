"""The training loop every drafter family shares (Medusa, EAGLE, DFlash and layer-skip exits), on accelerate.

    result = train(cfg, method)   # cfg: a composed entry config (model, data, trainer, logger, run_dir, ...)

``method`` says what is trained and how (a :class:`selfspec.train.method.TrainMethod`); the loop owns everything else, in this
order (one function per phase, below): **setup** (the frozen target, or from a feature store only the tensors the
method reads of it; data loading and sharding, the drafter, AdamW with a warmup + cosine/linear/constant schedule,
mixed precision, all prepared by accelerate; the logger), **resume** (from a checkpoint, or a check that the run
folder holds no earlier run), the **training steps** (gradient accumulation, clipping, logging and a progress bar on
the main process, evaluation every ``trainer.eval_every`` steps, atomic checkpoints every ``trainer.save_every`` steps
with the last ``trainer.keep_last`` kept), the final **evaluation** and the **save** of the drafter. With
``trainer.max_minutes`` the run's step count is sized to a time budget from its own pace, and it stops where the
budget runs out (train/budget.py).

Determinism and resume. The data order of epoch e is a permutation seeded by (trainer.seed, e), the same on every
rank; accelerate shards each global batch over the ranks. A step reads exactly ``gradient_accumulation_steps``
micro-batches per rank, so the data position is ``step * gradient_accumulation_steps`` micro-batches. A checkpoint
stores the drafter's trainable weights, the optimizer, scheduler, RNG states of every rank and that position; a run
resumed from it (``trainer.resume=true``, or a path) skips the consumed batches without loading them and ends with the
same parameters as a run that was never stopped. Resuming with a larger ``trainer.max_steps`` trains on: the
learning-rate schedule is rebuilt for the new length and goes on from the checkpoint's step.

Loss normalisation. Every method counts the items of a micro-batch (``count_items``, e.g. label tokens per head); the
loop sums the counts over the whole step (all micro-batches, all ranks) and passes them as ``num_items``, the method
returns ``loss_sum / num_items``, and the loop undoes accelerate's averaging over micro-batches and ranks, so a step's
gradient is that of the mean over every item of the global batch, whatever the split into ranks and micro-batches.

Device syncs. Losses and metrics stay on the device; the loop reads them once per optimizer step (the check that the
step's losses are finite, before the backward that may update) and once per log line.

Beside the loop: the settings (train/config.py), the accelerator (train/accelerator.py), the data and loaders
(train/loaders.py), checkpoints (train/checkpoint.py), and allocator tuning, bf16 detection and peak memory
(core/runtime.py).

Outputs in ``run_dir``: ``config.yaml`` (the resolved config), ``checkpoints/step-*``, ``heads/`` (``method.save``),
the logger's files (``metrics.jsonl``, ``wandb/``).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast, set_seed
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from selfspec.core import folders
from selfspec.core.config import cfg_get, to_dict
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.core.runtime import hold_freed_memory, peak_memory_bytes, release_held_memory
from selfspec.core.target import TargetSettings, load_target
from selfspec.core.target_parts import load_target_parts
from selfspec.train import budget as time_budget
from selfspec.train.accelerator import check_accumulation, make_accelerator
from selfspec.train.budget import TimeBudget
from selfspec.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    register_trainable_state_hooks,
    resolve_resume,
    save_checkpoint,
)
from selfspec.train.config import SCHEDULERS, TrainerConfig, training_dtype, write_resolved_config
from selfspec.train.loaders import eval_loader, micro_batches, packing_collate, prepare_splits, train_loader
from selfspec.train.loggers import LogWindow, make_logger
from selfspec.train.method import TrainMethod


# Steps between two release_held_memory() calls while memory is held: each release costs the pages it gives back one
# more zeroing. Releasing every 25 steps, EAGLE-3 steps ran faster than with the allocator's defaults, and resident
# memory stayed flat (docs/journal/2026-12-01-figures-from-code.md).
RELEASE_HELD_EVERY = 25


class RunExistsError(SelfspecError, ValueError):
    """A fresh run would mix its checkpoints with those of an earlier run in the same folder."""


class NonFiniteLossError(SelfspecError, RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the update."""


@dataclass
class TrainResult:
    run_dir: Path
    heads_dir: Path | None
    steps: int
    eval_metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)  # what was logged, every log_every steps
    train_tokens_per_s: float = 0.0
    train_tokens: int = 0
    wall_s: float = 0.0
    peak_memory_bytes: int = 0  # CUDA peak allocated on GPU, else the process's peak resident set
    last_checkpoint: Path | None = None
    whole_target: bool = True  # False: a store-fed run held only parts of the target (core/target_parts.py)


# --- the loop ---------------------------------------------------------------------------------------------------------


def train(cfg: Any, method: TrainMethod, target: Any = None, datasets: Any = None) -> TrainResult:
    """Train ``method``'s drafter on ``cfg``; ``target``/``datasets`` override loading them from ``cfg.model``/
    ``cfg.data`` (a ``selfspec.core.target.Target`` and a mapping with "train" and optionally "eval" splits)."""
    started = time_budget.now()  # trainer.max_minutes counts from here: the target, the data and a store included
    run = _setup(cfg, method, target, datasets, started)
    progress = _resume(run)
    _train_steps(run, progress)
    _evaluate_at_end(run, progress)
    heads_dir = _save(run, progress)
    return _finish(run, progress, heads_dir)


@dataclass
class _Run:
    """What setup builds, for the phases after it."""

    cfg: Any
    tc: TrainerConfig
    method: TrainMethod
    accelerator: Any
    run_dir: Path
    target: Any
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    eval_loader: DataLoader | None
    logger: Any  # None on processes other than the main one
    held_memory: bool = False  # hold_freed_memory() took: release_held_memory() every RELEASE_HELD_EVERY steps
    budget: TimeBudget | None = None  # trainer.max_minutes (train/budget.py)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@dataclass
class _Progress:
    """Where the run stands; the phases from resume on update it."""

    step: int = 0
    tokens_seen: int = 0  # over the whole run, resumed parts included
    last_checkpoint: Path | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    train_time: float = 0.0  # seconds in training steps since this process started (not evaluating or saving)
    trained_tokens: int = 0  # tokens trained on since this process started
    started: float = field(default_factory=time.perf_counter)


# --- setup ------------------------------------------------------------------------------------------------------------


def _setup(cfg: Any, method: TrainMethod, target: Any, datasets: Any, started: float | None = None) -> _Run:
    """The trainer settings, accelerator and run folder; the target and data; the module, optimizer, schedule and
    loaders, prepared by accelerate; the logger. Random numbers are drawn in this order from ``trainer.seed``.
    ``started``: the run's start on :func:`selfspec.train.budget.now`'s clock, where ``trainer.max_minutes`` counts from."""
    tc = TrainerConfig.from_cfg(cfg.trainer)
    budget = None if tc.max_minutes is None else TimeBudget(
        seconds=60.0 * tc.max_minutes, started=time_budget.now() if started is None else started)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file INFO lines drown the progress bar
    run_dir = Path(str(cfg.run_dir))
    accelerator = make_accelerator(tc, run_dir)
    set_seed(tc.seed)
    # before anything runs: a heads/ folder selfspec did not write is refused on every rank, or backed up (overwrite)
    heads_in_the_way = folders.in_the_way(run_dir / "heads", "heads", tc.overwrite, key="trainer.overwrite")
    if accelerator.is_main_process:
        folders.enter(run_dir, "run")  # marked when new or empty; a folder of the user's is used as it is
        if heads_in_the_way:
            folders.back_up(run_dir / "heads", key="trainer.overwrite")
        write_resolved_config(cfg, run_dir)
        if (run_dir / "checkpoints").exists():
            prune_checkpoints(run_dir / "checkpoints", None)  # removes temporary folders a killed run left behind
    if target is None:
        target = _load_target(cfg, accelerator, tc.target_dtype, method.trains_target, method.store_target_layers())
    else:
        target.model.to(accelerator.device)
    packed_collate = packing_collate(cfg, tc, method, target) if tc.packing else None  # its errors come first
    train_ds, eval_ds, collate_fn = prepare_splits(cfg, tc, method, target, datasets, accelerator)
    # Held from here on, not while a feature store is built: the store's target passes allocate blocks of ever new
    # sizes, and a heap that keeps them all grew a DFlash run far past one from a built store (docs/journal/).
    held = hold_freed_memory() if tc.hold_freed_memory else False
    module, optimizer, scheduler = _optimization(tc, method, target)
    module, optimizer, train_batches, scheduler = accelerator.prepare(
        module, optimizer, train_loader(train_ds, tc, packed_collate or collate_fn), scheduler)
    eval_batches = None if eval_ds is None else accelerator.prepare(eval_loader(eval_ds, tc, collate_fn))
    check_accumulation(accelerator, tc)
    register_trainable_state_hooks(accelerator)
    logger = make_logger(cfg.logger, run_dir, to_dict(cfg)) if accelerator.is_main_process else None
    return _Run(cfg=cfg, tc=tc, method=method, accelerator=accelerator, run_dir=run_dir, target=target,
                module=module, optimizer=optimizer, scheduler=scheduler, train_loader=train_batches,
                eval_loader=eval_batches, logger=logger, held_memory=held, budget=budget)


def _optimization(tc: TrainerConfig, method: TrainMethod, target: Any):
    """(module, AdamW over the method's parameter groups (by default every trainable parameter), the warmup + decay
    schedule)."""
    module = method.build_module(target)
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"The {method.name} method built a module with no trainable parameter.")
    groups = method.param_groups(module, tc.learning_rate)
    optimizer = torch.optim.AdamW(groups, lr=tc.learning_rate, betas=tc.adam_betas, eps=tc.adam_eps,
                                  weight_decay=tc.weight_decay, fused=_fused_adamw(groups))
    return module, optimizer, _lr_schedule(tc, optimizer)


def _lr_schedule(tc: TrainerConfig, optimizer: torch.optim.Optimizer):
    """The warmup + decay schedule of ``tc`` (its kind, warmup and max_steps) over ``optimizer``."""
    return get_scheduler(SCHEDULERS[tc.lr_scheduler], optimizer, num_warmup_steps=tc.warmup_steps,
                         num_training_steps=tc.max_steps)


def _fused_adamw(groups: list[dict]) -> bool | None:
    """True (torch's fused AdamW: one kernel per parameter for the whole update) when every parameter is a float
    tensor on the CPU or a CUDA device; None (torch's default implementation) otherwise. On the CPU the default is a
    loop of small operations per parameter, where a DFlash hour-recipe step spent a visible share of its time; fused,
    much less (docs/journal/2026-12-01-figures-from-code.md)."""
    params = [p for g in groups for p in g["params"]]
    ok = params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return True if ok else None


def _load_target(cfg: Any, accelerator, target_dtype: str = "auto", trains_target: bool = False,
                 store_layers: list[int] | None = None):
    """The frozen target, in ``trainer.target_dtype`` (:func:`training_dtype`). ``store_layers`` (a store-fed method's
    :meth:`TrainMethod.store_target_layers`): only its embeddings, final norm, LM head and those decoder layers are
    materialised, the rest stays on the meta device (selfspec.core.target_parts); a store still to be built loads the
    rest while it is built (selfspec.train.feature_store)."""
    asked = TargetSettings.from_config(cfg.model)
    settings = asked.replace(device=str(accelerator.device),  # each rank on its own device, not "auto" (= cuda:0)
                             dtype=training_dtype(target_dtype, accelerator.device, asked.dtype, trains_target))
    if store_layers is None or trains_target:
        return recorded_as_asked(load_target(settings), asked)

    target = recorded_as_asked(load_target_parts(settings, store_layers), asked)
    if accelerator.is_main_process:
        print(f"[selfspec] features=store: the trainer holds the target's {target.parts.describe(target.model)}; "
              "the rest stays on the meta device.", file=sys.stderr)
    return target


def recorded_as_asked(target, asked: TargetSettings):
    """``target`` with the dtype its heads record (how decoding loads it) set back to the model config's: training
    may run the frozen target in another dtype (``trainer.target_dtype``), decoding runs it in ``model.dtype``."""
    if target.settings and "dtype" in target.settings:
        target.settings = {**target.settings, "dtype": asked.dtype}
    return target


# --- resume -----------------------------------------------------------------------------------------------------------


def _resume(run: _Run) -> _Progress:
    """Where training starts: the checkpoint ``trainer.resume`` names (its step, data position, optimizer and RNG
    states), or step 0 of a fresh run. Runs after everything that might draw random numbers, since the RNG states
    are restored here."""
    tc = run.tc
    resume_from = resolve_resume(tc.resume, run.ckpt_dir)
    if tc.resume and resume_from is None and run.is_main:
        print(f"[selfspec] trainer.resume={tc.resume}: no checkpoint in {run.ckpt_dir} yet; starting fresh.",
              file=sys.stderr)
    if resume_from is None:
        _clear_earlier_run(run)
        return _Progress()
    return _restore(run, resume_from)


def _clear_earlier_run(run: _Run) -> None:
    """A fresh run refuses a folder with an earlier run's checkpoints, or deletes them with trainer.overwrite (those
    selfspec wrote; any other is moved to a backup)."""
    earlier = list_checkpoints(run.ckpt_dir)
    if earlier and not run.tc.overwrite:
        raise RunExistsError(
            f"{run.ckpt_dir} holds checkpoints of an earlier run (up to step {earlier[-1][0]}): continue it with "
            "trainer.resume=true, start over with trainer.overwrite=true (deletes them), or choose another run_name."
        )
    if earlier:
        run.accelerator.wait_for_everyone()
        if run.is_main:
            print(f"[selfspec] trainer.overwrite=true: deleting {len(earlier)} checkpoint(s) of an earlier run in "
                  f"{run.ckpt_dir}.", file=sys.stderr)
            for _, folder in earlier:
                if not folders.discard(folder, "checkpoint"):
                    folders.back_up(folder, key="trainer.overwrite")
        run.accelerator.wait_for_everyone()


def _restore(run: _Run, resume_from: Path) -> _Progress:
    tc = run.tc
    state = load_checkpoint(run.accelerator, resume_from)
    step, tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
    if run.budget is not None and state.get("sized_by_budget"):  # the count this run's first part sized: kept
        run.budget.sized = True
        _set_max_steps(run, int(state["max_steps"]))
    layout = (state.get("num_processes"), state.get("batch_size"), state.get("gradient_accumulation_steps"))
    if layout != (run.world, tc.batch_size, tc.gradient_accumulation_steps) and run.is_main:
        print("[selfspec] resuming with another process count or batch layout than the checkpoint's: the run "
              "continues from the same number of optimizer steps but will not repeat the original exactly.",
              file=sys.stderr)
    if step > tc.max_steps:
        raise SettingError(
            f"{resume_from} is at step {step}, past trainer.max_steps={tc.max_steps}: resume with "
            f"trainer.max_steps >= {step} to train on (the learning-rate schedule is rebuilt for the new length), "
            f"or use the heads that run saved."
        )
    # The schedule's own rate at this step: the restored one unless max_steps changed (older checkpoints do not
    # record it).
    lr = _schedule_at(run.scheduler, step)
    planned = state.get("max_steps")
    if planned is not None and int(planned) != tc.max_steps and run.is_main:
        print(f"[selfspec] the checkpoint's run was to end at step {planned}, trainer.max_steps={tc.max_steps} "
              f"now: the {tc.lr_scheduler} learning-rate schedule is rebuilt for {tc.max_steps} steps and "
              f"goes on from step {step} at learning rate {lr:.3g}.", file=sys.stderr)
    if run.is_main:
        print(f"[selfspec] resumed from {resume_from} at step {step}", file=sys.stderr)
    return _Progress(step=step, tokens_seen=tokens_seen, last_checkpoint=latest_checkpoint(run.ckpt_dir))


# --- training steps ---------------------------------------------------------------------------------------------------


def _train_steps(run: _Run, progress: _Progress) -> None:
    """Optimizer steps up to trainer.max_steps: a log line every log_every steps (and at the last), an evaluation
    every eval_every steps (before the last; the final one follows), a checkpoint every save_every and at the last."""
    tc, accum = run.tc, run.tc.gradient_accumulation_steps
    stream = micro_batches(run.accelerator, run.train_loader, start=progress.step * accum)
    window = LogWindow.empty(run.accelerator.device)
    bar = tqdm(total=tc.max_steps, initial=progress.step, desc=f"train {run.method.name}", unit="step",
               disable=not run.is_main, dynamic_ncols=True)
    run.module.train()
    stopped = False  # trainer.max_minutes spent before trainer.max_steps
    try:
        while progress.step < tc.max_steps and not stopped:
            _optimizer_step(run, [next(stream) for _ in range(accum)], window, progress.step + 1)
            progress.step += 1
            window.steps += 1
            bar.update(1)
            step = progress.step
            if run.budget is not None:
                stopped = _keep_to_budget(run, step, bar)
            last = step == tc.max_steps or stopped
            if run.held_memory and step % RELEASE_HELD_EVERY == 0:
                release_held_memory()
            if step % max(tc.log_every, 1) == 0 or last:
                _log_window(run, progress, window, bar)
                window = LogWindow.empty(run.accelerator.device)
            if run.eval_loader is not None and tc.eval_every and step % tc.eval_every == 0 and not last:
                t0 = time_budget.now()
                _evaluate_and_log(run, progress)
                if run.budget is not None:
                    run.budget.eval_seconds += time_budget.now() - t0
                if run.is_main:
                    tqdm.write(_format_eval(step, progress.eval_metrics))
                window.restart_clock()
            if tc.save_every and (step % tc.save_every == 0 or last):
                sized = run.budget is not None and run.budget.sized
                state = _trainer_state(step, progress.tokens_seen, tc, run.world, sized)
                progress.last_checkpoint = save_checkpoint(run.accelerator, run.ckpt_dir, step, state, tc.keep_last)
                window.restart_clock()
    finally:
        bar.close()


def _keep_to_budget(run: _Run, step: int, bar) -> bool:
    """trainer.max_minutes after optimizer step ``step`` (train/budget.py): size the run once the probe's steps are
    done (every rank takes the main process's count); True when the budget is spent before the last step (every rank
    stops when one's clock says so)."""
    budget, tc, accelerator = run.budget, run.tc, run.accelerator
    if budget.observe(step):
        eval_batches = len(run.eval_loader) if run.eval_loader is not None else 0
        fits = budget.size(step, tc.max_steps, eval_batches, tc.eval_every)
        if run.world > 1:
            fits = int(broadcast(torch.tensor([fits], device=accelerator.device), from_process=0).item())
        if run.is_main:
            p = budget.probe
            what = (f"the cap trainer.max_steps={tc.max_steps} fits" if fits == tc.max_steps else
                    f"{fits:,} steps fit (trainer.max_steps={tc.max_steps} would not); the {tc.lr_scheduler} "
                    f"learning-rate schedule is built for {fits:,}")
            bar.write(f"[selfspec] trainer.max_minutes={tc.max_minutes:g}: a step took {p['step_s']:.3g} s, "
                      f"{p['left_s'] / 60:.1f} minutes are left: {what}.", file=sys.stderr)
        if fits != tc.max_steps:
            _set_max_steps(run, fits)
            bar.total = fits
            bar.refresh()
    spent = budget.spent() and step < tc.max_steps
    if run.world > 1:
        spent = accelerator.reduce(torch.tensor([float(spent)], device=accelerator.device), reduction="sum").item() > 0
    if spent:
        if run.is_main:
            bar.write(f"[selfspec] trainer.max_minutes={tc.max_minutes:g} spent at step {step:,} of "
                      f"{tc.max_steps:,}: training stops here (evaluated, checkpointed and saved); the learning-rate "
                      "schedule's tail was not trained. A larger trainer.max_minutes, or a resume, trains on.",
                      file=sys.stderr)
        return True
    return False


def _set_max_steps(run: _Run, max_steps: int) -> None:
    """Make ``max_steps`` the run's length: the trainer's setting and the learning-rate schedule, rebuilt for it
    from the same warmup and kind, at the current step's rate (its last step, in the scheduler, is unchanged)."""
    run.tc.max_steps = max_steps
    inner = getattr(run.scheduler, "scheduler", run.scheduler)
    stand_in = torch.optim.SGD([{"params": [torch.zeros(1)]} for _ in inner.optimizer.param_groups], lr=1.0)
    inner.lr_lambdas = _lr_schedule(run.tc, stand_in).lr_lambdas  # the real optimizer's rates are left as they are
    _schedule_at(run.scheduler, inner.last_epoch)


def _optimizer_step(run: _Run, micro: list[dict], window: LogWindow, step: int) -> None:
    """Optimizer step number ``step`` over this rank's micro-batches ``micro``: forward and backward each; clip,
    check and update once the gradients are synced. Their losses and metrics go into ``window``.

    The step's losses are checked once, before the last micro-batch's backward (DeepSpeed updates inside it), so a
    non-finite loss stops training before any update and costs one device sync per step."""
    accelerator, accum = run.accelerator, len(micro)
    num_items = _step_items(run, micro)
    losses = []
    for i, batch in enumerate(micro):
        with accelerator.accumulate(run.module), accelerator.autocast():
            loss, metrics = run.method.compute_loss(batch, run.target, run.module, num_items=num_items)
            losses.append(loss.detach())
            if i == accum - 1:
                _stop_if_not_finite(accelerator, torch.stack(losses), "loss", step, run.ckpt_dir)
            # num_items already normalises over the step: undo the mean over micro-batches and ranks.
            accelerator.backward(loss * (accum * run.world))
            if accelerator.sync_gradients:
                _update(run, step)
        window.add(loss, metrics, batch["attention_mask"].sum(), accum)


def _step_items(run: _Run, micro: list[dict]) -> torch.Tensor:
    """The method's item counts summed over the step's micro-batches and every rank (at least 1 each)."""
    counts = [run.method.count_items(batch) for batch in micro]
    if not all(torch.is_tensor(c) for c in counts):
        raise TypeError(f"{type(run.method).__name__}.count_items returned {counts[0]!r}, not a tensor: it counts the "
                        "items a micro-batch's loss is a sum over (train/method.py:TrainMethod.count_items).")
    local = sum(c.to(run.accelerator.device, torch.float64) for c in counts)
    return run.accelerator.reduce(local, reduction="sum").clamp(min=1)


def _update(run: _Run, step: int) -> None:
    accelerator, tc = run.accelerator, run.tc
    grad_norm = None
    if tc.max_grad_norm:
        grad_norm = accelerator.clip_grad_norm_(run.module.parameters(), tc.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, replicated on every rank
            grad_norm = grad_norm.full_tensor()
    if grad_norm is not None and accelerator.mixed_precision != "fp16":
        _stop_if_not_finite(accelerator, torch.as_tensor(grad_norm).detach().float(), "gradient norm", step,
                            run.ckpt_dir)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def _log_window(run: _Run, progress: _Progress, window: LogWindow, bar) -> None:
    record, n_tok = window.reduce(run.accelerator)
    elapsed = time.perf_counter() - window.started
    progress.train_time += elapsed
    progress.trained_tokens += n_tok
    progress.tokens_seen += n_tok
    record.update(lr=run.scheduler.get_last_lr()[0], tokens_per_s=n_tok / max(elapsed, 1e-9),
                  tokens_seen=progress.tokens_seen)
    progress.history.append({"step": progress.step, **record})
    if run.is_main:
        run.logger.log(record, step=progress.step)
        bar.set_postfix(loss=f"{record['loss']:.4f}")


# --- evaluate and save ------------------------------------------------------------------------------------------------


def _evaluate_and_log(run: _Run, progress: _Progress) -> None:
    progress.eval_metrics = _evaluate(run.method, run.eval_loader, run.target, run.module, run.accelerator)
    if run.held_memory:  # evaluation's batches leave blocks of other sizes
        release_held_memory()
    if run.is_main:
        run.logger.log(progress.eval_metrics, step=progress.step)


def _evaluate_at_end(run: _Run, progress: _Progress) -> None:
    if run.eval_loader is not None:
        _evaluate_and_log(run, progress)
    run.module.eval()


def _save(run: _Run, progress: _Progress) -> Path:
    """Write the module with ``method.save`` into ``<run_dir>/heads`` (main process), with what the run was."""
    heads_dir = run.run_dir / "heads"
    full_state = run.accelerator.get_state_dict(run.module)  # gathers shards (ZeRO-3/FSDP); every rank must call it
    if run.is_main:
        meta = {
            "run_name": cfg_get(run.cfg, "run_name"),
            "method": run.method.name,
            "steps": progress.step,
            "tokens_seen": progress.tokens_seen,
            "data": to_dict(cfg_get(run.cfg, "data", {})),
            "trainer": asdict(run.tc),
            "eval": progress.eval_metrics,
        }
        run.method.save(heads_dir, run.accelerator.unwrap_model(run.module), run.target, meta, state_dict=full_state)
    run.accelerator.wait_for_everyone()
    return heads_dir


def _finish(run: _Run, progress: _Progress, heads_dir: Path) -> TrainResult:
    result = TrainResult(
        run_dir=run.run_dir, heads_dir=heads_dir, steps=progress.step, eval_metrics=progress.eval_metrics,
        history=progress.history, train_tokens=progress.trained_tokens,
        train_tokens_per_s=progress.trained_tokens / progress.train_time if progress.train_time > 0 else 0.0,
        wall_s=time.perf_counter() - progress.started, peak_memory_bytes=peak_memory_bytes(run.accelerator.device),
        whole_target=run.target.parts is None,
        last_checkpoint=progress.last_checkpoint,
    )
    if run.is_main:
        print(summary(result, run.method.name), file=sys.stderr)
        run.logger.finish()
    return result


# --- helpers ----------------------------------------------------------------------------------------------------------


def _stop_if_not_finite(accelerator, value: torch.Tensor, what: str, step: int, ckpt_dir: Path) -> None:
    """Stop with :class:`NonFiniteLossError` if any element of ``value`` (on any rank) is NaN or infinite: one
    all-reduce and one device sync."""
    bad = (~torch.isfinite(value)).any().to(accelerator.device, torch.float32)
    if accelerator.reduce(bad, reduction="sum").item() > 0:
        last = latest_checkpoint(ckpt_dir)
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        finite = torch.isfinite(value)
        shown = value[~finite][0] if not finite.all() else value.float().mean()  # this rank's first culprit
        raise NonFiniteLossError(
            f"The {what} is {shown.item()} (not finite) at step {step}: training stopped before that "
            f"update, and {where}. Lower trainer.learning_rate, keep trainer.max_grad_norm set, or train in fp32 "
            "(trainer.mixed_precision=no); resume with trainer.resume=true."
        )


def _evaluate(method, loader, target, module, accelerator) -> dict[str, float]:
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), accelerator.autocast():
            return method.evaluate(loader, target, module, accelerator)
    finally:
        module.train(was_training)


def _schedule_at(scheduler, step: int) -> float:
    """Set the optimizer's learning rates to the (rebuilt) schedule's values at ``step``; the first group's.

    A checkpoint restores the learning rates its own schedule had reached, which the next update would use; after
    a change of trainer.max_steps they must be the new schedule's (the end of a finished cosine run is 0). With the
    same schedule this sets the very values restored.
    """
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
    for group, base, factor in zip(inner.optimizer.param_groups, inner.base_lrs, inner.lr_lambdas):
        group["lr"] = base * factor(step)
    inner._last_lr = [group["lr"] for group in inner.optimizer.param_groups]
    return inner._last_lr[0]


def _trainer_state(step: int, tokens_seen: int, tc: TrainerConfig, world: int, sized: bool = False) -> dict[str, Any]:
    return {
        "micro_batches_per_rank": step * tc.gradient_accumulation_steps,
        "tokens_seen": tokens_seen,
        "num_processes": world,
        "batch_size": tc.batch_size,
        "gradient_accumulation_steps": tc.gradient_accumulation_steps,
        "seed": tc.seed,
        "max_steps": tc.max_steps,
        "sized_by_budget": bool(sized),
    }


def _format_eval(step: int, metrics: dict[str, float]) -> str:
    shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items()
                      if "accept" in k or k.endswith("loss") or "acc1" in k)
    return f"[selfspec] eval at step {step}: {shown}"


def summary(result: TrainResult, name: str) -> str:
    lines = [f"[selfspec] {name} training done: {result.steps} steps in {result.wall_s:.1f} s, "
             f"{result.train_tokens_per_s:,.0f} tokens/s, peak memory {result.peak_memory_bytes / 2**30:.2f} GiB"]
    if result.history:
        first, last = result.history[0]["loss"], result.history[-1]["loss"]
        lines.append(f"  loss {first:.4f} (first logged) -> {last:.4f} (last)")
    if result.eval_metrics:
        lines.append("  eval: " + _format_eval(result.steps, result.eval_metrics).split(": ", 1)[1])
    lines.append(f"  run folder {result.run_dir}: heads/, checkpoints/, config.yaml")
    return "\n".join(lines)


__all__ = [
    "NonFiniteLossError",
    "RELEASE_HELD_EVERY",
    "RunExistsError",
    "TrainResult",
    "train",
]
