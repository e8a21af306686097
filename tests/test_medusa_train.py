"""Medusa training through the shared loop, on the tiny random Llama and a small in-memory dataset.

Invariants: the loss falls; the heads change and the frozen target does not (bit for bit); a run killed mid-way and
resumed ends with exactly the parameters of an uninterrupted run; the offline feature store trains the same heads as
online hidden states; Medusa-2's adapter is saved, reloaded and applied; bad input stops with a clear message and the
last good checkpoint intact; every config option composes and instantiates.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import experiments_for

from selfspec.heads.medusa import (
    expected_accept_length,
    medusa_head_losses,
    medusa_positions,
    medusa_targets,
    weighted_head_loss,
)
from selfspec.core.target import Target, build_tiny
from selfspec.train.checkpoint import list_checkpoints
from selfspec.train.config import TrainerConfig
from selfspec.train.loaders import EmptyDatasetError, EpochSampler
from selfspec.train.loop import NonFiniteLossError, RunExistsError, train
from selfspec.train.medusa_method import METHODS, medusa_method

CONF = Path(__file__).resolve().parents[1] / "conf"


# --- helpers ------------------------------------------------------------------------------------------------------


def tiny_target(seed: int = 0) -> Target:
    """A fresh tiny Llama target (fresh because Medusa-2 injects LoRA layers into it)."""
    model, tokenizer = build_tiny("llama", seed=seed)
    return Target(model=model, tokenizer=tokenizer, name="tiny-llama")


def tiny_datasets(n_train: int = 24, n_eval: int = 8, seed: int = 0):
    """Arithmetic sequences over byte tokens (3..258): a prompt without labels, then a labelled answer; lengths vary
    so batches are padded. Learnable: the next tokens follow from the last ones."""
    import datasets

    gen = torch.Generator().manual_seed(seed)

    def example():
        length = int(torch.randint(20, 41, (1,), generator=gen))
        start, stride = (int(v) for v in torch.randint(0, 256, (2,), generator=gen))
        ids = [3 + (start + stride * t) % 256 for t in range(length)]
        prompt = int(torch.randint(4, 10, (1,), generator=gen))
        return ids, [-100] * prompt + ids[prompt:]

    def split(n):
        rows = [example() for _ in range(n)]
        return datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})

    return datasets.DatasetDict({"train": split(n_train), "eval": split(n_eval)})


def medusa_cfg(run_dir: Path, *overrides: str):
    from conftest import compose

    base = ["experiment=debug", f"run_dir={run_dir}", "trainer.max_steps=8", "trainer.batch_size=4",
            "trainer.learning_rate=1e-2", "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.log_every=1"]
    return compose("medusa", base + list(overrides))


def heads_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "heads" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, exact: bool = True, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


class Killed(Exception):
    pass


class KilledAt:
    """Mixed into a method (see :func:`killable`): its process 'dies' at the first micro-batch of a given step
    (nothing after it runs)."""

    def __init__(self, cfg, kill_at_step: int, accum: int):
        super().__init__(cfg)
        self.calls, self.kill_call = 0, (kill_at_step - 1) * accum + 1

    def compute_loss(self, batch, target, drafter, num_items):
        self.calls += 1
        if self.calls == self.kill_call:
            raise Killed
        return super().compute_loss(batch, target, drafter, num_items)


class NanAt(KilledAt):
    """Its loss is NaN at the first micro-batch of a given step; ``before`` holds the drafter's parameters as they
    were then."""

    def compute_loss(self, batch, target, drafter, num_items):
        if self.calls + 1 == self.kill_call:
            self.calls += 1
            self.before = {k: v.detach().clone() for k, v in drafter.named_parameters()}
            self.drafter = drafter
            loss, metrics = super(KilledAt, self).compute_loss(batch, target, drafter, num_items)
            return loss * float("nan"), metrics
        return super().compute_loss(batch, target, drafter, num_items)


def killable(kind: type, cfg, kill_at_step: int, accum: int):
    """``kind`` (KilledAt or NanAt) mixed into the Medusa method that ``cfg``'s heads.type names."""
    return type(kind.__name__, (kind, METHODS[cfg.heads.type]), {})(cfg, kill_at_step, accum)


# --- pure functions -----------------------------------------------------------------------------------------------


