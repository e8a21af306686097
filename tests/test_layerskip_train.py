"""Layer-skip exits (heads/layerskip.py, train/layerskip_method.py): trained exits draft losslessly in both forms
(with an adapter's own cache kept equal to a fresh computation), training leaves the target bit-identical, a killed
and resumed run ends with the same exit, the cheap teacher equals the dense one, exit_layer=auto keeps the exit its
table ranks first, and the heads folder decodes through decode/run.py's session."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.layerskip import LayerSkipDrafter, best_chain
from selfspec.heads.layerskip import ExitConfig, LayerSkipExit
from selfspec.core.target import Target, build_tiny
from selfspec.train.loop import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def confident_model(arch: str = "llama", seed: int = 0):
    """A tiny target whose later layers are scaled down, so early exits are often right (drafts get accepted)."""
    model, tokenizer = build_tiny(arch, num_hidden_layers=4, seed=seed)
    with torch.no_grad():
        for layer in model.get_decoder().layers[1:]:
            layer.mlp.down_proj.weight.mul_(0.3)
            layer.self_attn.o_proj.weight.mul_(0.3)
    return model, tokenizer


def trained_like_exit(model, exit_layer: int, form: str, vocab: int | None, seed: int = 0) -> LayerSkipExit:
    """An exit with every weight moved off its initialisation (as training would), adapter included."""
    config = ExitConfig.from_target(model, exit_layer=exit_layer, form=form, draft_vocab_size=vocab, tune_lm_head=True)
    token_map = None if vocab is None else torch.sort(torch.randperm(config.vocab_size)[:vocab]).values
    exit_module = LayerSkipExit(config, model, token_map=token_map).to(model.device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in exit_module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.02)
    return exit_module.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("form,vocab", [("head", None), ("head", 200), ("adapter", None), ("adapter", 200)])
def test_trained_exits_draft_losslessly(arch, form, vocab):
    model, _ = confident_model(arch)
    for exit_layer in (1, 3):
        drafter = LayerSkipDrafter(model, exit_layer=None, threshold=0.0, max_depth=4,
                                   exit=trained_like_exit(model, exit_layer, form, vocab))
        assert drafter.exit_layer == exit_layer
        decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
        accepted = drafted = 0
        g = torch.Generator().manual_seed(exit_layer)
        for _ in range(3):
            prompt = torch.randint(3, 300, (int(torch.randint(3, 16, (1,), generator=g)),), generator=g).tolist()
            ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=16,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            res = decoder.generate(prompt, max_new_tokens=16)
            assert res.tokens == ref
            accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
        assert drafted > accepted > 0  # accepted and rejected drafts both happened


def test_adapter_cache_after_each_commit_equals_a_fresh_run_of_the_adapter():
    model, _ = confident_model()
    exit_module = trained_like_exit(model, 2, "adapter", None)
    drafter = LayerSkipDrafter(model, exit_layer=None, threshold=0.0, max_depth=3, exit=exit_module)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    seen = []
    original = drafter.on_commit

    def check(state, draft, verdict, out):
        original(state, draft, verdict, out)
        drafter._catch_up()  # what the next propose does first (the adapter's catch-up is lazy)
        layer = drafter._adapter_cache.layers[0]
        seen.append((state.length, layer.keys.clone(), layer.values.clone()))

    drafter.on_commit = check
    prompt = [5, 9, 17, 33, 65, 129]
    res = decoder.generate(prompt, max_new_tokens=12)
    assert res.stats.accepted > 0 and len(seen) == res.stats.steps
    full = torch.tensor([prompt + res.tokens], device=model.device)
    from selfspec.decode.cache import new_cache

    with torch.no_grad():
        hidden = model(input_ids=full, output_hidden_states=True).hidden_states[2]
        for length, keys, values in seen:
            fresh = new_cache()
            exit_module.features(hidden[:, :length], cache=fresh)
            torch.testing.assert_close(keys, fresh.layers[0].keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values, fresh.layers[0].values, atol=1e-5, rtol=1e-4)


def test_the_adapter_catches_up_only_when_drafting_resumes():
    from test_eagle import OffAndOn

    model, _ = confident_model()
    exit_module = trained_like_exit(model, 2, "adapter", None)
    drafter = LayerSkipDrafter(model, exit_layer=None, threshold=0.0, max_depth=3, exit=exit_module)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=OffAndOn())
    calls = []
    original = exit_module.features

    def counted(hidden, *args, **kwargs):
        calls.append(int(hidden.shape[1]))
        return original(hidden, *args, **kwargs)

    exit_module.features = counted
    prompt = [5, 9, 17, 33, 65, 129]
    res = decoder.generate(prompt, max_new_tokens=16)
    ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=16,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert res.tokens == ref
    # the prompt's rows run with the prefill, in one batch (not timed as the first draft's); then three steps in four
    # draft nothing and run no adapter; a drafting step catches up in one batch (several rows), then runs the adapter
    # once per drafted token (one row each)
    assert calls[0] == len(prompt)
    batches = [n for n in calls[1:] if n > 1]
    assert len(batches) == (res.stats.steps // 4) and sum(calls) >= len(prompt) + 4


def test_sampling_with_an_adapter_exit_keeps_the_target_distribution():
    from test_engine import exact_first_three, sampled_first_three
    from test_verify import chi_square_pvalue

    model, _ = build_tiny("llama", vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    drafter = LayerSkipDrafter(model, exit_layer=None, threshold=0.0, max_depth=2, exit=trained_like_exit(model, 1, "adapter", 8))
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1000)
    assert accept_rate > 0.1
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_an_untrained_head_exit_is_the_target_own_norm_and_lm_head():
    model, _ = confident_model()
    config = ExitConfig.from_target(model, exit_layer=2, form="adapter", draft_vocab_size=None, tune_lm_head=True)
    exit_module = LayerSkipExit(config, model).to(model.device)
    hidden = torch.randn(1, 5, model.config.hidden_size).to(model.device)
    with torch.no_grad():  # the adapter's output projections start at zero: the identity
        expected = model.lm_head(model.get_decoder().norm(hidden))
        torch.testing.assert_close(exit_module.logits(exit_module.features(hidden)), expected)


# --- the cost model ---------------------------------------------------------------------------------------------------


def test_best_chain_follows_acceptance_and_cost():
    from selfspec.decode.adaptive import CostCurve

    flat = CostCurve.from_relative({1: 1.0, 64: 1.0})  # verifying costs what one token costs, whatever the size
    never = best_chain([1.0], [0.0], [0.0], 6, draft_cost=0.2, layer_share=0.2, curve=flat)
    assert never["speedup"] < 1.0 and never["depth"] == 1  # no accepted token: drafting cannot pay
    always = best_chain([1.0], [1.0], [0.0], 6, draft_cost=0.05, layer_share=0.05, curve=flat)
    assert always["depth"] == 6 and always["tokens_per_step"] == 7
    assert always["speedup"] == pytest.approx(7 / (6 * 0.05 + 0.95 + 0.05))
    # a threshold that keeps only the drafts that are right beats drafting everything
    picky = best_chain([1.0, 0.5], [0.5, 0.5], [0.0, 0.9], 4, draft_cost=0.3, layer_share=0.3, curve=flat)
    assert picky["threshold"] == 0.9


# --- training ---------------------------------------------------------------------------------------------------------


def layerskip_cfg(run_dir, *overrides: str):
    from conftest import compose

    base = ["experiment=debug", f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.batch_size=4",
            "trainer.learning_rate=1e-2", "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.log_every=1", "speed_check.prompts=null"]
    return compose("layerskip", base + list(overrides))


def tiny_run_target() -> Target:
    model, tokenizer = build_tiny("llama", seed=0)
    return Target(model=model, tokenizer=tokenizer, name="tiny-llama")


def test_training_moves_the_exits_keeps_the_target_bit_identical_and_keeps_the_best(tmp_path):
    from selfspec import heads
    from test_medusa_train import tiny_datasets

    from selfspec.train.layerskip_method import LayerSkipMethod

    target = tiny_run_target()
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = layerskip_cfg(tmp_path / "run", "trainer.max_steps=20", "exit.form=adapter")
    result = train(cfg, LayerSkipMethod(cfg), target=target, datasets=tiny_datasets())
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    rows = json.loads((result.run_dir / "exit_layers.json").read_text())
    assert [r["exit_layer"] for r in rows] and rows == sorted(rows, key=lambda r: -r["speedup"])
    assert sorted(r["exit_layer"] for r in rows) == [1, 2]  # every default candidate of a 4-layer target
    loaded = heads.load(result.run_dir / "heads", target)
    assert loaded.config["head_type"] == "layerskip"
    assert loaded.module.exit_layer == rows[0]["exit_layer"]  # the kept exit is the table's first
    assert loaded.config["decode"]["threshold"] == rows[0]["threshold"]
    assert loaded.module.adapter is not None and loaded.module.adapter.mlp.down_proj.weight.abs().sum() > 0
    for r in rows:
        assert 0.0 <= r["agreement"] <= 1.0 and r["draft_cost"] > 0
    for r in rows[1:]:  # every other exit is a heads folder of its own
        other = heads.load(result.run_dir / "exits" / f"layer-{r['exit_layer']}", target)
        assert other.module.exit_layer == r["exit_layer"] and other.config["decode"]["threshold"] == r["threshold"]


def test_killed_and_resumed_exit_training_ends_with_the_same_exit(tmp_path, deterministic):
    from test_medusa_train import Killed, assert_same_weights, heads_weights, tiny_datasets

    from selfspec.train.checkpoint import list_checkpoints
    from selfspec.train.layerskip_method import LayerSkipMethod

    class KilledAt(LayerSkipMethod):
        def __init__(self, cfg, kill_call):
            super().__init__(cfg)
            self.calls, self.kill_call = 0, kill_call

        def compute_loss(self, batch, target, drafter, num_items):
            self.calls += 1
            if self.calls == self.kill_call:
                raise Killed
            return super().compute_loss(batch, target, drafter, num_items)

    opts = ["exit_layer=2", "trainer.save_every=2", "trainer.max_steps=6"]
    data = tiny_datasets()
    full_cfg = layerskip_cfg(tmp_path / "full", *opts)
    train(full_cfg, LayerSkipMethod(full_cfg), target=tiny_run_target(), datasets=data)
    cfg = layerskip_cfg(tmp_path / "killed", *opts)
    with pytest.raises(Killed):
        train(cfg, KilledAt(cfg, kill_call=5), target=tiny_run_target(), datasets=data)
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [2, 4]
    resumed = layerskip_cfg(tmp_path / "killed", *opts, "trainer.resume=true")
    train(resumed, LayerSkipMethod(resumed), target=tiny_run_target(), datasets=data)
    assert_same_weights(heads_weights(tmp_path / "full"), heads_weights(tmp_path / "killed"))


def test_the_teacher_at_trained_rows_equals_the_dense_distribution(tmp_path):
    from test_medusa_train import tiny_datasets

    from selfspec.train.data import collate
    from selfspec.train.layerskip_method import LayerSkipMethod, exit_positions, kl_to_teacher

    target = tiny_run_target()
    cfg = layerskip_cfg(tmp_path, "exit.draft_vocab_size=40")
    method = LayerSkipMethod(cfg)
    data = tiny_datasets()
    method.prepare_data(data, target, None, None)
    device = target.model.device
    batch = {k: v.to(device) for k, v in collate([data["train"][i] for i in range(4)], pad_token_id=0).items()}
    token_map = method.token_map.to(device)
    where = exit_positions(batch["labels"])
    states, teacher, _ = method._teacher(batch, target, where)
    with torch.no_grad():
        from selfspec.train.data import position_ids_from_mask

        dense = target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=position_ids_from_mask(batch["attention_mask"])).logits
    torch.testing.assert_close(teacher, dense[where][:, token_map], atol=1e-4, rtol=1e-4)
    student = torch.randn_like(teacher, requires_grad=True)
    dense_kl = torch.nn.functional.kl_div(torch.log_softmax(student, -1), torch.log_softmax(dense[where][
        :, token_map], -1), log_target=True, reduction="sum")
    cheap = kl_to_teacher(student, teacher)
    torch.testing.assert_close(cheap, dense_kl, atol=1e-4, rtol=1e-4)
    # labels: position t is trained when token t + 1 is an answer token
    assert torch.equal(where[:, :-1], batch["labels"][:, 1:] != -100) and not where[:, -1].any()


def test_bad_exit_settings_are_refused_clearly(tmp_path):
    from selfspec.core.errors import SettingError
    from selfspec.train.layerskip_method import LayerSkipMethod, default_candidates, exit_layers

    assert default_candidates(30) == [2, 4, 8, 11, 15] and default_candidates(4) == [1, 2]
    assert exit_layers(5, None, 30) == [5] and exit_layers("auto", [9, 3], 30) == [3, 9]
    with pytest.raises(SettingError, match="exit_layer \\[30\\]"):
        exit_layers(30, None, 30)
    with pytest.raises(SettingError, match="exit.form"):
        LayerSkipMethod(layerskip_cfg(tmp_path, "exit.form=mlp"))


def test_decode_session_drafts_with_a_trained_exit_folder(tmp_path):
    from conftest import compose

    from selfspec.decode.session import load_session
    from selfspec.heads.io import save_heads

    target = tiny_run_target()
    exit_module = trained_like_exit(target.model, 1, "head", 64)
    save_heads(tmp_path / "heads", exit_module, "layerskip", exit_module.config.to_dict(), target,
               {"decode": {"threshold": 0.25, "max_depth": 3}})
    session = load_session(compose("decode", [f"heads={tmp_path / 'heads'}", "max_new_tokens=8"]))
    drafter = session.decoder.drafter.inner  # a hybrid with the suffix drafter by default
    assert isinstance(drafter, LayerSkipDrafter) and drafter.exit is session.heads
    assert drafter.exit_layer == 1 and drafter.threshold == 0.25 and drafter.max_depth == 3
    torch.testing.assert_close(drafter.exit.token_map, exit_module.token_map)
    from selfspec.decode.types import DecodeSetupError

    with pytest.raises(DecodeSetupError, match="trained after layer 1"):
        load_session(compose("decode", [f"heads={tmp_path / 'heads'}", "draft.exit_layer=2"]))
