"""A store-fed trainer holds only what the drafter reads of the target (core/target_parts.py): the tensors it keeps
are the whole target's, bit for bit; its decoder layers stay on the meta device; it trains the heads the whole target
trains; and its peak memory does not grow with the target's depth (scripts/store_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfspec.core.layers import decoder_of
from selfspec.core.target import build_tiny, fingerprint, load_target
from selfspec.core.target_parts import drop_rest, load_rest, load_target_parts

REPO = Path(__file__).resolve().parents[1]


def saved_tiny(folder: Path, shard: str = "5GB", **tiny) -> Path:
    """A tiny random target saved as a Hugging Face checkpoint (safetensors, in shards of ``shard``)."""
    model, tokenizer = build_tiny(**tiny)
    model.save_pretrained(folder, max_shard_size=shard)
    tokenizer.save_pretrained(folder)
    return folder


def assert_the_whole_targets_parts(parts, whole, layers=()) -> None:
    """``parts`` holds exactly the whole target's embeddings, final norm, LM head and decoder ``layers`` (same values,
    dtype, device), everything else on the meta device; its buffers and fingerprint are the whole target's."""
    mine = dict(parts.model.named_parameters(remove_duplicate=False))
    theirs = dict(whole.model.named_parameters(remove_duplicate=False))
    assert mine.keys() == theirs.keys()
    held = {n for n, p in mine.items() if not p.is_meta}
    assert held == set(parts.parts.kept)
    base = decoder_of(parts.model)
    in_layers = {f"{n.split('.layers.')[0]}.layers.{n.split('.layers.')[1].split('.')[0]}" for n in held
                 if ".layers." in n}
    assert len(in_layers) == len(layers)
    assert all(not p.is_meta for i in layers for p in base.layers[i].parameters())
    assert any(".embed_tokens." in n for n in held) and any(n.startswith("lm_head") for n in held)
    for name in held:
        a, b = mine[name], theirs[name]
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name
        assert not a.requires_grad
    buffers = dict(whole.model.named_buffers())
    for name, buf in parts.model.named_buffers():
        assert buf.dtype == buffers[name].dtype and torch.equal(buf, buffers[name]), name
    assert fingerprint(parts.model) == fingerprint(whole.model)
    assert parts.name == whole.name and parts.tokenizer("a b").input_ids == whole.tokenizer("a b").input_ids


@pytest.mark.parametrize("case", ["tiny", "folder", "sharded-bfloat16", "tied", "gemma3"])
def test_the_parts_are_the_whole_targets_tensors_and_nothing_else(tmp_path, case):
    tiny = {"arch": "gemma3" if case == "gemma3" else "llama", "tie_word_embeddings": case in ("tied", "gemma3")}
    if case == "tiny":
        cfg = {"source": "tiny", "dtype": "float32", "device": "cpu", "tiny": tiny}
    else:
        folder = saved_tiny(tmp_path / "target", shard="40KB" if case.startswith("sharded") else "5GB", **tiny)
        if case.startswith("sharded"):
            assert (folder / "model.safetensors.index.json").is_file()
        cfg = {"source": "hub", "name_or_path": str(folder), "device": "cpu",
               "dtype": "bfloat16" if case.endswith("bfloat16") else "float32"}
    whole = load_target(cfg)
    parts = load_target_parts(cfg, layers=[-1] if case == "folder" else [])
    assert_the_whole_targets_parts(parts, whole, layers=[3] if case == "folder" else [])
    if tiny["tie_word_embeddings"]:
        assert parts.model.get_output_embeddings().weight is parts.model.get_input_embeddings().weight
    assert all(p.is_meta for p in decoder_of(parts.model).layers[0].parameters())
    ids = torch.randint(3, 250, (1, 12))
    load_rest(parts)  # the whole model, in place (a store being built): the whole target's logits
    assert not any(p.is_meta for p in parts.model.parameters())
    with torch.no_grad():
        assert torch.equal(parts.model(ids).logits, whole.model(ids).logits)
    drop_rest(parts)
    assert_the_whole_targets_parts(parts, whole, layers=[3] if case == "folder" else [])


def test_a_folder_s_parts_read_no_layer_tensor(tmp_path, monkeypatch):
    """From a safetensors checkpoint, only the kept tensors are read (safe_open, one tensor at a time)."""
    import safetensors

    folder = saved_tiny(tmp_path / "target", shard="40KB")
    read = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    parts = load_target_parts({"source": "hub", "name_or_path": str(folder), "device": "cpu", "dtype": "float32"})
    assert sorted(read) == sorted(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"])
    assert parts.parts.describe(parts.model).startswith("embeddings, final norm, LM head: ")


def store_cfg(family: str, run_dir: Path, store: Path, *overrides: str):
    from conftest import compose

    from selfspec.core.families import FAMILIES

    chosen = FAMILIES[family]
    base = ["experiment=debug", f"run_dir={run_dir}", "trainer.max_steps=2", "trainer.batch_size=4",
            "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
            "features=store", f"feature_store.dir={store}", "feature_store.dtype=float32",
            "trainer.target_dtype=float32"]  # auto is bfloat16 where a CPU multiplies it natively; the parts are
    # compared with the whole target as load_target gives it (the model config's float32) on every machine
    return compose(chosen.train_conf, chosen.train_overrides() + base + list(overrides)), chosen


def heads_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "heads" / "model.safetensors"))