def _shift_left(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t + shift] (zeros past the end)."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - shift] = x[:, shift:]
    return out


def test_flat_head_losses_equal_the_dense_medusa_loss():
    torch.manual_seed(0)
    K, B, T, V = 3, 2, 9, 17
    logits, teacher = torch.randn(K, B, T, V), torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    labels[0, :3] = -100
    labels[1, 6:] = -100
    index, head_targets = medusa_positions(labels, K)
    dense_targets = torch.stack(medusa_targets(labels, K))  # [K, B, T]
    for k, target in enumerate(dense_targets):  # the flat targets are the dense ones, gathered
        assert torch.equal(head_targets[k], target.flatten()[index])
    # The dense loss: every position of [B, T], each head's mean over its valid ones.
    dense_sum, dense_count = medusa_head_losses(logits.flatten(1, 2), dense_targets.flatten(1, 2))
    per_head = dense_sum / dense_count.clamp(min=1)
    loss = weighted_head_loss(per_head, 0.8)
    loss_sum, count = medusa_head_losses(logits.flatten(1, 2)[:, index], head_targets)
    torch.testing.assert_close(loss_sum / count, per_head)
    torch.testing.assert_close(loss, (0.8 ** torch.arange(K) * per_head).sum())
    # KL: head k at t is compared with the teacher at t + k + 1.
    dense_teacher = torch.stack([_shift_left(teacher, k + 1) for k in range(K)]).flatten(1, 2)  # [K, B*T, V]
    dense_kl, _ = medusa_head_losses(logits.flatten(1, 2), dense_targets.flatten(1, 2), dense_teacher)
    per_head_kl = dense_kl / dense_count.clamp(min=1)
    shifted = torch.stack([torch.cat([teacher[:, k + 1:], teacher[:, : k + 1]], 1) for k in range(K)])
    kl_sum, _ = medusa_head_losses(logits.flatten(1, 2)[:, index], head_targets, shifted.flatten(1, 2)[:, index])
    torch.testing.assert_close(kl_sum / count, per_head_kl)


def test_draft_ids_are_what_a_lookup_table_gives():
    from selfspec.heads.medusa import to_draft_ids

    g = torch.Generator().manual_seed(0)
    token_map = torch.randperm(50, generator=g)[:12].sort().values
    ids = torch.randint(-1, 50, (4, 30), generator=g)
    ids[ids == -1] = -100
    table = {int(t): i for i, t in enumerate(token_map)}
    expected = torch.tensor([[table.get(int(t), -100) for t in row] for row in ids])
    assert torch.equal(to_draft_ids(ids, token_map), expected)


