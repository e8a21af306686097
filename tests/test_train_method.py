"""train/method.py: a method that writes only the required members of TrainMethod trains through the shared loop,
every optional capability has the default the loop relies on, and each declared capability is what the loop uses; a
method that does not count its items (the step's normaliser) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
    from core.errors import SettingError

    cfg = medusa_cfg(tmp_path / "run", "trainer.packing=true")
    with pytest.raises(SettingError, match=r"not supported by next-token training: set trainer.packing=false"):
        train(cfg, NextToken(), target=tiny_target(), datasets=tiny_datasets())


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
