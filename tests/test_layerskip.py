"""Layer-skip self-speculation (decode/layerskip.py): drafting with the target's own first E layers and verifying
with the rest, without recomputing the first layers, equals HF generate token for token for several exit layers
(E = 1 and E = L - 1 included) on Llama and Qwen2; after each commit every layer's cache equals a fresh forward's;
sampling keeps the target's distribution; other architectures are refused clearly."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.cache import layer_lengths, new_cache
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.layerskip import LayerSkipDrafter
from selfspec.decode.types import DecodeSetupError
from selfspec.core.target import cache_kwarg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def confident_target(arch: str):
    """A tiny target whose early exits are often right: its later layers are scaled down, so the first layers
    decide most of the output and drafts get accepted (the test then covers accepted and rejected drafts)."""
    from selfspec.core.target import build_tiny

    model, tokenizer = build_tiny(arch, num_hidden_layers=4)
    with torch.no_grad():
        for layer in model.get_decoder().layers[1:]:
            layer.mlp.down_proj.weight.mul_(0.3)
            layer.self_attn.o_proj.weight.mul_(0.3)
    return model, tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_greedy_equals_hf_generate(arch, exit_layer, threshold):
    model, _ = confident_target(arch)
    drafter = LayerSkipDrafter(model, exit_layer=exit_layer, threshold=threshold, max_depth=4)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    accepted = drafted = 0
    g = torch.Generator().manual_seed(exit_layer)
    for _ in range(4):
        prompt = torch.randint(3, 300, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=20,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        res = decoder.generate(prompt, max_new_tokens=20)
        assert res.tokens == ref
        accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
    assert drafted > 0 and accepted > 0  # drafts were made, and some were accepted
    if threshold == 0.0:
        assert accepted < drafted  # and some rejected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_after_each_commit_every_layer_equals_a_fresh_forward(arch):
    model, _ = confident_target(arch)
    drafter = LayerSkipDrafter(model, exit_layer=2, threshold=0.0, max_depth=3)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    prompt = [5, 9, 17, 33, 65, 129]
    states = []
    original = decoder.drafter.on_commit

    def check(state, draft, verdict, out):
        original(state, draft, verdict, out)
        states.append((state.length, [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers],
                       layer_lengths(state.cache)))

    decoder.drafter.on_commit = check
    res = decoder.generate(prompt, max_new_tokens=12)
    assert len(states) == res.stats.steps and res.stats.accepted > 0
    assert_caches_equal_fresh_forwards(model, prompt + res.tokens, states)


def assert_caches_equal_fresh_forwards(model, full: list[int], states) -> None:
    """Each (committed length, every layer's (keys, values), layer lengths, ...) snapshot in ``states`` holds every
    layer at the committed length, with the rows a plain forward over the first ``length`` tokens of ``full``
    writes."""
    for length, layers, lengths, *_ in states:
        assert lengths == [length] * len(layers)  # every layer at the committed length
        cache = new_cache()
        with torch.no_grad():
            model(input_ids=torch.tensor([full[:length]], device=model.device), use_cache=True,
                  **{cache_kwarg(model): cache})
        for (k, v), fresh in zip(layers, cache.layers):  # same rows, up to kernel rounding (other batch shapes)
            torch.testing.assert_close(k, fresh.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, fresh.values, atol=1e-5, rtol=1e-4)


def test_sampled_tokens_follow_the_target_distribution():
    from test_engine import exact_first_three, sampled_first_three
    from test_verify import chi_square_pvalue

    from selfspec.core.target import build_tiny

    model, _ = build_tiny("llama", vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    drafter = LayerSkipDrafter(model, exit_layer=1, threshold=0.0, max_depth=2)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1000)
    assert accept_rate > 0.2  # drafts were accepted often enough for the test to mean something
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_bad_exit_layers_and_architectures_are_refused(tiny_llama):
    model, _ = tiny_llama
    layers = model.config.num_hidden_layers
    for bad in (0, layers):
        with pytest.raises(DecodeSetupError, match=f"exit_layer={bad}"):
            LayerSkipDrafter(model, exit_layer=bad, threshold=0.5, max_depth=6)

    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    with pytest.raises(DecodeSetupError, match=r"\(Other\) has no decoder with embed_tokens, layers, norm, rotary_emb"):
        LayerSkipDrafter(Other(), exit_layer=1, threshold=0.5, max_depth=6)


def test_decode_run_drafts_with_the_target_own_first_layers():
    from conftest import compose

    from selfspec.decode.session import load_session

    session = load_session(compose("decode", ["model=tiny", "drafter=layerskip", "draft.exit_layer=1",
                                              "draft.threshold=0.0", "max_new_tokens=12"]))
    from selfspec.decode.hybrid import HybridDrafter

    hybrid = session.decoder.drafter  # by default a hybrid with the suffix drafter, as every family
    assert isinstance(hybrid, HybridDrafter) and session.heads is None
    drafter = hybrid.inner
    assert isinstance(drafter, LayerSkipDrafter) and drafter.exit_layer == 1
    policy = session.decoder.depth_policy  # the engine's, applied by the hybrid to the chain's part
    assert policy is not None  # adaptive by default: no drafting where it does not pay
    # ... charging its verify pass only for the layers after the exit
    assert policy.verify_share == drafter.verify_share < 1
    ids = [5, 6, 7, 8, 5, 6, 7]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=12, pad_token_id=0)
    assert session.decoder.generate(ids, max_new_tokens=12).tokens == ref[0, len(ids):].tolist()
    alone = load_session(compose("decode", ["model=tiny", "drafter=layerskip", "draft.suffix=false"])).decoder
    assert isinstance(alone.drafter, LayerSkipDrafter) and alone.depth_policy.verify_share == alone.drafter.verify_share
    assert alone.drafter.exit_layer == session.target.model.config.num_hidden_layers // 2  # the default: half


def test_the_verify_share_leaves_out_the_layers_drafting_ran(tiny_llama):
    model, _ = tiny_llama
    per_layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    head = model.get_output_embeddings().weight.numel()
    layers = model.config.num_hidden_layers
    for e in (1, layers - 1):
        share = LayerSkipDrafter(model, exit_layer=e, threshold=0.5, max_depth=6).verify_share
        assert share == pytest.approx(1 - e * per_layer / (layers * per_layer + head), rel=1e-12)


def test_exit_agreement_counts_what_a_direct_comparison_counts(tiny_llama):
    from selfspec.decode.layerskip import exit_agreement

    model, _ = tiny_llama
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 300, (12,), generator=g).tolist(),
                 "labels": [-100] * 4 + list(range(8))} for _ in range(3)]
    rows = exit_agreement(model, examples, thresholds=(0.0, 1.01))
    layers = model.config.num_hidden_layers
    assert [r["exit_layer"] for r in rows] == list(range(1, layers)) and rows[0]["positions"] == 24
    decoder = model.get_decoder()
    for r in rows:
        same = 0
        for ex in examples:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ex["input_ids"]], device=model.device), output_hidden_states=True)
                exit_top = model.lm_head(decoder.norm(out.hidden_states[r["exit_layer"]][0])).argmax(-1)
            same += int((exit_top == out.logits[0].argmax(-1))[4:].sum())
        assert r["agreement"] == pytest.approx(same / 24)
        assert r["share_p>=0.0"] == 1.0 and r["right_p>=0.0"] == pytest.approx(r["agreement"])
        assert r["share_p>=1.01"] == 0.0


@pytest.mark.parametrize("threshold", [0.0, 1.0])  # 0: every step drafts its chain; 1: none does (the model's forward)
def test_greedy_verification_reads_the_bfloat16_head_and_equals_hf_generate(threshold, fresh_heads):
    """Layer-skip's own verify forward reads greedy verification's LM head as the engine's forward does (on drafted
    steps from its final hidden states, on undrafted ones through the engine's tree forward)."""
    from selfspec.cpu_kernels.greedy_head import greedy_head

    model, _ = confident_target("llama")
    if model.device.type != "cpu":
        pytest.skip("the bfloat16 greedy head is made for a CPU's float32 LM head only")
    drafter = LayerSkipDrafter(model, exit_layer=2, threshold=threshold, max_depth=4)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[], linear_kernel="small_batch", depth_policy=None)
    prompt = [5, 9, 17, 33, 65, 129]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    res = decoder.generate(prompt, max_new_tokens=24)
    head = greedy_head(model)
    assert res.tokens == ref
    assert head is not None and head.positions >= res.stats.steps  # every step's logits came from the head
    if threshold == 0.0:
        assert res.stats.accepted > 0  # drafted chains were accepted, so the head's argmax over them counted
    else:
        assert res.stats.drafted == 0
