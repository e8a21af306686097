"""Two processes on CPU (torchrun, gloo) train the same heads as one process with the same global batch.

One process: batch 4 x 2 micro-batches. Two processes: batch 2 x 2 micro-batches each. Same data order, same global
batch, loss normalised by the global label count: the heads must agree to float rounding, and so must the eval
metrics (the eval split is not a multiple of the batch, so gathering must drop the padding duplicates).

How close is "to float rounding"? The two runs compute the same sums in another order (per-rank matmuls, then the
all-reduce), so they differ by rounding alone, and Adam amplifies that: its update g / sqrt(v) is scale-free, so an
element whose gradient is a near-cancelling sum moves by about lr times the sum's *relative* rounding error, which has
no useful a-priori bound. The tolerance is therefore measured, not guessed: a second one-process run with the
same global batch as 2 x 4 micro-batches is the same computation in yet another summation order, and its distance
from the first run is this machine's rounding noise for exactly this training (about 1e-6 on values ~0.025). The
two-process heads must lie within a small multiple of it. A real divergence moves parameters by about lr per step;
`test_a_broken_gradient_all_reduce_is_caught` shows the comparison failing when the ranks skip the all-reduce.

Every shipped config in conf/accelerate/ is held to that standard: DDP (torchrun, and two "nodes" on this machine with
conf/accelerate/multinode.yaml), DeepSpeed ZeRO-2 (Medusa-1 and Medusa-2), ZeRO-3 and FSDP2 over gloo (Medusa-1,
EAGLE-3 and DFlash, one launch each: the families train one after another in the same processes). Each launch also
kills one family's run mid-way and resumes it, and its checkpoints hold the trainable weights only.

Run as a script by torchrun, this file is the worker: ``test_distributed.py <run_dir> [overrides...]``; with
``SELFSPEC_TEST_FAMILIES=medusa,eagle3,...`` it trains each of them into ``<run_dir>/<family>``, and with
``SELFSPEC_TEST_RESUME=<family>`` it also kills that family's run in step 3 and resumes it
(``<run_dir>/<family>-killed``); with ``SELFSPEC_TEST_BUDGET_THEN_BROKEN=1`` it trains Medusa-1 with a time budget
into ``<run_dir>/budget``, then with the gradient all-reduce skipped into ``<run_dir>/broken``.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STEPS = ["trainer.max_steps=4", "trainer.gradient_accumulation_steps=2", "trainer.save_every=2"]
LAUNCH_TIMEOUT = 300
WORKER_TIMEOUT = 240  # a rank still running by then prints every thread's stack and exits, so a hang says where


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, launcher: list[str], *overrides: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # A folder of our own for any op DeepSpeed compiles: a lock left by some other killed build cannot block it.
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1",
               SELFSPEC_DATA_CACHE=str(run_dir.parent / "data-cache"), ACCELERATE_DISABLE_RICH="1",
               TORCH_EXTENSIONS_DIR=str(run_dir.parent / "torch-extensions"))
    cmd = launcher + [__file__, str(run_dir), *overrides]
    # Its own session, so a hung launch is killed with all its ranks rather than leaving them behind.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... did not finish in {LAUNCH_TIMEOUT} s\n{out[-3000:]}\n{err[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


NOISE_MULTIPLE = 8  # observed: the two-process distance is 0.6-1.2x the one-process reordering noise
FLOAT32_EPS = torch.finfo(torch.float32).eps


def _heads(run_dir: Path) -> dict[str, torch.Tensor]:
    """The heads' weights, and Medusa-2's LoRA adapter (``adapter.<name>``) where there is one."""
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "heads" / "model.safetensors"))
    adapter = run_dir / "heads" / "adapter" / "adapter_model.safetensors"
    if adapter.is_file():
        weights.update({f"adapter.{k}": v for k, v in load_file(str(adapter)).items()})
    return weights


def _rounding_noise(one: Path, reordered: Path) -> float:
    """The largest difference between two one-process runs that differ only in summation order, floored at a few
    float32 ulps of the largest weight (two orders that happen to round alike would otherwise give 0)."""
    a, b = _heads(one), _heads(reordered)
    floats = [k for k in a if a[k].is_floating_point()]  # not the draft vocabulary's maps
    noise = max(float((a[k] - b[k]).abs().max()) for k in floats)
    return max(noise, 4 * FLOAT32_EPS * max(float(a[k].abs().max()) for k in floats))


def _compare(one: Path, two: Path, noise: float, family: str = "medusa") -> None:
    import json

    a, b = _heads(one), _heads(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=NOISE_MULTIPLE * noise if a[k].is_floating_point() else 0,
                                   msg=k)
    if family.startswith("medusa"):
        assert any(a[k].abs().sum() > 0 for k in a if k.startswith("blocks."))  # they did train (blocks start at 0)
    eval_a = json.loads((one / "heads" / "config.json").read_text())["eval"]
    eval_b = json.loads((two / "heads" / "config.json").read_text())["eval"]
    prefix = "" if family.startswith("medusa") else "eval/"
    assert eval_a[prefix + "positions"] == eval_b[prefix + "positions"] > 0
    # DFlash's evaluation draws its anchors from a generator seeded alike on every rank, so each rank's batches get
    # other anchors than one process's: the same count of positions, not the same loss.
    keys = ("acc1", "acc5", "loss") if family.startswith("medusa") else ("loss",) if family == "eagle3" else ()
    for key in keys:
        torch.testing.assert_close(torch.tensor(eval_a[prefix + key]), torch.tensor(eval_b[prefix + key]),
                                   rtol=1e-4, atol=1e-5)


# The families the launches train: (test module, its config function, the method, overrides). Tiny drafters: EAGLE-3
# and DFlash with a 64-token draft vocabulary. Their evaluations sum over every rank's batches, padding duplicates
# included (train/eagle_method.py), so they get an eval split of 8, which two ranks of 2 x 2 cover without padding;
# Medusa's drops the duplicates, and gets 7.
FAMILIES = {
    "medusa": ("test_medusa_train", "medusa_cfg", "selfspec.train.medusa_method:medusa_method", []),
    # no LoRA dropout: its masks are drawn per micro-batch and rank, so another split would draw others
    "medusa2": ("test_medusa_train", "medusa_cfg", "selfspec.train.medusa_method:medusa_method",
                ["heads=medusa2", "heads.lora.dropout=0"]),
    "eagle3": ("test_eagle", "eagle_cfg", "selfspec.train.eagle_method:EagleMethod",
               ["heads=eagle3", "heads.draft_vocab_size=64"]),
    "dflash": ("test_dflash_train", "dflash_cfg", "selfspec.train.dflash_method:DFlashMethod", []),
}


def _family_cfg(family: str, run_dir: Path, *overrides: str):
    """(the composed config of ``family`` in ``run_dir``, its method class or factory)."""
    import importlib

    module, cfg_fn, method, extra = FAMILIES[family]
    method_module, method_name = method.split(":")
    cfg = getattr(importlib.import_module(module), cfg_fn)(run_dir, *extra, *overrides)
    return cfg, getattr(importlib.import_module(method_module), method_name)


def _train_family(family: str, run_dir: Path, *overrides: str, kill_at_step: int | None = None):
    """Train ``family`` on the tiny target and data every test here uses; with ``kill_at_step``, its process 'dies'
    at that step's first micro-batch (test_medusa_train.Killed)."""
    from test_medusa_train import KilledAt, killable, tiny_datasets, tiny_target

    from selfspec.train.loop import train

    cfg, method = _family_cfg(family, run_dir, *overrides)
    if kill_at_step is None:
        method = method(cfg)
    elif family.startswith("medusa"):
        method = killable(KilledAt, cfg, kill_at_step, cfg.trainer.gradient_accumulation_steps)
    else:
        method = type("KilledAt", (KilledAt, method), {})(cfg, kill_at_step, cfg.trainer.gradient_accumulation_steps)
    n_eval = 7 if family.startswith("medusa") else 8
    return train(cfg, method, target=tiny_target(), datasets=tiny_datasets(n_eval=n_eval))


