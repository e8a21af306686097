"""Gradient accumulation does not change a step, in every family that normalises over the whole step.

A step's loss is the sum of its items' losses (label positions per head, trained positions per exit) divided by the
number of items in the whole step. A method returns, per micro-batch, its own items' sum divided by the step's count
(``num_items``, the sum of ``count_items`` over the step's micro-batches), so the micro-batches' losses, and their
gradients, add up to those of the whole batch: exactly in real arithmetic. In float32 the two differ only by the
order of the additions and the padding of the shorter micro-batch rows, which no loss reads; over the few hundred
items here that is a few float32 ulps of each sum (relative 1e-6), well inside the tolerance of 1e-5. A per-micro-batch
mean would be off by the ratio of the micro-batches' counts (here several percent).
"""

from __future__ import annotations

import pytest
import torch

FAMILIES = ["medusa", "medusa-kl-draft-vocab", "medusa2", "medusa2-kl", "layerskip", "eagle", "eagle3", "eagle3-ce",
            "eagle3-packed", "dflash", "dflash-ce"]


def _method(family: str, run_dir):
    """(config, method) of ``family`` on the tiny target's configs (no dropout: the two runs must see one model)."""
    if family.startswith("medusa"):
        from test_medusa_train import medusa_cfg

        from selfspec.train.medusa_method import medusa_method

        overrides = {
            "medusa": [],
            "medusa-kl-draft-vocab": ["heads.loss=kl", "heads.draft_vocab_size=64"],
            "medusa2": ["heads=medusa2", "heads.lora.dropout=0"],
            "medusa2-kl": ["heads=medusa2", "heads.lora.dropout=0", "heads.loss=kl", "heads.target_loss=kl"],
        }[family]
        cfg = medusa_cfg(run_dir, *overrides)
        return cfg, medusa_method(cfg)
    if family.startswith("eagle"):
        from test_eagle import eagle_cfg

        from selfspec.train.eagle_method import EagleMethod

        eagle3 = ["heads=eagle3", "heads.draft_vocab_size=64"]
        overrides = {"eagle": ["heads.unroll_steps=2"], "eagle3": eagle3,
                     "eagle3-ce": eagle3 + ["heads.loss.token_loss=ce"],
                     "eagle3-packed": eagle3 + ["trainer.packing=true", "trainer.pack_length=96"]}[family]
        cfg = eagle_cfg(run_dir, "heads.feature_noise=0", *overrides)
        return cfg, EagleMethod(cfg)
    if family.startswith("dflash"):
        from test_dflash_train import dflash_cfg

        from selfspec.train.dflash_method import DFlashMethod

        # more anchors than positions: every trained position is an anchor, so the split and the whole batch draft
        # the same blocks (anchors are otherwise drawn per micro-batch)
        overrides = ["heads.anchors_per_sequence=64"] + (["heads.loss.token_loss=ce"] if family == "dflash-ce" else [])
        cfg = dflash_cfg(run_dir, *overrides)
        return cfg, DFlashMethod(cfg)
    from test_layerskip_train import layerskip_cfg

    from selfspec.train.layerskip_method import LayerSkipMethod

    cfg = layerskip_cfg(run_dir)
    return cfg, LayerSkipMethod(cfg)


def _step(method, target, drafter, micro_batches: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the step's loss, the gradients) as the loop computes them: each micro-batch's loss with the step's count,
    backward per micro-batch, gradients summed."""
    num_items = sum(method.count_items(batch) for batch in micro_batches)
    drafter.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for batch in micro_batches:
        loss, _ = method.compute_loss(batch, target, drafter, num_items=num_items)
        loss.backward()
        total += loss.detach().double().cpu()
    return total, {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_micro_batches_give_the_loss_and_gradients_of_one_batch(tmp_path, family):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.data import collate, collate_packed

    target, datasets = tiny_target(), tiny_datasets()
    cfg, method = _method(family, tmp_path)
    method.prepare_data(datasets, target, None, None)  # the draft vocabulary, where the config asks for one
    drafter = method.build_module(target)
    drafter.train()
    examples = [datasets["train"][i] for i in range(4)]

    def batch(rows):
        pad = target.tokenizer.pad_token_id
        if cfg.trainer.packing:
            collated = collate_packed(rows, pad, capacity=cfg.trainer.pack_length)
        else:
            collated = collate(rows, pad)
        return {k: v.to(target.model.device) for k, v in collated.items()}

    whole_loss, whole_grads = _step(method, target, drafter, [batch(examples)])
    split_loss, split_grads = _step(method, target, drafter, [batch(examples[:2]), batch(examples[2:])])

    assert method.count_items(batch(examples[:2])).sum() != method.count_items(batch(examples[2:])).sum()
    assert float(split_loss) == pytest.approx(float(whole_loss), rel=1e-5)
    assert whole_grads.keys() == split_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        scale = float(grad.abs().max()) or 1.0
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("family", ["medusa", "layerskip", "eagle3", "dflash"])
def test_a_step_logs_the_same_loss_with_or_without_accumulation(tmp_path, family):
    """Through the loop: one step of batch 4 and one step of two micro-batches of 2 (the same 4 examples, in the same
    order) log the same loss."""
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.loop import train

    losses = {}
    for batch_size, accum in ((4, 1), (2, 2)):
        run_dir = tmp_path / f"b{batch_size}x{accum}"
        cfg, method = _method(family, run_dir)
        cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.trainer.gradient_accumulation_steps = 1, batch_size, accum
        result = train(cfg, method, target=tiny_target(), datasets=tiny_datasets())
        losses[accum] = result.history[0]["loss"]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
