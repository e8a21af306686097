"""train/method.py: a method that writes only the required members of TrainMethod trains through the shared loop,
every optional capability has the default the loop relies on, and each declared capability is what the loop uses;
every family of the table (core/families.py) that trains composes its entry config and builds its method."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.families import FAMILIES
from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target
from train.loop import train
from train.method import TrainMethod

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class NextToken(TrainMethod):
    """The smallest family: a linear head on the target's last hidden states predicting the next token."""

    name = "next-token"

    def build_drafter(self, target) -> nn.Module:
        model = target.model
        return nn.Linear(model.config.hidden_size, model.config.vocab_size).to(model.device)

    def _logits(self, batch, target, drafter):
        with torch.no_grad():
            hidden = target.model.get_decoder()(input_ids=batch["input_ids"],
                                                attention_mask=batch["attention_mask"]).last_hidden_state
        return drafter(hidden.float())[:, :-1]  # [B, T-1, V]: position t predicts token t + 1

    def compute_loss(self, batch, target, drafter, num_items=None):
        logits = self._logits(batch, target, drafter)
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100), {}

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
    assert method.count_items({"labels": torch.zeros(2, 3)}) is None
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
    from core.errors import SettingError

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
    from train.cli import main

    family = FAMILIES[name]
    cfg = compose(family.train_conf, family.train_overrides() + ["experiment=debug", f"run_dir={tmp_path}"])
    method = family.load("method")(cfg)
    assert isinstance(method, TrainMethod) and method.name == name
    monkeypatch.setattr(sys, "argv", ["selfspec-train", name, "experiment=debug", "--cfg", "job", "--resolve"])
    try:
        main()
    finally:
        GlobalHydra.instance().clear()
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["task"] == name and shown["run_name"] == f"{name}-debug"
