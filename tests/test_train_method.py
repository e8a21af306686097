"""train/method.py: a method that writes only the required members of TrainMethod trains through the shared loop,
every optional capability has the default the loop relies on, and each declared capability is what the loop uses; a
method that does not count its items (the step's normaliser) is refused; every family of the table (core/families.py)
that trains composes its entry config, builds its method and saves through the one save path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfspec.core.families import FAMILIES
from selfspec.train.families import METHODS
from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target
from selfspec.train.loop import train
from selfspec.train.method import TrainMethod

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class NextToken(TrainMethod):
    """The smallest family: a linear head on the target's last hidden states predicting the next token."""

    name = "next-token"

    def build_module(self, target) -> nn.Module:
        model = target.model
        return nn.Linear(model.config.hidden_size, model.config.vocab_size).to(model.device)

    def _logits(self, batch, target, drafter):
        with torch.no_grad():
            hidden = target.model.get_decoder()(input_ids=batch["input_ids"],
                                                attention_mask=batch["attention_mask"]).last_hidden_state
        return drafter(hidden.float())[:, :-1]  # [B, T-1, V]: position t predicts token t + 1

    def count_items(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()

    def compute_loss(self, batch, target, drafter, num_items):
        logits = self._logits(batch, target, drafter)  # [B, T-1, V]
        loss_sum = F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="sum")
        return loss_sum / num_items, {}

    def evaluate(self, loader, target, drafter, accelerator) -> dict[str, float]:
        return {"eval/batches": float(sum(1 for _ in loader))}

    def save(self, path: Path, drafter, target, meta, state_dict=None) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state_dict if state_dict is not None else drafter.state_dict(), path / "head.pt")
        return path


def test_the_optional_capabilities_have_declared_defaults():
    method, drafter = NextToken(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    drafter[0].requires_grad_(False)
    assert method.trains_target is False and method.supports_packing is False
    [group] = method.param_groups(drafter, lr=1e-3)
    assert [id(p) for p in group["params"]] == [id(p) for p in drafter[1].parameters()]
    collate = object()
    assert method.prepare_data({"train": [1], "eval": None}, None, None, collate) == ([1], None, collate)


def test_a_method_with_only_the_required_members_trains(tmp_path):
    cfg = medusa_cfg(tmp_path / "run", "trainer.max_steps=6", "trainer.gradient_accumulation_steps=2")
    data = tiny_datasets()
    target = tiny_target()
    frozen = {k: v.clone() for k, v in target.model.state_dict().items()}
    result = train(cfg, NextToken(), target=target, datasets=data)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert result.eval_metrics == {"eval/batches": 2.0}
    assert (result.heads_dir / "head.pt").is_file()
    assert all(torch.equal(v, frozen[k]) for k, v in target.model.state_dict().items())


def test_packing_is_refused_for_a_method_that_does_not_declare_it(tmp_path):
    from selfspec.core.errors import SettingError

    cfg = medusa_cfg(tmp_path / "run", "trainer.packing=true")
    with pytest.raises(SettingError, match=r"not supported by next-token training: set trainer.packing=false"):
        train(cfg, NextToken(), target=tiny_target(), datasets=tiny_datasets())


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.trains])
def test_every_trainable_family_composes_its_entry_config_and_instantiates_its_method(name, tmp_path, monkeypatch,
                                                                                        capsys):
    """Each family of the table that trains: its entry config composes with its heads option, as ``selfspec-train
    NAME`` composes it, and its method is built from it."""
    import yaml
    from hydra.core.global_hydra import GlobalHydra

    from conftest import compose
    from selfspec.train.cli import main

    family = FAMILIES[name]
    cfg = compose(family.train_conf, family.train_overrides() + ["experiment=debug", f"run_dir={tmp_path}"])
    method = METHODS[name](cfg)
    assert isinstance(method, TrainMethod) and method.name == name
    monkeypatch.setattr(sys, "argv", ["selfspec-train", name, "experiment=debug", "--cfg", "job", "--resolve"])
    try:
        main()
    finally:
        GlobalHydra.instance().clear()
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["task"] == name and shown["run_name"] == f"{name}-debug"


def test_a_method_that_does_not_count_its_items_cannot_be_built():
    """count_items is required: without it a step has no normaliser, so the class cannot be instantiated."""

    class Uncounted(NextToken):
        count_items = TrainMethod.count_items  # the abstract declaration, not overridden

    with pytest.raises(TypeError, match="count_items"):
        Uncounted()


def test_the_loop_refuses_a_count_that_is_not_a_tensor(tmp_path):
    class CountsNothing(NextToken):
        def count_items(self, batch):
            return None

    cfg = medusa_cfg(tmp_path / "run", "trainer.max_steps=1")
    with pytest.raises(TypeError, match=r"CountsNothing.count_items returned None, not a tensor"):
        train(cfg, CountsNothing(), target=tiny_target(), datasets=tiny_datasets())


SAVED_BY_EVERY_FAMILY = {  # selfspec.heads.io.save_heads' own keys, the loop's meta, and what save_run_heads adds
    "format_version", "head_type", "base_model", "target_fingerprint", "hidden_size", "vocab_size", "num_heads",
    "num_layers", "head_config", "adapter", "weights_sha256", "run_name", "method", "steps", "tokens_seen", "data",
    "trainer", "eval", "features"}


@pytest.mark.parametrize("family, module, settings_key, decode_key", [
    ("medusa", "selfspec.train.medusa_method", "heads", None), ("medusa2", "selfspec.train.medusa_method", "heads", None),
    ("eagle", "selfspec.train.eagle_method", "heads", "tree"), ("eagle3", "selfspec.train.eagle_method", "heads", "tree"),
    ("dflash", "selfspec.train.dflash_method", "heads", None), ("layerskip", "selfspec.train.layerskip_method", "exit", "decode")])
def test_every_family_saves_through_save_drafter(tmp_path, monkeypatch, family, module, settings_key, decode_key):
    """Each family's save hands its heads to selfspec.train.method.save_run_heads (one call, two for layer-skip's two exits),
    and the heads folder's config.json carries the common keys, the settings and the decode settings under the key
    decoding reads them from; it loads back with the target."""
    import importlib
    import json

    from selfspec import heads
    from test_accumulation import _method
    from selfspec.train import method as method_module

    calls = []

    def spy(path, *args, **kwargs):
        calls.append(Path(path))
        return method_module.save_run_heads(path, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module(module), "save_run_heads", spy)
    cfg, method = _method(family, tmp_path / "run")
    cfg.trainer.max_steps = 1
    if family == "layerskip":
        cfg.exit.candidates = [1, 2]
    target = tiny_target()
    result = train(cfg, method, target=target, datasets=tiny_datasets())
    assert result.heads_dir in calls and len(calls) == (2 if family == "layerskip" else 1)
    saved = json.loads((result.heads_dir / "config.json").read_text())
    assert SAVED_BY_EVERY_FAMILY <= saved.keys()
    assert saved[settings_key] == dict(method.settings.__dict__) and saved["features"] == "online"
    assert saved["head_type"] == {"medusa2": "medusa"}.get(family, family) and saved["steps"] == 1
    assert (decode_key in saved) == (decode_key is not None)
    assert (saved["adapter"] == "adapter") == (family == "medusa2")  # Medusa-2's LoRA, beside the heads
    if family == "layerskip":
        assert saved["decode"]["threshold"] == saved["exit_layers"][0]["threshold"]
    assert heads.load(result.heads_dir, target=tiny_target()).module is not None
