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

Run as a script by torchrun, this file is the worker: ``test_distributed.py <run_dir> <launcher> [overrides...]``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
    from safetensors.torch import load_file

    return load_file(str(run_dir / "heads" / "model.safetensors"))


def _rounding_noise(one: Path, reordered: Path) -> float:
    """The largest difference between two one-process runs that differ only in summation order, floored at a few
    float32 ulps of the largest weight (two orders that happen to round alike would otherwise give 0)."""
    a, b = _heads(one), _heads(reordered)
    noise = max(float((a[k] - b[k]).abs().max()) for k in a)
    return max(noise, 4 * FLOAT32_EPS * max(float(a[k].abs().max()) for k in a))


def _compare(one: Path, two: Path, noise: float) -> None:
    import json

    a, b = _heads(one), _heads(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=NOISE_MULTIPLE * noise, msg=k)
    assert any(a[k].abs().sum() > 0 for k in a if k.startswith("blocks."))  # they did train
    eval_a = json.loads((one / "heads" / "config.json").read_text())["eval"]
    eval_b = json.loads((two / "heads" / "config.json").read_text())["eval"]
    assert eval_a["positions"] == eval_b["positions"] > 0
    for key in ("acc1", "acc5", "loss"):
        torch.testing.assert_close(torch.tensor(eval_a[key]), torch.tensor(eval_b[key]), rtol=1e-4, atol=1e-5)


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
    two = one_process_run.parent / "two"
    proc = _launch(two, _torchrun(), *STEPS, "trainer.batch_size=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes" in proc.stdout
    _compare(one_process_run, two, rounding_noise)
    # Every rank wrote its RNG state into the same checkpoint; only complete checkpoints are left.
    ckpt = two / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in ckpt.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert not list((two / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_two_deepspeed_zero2_processes_train_the_same_heads_as_one(one_process_run, rounding_noise):
    pytest.importorskip("deepspeed")
    two = one_process_run.parent / "zero2"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO / "conf" / "accelerate" / "zero2.yaml"), "--num_processes", "2", "--mixed_precision", "no",
                "--main_process_port", str(_free_port())]
    proc = _launch(two, launcher, *STEPS, "trainer.batch_size=2", "trainer.max_grad_norm=1.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DEEPSPEED" in proc.stdout
    _compare(one_process_run, two, rounding_noise)
    # DeepSpeed's shared-memory all-reduce op (inference only) was not compiled at start-up.
    assert not list((two.parent / "torch-extensions").glob("*/deepspeed_shm_comm*"))


def test_ranks_with_a_time_budget_size_alike_and_stop_together(one_process_run):
    """trainer.max_minutes with two ranks: the main process sizes the run after step 2 and every rank takes its count
    (a 60-minute budget keeps the cap of 4); then the budget is spent on rank 1's clock alone at step 2, and both ranks
    stop there (were that not shared, rank 0 would wait at its next all-reduce for a rank that had left)."""
    run = one_process_run.parent / "budget"
    proc = _launch(run, _torchrun(), *STEPS, "trainer.batch_size=2", "trainer.max_minutes=60",
                   env={"SELFSPEC_TEST_PROBE_STEPS": "1", "SELFSPEC_TEST_SPENT_ON_RANK": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the cap trainer.max_steps=4 fits" in proc.stderr
    assert "spent at step 2 of 4: training stops here" in proc.stderr
    assert (run / "heads" / "model.safetensors").exists()
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]


def test_a_broken_gradient_all_reduce_is_caught(one_process_run, rounding_noise):
    """The comparison has teeth: ranks that each step on their own gradients (no all-reduce) are told apart."""
    broken = one_process_run.parent / "broken"
    proc = _launch(broken, _torchrun(), *STEPS, "trainer.batch_size=2", env={"SELFSPEC_TEST_SKIP_ALLREDUCE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with pytest.raises(AssertionError, match=r"blocks\."):
        _compare(one_process_run, broken, rounding_noise)


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


def _worker(run_dir: str, *overrides: str) -> None:
    import faulthandler

    if os.environ.get("SELFSPEC_TEST_SKIP_ALLREDUCE") == "1":
        _skip_gradient_all_reduce()

    if os.environ.get("SELFSPEC_TEST_PROBE_STEPS"):
        import selfspec.train.budget

        selfspec.train.budget.WARMUP_STEPS, selfspec.train.budget.PROBE_STEPS = 1, int(os.environ["SELFSPEC_TEST_PROBE_STEPS"])
    if os.environ.get("SELFSPEC_TEST_SPENT_ON_RANK") == os.environ.get("RANK"):
        from selfspec.train.budget import TimeBudget

        calls = iter(range(1, 1000))
        TimeBudget.spent = lambda self: next(calls) >= 2  # this rank's clock alone: spent from step 2 on

    faulthandler.dump_traceback_later(WORKER_TIMEOUT, exit=True)
    from accelerate import PartialState
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    cfg = medusa_cfg(Path(run_dir), *overrides)
    train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets(n_eval=7))
    state = PartialState()  # as the training loop's Accelerator set it up
    if state.is_main_process:
        print(f"{state.num_processes} processes, {state.distributed_type}", flush=True)
    state.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