@pytest.mark.parametrize("shared", [True, False])
def test_draft_vocabulary_losses_equal_the_dense_ones(shared):
    """Over a draft vocabulary the heads' losses are the dense ones with every other token's logit at -inf (value
    and gradient): exactly the dense ones when the map is the whole vocabulary."""
    from selfspec.heads.medusa import MedusaConfig, MedusaHeads, to_draft_ids

    torch.manual_seed(0)
    K, N, H, V = 3, 40, 16, 50
    lm_head = torch.nn.Linear(H, V, bias=False)
    lm_head.requires_grad_(False)
    hidden = torch.randn(N, H)
    targets = torch.randint(0, V, (K, N))
    targets[1, :5] = -100
    teacher = torch.randn(K, N, V)

    def heads_with(token_map):
        torch.manual_seed(1)
        heads = MedusaHeads(MedusaConfig(H, V, K, 1, shared, len(token_map)), lm_head)
        for block in heads.blocks:  # non-zero blocks, so the gradients reach them through the LM head
            torch.nn.init.normal_(block[0].linear.weight, std=0.3)
        heads.set_token_map(token_map)
        return heads

    def grads(heads, loss):
        params = [p for p in heads.parameters() if p.requires_grad]
        return torch.autograd.grad(loss, params)

    for token_map in (torch.arange(V), torch.tensor([1, 4, 5, 9, 17, 23, 30, 31, 42, 49])):
        reduced_heads, dense_heads = heads_with(token_map), heads_with(token_map)
        outside = torch.ones(V, dtype=torch.bool)
        outside[token_map] = False
        draft_targets = to_draft_ids(targets, token_map)
        in_vocab_targets = torch.where(draft_targets < 0, torch.full_like(targets, -100), targets)
        # cross-entropy with the data's tokens
        small = reduced_heads(hidden, draft_vocab=True)
        assert small.shape == (K, N, len(token_map))
        loss_small = medusa_head_losses(small, draft_targets)
        dense = dense_heads(hidden).masked_fill(outside, float("-inf"))
        loss_dense = medusa_head_losses(dense, in_vocab_targets)
        torch.testing.assert_close(loss_small[0], loss_dense[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(loss_small[1], loss_dense[1])
        for a, b in zip(grads(reduced_heads, loss_small[0].sum()), grads(dense_heads, loss_dense[0].sum())):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        # KL to the teacher renormalised over the draft vocabulary, equal to the dense one on the whole vocabulary
        kl_small = medusa_head_losses(reduced_heads(hidden, draft_vocab=True), draft_targets, teacher[..., token_map])
        if len(token_map) == V:
            kl_dense = medusa_head_losses(dense_heads(hidden), targets, teacher)
            torch.testing.assert_close(kl_small[0], kl_dense[0], rtol=1e-5, atol=1e-5)
            for a, b in zip(grads(reduced_heads, kl_small[0].sum()), grads(dense_heads, kl_dense[0].sum())):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        else:
            p = torch.softmax(teacher[..., token_map], -1)
            q = torch.log_softmax(dense_heads(hidden)[..., token_map], -1)
            ref = ((p * (p.log() - q)).sum(-1) * (draft_targets != -100)).sum(-1)
            torch.testing.assert_close(kl_small[0], ref, rtol=1e-5, atol=1e-5)


def test_expected_accept_length_of_a_chain():
    assert expected_accept_length([1.0, 1.0, 1.0]) == 3.0
    assert expected_accept_length([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert expected_accept_length([0.0, 1.0]) == 0.0


def test_epoch_sampler_is_seeded_per_epoch_and_leaves_global_rng_alone():
    sampler = EpochSampler(10, seed=3)
    state = torch.get_rng_state()
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == first and sorted(first) == list(range(10)) and first != second
    assert torch.equal(torch.get_rng_state(), state)


# --- training -----------------------------------------------------------------------------------------------------


def test_loss_falls_heads_change_and_target_stays_bit_identical(tmp_path):
    from selfspec import heads
    target = tiny_target()
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = medusa_cfg(tmp_path / "run", "trainer.max_steps=40")
    result = train(cfg, medusa_method(cfg), target=target, datasets=tiny_datasets())

    losses = [h["loss"] for h in result.history]
    assert len(losses) == 40 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    trained = heads_weights(result.run_dir)
    # Blocks start at zero (each head starts as the target LM head): training must have moved every one.
    blocks = [k for k in trained if k.startswith("blocks.")]
    assert blocks and all(trained[k].abs().sum() > 0 for k in blocks)
    # The run folder: resolved config, heads with eval metrics in config.json, loadable for this target.
    assert (result.run_dir / "config.yaml").is_file()
    loaded = heads.load(result.run_dir / "heads", target)
    evals = loaded.config["eval"]
    assert len(evals["acc1"]) == 4 and all(0 <= a <= b <= 1 for a, b in zip(evals["acc1"], evals["acc5"]))
    assert evals["expected_accept_length_chain"] == pytest.approx(expected_accept_length(evals["acc1"]))
    assert loaded.config["steps"] == 40 and loaded.config["base_model"] == "tiny-llama"
    hidden = torch.randn(5, 64).to(target.model.device)
    assert torch.equal(loaded.module(hidden), loaded.module(hidden))  # deterministic, eval mode


@pytest.mark.parametrize("heads_option", ["medusa", "medusa2"])
def test_killed_and_resumed_run_ends_with_the_same_parameters(tmp_path, heads_option, deterministic):
    # 24 examples / batch 4 = 6 micro-batches per epoch; 2 per step; checkpoints every 2 steps (the last 2 kept).
    # Killed during step 5: resumes from step 4 = 8 micro-batches, i.e. mid-way through epoch 1.
    opts = [f"heads={heads_option}", "trainer.gradient_accumulation_steps=2", "trainer.save_every=2",
            "trainer.keep_last=2", "trainer.max_steps=8"]
    if heads_option == "medusa2":
        opts += ["heads.lora.dropout=0.1"]  # random dropout masks: the RNG states must be restored too
    data = tiny_datasets()

    full_cfg = medusa_cfg(tmp_path / "full", *opts)
    train(full_cfg, medusa_method(full_cfg), target=tiny_target(), datasets=data)

    cfg = medusa_cfg(tmp_path / "killed", *opts)
    with pytest.raises(Killed):
        train(cfg, killable(KilledAt, cfg, kill_at_step=5, accum=2), target=tiny_target(), datasets=data)
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [2, 4]
    assert not (tmp_path / "killed" / "heads").exists()
    resumed_cfg = medusa_cfg(tmp_path / "killed", *opts, "trainer.resume=true")
    result = train(resumed_cfg, medusa_method(resumed_cfg), target=tiny_target(), datasets=data)

    assert result.steps == 8 and len(result.history) == 4  # steps 5..8 only
    assert_same_weights(heads_weights(tmp_path / "full"), heads_weights(tmp_path / "killed"))
    if heads_option == "medusa2":
        from safetensors.torch import load_file

        adapter = [load_file(str(tmp_path / run / "heads" / "adapter" / "adapter_model.safetensors"))
                   for run in ("full", "killed")]
        assert_same_weights(*adapter)
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [6, 8]


def test_a_finished_run_resumed_with_more_steps_trains_on(tmp_path, capsys):
    # A cosine schedule ends at learning rate 0: the resumed steps must use the schedule rebuilt for the new length,
    # not the 0 the checkpoint's optimizer holds (with it, step 5 would leave every weight where it was).
    opts = ["trainer.save_every=2", "trainer.lr_scheduler=cosine", "trainer.warmup_steps=0"]
    data = tiny_datasets()
    cfg = medusa_cfg(tmp_path / "run", *opts, "trainer.max_steps=4")
    train(cfg, medusa_method(cfg), target=tiny_target(), datasets=data)
    after_four = heads_weights(tmp_path / "run")
    capsys.readouterr()

    with pytest.raises(ValueError, match=r"at step 4, past trainer.max_steps=3: resume with trainer.max_steps >= 4"):
        short = medusa_cfg(tmp_path / "run", *opts, "trainer.max_steps=3", "trainer.resume=true")
        train(short, medusa_method(short), target=tiny_target(), datasets=data)

    longer = medusa_cfg(tmp_path / "run", *opts, "trainer.max_steps=5", "trainer.resume=true")
    result = train(longer, medusa_method(longer), target=tiny_target(), datasets=data)
    assert result.steps == 5 and [h["step"] for h in result.history] == [5]
    assert "was to end at step 4, trainer.max_steps=5 now" in capsys.readouterr().err
    after_five = heads_weights(tmp_path / "run")
    assert any(not torch.equal(after_four[k], after_five[k]) for k in after_four)
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")][-1] == 5


def test_feature_store_trains_the_same_heads_as_online_features(tmp_path):
    data = tiny_datasets()
    common = ["trainer.max_steps=6", "heads.loss=kl", "feature_store.dtype=float32", "feature_store.teacher_topk=320",
              "feature_store.examples_per_shard=10"]
    online_cfg = medusa_cfg(tmp_path / "online", *common)
    online = train(online_cfg, medusa_method(online_cfg), target=tiny_target(), datasets=data)
    store_cfg = medusa_cfg(tmp_path / "store", *common, "features=store")
    store = train(store_cfg, medusa_method(store_cfg), target=tiny_target(), datasets=data)

    meta = (tmp_path / "store" / "features" / "meta.json")
    assert meta.is_file() and len(list((tmp_path / "store" / "features" / "train").glob("shard-*"))) == 3
    assert_same_weights(heads_weights(tmp_path / "online"), heads_weights(tmp_path / "store"), exact=False, atol=1e-5)
    for key, value in online.eval_metrics.items():
        assert store.eval_metrics[key] == pytest.approx(value, abs=1e-4), key

    # A second run reuses the store (written once) and trains the same again.
    stamp = meta.stat().st_mtime_ns
    shared_store = f"feature_store.dir={tmp_path / 'store' / 'features'}"
    again_cfg = medusa_cfg(tmp_path / "again", *common, "features=store", shared_store)
    train(again_cfg, medusa_method(again_cfg), target=tiny_target(), datasets=data)
    assert meta.stat().st_mtime_ns == stamp
    assert_same_weights(heads_weights(tmp_path / "store"), heads_weights(tmp_path / "again"))


def test_medusa2_adapter_is_saved_loaded_and_applied(tmp_path):
    from selfspec import heads
    cfg = medusa_cfg(tmp_path / "run", "heads=medusa2", "trainer.max_steps=4")
    target = tiny_target()
    base_params = {n: p.clone() for n, p in target.model.named_parameters()}
    result = train(cfg, medusa_method(cfg), target=target, datasets=tiny_datasets())
    folder = result.run_dir / "heads"
    assert (folder / "adapter" / "adapter_config.json").is_file()
    # The base weights under the LoRA did not move.
    for name, p in target.model.named_parameters():  # LoRA layers were injected into this model in place
        if "lora_" not in name:
            assert torch.equal(p, base_params[name.replace(".base_layer", "")]), name

    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]], device=target.model.device)
    with torch.no_grad():
        trained_logits = target.model(ids).logits
        plain = tiny_target()
        plain_logits = plain.model(ids).logits
        loaded = heads.load(folder, plain)
        merged_logits = loaded.target(ids).logits
    assert loaded.adapter == folder / "adapter" and loaded.config["method"] == "medusa2"
    assert not torch.allclose(plain_logits, trained_logits, atol=1e-4)  # the adapter changed the target
    torch.testing.assert_close(merged_logits, trained_logits, rtol=1e-4, atol=1e-4)  # and is back after reload
    # The shared-LM-head heads project through the adapted target's LM head.
    assert loaded.module._target_lm_head[0] is loaded.target.get_output_embeddings()


def test_empty_training_split_is_refused_before_training(tmp_path):
    data = tiny_datasets()
    data["train"] = data["train"].select([])
    cfg = medusa_cfg(tmp_path / "run")
    with pytest.raises(EmptyDatasetError, match="training split is empty.*data.max_records"):
        train(cfg, medusa_method(cfg), target=tiny_target(), datasets=data)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("accum", [1, 2])
def test_nan_loss_stops_with_the_last_good_checkpoint_intact(tmp_path, accum):
    """A NaN loss stops the run before its step's update (with accumulation too: the loss is checked once a step,
    before the last micro-batch's backward), leaving the last checkpoint to resume from."""
    opts = ["trainer.save_every=2", "trainer.max_steps=8", f"trainer.gradient_accumulation_steps={accum}"]
    cfg = medusa_cfg(tmp_path / "run", *opts)
    method = killable(NanAt, cfg, kill_at_step=5, accum=accum)
    with pytest.raises(NonFiniteLossError, match=r"The loss is nan \(not finite\) at step 5.*step-00000004"):
        train(cfg, method, target=tiny_target(), datasets=tiny_datasets())
    for k, v in method.drafter.named_parameters():  # no update from the NaN step
        assert torch.equal(v.detach(), method.before[k]), k
    checkpoints = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in checkpoints] == [2, 4]
    assert not (tmp_path / "run" / "heads").exists()
    # The checkpoint is usable: resuming from it finishes the run with finite weights.
    resumed = medusa_cfg(tmp_path / "run", *opts, "trainer.resume=true")
    result = train(resumed, medusa_method(resumed), target=tiny_target(), datasets=tiny_datasets())
    assert result.steps == 8 and all(torch.isfinite(v).all() for v in heads_weights(tmp_path / "run").values())


