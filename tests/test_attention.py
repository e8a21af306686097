"""Grouped-query attention without key/value copies (cpu_kernels/attention.py): the same output as transformers' sdpa,
the copies actually skipped inside a block, the configs switched for the block only, and the engine's greedy output
still HF generate's with drafts accepted."""

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from selfspec.cpu_kernels.attention import GQA_SDPA, grouped_query_attention, sdpa_gqa_attention
from selfspec.decode.cache import new_cache
from selfspec.decode.drafters import OracleDrafter
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.core.target import build_tiny, cache_kwarg


class _Layer(torch.nn.Module):
    num_key_value_groups = 3


def _tree_mask(queries: int, past: int) -> torch.Tensor:
    """A tree-verify style additive mask [1, 1, queries, past + queries]: the past, then a causal block."""
    mask = torch.zeros(1, 1, queries, past + queries)
    mask[..., past:] = torch.triu(torch.full((queries, queries), torch.finfo(torch.float32).min), 1)
    return mask


@pytest.mark.parametrize("queries", [2, 5, 12])
def test_same_output_as_sdpa_bit_for_bit(queries):
    # The same products in the same order (each query head reads its key/value head in place instead of a copy), so
    # the output is the same to the last bit, not merely close.
    gen = torch.Generator().manual_seed(queries)
    past = 37
    q = torch.randn(1, 9, queries, 64, generator=gen)
    k = torch.randn(1, 3, past + queries, 64, generator=gen)
    v = torch.randn(1, 3, past + queries, 64, generator=gen)
    mask = _tree_mask(queries, past)
    ours, _ = sdpa_gqa_attention(_Layer(), q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.125)
    assert ours.shape == theirs.shape == (1, queries, 9, 64)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("past", [1, 37, 600])
def test_one_query_under_a_zero_mask_is_generates_own_step_bit_for_bit(past):
    # A plain step passes a zero mask; transformers' generate passes none, which sdpa runs with enable_gqa: ours
    # equals that, not merely the copies' result (which differs in the last bits).
    gen = torch.Generator().manual_seed(past)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    k = torch.randn(1, 3, past + 1, 64, generator=gen)
    v = torch.randn(1, 3, past + 1, 64, generator=gen)
    ours, _ = sdpa_gqa_attention(_Layer(), q, k, v, torch.zeros(1, 1, 1, past + 1), scaling=0.125)
    generates, _ = sdpa_attention_forward(_Layer(), q, k, v, None, scaling=0.125)
    assert ours.shape == (1, 1, 9, 64) and torch.equal(ours, generates)
    masked = torch.zeros(1, 1, 1, past + 1)
    masked[..., : past // 2 + 1] = torch.finfo(torch.float32).min  # a sliding window's cut: those keys not read
    cut, _ = sdpa_gqa_attention(_Layer(), q, k, v, masked, scaling=0.125)
    kept = slice(past // 2 + 1, None)
    window, _ = sdpa_attention_forward(_Layer(), q, k[:, :, kept], v[:, :, kept], None, scaling=0.125)
    torch.testing.assert_close(cut, window, rtol=1e-5, atol=1e-6)  # the same softmax over fewer keys: rounding only


def _verify_forward(model, queries: int = 4):
    """Logits of a masked forward of ``queries`` tokens over a 6-token cache (the shape of a tree verify)."""
    cache = {cache_kwarg(model): new_cache()}
    device = model.device
    with torch.no_grad():
        model(input_ids=torch.arange(10, 16, device=device)[None], use_cache=True, **cache)
        return model(input_ids=torch.arange(20, 20 + queries, device=device)[None],
                     attention_mask=_tree_mask(queries, 6).to(device),
                     position_ids=torch.arange(6, 6 + queries, device=device)[None], use_cache=True, **cache).logits


def test_block_skips_repeat_kv_and_keeps_logits(monkeypatch, tiny_llama):
    model, _ = tiny_llama
    if model.device.type != "cpu":
        pytest.skip("the copy-free path is a CPU one (cpu_kernels/attention.py): on CUDA, SDPA with enable_gqa and a "
                    "mask falls back to its slowest kernel, so the block leaves every call to sdpa's own")
    reference = _verify_forward(model)
    calls = []
    real = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    _verify_forward(model)
    assert calls, "the tiny Llama (4 query heads on 2) should copy its keys and values under plain sdpa"
    calls.clear()
    with grouped_query_attention(model) as switched:
        assert switched == 1
        inside = _verify_forward(model)
    assert calls == []
    assert torch.equal(inside, reference)


def test_configs_switched_for_the_block_only(tiny_llama):
    model, _ = tiny_llama
    eager, _ = build_tiny(attn_implementation="eager")
    with grouped_query_attention(model, eager, None) as outer:
        assert outer == 1
        assert model.config._attn_implementation == GQA_SDPA
        assert eager.config._attn_implementation == "eager"  # only sdpa is switched
        with grouped_query_attention(model) as inner:
            assert inner == 0
        assert model.config._attn_implementation == GQA_SDPA  # the inner block left the outer one's config alone
    assert model.config._attn_implementation == "sdpa"
    with grouped_query_attention(model, enabled=False) as none:
        assert none == 0 and model.config._attn_implementation == "sdpa"


def test_config_restored_when_the_block_raises(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(RuntimeError), grouped_query_attention(model):
        raise RuntimeError("stop")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_engine_greedy_equals_generate_through_the_block(request, fixture, monkeypatch):
    # Drafts of 6 nodes are accepted, so every step is a masked forward of several queries through the fast path.
    model, _ = request.getfixturevalue(fixture)
    prompt = torch.arange(30, 42, device=model.device)
    with torch.no_grad():
        ref = model.generate(prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long, device=model.device),
                             do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    calls = []
    real = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    engine = SpeculativeDecoder(model, OracleDrafter(ref, depth=5), eos_token_ids=[], linear_kernel="torch")
    calls.clear()  # the constructor's tree-attention probe runs outside a decode, on plain sdpa
    result = engine.generate(prompt, max_new_tokens=40)
    assert result.tokens == ref
    assert result.stats.tau > 3.0  # the drafts were accepted: a broken fast path would show in the tokens
    if model.device.type == "cpu":  # elsewhere the block leaves attention to sdpa's own, copies included
        assert calls == []
    assert model.config._attn_implementation == "sdpa"
