"""Every console script (pyproject.toml's [project.scripts], and the stream and replay scripts that compose their own
configs) answers a mistyped key and a bad value with one ``error:`` line and exit status 2, no traceback (issue 69);
``HYDRA_FULL_ERROR=1`` still gives the whole trace. And the user-setting errors of training (features=,
feature_store.engine=, heads.*, the logger, DeepSpeed's accumulation, resuming past max_steps, a layer-skip exit) are
the project's own :class:`SettingError`, reported in one line.

Every case runs in this process (:func:`run_in_process`): the console script's own entry function (as
pyproject.toml's [project.scripts] names it) or the script file run as ``__main__``, with its command line in
``sys.argv``, its working folder, and stdout and stderr captured at the file descriptors; what a process would give
back (exit status, stdout, stderr) is read off it. Each fails before any model loads (``model=tiny`` where one would).
:data:`SUBPROCESS_CASES` also run as real processes (the installed console script, and a script file run by
Python), which proves the wiring from the command line to the entry function that the in-process runs call."""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import subprocess
import sys
import tomllib
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
# Also run as real processes: an installed console script (bin/selfspec-train) and a script file run by Python (its
# folder first on sys.path). The other console scripts are the same wiring: an entry in [project.scripts], whose
# function every case calls in process, and the installed file test_every_console_script_... checks.
SUBPROCESS_CASES = ("train-key", "stream-key")


def _run(case: str, name: str, args: list[str], folder: Path, full_error: bool = False) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "q.jsonl").write_text(QUESTION)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(OMP_NUM_THREADS="1", **({"HYDRA_FULL_ERROR": "1"} if full_error else {}))
    argv = [*_command(name), *(a.replace("{tmp}", str(folder)) for a in args)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=folder, timeout=300)


@pytest.fixture(scope="module")
def subprocess_runs(tmp_path_factory):
    """The cases of :data:`SUBPROCESS_CASES` started at once as real processes: case -> its future CompletedProcess."""
    root = tmp_path_factory.mktemp("cli")
    pool = ThreadPoolExecutor(max_workers=len(SUBPROCESS_CASES))
    futures = {case: pool.submit(_run, case, name, args, root / case) for case, name, args, _ in CASES
               if case in SUBPROCESS_CASES}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _entry(name: str):
    """What the command ``name`` runs: the function [project.scripts] names, or the script file as ``__main__``
    (``x.py``: scripts/x.py; ``folder/x.py``: that file of the repository). The file's folder is not put first on
    sys.path as ``python <file>`` puts it (its modules would shadow others in this process for the later tests):
    :data:`SUBPROCESS_CASES` run a script file by Python."""
    if name.endswith(".py"):
        path = REPO / name if "/" in name else REPO / "scripts" / name
        return lambda: runpy.run_path(str(path), run_name="__main__")
    module, _, function = SCRIPTS[name].partition(":")
    return getattr(importlib.import_module(module), function)


@contextmanager
def _process_state_kept():
    """What an entry point may change in this process (logging, which Hydra configures; Hydra's job config; the
    environment; torch's threads) is put back afterwards, so the runs leave nothing to later tests."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    def all_loggers() -> list[logging.Logger]:
        return [logging.root, *(lg for lg in logging.Logger.manager.loggerDict.values()
                                if isinstance(lg, logging.Logger))]

    saved = {lg: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in all_loggers()}
    disable, hydra_cfg, environ, threads = logging.root.manager.disable, HydraConfig.instance().cfg, \
        dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        for lg in all_loggers():
            handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        logging.disable(disable)
        HydraConfig.instance().cfg = hydra_cfg
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)


def run_in_process(name: str, args: list[str], folder: Path, monkeypatch, capfd,
                   full_error: bool = False) -> subprocess.CompletedProcess:
    """The command ``name args`` run in this process as :func:`_run` runs it in its own (the same working folder,
    arguments and HYDRA_FULL_ERROR): its exit status (SystemExit's code; 1 and the trace on stderr for an exception
    that would have ended the process, as Python reports one), stdout and stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "q.jsonl").write_text(QUESTION)
    argv = [a.replace("{tmp}", str(folder)) for a in args]
    entry = _entry(name)  # imported before the capture: an import's own output is no part of the command's
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", [name, *argv])
    if full_error:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    else:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    capfd.readouterr()
    code = 0
    with _process_state_kept():
        try:
            entry()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            if not isinstance(exit_.code, int) and exit_.code is not None:
                print(exit_.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        except Exception:  # noqa: BLE001 - uncaught in a process: its trace on stderr, exit status 1
            traceback.print_exc()
            code = 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([name, *argv], code, out, err)


def _assert_one_error_line(proc: subprocess.CompletedProcess, message: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert message in lines[-1]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not any(line.startswith("error: ") for line in lines[:-1])  # one line


def test_every_console_script_has_a_mistyped_key_and_a_bad_value():
    for name in [*SCRIPTS, "stream_bench.py", "learn_replay.py"]:
        kinds = {case.rsplit("-", 1)[-1] for case, script, _, _ in CASES if script == name}
        assert "key" in kinds and kinds - {"key"}, f"{name}: a mistyped key and a bad value"
    for name in SCRIPTS:
        assert (BIN / name).is_file(), f"{name} is not installed: pip install -e ."


@pytest.mark.parametrize("case, name, args, message", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_error_line_and_exit_2(case, name, args, message, tmp_path, monkeypatch, capfd):
    _assert_one_error_line(run_in_process(name, args, tmp_path / case, monkeypatch, capfd), message)


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_a_mistake_is_one_error_line_and_exit_2_in_a_process_of_its_own(subprocess_runs, case):
    """The same as a real command: the installed console script, and a script file run by Python."""
    *_, message = next(c for c in CASES if c[0] == case)
    _assert_one_error_line(subprocess_runs[case].result(), message)


@pytest.mark.parametrize("case", FULL_ERROR)
def test_hydra_full_error_gives_the_whole_trace(case, tmp_path, monkeypatch, capfd):
    _, name, args, _ = next(c for c in CASES if c[0] == case)
    proc = run_in_process(name, args, tmp_path / case, monkeypatch, capfd, full_error=True)
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