def test_the_losses_are_checked_once_per_optimizer_step(tmp_path, monkeypatch):
    """One device sync per step for the loss check, over all of the step's micro-batch losses."""
    import selfspec.train.loop as loop

    checked, check = [], loop._stop_if_not_finite
    monkeypatch.setattr(loop, "_stop_if_not_finite",
                        lambda acc, value, what, *rest: checked.append((what, value.numel())) or check(acc, value, what,
                                                                                                       *rest))
    cfg = medusa_cfg(tmp_path / "run", "trainer.max_steps=3", "trainer.gradient_accumulation_steps=2")
    train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets())
    assert [c for c in checked if c[0] == "loss"] == [("loss", 2)] * 3


def test_a_fresh_run_does_not_mix_with_an_earlier_runs_checkpoints(tmp_path):
    opts = ["trainer.max_steps=2", "trainer.save_every=1"]
    first = medusa_cfg(tmp_path / "run", *opts, "trainer.max_steps=3")
    train(first, medusa_method(first), target=tiny_target(), datasets=tiny_datasets())
    again = medusa_cfg(tmp_path / "run", *opts)
    with pytest.raises(RunExistsError, match="trainer.resume=true.*trainer.overwrite=true"):
        train(again, medusa_method(again), target=tiny_target(), datasets=tiny_datasets())
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 3]
    over = medusa_cfg(tmp_path / "run", *opts, "trainer.overwrite=true")
    train(over, medusa_method(over), target=tiny_target(), datasets=tiny_datasets())
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2]  # none left from the first


