"""Sweeps and resumes: each job of a Hydra multirun (``-m``) trains in a run folder of its own, and a resumed run goes
on logging into its W&B run (offline here) by the id kept in the run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

REPO = Path(__file__).resolve().parents[1]


def test_each_job_of_a_multirun_trains_in_a_run_folder_of_its_own(tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            answer = " ".join(str(i + j) for j in range(12))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"count from {i}"},
                                                  {"from": "gpt", "value": answer}]}) + "\n")
    run_dir = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "train" / "medusa.py"), "-m", "model=tiny", "data=file", f"data.path={data}",
           "trainer.max_steps=1", "trainer.batch_size=2", "trainer.eval_every=0", "trainer.save_every=0",
           "speed_check.prompts=null", f"run_dir={run_dir}", "trainer.learning_rate=1e-3,2e-3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    from omegaconf import OmegaConf

    for num, lr in ((0, 1e-3), (1, 2e-3)):
        job = run_dir / str(num)
        assert (job / "heads" / "model.safetensors").is_file() and (job / "metrics.jsonl").is_file()
        cfg = OmegaConf.load(job / "config.yaml")
        assert cfg.run_dir == str(job) and cfg.trainer.learning_rate == lr
    assert not (run_dir / "heads").exists()  # nothing trained in the folder the jobs share


def _offline_runs(run_dir: Path) -> list[str]:
    """The ids of the offline W&B runs in ``run_dir`` (folders ``wandb/offline-run-<date>_<time>-<id>``; two started
    within one second sort by id, so the order is not asserted: a list of ids, counted)."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_a_resumed_run_goes_on_logging_into_its_wandb_run(tmp_path, monkeypatch):
    from selfspec.train.loggers import WANDB_ID_FILE
    from selfspec.train.loop import RunExistsError, train
    from selfspec.train.medusa_method import medusa_method

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, data = tmp_path / "run", tiny_datasets()
    opts = ["logger=wandb", "trainer.save_every=2", "trainer.log_every=1"]

    def run(*overrides: str):
        cfg = medusa_cfg(run_dir, *opts, *overrides)
        return train(cfg, medusa_method(cfg), target=tiny_target(), datasets=data)

    run("trainer.max_steps=2")
    first = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert _offline_runs(run_dir) == [first]
    with pytest.raises(RunExistsError):  # a fresh start refused over the checkpoints: the kept id is left alone
        run("trainer.max_steps=4")
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == first
    time.sleep(1.1)  # W&B names an offline run's folder to the second: the same id within one second shares it
    result = run("trainer.max_steps=4", "trainer.resume=true")
    assert result.steps == 4
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == first
    assert _offline_runs(run_dir).count(first) == 2  # the resumed part logged into the same W&B run
    run("trainer.max_steps=2", "trainer.overwrite=true")  # started over: a W&B run of its own
    again = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert again != first and _offline_runs(run_dir).count(again) == 1 and len(_offline_runs(run_dir)) == 3
