"""Heads folders: round trip, refusal of another target, clear errors for missing or corrupt folders, atomic writes,
and head types as the family table (core/families.py) names them: every family's heads round-trip through its row."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from selfspec import heads
from selfspec.core.families import FAMILIES
from selfspec.decode.families import DRAFTERS
from selfspec.heads.families import HEADS
from selfspec.heads.io import HeadsLoadError, save_heads
from selfspec.heads.medusa import MedusaConfig, MedusaHeads, build_medusa_heads
from selfspec.core.target import TargetMismatchError, build_tiny


def trained_heads(model, shared: bool = False, seed: int = 0) -> MedusaHeads:
    config = MedusaConfig(hidden_size=64, vocab_size=320, num_heads=3, num_layers=2, shared_lm_head=shared,
                          draft_vocab_size=None)
    module = MedusaHeads(config, model.get_output_embeddings())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # as if trained: blocks are no longer zero
    return module.to(model.device)  # drawn on the CPU (the same numbers on every device), used beside the target


@pytest.mark.parametrize("shared", [False, True])
def test_round_trip_gives_the_same_heads_and_records_the_target(tmp_path, tiny_llama, shared):
    model, _ = tiny_llama
    module = trained_heads(model, shared)
    path = save_heads(tmp_path / "heads", module, "medusa", module.config.to_dict(), model,
                      {"steps": 7, "eval": {"acc1": [0.5, 0.25, 0.1]}, "data": {"source": "sharegpt"}})
    config = json.loads((path / "config.json").read_text())
    assert config["head_type"] == "medusa" and config["num_heads"] == 3 and config["num_layers"] == 2
    assert config["hidden_size"] == 64 and config["vocab_size"] == 320
    assert config["steps"] == 7 and config["eval"]["acc1"] == [0.5, 0.25, 0.1]
    assert config["target_fingerprint"]["model_type"] == "llama" and config["adapter"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temporary folder left behind

    loaded = heads.load(path, model)
    assert loaded.target is model and loaded.adapter is None
    assert not any(p.requires_grad for p in loaded.module.parameters()) and not loaded.module.training
    hidden = torch.randn(2, 5, 64).to(model.device)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(hidden), module(hidden), rtol=0, atol=0)
    # A training run's folder stands for its heads/ folder (outputs/<run_name> for outputs/<run_name>/heads).
    from_run = heads.load(tmp_path, model)
    assert from_run.path == path
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in from_run.module.state_dict().items())
    # Without a target: same weights (a shared LM head is attached later).
    bare = heads.load(path)
    assert bare.target is None
    assert all(torch.equal(v, module.state_dict()[k].cpu()) for k, v in bare.module.state_dict().items())


def test_heads_of_another_target_are_refused(tmp_path, tiny_llama, tiny_qwen2):
    model, _ = tiny_llama
    module = trained_heads(model)
    save_heads(tmp_path / "heads", module, "medusa", module.config.to_dict(), model)
    with pytest.raises(TargetMismatchError, match="another target.*model_type"):
        heads.load(tmp_path / "heads", tiny_qwen2[0])
    other_weights, _ = build_tiny("llama", seed=5)  # same shapes, different model
    with pytest.raises(TargetMismatchError, match="embedding weights differ"):
        heads.load(tmp_path / "heads", other_weights)


def test_heads_of_another_revision_are_refused_at_decode_unless_forced(tmp_path, tiny_llama, capsys):
    """Heads trained on a fine-tune of the tiny target (embeddings 1e-3 apart, relative) record its digest: decoding
    on the target the heads name is refused in one line that names heads_check=shape, which takes them with a
    warning; the same target in bfloat16 is accepted."""
    import copy

    from conftest import compose
    from selfspec.decode.session import load_session

    model = tiny_llama[0]
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.get_input_embeddings().weight.mul_(1 + 1e-3)
    module = trained_heads(tuned)
    path = save_heads(tmp_path / "heads", module, "medusa", module.config.to_dict(), tuned)
    fp = json.loads((path / "config.json").read_text())["target_fingerprint"]
    assert {"embedding_rows", "embedding_dtype", "embedding_sha256", "revision", "config_sha256"} <= set(fp)
    with pytest.raises(TargetMismatchError, match="embedding weights differ.*heads_check=shape") as err:
        heads.load(path, model)
    assert "\n" not in str(err.value)
    base = [f"heads={path}", "max_new_tokens=4", "device=cpu", "draft.tree=chain-3"]
    with pytest.raises(TargetMismatchError, match="another revision"):
        load_session(compose("decode", base))
    capsys.readouterr()
    session = load_session(compose("decode", base + ["heads_check=shape"]))
    assert session.settings.heads_check == "shape" and session.heads is not None
    assert "warning: heads_check=shape" in capsys.readouterr().err
    mine = save_heads(tmp_path / "mine", module, "medusa", module.config.to_dict(), model)
    session = load_session(compose("decode", [f"heads={mine}", "device=cpu", "dtype=bfloat16", "draft.tree=chain-3"]))
    assert next(session.target.model.parameters()).dtype == torch.bfloat16  # the float32 target's heads, in bf16


def test_missing_and_corrupt_folders_fail_clearly(tmp_path, tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(HeadsLoadError, match="No heads folder"):
        heads.load(tmp_path / "nowhere", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsLoadError, match="has no config.json"):
        heads.load(tmp_path / "empty", model)

    module = trained_heads(model)
    good = save_heads(tmp_path / "heads", module, "medusa", module.config.to_dict(), model)
    weights = good / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # cut off, as by a failed copy
    with pytest.raises(HeadsLoadError, match="checksum.*corrupt"):
        heads.load(good, model)
    with pytest.raises(HeadsLoadError, match="cannot be read"):
        heads.load(good, model, verify_weights=False)
    weights.unlink()
    with pytest.raises(HeadsLoadError, match="no model.safetensors"):
        heads.load(good, model)
    (good / "config.json").write_text("{not json")
    with pytest.raises(HeadsLoadError, match="not valid JSON"):
        heads.load(good, model)


def test_weights_that_do_not_fit_the_config_fail_clearly(tmp_path, tiny_llama):
    model, _ = tiny_llama
    module = trained_heads(model)
    path = save_heads(tmp_path / "heads", module, "medusa", module.config.to_dict(), model)
    config = json.loads((path / "config.json").read_text())
    config["head_config"]["num_heads"] = 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsLoadError, match="does not fit a medusa module"):
        heads.load(path, model)


def test_saving_over_a_folder_replaces_it_and_a_failed_save_keeps_the_old_one(tmp_path, tiny_llama):
    model, _ = tiny_llama
    first, second = trained_heads(model, seed=1), trained_heads(model, seed=2)
    path = save_heads(tmp_path / "heads", first, "medusa", first.config.to_dict(), model, {"steps": 1})
    save_heads(path, second, "medusa", second.config.to_dict(), model, {"steps": 2})
    loaded = heads.load(path, model)
    assert loaded.config["steps"] == 2
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in loaded.module.state_dict().items())

    class Broken(nn.Module):
        def state_dict(self, *args, **kwargs):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_heads(path, Broken(), "medusa", second.config.to_dict(), model, {"steps": 3})
    assert heads.load(path, model).config["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]


class Exit(nn.Module):
    """The heads of a family added by a row of the table alone (test_a_new_row_is_all_heads_io_needs)."""

    def __init__(self, config, target_model):
        super().__init__()
        self.proj = nn.Linear(config["hidden_size"], config["hidden_size"])


def test_a_new_row_and_its_builder_are_all_heads_io_needs(tmp_path, tiny_llama, monkeypatch):
    from selfspec.core.families import FAMILIES, Family
    from selfspec.heads.families import HEADS

    model, _ = tiny_llama
    module = trained_heads(model)
    with pytest.raises(HeadsLoadError, match="Unknown head type 'nonsense'.*medusa"):
        save_heads(tmp_path / "x", module, "nonsense", {}, model)
    with pytest.raises(HeadsLoadError, match="Unknown head type 'vanilla'"):  # a family that trains nothing
        save_heads(tmp_path / "x", module, "vanilla", {}, model)

    monkeypatch.setitem(FAMILIES, "test-exit", Family("test-exit", "a test"))
    with pytest.raises(HeadsLoadError, match="Unknown head type 'test-exit'.*selfspec/heads/families.py"):
        save_heads(tmp_path / "x", module, "test-exit", {}, model)  # a row without a builder
    monkeypatch.setitem(HEADS, "test-exit", Exit)
    exit_head = Exit({"hidden_size": 64}, model).to(model.device)
    save_heads(tmp_path / "exit", exit_head, "test-exit", {"hidden_size": 64}, model)
    loaded = heads.load(tmp_path / "exit", model)
    assert isinstance(loaded.module, Exit) and loaded.config["head_type"] == "test-exit"
    assert torch.equal(loaded.module.proj.weight, exit_head.proj.weight)


def _untrained_heads(family, model) -> nn.Module:
    """Heads of ``family`` for ``model`` as the table builds them: its random heads, or a trained-like exit."""
    random_heads = DRAFTERS[family.name].random_heads
    if random_heads is not None:
        return random_heads(model, seed=1)
    from test_layerskip_train import trained_like_exit

    assert family.name == "layerskip", f"{family.name}: give it random_heads, or build its heads here"
    return trained_like_exit(model, 1, "adapter", 64)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n in HEADS])
def test_every_family_with_heads_round_trips_through_its_row(name, tmp_path, tiny_llama):
    """Heads of each family that has them are saved and rebuilt by selfspec.heads.io through the table's builder."""
    family = FAMILIES[name]
    model, _ = tiny_llama
    module = _untrained_heads(family, model)
    save_heads(tmp_path / name, module, name, module.config.to_dict(), model)
    loaded = heads.load(tmp_path / name, model)
    assert type(loaded.module) is type(module) and loaded.config["head_type"] == name
    assert type(loaded.module) is type(HEADS[name](loaded.config["head_config"], model))
    expected = module.state_dict()
    assert loaded.module.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.module.state_dict().items())


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_draft_logits_are_the_heads_logits_on_the_draft_vocabulary(tiny_llama, tmp_path, shared, mapped):
    """The drafter's projection (one batch through a shared head, each head otherwise) equals each head's own logits,
    restricted to the token map's rows when the heads have one; the map survives saving and loading."""
    from selfspec.decode.drafters import MedusaDrafter

    model, _ = tiny_llama
    module = trained_heads(model, shared=shared).eval()
    ids = torch.tensor([3, 9, 17, 40, 200, 301], device=model.device)
    if mapped:
        config = {**module.config.to_dict(), "draft_vocab_size": len(ids)}
        state = module.state_dict()
        module = build_medusa_heads(config, model).eval()
        module.load_state_dict({**state, "token_map": torch.zeros(len(ids), dtype=torch.long)})
        module.set_token_map(ids)
        save_heads(tmp_path / "mapped", module, "medusa", module.config.to_dict(), model)
        module = heads.load(tmp_path / "mapped", model).module.eval()
        assert torch.equal(module.token_map, ids)
    drafter = MedusaDrafter(module, tree="chain-3")
    hidden = torch.randn(64).to(model.device)
    with torch.no_grad():
        features = module.features(hidden)
        each = torch.stack([module.project(k, features[k]) for k in range(3)])
        if mapped:
            each = each[:, ids]
        for depth in (1, 2, 3):
            torch.testing.assert_close(drafter._logits(depth, features), each[:depth])
    with pytest.raises(ValueError, match="ascending"):
        module.set_token_map(ids.flip(0)) if mapped else build_medusa_heads(
            {**module.config.to_dict(), "draft_vocab_size": 2}, model).set_token_map(torch.tensor([5, 1]))
