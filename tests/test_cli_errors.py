"""Every console script (pyproject.toml's [project.scripts], and the stream and replay scripts that compose their own
configs) answers a mistyped key and a bad value with one ``error:`` line and exit status 2, no traceback (issue 69);
``HYDRA_FULL_ERROR=1`` still gives the whole trace. And the user-setting errors of training (features=,
feature_store.engine=, heads.*, the logger, DeepSpeed's accumulation, resuming past max_steps, a layer-skip exit) are
the project's own :class:`SettingError`, reported in one line.

The scripts run as subprocesses, several at a time (:func:`runs`): each fails before any model loads (``model=tiny``
where one would), so the file takes about as long as its slowest few imports of torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfspec.core.errors import SelfspecError, SettingError, config_error_message, reported_errors

from conftest import REPO, compose

BIN = Path(sys.executable).parent  # the venv's console scripts
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
QUESTION = '{"question_id": 1, "category": "writing", "turns": ["Say hi."]}\n'


def _command(name: str) -> list[str]:
    """A console script by its installed name, or a script of scripts/ by its file name."""
    if name.endswith(".py"):
        return [sys.executable, str(REPO / "scripts" / name)]
    return [str(BIN / name)]


# (case, command, arguments, a part of the error line); {tmp}: the case's own folder, also the working folder
CASES = [
    ("train-key", "selfspec-train", ["medusa", "model=tiny", "experiment=debug", "trainer.max_stepz=1"],
     "trainer.max_stepz is not a setting of this config (did you mean trainer.max_steps"),
    ("train-value", "selfspec-train", ["medusa", "model=tiny", "experiment=debug", "trainer.max_steps=abc"],
     "trainer.max_steps='abc' is not a whole number"),
    ("train-features", "selfspec-train", ["medusa", "model=tiny", "experiment=debug", "features=bogus"],
     "features='bogus': use online or store"),
    ("train-option", "selfspec-train", ["medusa", "heads=bogus"], "heads=bogus: no such option of heads; use one of"),
    ("train-family", "selfspec-train", ["bogus", "model=tiny"], "No family 'bogus' to train"),
    ("decode-key", "selfspec-decode", ["model=tiny", "nosuchkey=1"], "nosuchkey is not a setting of this config"),
    ("decode-value", "selfspec-decode", ["model=tiny", "prompt=hi", "max_new_tokens=abc"],
     "max_new_tokens='abc' is not a whole number"),
    ("decode-parse", "selfspec-decode", ["model=tiny", "draft.tree=[1"], "cannot read the override 'draft.tree=[1'"),
    ("bench-key", "selfspec-bench", ["model=tiny", "limt=2"],
     "limt is not a setting of this config (did you mean limit"),
    ("bench-value", "selfspec-bench", ["model=tiny", "prompts={tmp}/q.jsonl", "limit=abc", "out={tmp}/bench"],
     "limit='abc': give a whole number"),
    ("export-key", "selfspec-export", ["heads=x", "formt=vllm"], "formt is not a setting of this config"),
    ("export-key-cfg", "selfspec-export", ["heads=x", "formt=vllm", "--cfg", "job"],
     "formt is not a setting of this config"),
    ("export-value", "selfspec-export", ["heads={tmp}/nowhere"], "No heads folder at"),
    ("serve-check-key", "selfspec-serve-check", ["heads=x", "prompts=y", "serving.vllm_venf=x"],
     "serving.vllm_venf is not a setting of this config (did you mean serving.vllm_venv"),
    ("serve-check-value", "selfspec-serve-check", ["heads=x", "prompts=y", "serving.vllm_venv={tmp}/novenv"],
     "No vLLM virtualenv at"),
    ("regenerate-key", "selfspec-regenerate", ["model=tiny", "max_new_tokns=3"],
     "max_new_tokns is not a setting of this config (did you mean max_new_tokens"),
    ("regenerate-value", "selfspec-regenerate", ["model=tiny", "engine=bogus"], "engine='bogus'"),
    ("features-key", "selfspec-features", ["model=tiny", "feature_store.dri={tmp}/store"],
     "feature_store.dri is not a setting of this config (did you mean feature_store.dir"),
    ("features-value", "selfspec-features", ["model=tiny", "feature_store.dir={tmp}/store", "feature_store.engine=tgi"],
     "feature_store.engine='tgi': use hf"),
    ("stream-key", "stream_bench.py", ["model=tiny", "nosuchkey=1"], "nosuchkey is not a setting of this config"),
    ("stream-value", "stream_bench.py", ["model=tiny", "methods=[bogus]", "out={tmp}/stream"],
     "'bogus' is not a stream method"),
    ("replay-key", "learn_replay.py", ["model=tiny", "nosuchkey=1"], "nosuchkey is not a setting of this config"),
    ("replay-value", "learn_replay.py", ["model=tiny", "heads=x", "prompts={tmp}/q.jsonl"],
     "record is not set: give record="),
]
FULL_ERROR = ("train-key", "bench-key")  # run again under HYDRA_FULL_ERROR=1: the trace comes back


def _run(case: str, name: str, args: list[str], folder: Path, full_error: bool = False) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "q.jsonl").write_text(QUESTION)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(OMP_NUM_THREADS="1", **({"HYDRA_FULL_ERROR": "1"} if full_error else {}))
    argv = [*_command(name), *(a.replace("{tmp}", str(folder)) for a in args)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=folder, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case started at once, a few at a time: case -> its future CompletedProcess."""
    root = tmp_path_factory.mktemp("cli")
    pool = ThreadPoolExecutor(max_workers=4)
    futures = {case: pool.submit(_run, case, name, args, root / case) for case, name, args, _ in CASES}
    for case, name, args, _ in CASES:
        if case in FULL_ERROR:
            futures[case + "/full"] = pool.submit(_run, case, name, args, root / (case + "-full"), True)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_every_console_script_has_a_mistyped_key_and_a_bad_value():
    for name in [*SCRIPTS, "stream_bench.py", "learn_replay.py"]:
        kinds = {case.rsplit("-", 1)[-1] for case, script, _, _ in CASES if script == name}
        assert "key" in kinds and kinds - {"key"}, f"{name}: a mistyped key and a bad value"
    for name in SCRIPTS:
        assert (BIN / name).is_file(), f"{name} is not installed: pip install -e ."