@pytest.fixture(scope="module")
def reference(one_process_run, rounding_noise):
    """``reference(family)``: (the one-process run of ``family``, its rounding noise), each trained once per module:
    the global batch as 4 x 2 micro-batches, then as 2 x 4 for the noise (as for Medusa-1 below)."""
    made = {"medusa": (one_process_run, rounding_noise)}

    def get(family: str) -> tuple[Path, float]:
        if family not in made:
            one = one_process_run.parent / f"one-{family}"
            _train_family(family, one, *STEPS, "trainer.batch_size=4")
            reordered = one_process_run.parent / f"one-{family}-reordered"
            steps = [s for s in STEPS if not s.startswith("trainer.gradient_accumulation_steps")]
            _train_family(family, reordered, *steps, "trainer.batch_size=2", "trainer.gradient_accumulation_steps=4")
            made[family] = (one, _rounding_noise(one, reordered))
        return made[family]

    return get


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, device):
    """The one-process reference run. Every test here needs it, so under ``--device cuda`` they are skipped here,
    before any training: they check CPU training over gloo, and two ranks on a GPU need a GPU each."""
    if device.type != "cpu":
        pytest.skip(f"--device {device}: these tests train two ranks on the CPU over gloo (on a GPU, each rank "
                    "would need a GPU of its own)")
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    run_dir = tmp_path_factory.mktemp("dist") / "one"
    cfg = medusa_cfg(run_dir, *STEPS, "trainer.batch_size=4")
    train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets(n_eval=7))
    return run_dir