def test_a_second_run_in_one_process_does_not_inherit_the_first_ones_precision(tmp_path):
    from accelerate.state import AcceleratorState

    first = medusa_cfg(tmp_path / "bf16", "trainer.max_steps=1", "trainer.mixed_precision=bf16")
    train(first, medusa_method(first), target=tiny_target(), datasets=tiny_datasets())
    assert AcceleratorState().mixed_precision == "bf16"
    second = medusa_cfg(tmp_path / "fp32", "trainer.max_steps=1")
    train(second, medusa_method(second), target=tiny_target(), datasets=tiny_datasets())
    assert AcceleratorState().mixed_precision == "no"


def test_the_frozen_target_trains_in_bf16_only_where_bf16_is_native(monkeypatch):
    from selfspec.core.errors import SettingError
    from selfspec.train.config import training_dtype

    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)
    assert training_dtype("auto", "cpu", "float32") == "float32"  # emulated bf16 is slower: the model's own dtype
    assert training_dtype("auto", "cpu", "auto") == "auto"
    assert training_dtype("auto", "cuda", "float32") == "bfloat16"
    assert training_dtype("float16", "cpu", "float32") == "float16"  # asked for by name: as asked
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert training_dtype("auto", "cpu", "float32") == "bfloat16"
    with pytest.raises(SettingError, match=r"trainer.target_dtype='half'.*bfloat16"):
        TrainerConfig.from_cfg(medusa_cfg(Path("unused"), "trainer.target_dtype=half").trainer)