@pytest.mark.slow
@pytest.mark.parametrize("case, name, args, message", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_error_line_and_exit_2(runs, case, name, args, message):
    proc = runs[case].result()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert message in lines[-1]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not any(line.startswith("error: ") for line in lines[:-1])  # one line


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_ERROR)
def test_hydra_full_error_gives_the_whole_trace(runs, case):
    proc = runs[case + "/full"].result()
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    assert "ConfigCompositionException" in proc.stderr


# --- the messages, in process ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_stepz=1"], "trainer.max_stepz is not a setting of this config (did you mean trainer.max_steps or "
                              "trainer.max_minutes?): check its spelling, or write +trainer.max_stepz=1 to add a key "
                              "of your own."),
    (["heads.num_head=3"], "heads.num_head is not a setting of this config (did you mean heads.num_heads?)"),
    (["nosuchkey=1"], "nosuchkey is not a setting of this config: check its spelling"),
    (["heads=bogus"], "heads=bogus: no such option of heads; use one of dflash, eagle, eagle3, medusa, medusa2."),
    (["trainer.max_steps=[1"], "cannot read the override 'trainer.max_steps=[1': no viable alternative"),
    (["trainer.max_steps=1,2"], "Ambiguous value for argument 'trainer.max_steps=1,2'"),
    (["+trainer.max_steps=2"], "An item is already at 'trainer.max_steps'"),
])
def test_composition_errors_become_one_line(overrides, message, capsys):
    with pytest.raises(SystemExit) as exit_info, reported_errors():
        compose("medusa", overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_omegaconf_errors_become_one_line_and_others_stay():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"out": "${nowhere}/x", "heads": "???"})
    for read, message in ((lambda: cfg.out, "Interpolation key 'nowhere' not found (at out)"),
                          (lambda: cfg.heads, "heads is not set: give heads=... on the command line.")):
        with pytest.raises(Exception) as info:
            read()
        assert config_error_message(info.value) == message
    assert config_error_message(ValueError("a bug")) is None
    with pytest.raises(ValueError, match="a bug"), reported_errors():  # not a mistake of the user's: the trace stays
        raise ValueError("a bug")


