"""Experiment loggers, chosen by the ``logger`` config group (``_target_`` is one of these classes).

Call them from the main process only. ``NoLogger`` writes metrics to ``metrics.jsonl`` in the run folder and nothing
remote. ``WandbLogger`` logs through wandb; with no API key or no network it runs offline into the run folder and says
so (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later). It keeps its W&B run id in
``<run_dir>/wandb-run-id``, and a run resumed from a checkpoint goes on logging into that W&B run. :func:`make_logger`
builds the configured one.

:class:`LogWindow` holds what the training loop logs (loss, metrics, tokens) summed on the device over the steps since
the last log line, and reduces it over the ranks when the line is written.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object
from selfspec.core.config import to_dict
from selfspec.core.errors import SettingError
from selfspec.train.checkpoint import CheckpointError, resolve_resume


class NoLogger:
    """Metrics go to ``<run_dir>/metrics.jsonl`` only."""

    def __init__(self, run_dir: str | os.PathLike | None = None, config: dict | None = None, **_: Any):
        self.path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **_plain(metrics)}) + "\n")

    def finish(self) -> None:
        pass


class WandbLogger(NoLogger):
    """wandb, online when a key and network are there, otherwise offline into the run folder."""

    def __init__(
        self,
        run_dir: str | os.PathLike | None = None,
        config: dict | None = None,
        project: str = "selfspec",
        entity: str | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
        name: str | None = None,
        resume: bool = False,
    ):
        super().__init__(run_dir, config)
        import wandb  # noqa: F401 (a missing wandb fails here, at setup, not at the first log)

        run_id = wandb_run_id(run_dir, resume)
        ids = {"id": run_id, "resume": "allow"} if run_id else {}
        self._id_to_keep = (Path(run_dir), run_id) if run_id else None  # written once the run has logged
        mode = mode or os.environ.get("WANDB_MODE")
        if mode is None:
            mode = "online" if _has_wandb_key() else "offline"
        if mode == "offline":
            print(f"[selfspec] wandb runs offline into {run_dir or '.'}/wandb (no API key or WANDB_MODE=offline); "
                  "upload later with `wandb sync`.", file=sys.stderr)
        # started at the first log, not here: a run refused at its start (RunExistsError) leaves no W&B run behind
        self._init = dict(project=project, entity=entity, mode=mode, dir=str(run_dir) if run_dir else None,
                          config=config, name=name, tags=list(tags or []), **ids)
        self.run = None

    def _start(self):
        # deferred: wandb (slow to import) only for logger=wandb
        import wandb

        try:
            return wandb.init(**self._init)
        except Exception as err:  # no network although a key exists: keep the run, go offline
            print(f"[selfspec] wandb could not go online ({err}); logging offline instead.", file=sys.stderr)
            return wandb.init(**{**self._init, "mode": "offline"})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        super().log(metrics, step)
        if self.run is None:
            self.run = self._start()
        self.run.log(_plain(metrics), step=step)
        if self._id_to_keep:  # not before: a run refused at its start (RunExistsError) leaves the kept id alone
            keep_wandb_run_id(*self._id_to_keep)
            self._id_to_keep = None

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


WANDB_ID_FILE = "wandb-run-id"  # in the run folder: the W&B run a resumed run goes on logging into


def wandb_run_id(run_dir: str | os.PathLike | None, resume: bool) -> str | None:
    """The W&B run id of the run in ``run_dir``: the one kept there (:func:`keep_wandb_run_id`) when the run resumes
    from a checkpoint, else a new one (None without a run folder: wandb picks one)."""
    if not run_dir:
        return None
    path = Path(run_dir) / WANDB_ID_FILE
    if resume and path.is_file() and path.read_text().strip():
        run_id = path.read_text().strip()
        print(f"[selfspec] wandb: the resumed run goes on in W&B run {run_id} ({path})", file=sys.stderr)
        return run_id

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as wandb makes them


def keep_wandb_run_id(run_dir: Path, run_id: str) -> None:
    """Write ``run_id`` into ``<run_dir>/wandb-run-id`` (atomically), for a resume of the run to go on with."""
    path = run_dir / WANDB_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)


def make_logger(logger_cfg: Any, run_dir: Path, config: dict):
    """The ``logger`` group's class with the run folder and the run's config (hydra's ``instantiate`` reserves the
    keyword ``config``, so the class is looked up and called directly)."""
    kwargs = to_dict(logger_cfg)
    target = kwargs.pop("_target_", None)
    if not target:
        raise SettingError("logger config has no _target_: use logger=none or logger=wandb.")
    return get_object(target)(run_dir=str(run_dir), config=config, resume=_resumes(config, run_dir), **kwargs)


def _resumes(config: dict, run_dir: Path) -> bool:
    """Whether the run resumes from a checkpoint (``trainer.resume`` names one that is there): its logger then goes on
    with the run it logged to before. A ``trainer.resume`` that names nothing is left to the loop to refuse."""
    resume = (config.get("trainer") or {}).get("resume")
    try:
        return resolve_resume(resume, Path(run_dir) / "checkpoints") is not None
    except CheckpointError:
        return False


@dataclass
class LogWindow:
    """Sums over the optimizer steps since the last log line, kept on the device until they are logged."""

    loss: torch.Tensor
    tokens: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> "LogWindow":
        return cls(loss=torch.zeros((), device=device), tokens=torch.zeros((), device=device))

    def add(self, loss: torch.Tensor, metrics: dict, tokens: torch.Tensor, accum: int) -> None:
        """One micro-batch of a step of ``accum``: its loss, normalised by the step's count (already a share of the
        step's mean on this rank), is summed; its metrics are averaged over the step."""
        self.loss += loss.detach().float()
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, 0) + torch.as_tensor(v).detach().float() / accum
        self.tokens += tokens

    def restart_clock(self) -> None:
        """Evaluating and saving are not training time."""
        self.started = time.perf_counter()

    def reduce(self, accelerator) -> tuple[dict[str, float], int]:
        """(mean over the window, tokens over all ranks); the loss summed over ranks (each rank's share of a step's
        count-normalised loss)."""
        loss = accelerator.reduce(self.loss.clone(), reduction="sum") / self.steps
        record = {"loss": loss.item()}
        for k, v in sorted(self.metrics.items()):
            record[k] = (accelerator.reduce(v.to(accelerator.device).clone(), reduction="mean") / self.steps).item()
        n_tok = int(accelerator.reduce(self.tokens.clone(), reduction="sum").item())
        return record, n_tok


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
            v = v.item()
        out[k] = v
    return out
