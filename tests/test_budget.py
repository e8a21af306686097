"""trainer.max_minutes (train/budget.py): a run sized to a time budget from its own pace, on a clock the tests drive.

Each optimizer step costs a set number of the fake clock's seconds (evaluations, loading and saving cost none), so
the count a run sizes itself to follows from the budget by arithmetic, and the tests check the loop does it: the
learning-rate schedule built for that count, the count kept by a resumed run, and the stop when steps slow down.
"""

from __future__ import annotations

import json

import pytest
import torch

import selfspec.train.budget as budget
import selfspec.train.loop as loop
from selfspec.core.errors import SettingError
from test_medusa_train import Killed, KilledAt, heads_weights, killable, medusa_cfg, tiny_datasets, tiny_target
from selfspec.train.budget import fitting_steps
from selfspec.train.checkpoint import STATE_NAME, list_checkpoints
from selfspec.train.config import TrainerConfig
from selfspec.train.medusa_method import medusa_method


def _simulated_last_step(step, left, step_s, eval_s, eval_every, cap):
    """The loop's own order, one step at a time: the last step whose steps, evaluations before it (every
    ``eval_every``, not at the last) and final evaluation fit in ``left``."""
    best, spent = step, eval_s  # no further step: the final evaluation only
    if spent > left:
        return step
    walked = 0.0
    for last in range(step + 1, cap + 1):
        walked += step_s
        evals_before = sum(1 for s in range(step + 1, last) if eval_every and s % eval_every == 0)
        if walked + (evals_before + 1) * eval_s <= left:
            best = last
    return best


@pytest.mark.parametrize("eval_every", [0, 1, 3, 7])
def test_fitting_steps_is_the_last_step_whose_steps_and_evaluations_fit(eval_every):
    for step in (0, 5, 6):
        for left in (0.0, 1.0, 7.5, 20.0, 33.0, 200.0):
            for step_s, eval_s in ((1.0, 0.0), (1.0, 2.5), (0.7, 4.0)):
                for cap in (step, step + 10, step + 40):
                    got = fitting_steps(step, left, step_s, eval_s, eval_every, cap)
                    assert got == _simulated_last_step(step, left, step_s, eval_s, eval_every, cap), \
                        (step, left, step_s, eval_s, eval_every, cap)


class FakeClock:
    """Seconds that pass only when a step runs: ``per_step`` each (a list: the i-th step's, the last one on)."""

    def __init__(self, per_step):
        self.t, self.steps, self.per_step = 1000.0, 0, list(per_step)

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.per_step[min(self.steps, len(self.per_step) - 1)]
        self.steps += 1


@pytest.fixture
def clock(monkeypatch):
    """A fake budget clock advanced by every optimizer step; the probe over steps 2-5 (after one warm-up step)."""
    fake = FakeClock([1.0])
    monkeypatch.setattr(budget, "now", fake)
    monkeypatch.setattr(budget, "WARMUP_STEPS", 1)
    monkeypatch.setattr(budget, "PROBE_STEPS", 4)
    real_step = loop._optimizer_step

    def step_and_tick(*args, **kwargs):
        real_step(*args, **kwargs)
        fake.tick()

    monkeypatch.setattr(loop, "_optimizer_step", step_and_tick)
    return fake


# 24 training examples, batch 4; 8 eval examples = 2 eval batches, so an evaluation is estimated at 2 steps' time.
OPTS = ["trainer.max_steps=40", "trainer.max_minutes=0.3333333333333333", "trainer.lr_scheduler=cosine",
        "trainer.warmup_steps=0", "trainer.save_every=2", "trainer.keep_last=2"]


def test_a_budgeted_run_sizes_its_steps_and_its_schedule_to_the_budget(tmp_path, clock, capsys):
    # 20 s. Step 1 ends at 1 s (the probe starts there), step 5 at 5 s: 1 s a step, 15 s left; the final
    # evaluation's 2 s leave 13 more steps: the run ends at step 18, where its cosine schedule reaches 0.
    cfg = medusa_cfg(tmp_path / "run", *OPTS)
    result = train_run(cfg)
    assert result.steps == 18
    assert result.history[-1]["lr"] == 0.0 and result.history[-2]["lr"] > 0.0  # built for 18 steps, not 40
    err = capsys.readouterr().err
    assert "trainer.max_minutes=0.333333: a step took 1 s, 0.2 minutes are left: 18 steps fit" in err
    state = json.loads((list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1] / STATE_NAME).read_text())
    assert state["max_steps"] == 18 and state["sized_by_budget"] is True