def _resume_past_max_steps(monkeypatch, tmp_path):
    import selfspec.train.loop as loop

    monkeypatch.setattr(loop, "load_checkpoint", lambda accelerator, path: {"step": 5})
    tc = SimpleNamespace(max_steps=3, batch_size=1, gradient_accumulation_steps=1)
    loop._restore(SimpleNamespace(tc=tc, accelerator=None, budget=None, world=1, is_main=False), tmp_path / "ckpt")


def _mistakes():
    """(name, a call that makes a user-setting mistake, a part of its message)."""
    from selfspec.heads.layerskip import ExitConfig
    from selfspec.train.accelerator import check_accumulation
    from selfspec.train.config import TrainerConfig
    from selfspec.train.eagle_method import EagleSettings
    from selfspec.train.feature_store import FeatureSource
    from selfspec.train.loggers import make_logger
    from selfspec.train.medusa_method import MedusaSettings, medusa_method

    tc = TrainerConfig.from_cfg(compose("medusa").trainer)
    return [
        ("features", lambda mp, tmp: FeatureSource.from_cfg(compose("medusa", ["features=bogus"])),
         "features='bogus': use online or store."),
        ("engine", lambda mp, tmp: FeatureSource.from_cfg(compose("medusa", ["feature_store.engine=tgi"])),
         "feature_store.engine='tgi'"),
        ("medusa-loss", lambda mp, tmp: MedusaSettings.from_cfg(compose("medusa", ["heads.loss=mse"]).heads),
         "heads.loss='mse': use ce or kl"),
        ("medusa-type", lambda mp, tmp: medusa_method(compose("medusa", ["heads.type=eagle"])), "heads.type='eagle'"),
        ("medusa-kl-store", lambda mp, tmp: medusa_method(compose("medusa", ["heads.loss=kl", "features=store",
                                                                             "feature_store.teacher_topk=null"])),
         "heads.loss=kl with features=store"),
        ("eagle-layout", lambda mp, tmp: EagleSettings.from_cfg(compose("eagle", ["heads.layout=wide"]).heads),
         "heads.layout='wide'"),
        ("eagle-loss", lambda mp, tmp: EagleSettings.from_cfg(compose("eagle", ["+heads.loss.bogus=1"]).heads),
         "heads.loss:"),
        ("logger", lambda mp, tmp: make_logger({"project": "x"}, tmp, {}), "logger config has no _target_"),
        ("accumulation", lambda mp, tmp: check_accumulation(SimpleNamespace(gradient_accumulation_steps=7), tc),
         "gradient_accumulation_steps=7"),
        ("exit-layer", lambda mp, tmp: ExitConfig(exit_layer=9, form="head", hidden_size=8, vocab_size=16,
                                                  num_hidden_layers=4, draft_vocab_size=None, tune_lm_head=False),
         "exit_layer=9: an exit goes after a layer in 1..3"),
        ("exit-form", lambda mp, tmp: ExitConfig(exit_layer=1, form="tail", hidden_size=8, vocab_size=16,
                                                 num_hidden_layers=4, draft_vocab_size=None, tune_lm_head=False),
         "exit form 'tail'"),
        ("resume", _resume_past_max_steps, "is at step 5, past trainer.max_steps=3"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_training_setting_mistakes_are_setting_errors_in_one_line(index, monkeypatch, tmp_path, capsys):
    mistakes = _mistakes()
    assert len(mistakes) == 12
    name, call, message = mistakes[index]
    with pytest.raises(SettingError) as info:
        call(monkeypatch, tmp_path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SelfspecError)  # old callers keep working
    assert message in str(info.value), name
    with pytest.raises(SystemExit) as exit_info, reported_errors():
        call(monkeypatch, tmp_path)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