@pytest.fixture(scope="module")
def rounding_noise(one_process_run):
    """The same global batch in one process as 2 x 4 micro-batches: the same maths, summed in another order."""
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    run_dir = one_process_run.parent / "one-reordered"
    steps = [s for s in STEPS if not s.startswith("trainer.gradient_accumulation_steps")]
    cfg = medusa_cfg(run_dir, *steps, "trainer.batch_size=2", "trainer.gradient_accumulation_steps=4")
    train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets(n_eval=7))
    return _rounding_noise(one_process_run, run_dir)


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]


def test_two_ddp_processes_train_the_same_heads_as_one(one_process_run, rounding_noise):
    """conf/accelerate/ddp.yaml (torchrun itself: the tests below)."""
    two = one_process_run.parent / "two"
    proc = _launch(two, _accelerate("ddp"), *STEPS, "trainer.batch_size=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes, DistributedType.MULTI_CPU, torch.distributed world size 2" in proc.stdout
    _compare(one_process_run, two, rounding_noise)
    # Every rank wrote its RNG state into the same checkpoint; only complete checkpoints are left.
    ckpt = two / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert not list((two / "checkpoints").glob(".tmp-*"))


def _accelerate(config: str, *args: str) -> list[str]:
    """``accelerate launch`` with conf/accelerate/<config>.yaml: two processes in float32 (the reference's)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "conf" / "accelerate" / f"{config}.yaml"), "--num_processes", "2", "--mixed_precision", "no",
            "--main_process_port", str(_free_port()), *args]


def _frozen_names(family: str, run_dir: Path) -> set[str]:
    """The names of the frozen parameters of ``family``'s training module (Medusa-2's: the target's own weights)."""
    from test_medusa_train import tiny_target

    cfg, method = _family_cfg(family, run_dir)
    module = method(cfg).build_module(tiny_target())
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def _checkpoint_weights(ckpt: Path) -> set[str]:
    """The names of the module weights a checkpoint holds: accelerate's (model*.safetensors), FSDP's
    (pytorch_model_fsdp*.bin) or DeepSpeed's (the module and the frozen parameters of */*model_states.pt)."""
    from safetensors.torch import load_file

    names = set()
    for file in ckpt.glob("model*.safetensors"):
        names |= set(load_file(str(file)))
    for file in ckpt.glob("pytorch_model_fsdp*.bin"):
        names |= set(torch.load(file, weights_only=True))
    for file in ckpt.glob("*/*model_states.pt"):
        state = torch.load(file, weights_only=False)
        names |= {k for k, v in (state.get("module") or {}).items() if torch.is_tensor(v) and v.numel() > 0}
        names |= set(state.get("frozen_param_fragments") or {})
    return names


def _check_resumed(run: Path, family: str, launched: Path, named: bool = True) -> None:
    """The run killed in step 3 and resumed ends with the heads of the run that was never stopped, and its
    checkpoints hold the drafter's trainable weights only (no weight of the frozen target). ``named``: the
    checkpoint names its weights (ZeRO-3's are flat partitions of the optimizer's, all of them trainable)."""
    a, b = _heads(launched / family), _heads(launched / f"{family}-killed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ckpt = launched / f"{family}-killed" / "checkpoints" / "step-00000004"
    held = _checkpoint_weights(ckpt)
    frozen = _frozen_names(family, run / "names")
    assert frozen or not family.startswith("medusa2")  # Medusa-2's module holds the whole target
    assert not held & frozen, sorted(held & frozen)[:5]
    assert held or not named


@pytest.mark.slow
def test_two_deepspeed_zero2_processes_train_the_same_heads_as_one(one_process_run, rounding_noise, reference):
    """ZeRO-2: Medusa-1, then Medusa-2 (LoRA inside the target), killed and resumed."""
    pytest.importorskip("deepspeed")
    two = one_process_run.parent / "zero2"
    proc = _launch(two, _accelerate("zero2"), *STEPS, "trainer.batch_size=2", "trainer.max_grad_norm=1.0",
                   env={"SELFSPEC_TEST_FAMILIES": "medusa,medusa2", "SELFSPEC_TEST_RESUME": "medusa2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DistributedType.DEEPSPEED, torch.distributed world size 2" in proc.stdout
    _compare(one_process_run, two / "medusa", rounding_noise)
    one2, noise2 = reference("medusa2")
    _compare(one2, two / "medusa2", noise2, "medusa2")
    _check_resumed(one_process_run.parent, "medusa2", two)
    # DeepSpeed's shared-memory all-reduce op (inference only) was not compiled at start-up.
    assert not list((two.parent / "torch-extensions").glob("*/deepspeed_shm_comm*"))


@pytest.mark.slow
@pytest.mark.parametrize("config, resumed", [("fsdp", "dflash"), ("zero3", "eagle3")])
def test_fsdp_and_zero3_train_the_same_heads_as_one_process(one_process_run, reference, config, resumed):
    """conf/accelerate/fsdp.yaml (torch's FSDP2 over gloo on CPU) and zero3.yaml: Medusa-1, EAGLE-3 and DFlash, one
    after another in one launch of two processes; one family is killed in step 3 and resumed."""
    if config == "zero3":
        pytest.importorskip("deepspeed")
    two = one_process_run.parent / config
    families = ("medusa", "eagle3", "dflash")
    proc = _launch(two, _accelerate(config), *STEPS, "trainer.batch_size=2",
                   env={"SELFSPEC_TEST_FAMILIES": ",".join(families), "SELFSPEC_TEST_RESUME": resumed})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kind = "FSDP" if config == "fsdp" else "DEEPSPEED"
    assert f"2 processes, DistributedType.{kind}, torch.distributed world size 2" in proc.stdout
    for family in families:
        one, noise = reference(family)
        _compare(one, two / family, noise, family)
    _check_resumed(one_process_run.parent, resumed, two, named=config != "zero3")


@pytest.mark.slow
def test_two_nodes_train_the_same_heads_as_one(one_process_run, rounding_noise):
    """conf/accelerate/multinode.yaml as two "machines" on this one: two launchers started together, machine ranks 0
    and 1, one process each, meeting at 127.0.0.1."""
    two = one_process_run.parent / "two-nodes"
    port = str(_free_port())
    node = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "conf" / "accelerate" / "multinode.yaml"), "--num_machines", "2", "--num_processes", "2",
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_launch, two, node + ["--machine_rank", str(rank)], *STEPS, "trainer.batch_size=2")
                for rank in (0, 1)]
        procs = [run.result() for run in runs]
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes, DistributedType.MULTI_CPU, torch.distributed world size 2" in procs[0].stdout
    _compare(one_process_run, two, rounding_noise)
    ckpt = two / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]


