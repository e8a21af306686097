"""Shared fixtures: tiny random targets with fixed init (Llama and a non-Llama architecture), and composed configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


@pytest.fixture(autouse=True)
def _seed_and_cache(tmp_path_factory, monkeypatch):
    torch.manual_seed(0)
    # Tokenized-dataset caches of tests go to a temporary folder; the converted SmolLM2 stays in the user cache.
    monkeypatch.setenv("SELFSPEC_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")


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
    from heads.target import build_tiny

    return build_tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from heads.target import build_tiny

    return build_tiny("qwen2")


@pytest.fixture(scope="session")
def smollm2():
    from heads.target import load_target

    return load_target({"source": "smollm2", "device": "cpu", "dtype": "float32"})


DECODE_CONFIGS = ("decode", "export")  # in conf/decode/, the config folder of decoding and export


def compose(config_name: str, overrides: list[str] | None = None):
    """Compose a real entry config (from conf/, or conf/decode/ for decoding and export, as the entry scripts do),
    with overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = CONF / "decode" if config_name in DECODE_CONFIGS else CONF
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])