def _family(option: str, run_dir: Path, *overrides: str):
    """(config, method class) of a training family on the tiny target, for tests across families."""
    if option.startswith("medusa"):
        return medusa_cfg(run_dir, f"heads={option}", *overrides), METHODS[option]
    if option == "eagle3":
        from test_eagle import eagle_cfg

        from selfspec.train.eagle_method import EagleMethod

        return eagle_cfg(run_dir, "heads=eagle3", "heads.draft_vocab_size=64", *overrides), EagleMethod
    from test_layerskip_train import layerskip_cfg

    from selfspec.train.layerskip_method import LayerSkipMethod

    frozen = ["exit.tune_lm_head=false"] if option == "layerskip-frozen-head" else []
    return layerskip_cfg(run_dir, *frozen, *overrides), LayerSkipMethod


@pytest.mark.parametrize("heads_option", ["medusa", "medusa2", "eagle3", "layerskip", "layerskip-frozen-head"])
def test_a_bf16_target_trains_float32_heads_close_to_a_float32_targets(tmp_path, heads_option, device):
    """trainer.target_dtype=bfloat16 runs the frozen target in bf16 (Medusa-2, whose LoRA trains inside the target,
    keeps it in float32 under auto); the heads stay float32, load onto the float32 target, and train as a float32
    target would, within rounding: bf16 keeps 8 significant bits (relative rounding 2^-9 per value), so over this tiny
    model's two layers the hidden states, and the first loss, move by a few 0.1% (allowed: 2%)."""
    from selfspec import heads
    from selfspec.core.target import load_target

    runs = {}
    for dtype in ("float32", "bfloat16", "auto"):
        seen = {}
        cfg, method_class = _family(heads_option, tmp_path / dtype, "trainer.max_steps=6",
                                    f"trainer.target_dtype={dtype}")

        class Recording(method_class):
            def compute_loss(self, batch, target, drafter, **kwargs):
                seen["dtype"] = next(target.model.parameters()).dtype
                return super().compute_loss(batch, target, drafter, **kwargs)

        result = train(cfg, Recording(cfg), datasets=tiny_datasets())  # the target loaded from cfg.model (tiny)
        runs[dtype] = ([h["loss"] for h in result.history], seen["dtype"], result.run_dir)
    assert runs["float32"][1] == torch.float32 and runs["bfloat16"][1] == torch.bfloat16
    auto = torch.bfloat16 if heads_option != "medusa2" and _native_here(device) else torch.float32
    assert runs["auto"][1] == auto
    first32, first16 = runs["float32"][0][0], runs["bfloat16"][0][0]
    assert first16 != first32  # the teacher did run in bf16
    # The first step starts from the same heads, so only the teacher's rounding separates the two (later steps drift
    # apart: the tiny random target's near-tied top tokens flip, and with them the positions EAGLE-3 trains on).
    assert first16 == pytest.approx(first32, rel=0.02)
    for losses, _, _ in runs.values():
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    cfg, _ = _family(heads_option, tmp_path / "load")
    target = load_target({**cfg.model, "dtype": "float32"})
    loaded = heads.load(runs["bfloat16"][2] / "heads", target)
    assert all(p.dtype == torch.float32 for p in loaded.module.parameters())