@pytest.fixture(scope="module")
def torchrun_launch(one_process_run):
    """One torchrun launch of two processes for the two tests below, one run after the other in the same ranks (as
    the families of the accelerate launches above): ``<root>/budget``, with a time budget (its probe after step 1,
    spent on rank 1's clock alone at step 2), then ``<root>/broken``, whose ranks skip the gradient all-reduce."""
    root = one_process_run.parent / "torchrun"
    return root, _launch(root, _torchrun(), *STEPS, "trainer.batch_size=2",
                         env={"SELFSPEC_TEST_BUDGET_THEN_BROKEN": "1"})


def test_ranks_with_a_time_budget_size_alike_and_stop_together(torchrun_launch):
    """trainer.max_minutes with two ranks: the main process sizes the run after step 2 and every rank takes its count
    (a 60-minute budget keeps the cap of 4); then the budget is spent on rank 1's clock alone at step 2, and both ranks
    stop there (were that not shared, rank 0 would wait at its next all-reduce for a rank that had left)."""
    root, proc = torchrun_launch
    run = root / "budget"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the cap trainer.max_steps=4 fits" in proc.stderr  # the broken run after it has no budget: says nothing
    assert "spent at step 2 of 4: training stops here" in proc.stderr
    assert (run / "heads" / "model.safetensors").exists()
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]