@pytest.mark.parametrize("family,overrides,layers", [
    ("eagle3", ["heads.draft_vocab_size=64"], []),
    ("dflash", ["heads.init_from_layer=-1"], [3]),  # the layer the drafter starts from is held too
    ("medusa", [], []),
    ("eagle3-build", ["heads.draft_vocab_size=64"], []),  # no store yet: built with the whole target, then parts
])
def test_a_store_fed_run_holds_the_parts_and_trains_the_heads_the_whole_target_trains(tmp_path, monkeypatch, capsys,
                                                                                       family, overrides, layers):
    from test_medusa_train import tiny_datasets

    import selfspec.train.loop as loop
    from selfspec.train.families import METHODS
    from selfspec.train.loop import train

    building = family.endswith("-build")
    family = family.removesuffix("-build")
    data = tiny_datasets()
    cfg, chosen = store_cfg(family, tmp_path / "whole", tmp_path / "store", *overrides)
    whole = train(cfg, METHODS[family](cfg), target=load_target(cfg.model), datasets=data)  # builds the store
    assert whole.whole_target
    held = []
    real = loop.load_target_parts
    monkeypatch.setattr(loop, "load_target_parts", lambda *a, **k: held.append(real(*a, **k)) or held[-1])
    store = tmp_path / ("new-store" if building else "store")
    cfg, chosen = store_cfg(family, tmp_path / "parts", store, *overrides)
    capsys.readouterr()
    parts = train(cfg, METHODS[family](cfg), datasets=data)
    err = capsys.readouterr().err
    assert not parts.whole_target and len(held) == 1
    assert "features=store: the trainer holds the target's embeddings, final norm, LM head" in err
    assert ("building it runs the whole target" in err) == building and ("(reused)" in err) != building
    assert_the_whole_targets_parts(held[0], load_target(cfg.model), layers=layers)  # the rest dropped after a build
    a, b = heads_weights(tmp_path / "whole"), heads_weights(tmp_path / "parts")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert parts.eval_metrics == whole.eval_metrics
    config = json.loads((tmp_path / "parts" / "heads" / "config.json").read_text())
    assert config["target_fingerprint"] == json.loads((tmp_path / "whole" / "heads" / "config.json").read_text())[
        "target_fingerprint"]


def test_online_training_medusa2_and_layer_skip_keep_the_whole_target(tmp_path):
    from conftest import compose

    from selfspec.core.families import FAMILIES
    from selfspec.train.families import METHODS

    def method(family, *overrides):
        chosen = FAMILIES[family]
        cfg = compose(chosen.train_conf, chosen.train_overrides() + ["experiment=debug", f"run_dir={tmp_path}",
                                                                      *overrides])
        return METHODS[family](cfg)

    for family in ("eagle", "eagle3", "dflash", "medusa", "layerskip"):
        assert method(family).store_target_layers() is None, family  # online
    assert method("medusa", "heads=medusa2").store_target_layers() is None  # it trains the target (and needs online)
    assert method("eagle3", "features=store").store_target_layers() == []
    assert method("eagle", "features=store", "heads.init_layer_from=1").store_target_layers() == [1]
    assert method("dflash", "features=store", "heads.init_from_layer=-1").store_target_layers() == [-1]
    assert method("medusa", "features=store").store_target_layers() == []
    assert method("layerskip", "features=store").store_target_layers() is None


def test_the_speed_check_is_left_out_after_a_run_that_held_parts(tmp_path, capsys):
    from omegaconf import OmegaConf

    from selfspec.train.speed_check import after_training

    cfg = OmegaConf.create({"speed_check": {"prompts": 2, "max_new_tokens": 8}})
    after_training(cfg, tmp_path / "heads", whole_target=False)  # no heads there: nothing is loaded
    err = capsys.readouterr().err
    assert "quick speed check skipped" in err and f"selfspec-decode heads={tmp_path / 'heads'}" in err


@pytest.mark.slow
@pytest.mark.memory
def test_store_fed_peak_memory_does_not_grow_with_the_layers(tmp_path):
    """EAGLE-3 and DFlash from a store, each in a fresh process: the 32-layer target's run peaks within 10% of the
    4-layer one's, although its decoder layers alone weigh more than either run's peak.

    A measurement (minutes: five processes at a Llama-3-8B-like shape), so opt-in: ``pytest -m memory`` runs it, the
    default run leaves it out (tests/conftest.py). What keeps the peak flat is checked by the tests above in every run:
    a store-fed trainer holds the embeddings, final norm and LM head (and any layer its drafter starts from) and
    nothing else, every decoder layer on the meta device, and drops the rest after building a store."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "store_memory.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    four, deep = report["runs"]["4"], report["runs"]["32"]
    for family in ("eagle3", "dflash"):
        a, b = four[family]["peak_rss_bytes"], deep[family]["peak_rss_bytes"]
        assert abs(b - a) <= 0.10 * a, (family, a, b)
        assert deep["layers_bytes"] - four["layers_bytes"] > 1.0 * a, (family, a, deep["layers_bytes"])
    assert "| 32 |" in proc.stdout