def _native_here(device) -> bool:
    from selfspec.core.runtime import native_bf16

    return native_bf16(device)


# --- configs ------------------------------------------------------------------------------------------------------


def _options(group: str, skip_prefixes: tuple[str, ...] = ()) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith(skip_prefixes))


@pytest.mark.parametrize("experiment", [None] + experiments_for(("medusa", "medusa2")))
@pytest.mark.parametrize("trainer", _options("trainer"))
def test_every_trainer_and_experiment_option_composes_and_instantiates(tmp_path, trainer, experiment):
    from conftest import compose

    from selfspec.train.loggers import make_logger

    overrides = [f"trainer={trainer}", f"run_dir={tmp_path}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = compose("medusa", overrides)
    tc = TrainerConfig.from_cfg(cfg.trainer)
    assert tc.max_steps >= 1 and tc.lr_scheduler in ("cosine", "linear", "constant")
    method = medusa_method(cfg)
    assert method.name == cfg.heads.type
    logger = make_logger(cfg.logger, tmp_path, {"run": 1})
    logger.log({"x": 1.0}, step=1)
    logger.finish()


@pytest.mark.parametrize("heads_option", [o for o in _options("heads") if o.startswith("medusa")])
def test_every_heads_option_builds_a_drafter(tmp_path, heads_option):
    from conftest import compose

    cfg = compose("medusa", [f"heads={heads_option}", "experiment=debug", f"run_dir={tmp_path}"])
    method = medusa_method(cfg)
    target = tiny_target()
    drafter = method.build_module(target)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and all(("lora_" in n) or ("heads." in n) or n.startswith("blocks.") for n in trainable)
    groups = method.param_groups(drafter, 1e-3)
    assert sum(len(g["params"]) for g in groups) == len(trainable)


def test_default_config_is_the_documented_cpu_run():
    from conftest import compose

    cfg = compose("medusa")
    assert cfg.model.source == "smollm2" and cfg.data.source == "sharegpt" and cfg.heads.type == "medusa"
    assert cfg.run_dir == "outputs/medusa-smollm2" and cfg.features == "online"
    with pytest.raises(ValueError, match="heads.loss"):
        medusa_method(compose("medusa", ["heads.loss=mse"]))
    with pytest.raises(ValueError, match="feature store"):
        medusa_method(compose("medusa", ["heads=medusa2", "features=store"]))
    with pytest.raises(ValueError, match="Unknown trainer option"):
        TrainerConfig.from_cfg(compose("medusa", ["+trainer.max_stepz=3"]).trainer)


def test_settings_defaults_are_written_once_in_conf():
    """The trainer's and the heads' defaults live in conf/ only: their dataclasses set none (Medusa-2's fields are
    None under Medusa-1), so the two cannot disagree; the entry point trains with exactly the yaml's values."""
    import dataclasses

    from conftest import compose
    from omegaconf import OmegaConf

    from selfspec.train.dflash_method import DFlashSettings
    from selfspec.train.eagle_method import EagleSettings
    from selfspec.train.medusa_method import MedusaSettings

    for cls in (TrainerConfig, MedusaSettings, EagleSettings, DFlashSettings):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        assert all(value is None for value in defaults.values()), (cls.__name__, defaults)
    trainer_yaml = OmegaConf.to_container(OmegaConf.load(CONF / "trainer" / "default.yaml"))
    assert set(trainer_yaml) == {f.name for f in dataclasses.fields(TrainerConfig)}
    expected = {**trainer_yaml, **OmegaConf.to_container(OmegaConf.load(CONF / "medusa.yaml").trainer)}
    expected["adam_betas"] = tuple(expected["adam_betas"])
    assert TrainerConfig.from_cfg(compose("medusa").trainer) == TrainerConfig(**expected)
    with pytest.raises(ValueError, match=r"Missing trainer option\(s\) \['max_steps'\]"):
        TrainerConfig.from_cfg({k: v for k, v in trainer_yaml.items() if k != "max_steps"})
    # heads.shared_lm_head of conf/heads/medusa.yaml is what the trained heads get (MedusaConfig's own default,
    # for heads built by hand, is not used).
    shared = OmegaConf.load(CONF / "heads" / "medusa.yaml").shared_lm_head
    heads = medusa_method(compose("medusa", ["experiment=debug"])).build_module(tiny_target())
    assert heads.config.shared_lm_head is shared and (heads.lm_heads is None) is shared


def test_size_for_coverage_is_the_fewest_most_frequent_tokens():
    from selfspec.heads.vocab import resolve_size, size_for_coverage

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 50, (40,), generator=g) ** 2
        coverage = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        share = torch.cumsum(counts.sort(descending=True).values.double(), 0) / counts.sum()
        brute = next(n for n in range(1, 41) if share[n - 1] >= coverage - 1e-12)
        assert size_for_coverage(counts, coverage) == brute
    assert resolve_size(torch.ones(10), 4, None) == 4 and resolve_size(torch.ones(10), None, None) == 10
    assert resolve_size(torch.ones(10), 99, None) == 10