def test_a_broken_gradient_all_reduce_is_caught(one_process_run, rounding_noise, torchrun_launch):
    """The comparison has teeth: ranks that each step on their own gradients (no all-reduce) are told apart."""
    root, proc = torchrun_launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (root / "broken" / "heads" / "model.safetensors").exists()
    with pytest.raises(AssertionError, match=r"blocks\."):
        _compare(one_process_run, root / "broken", rounding_noise)


# --- launches this machine cannot run: refused in one line, before any process group starts -------------------------


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("case", ["no deepspeed", "more processes than GPUs", "fsdp1 without a GPU",
                                  "fp16 without a GPU"])
def test_a_launch_this_machine_cannot_run_is_refused(monkeypatch, case):
    from types import SimpleNamespace

    from selfspec.core.errors import SettingError
    from selfspec.train.accelerator import check_launch

    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION", "FSDP_VERSION",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    tc = SimpleNamespace(mixed_precision=None)
    if case == "no deepspeed":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed: find_spec gives None
        fix = "pip install deepspeed"
    elif case == "more processes than GPUs":  # zero3.yaml's num_processes: 8 on a machine of 2 GPUs
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        for key, value in (("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "8"), ("WORLD_SIZE", "8")):
            monkeypatch.setenv(key, value)
        fix = "--num_processes 2 "
    elif case == "fsdp1 without a GPU":
        _no_gpu(monkeypatch)
        for key, value in (("ACCELERATE_USE_FSDP", "true"), ("FSDP_VERSION", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(key, value)
        fix = "fsdp_version: 2"
    else:
        _no_gpu(monkeypatch)
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # the accelerate config's (trainer's null)
        fix = "trainer.mixed_precision=bf16"
    with pytest.raises(SettingError, match=re.escape(fix)) as err:
        check_launch(tc)
    assert "\n" not in str(err.value)


def test_processes_the_accelerator_does_not_hold_are_refused(monkeypatch):
    """torch.distributed launched 2 processes but the accelerator holds 1 (DistributedType.NO): each would train its
    own copy into one run folder. And a config's FSDP or DeepSpeed that the accelerator dropped."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from selfspec.core.errors import SettingError
    from selfspec.train.accelerator import check_processes

    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SettingError, match=r"WORLD_SIZE=2.*NO with 1 process"):
        check_processes(SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO))
    check_processes(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SettingError, match=r"asks for FSDP, but the accelerator runs MULTI_CPU"):
        check_processes(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))
    check_processes(SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP))


def test_a_deepspeed_config_without_deepspeed_ends_in_one_error_line(tmp_path, monkeypatch, capfd):
    """Through a training entry (train/medusa.py, run in this process as tests/test_cli_errors.py runs the console
    scripts): ``error: ...`` on one line with the fix, exit status 2, no traceback."""
    from test_cli_errors import run_in_process

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    proc = run_in_process("train/medusa.py", ["experiment=debug", f"run_dir={tmp_path / 'run'}"], tmp_path / "cwd",
                          monkeypatch, capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: The accelerate config asks for DeepSpeed") and "pip install deepspeed" in last
    assert "Traceback" not in proc.stderr


def _skip_gradient_all_reduce() -> None:
    """Every DDP model built from here on keeps each rank's own gradients (a comm hook that returns them as they are)."""
    from torch.nn.parallel import DistributedDataParallel

    def local_gradients(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    init = DistributedDataParallel.__init__

    def init_without_all_reduce(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, local_gradients)

    DistributedDataParallel.__init__ = init_without_all_reduce


@contextmanager
def _budget_spent_on_rank_1():
    """The time budget probed after step 1 (past a warm-up of 1), and spent from step 2 on rank 1's clock alone."""
    import selfspec.train.budget as budget

    kept = budget.WARMUP_STEPS, budget.PROBE_STEPS, budget.TimeBudget.spent
    budget.WARMUP_STEPS, budget.PROBE_STEPS = 1, 1
    if os.environ.get("RANK") == "1":
        calls = iter(range(1, 1000))
        budget.TimeBudget.spent = lambda self: next(calls) >= 2  # this rank's clock alone: spent from step 2 on
    try:
        yield
    finally:
        budget.WARMUP_STEPS, budget.PROBE_STEPS, budget.TimeBudget.spent = kept


def _worker(run_dir: str, *overrides: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT, exit=True)
    from accelerate import PartialState
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    def medusa(folder: Path, *more: str) -> None:
        cfg = medusa_cfg(folder, *overrides, *more)
        train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets(n_eval=7))

    families = os.environ.get("SELFSPEC_TEST_FAMILIES")
    if os.environ.get("SELFSPEC_TEST_BUDGET_THEN_BROKEN") == "1":  # torchrun_launch
        with _budget_spent_on_rank_1():
            medusa(Path(run_dir) / "budget", "trainer.max_minutes=60")
        _skip_gradient_all_reduce()
        medusa(Path(run_dir) / "broken")
    elif families is None:
        medusa(Path(run_dir))
    for family in (families or "").split(","):
        if family:
            _train_family(family, Path(run_dir) / family, *overrides)
    resumed = os.environ.get("SELFSPEC_TEST_RESUME")
    if resumed:
        from test_medusa_train import Killed

        killed = Path(run_dir) / f"{resumed}-killed"
        try:
            _train_family(resumed, killed, *overrides, kill_at_step=3)
            raise AssertionError("the run was not killed")
        except Killed:
            pass
        _train_family(resumed, killed, *overrides, "trainer.resume=true")
    state = PartialState()  # as the training loop's Accelerator set it up
    if state.is_main_process:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        print(f"{state.num_processes} processes, {state.distributed_type}, torch.distributed world size {world}",
              flush=True)
    state.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