def test_a_cap_that_fits_is_kept(tmp_path, clock, capsys):
    cfg = medusa_cfg(tmp_path / "run", *OPTS[:1], "trainer.max_minutes=10", *OPTS[2:], "trainer.max_steps=12")
    result = train_run(cfg)
    assert result.steps == 12
    assert "the cap trainer.max_steps=12 fits" in capsys.readouterr().err


def test_a_killed_budgeted_run_resumes_to_the_same_count_and_parameters(tmp_path, clock, deterministic):
    data = tiny_datasets()
    full = medusa_cfg(tmp_path / "full", *OPTS)
    loop.train(full, medusa_method(full), target=tiny_target(), datasets=data)

    cfg = medusa_cfg(tmp_path / "killed", *OPTS)
    with pytest.raises(Killed):  # dies during step 13, after the sizing at step 5; the last checkpoint is step 12
        loop.train(cfg, killable(KilledAt, cfg, kill_at_step=13, accum=1), target=tiny_target(), datasets=data)
    resumed = medusa_cfg(tmp_path / "killed", *OPTS, "trainer.resume=true")
    result = loop.train(resumed, medusa_method(resumed), target=tiny_target(), datasets=data)
    assert result.steps == 18 and [h["step"] for h in result.history] == list(range(13, 19))
    full_weights, resumed_weights = heads_weights(tmp_path / "full"), heads_weights(tmp_path / "killed")
    assert full_weights.keys() == resumed_weights.keys()
    for k in full_weights:
        assert torch.equal(full_weights[k], resumed_weights[k]), k


def test_a_run_that_slows_down_stops_where_the_budget_runs_out(tmp_path, clock, capsys):
    # Sized at step 5 to 18 steps (as above); then each step takes 3 s: step 10 ends at 20 s, the whole budget.
    clock.per_step = [1.0] * 5 + [3.0]
    cfg = medusa_cfg(tmp_path / "run", *OPTS)
    result = train_run(cfg)
    assert result.steps == 10 and result.history[-1]["lr"] > 0.0  # the schedule's tail untrained
    assert (tmp_path / "run" / "heads" / "model.safetensors").exists()
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")][-1] == 10
    assert "spent at step 10 of 18: training stops here" in capsys.readouterr().err


def test_a_budget_must_be_positive():
    from conftest import compose

    cfg = compose("medusa", ["experiment=debug", "trainer.max_minutes=0"])
    with pytest.raises(SettingError, match=r"trainer.max_minutes=0 must be > 0 \(or null: no time budget\)"):
        TrainerConfig.from_cfg(cfg.trainer)


@pytest.mark.parametrize("native", [True, False])
def test_mixed_precision_auto_is_bf16_only_where_the_device_multiplies_it_natively(monkeypatch, native):
    """auto (the CPU hour recipes): bf16 autocast on CUDA and on CPUs with AVX512-BF16 or AMX; float32 elsewhere,
    where emulated bf16 made a Gemma DFlash step over 20 times slower on an AVX2 CPU (docs/targets.md)."""
    from conftest import compose

    import selfspec.train.config as config

    asked = []
    monkeypatch.setattr(config, "native_bf16", lambda device: asked.append(str(device)) or native)
    cfg = compose("medusa", ["experiment=debug", "trainer.mixed_precision=auto"])
    assert TrainerConfig.from_cfg(cfg.trainer).mixed_precision == ("bf16" if native else "no")
    assert asked == ["cuda" if torch.cuda.is_available() else "cpu"]
    cfg = compose("medusa", ["experiment=debug", "trainer.mixed_precision=bf16"])
    assert TrainerConfig.from_cfg(cfg.trainer).mixed_precision == "bf16"  # asked for by name: kept
    with pytest.raises(SettingError, match="trainer.mixed_precision='fp8': use no, bf16, fp16, auto or null"):
        TrainerConfig.from_cfg(compose("medusa", ["experiment=debug", "trainer.mixed_precision=fp8"]).trainer)


def train_run(cfg):
    return loop.train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets())