def test_draft_vocabulary_is_chosen_by_coverage_and_saved_with_the_heads(tmp_path):
    from selfspec import heads
    from selfspec.decode.drafters import MedusaDrafter
    from selfspec.decode.engine import SpeculativeDecoder
    from selfspec.heads.vocab import count_tokens

    target, data = tiny_target(), tiny_datasets()
    cfg = medusa_cfg(tmp_path / "run", "trainer.max_steps=2", "heads.draft_vocab_coverage=0.9")
    result = train(cfg, medusa_method(cfg), target=target, datasets=data)
    loaded = heads.load(result.run_dir / "heads", target)
    token_map = loaded.module.token_map.cpu()  # beside the counts, on the CPU
    counts = sum(count_tokens(torch.tensor(ex["input_ids"]), 320, torch.tensor(ex["labels"]) != -100)
                 for ex in data["train"])
    share = lambda ids: float(counts[ids].sum()) / float(counts.sum())  # noqa: E731
    assert share(token_map) >= 0.9 and loaded.config["draft_vocab_coverage"] == pytest.approx(share(token_map))
    least = token_map[counts[token_map].argmin()]
    assert share(token_map[token_map != least]) < 0.9  # the fewest: one token less does not cover
    assert counts[token_map].min() >= counts[~torch.isin(torch.arange(320), token_map)].max()  # the most frequent
    assert loaded.module.config.draft_vocab_size == len(token_map) < 256

    drafter = MedusaDrafter(loaded.module, tree="small_16")
    seen = []
    original = drafter._logits
    drafter._logits = lambda depth, features: seen.append(depth) or original(depth, features)
    decoder = SpeculativeDecoder(target.model, drafter, eos_token_ids=[])
    prompt = data["eval"][0]["input_ids"][:12]
    ref = target.model.generate(torch.tensor([prompt], device=target.model.device), do_sample=False,
                                max_new_tokens=16, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert decoder.generate(prompt, max_new_tokens=16).tokens == ref and seen  # lossless with the reduced heads
    state = type("S", (), {"hidden": torch.randn(64).to(target.model.device), "next_token": 5})()
    drafted = drafter.propose(state, max_depth=4).tokens[1:]
    assert bool(torch.isin(drafted.cpu(), token_map).all())  # drafts come from the map only
