"""Greedy verification's bfloat16 LM head (cpu_kernels/greedy_head.py): its error bound, its argmax, and the engine
with it against HF ``generate``, with drafts that are accepted."""

import pytest
import torch
import torch.nn.functional as F

import selfspec.cpu_kernels.greedy_head as greedy_module
from selfspec.decode.drafters import OracleDrafter
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.cpu_kernels.greedy_head import GreedyHead, error_factor, greedy_head, matches_model
from selfspec.decode.verify import Sampling
from selfspec.core.target import build_tiny


def heavy_tailed(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Normal values scaled by e^(2 N(0,1)): magnitudes over several orders, so that products cancel and norms
    overstate them, the cases a bound must still cover."""
    return torch.randn(*shape, generator=generator) * torch.exp(2 * torch.randn(*shape, generator=generator))


@pytest.mark.parametrize("hidden_size", [64, 576, 2048])
def test_the_bound_covers_every_logit_with_room_to_spare_and_no_more(hidden_size):
    g = torch.Generator().manual_seed(hidden_size)
    weight = heavy_tailed(512, hidden_size, generator=g)
    hidden = torch.cat([heavy_tailed(16, hidden_size, generator=g), torch.randn(16, hidden_size, generator=g)])
    head = GreedyHead(weight)
    approx = head.approximate(hidden).double()
    exact = hidden.double() @ weight.double().T
    float32 = F.linear(hidden, weight).double()
    radius = head.radius(hidden).double()
    # the bound covers the distance to the exact logit and to a float32 kernel's
    assert bool(((approx - exact).abs() <= radius).all())
    assert bool(((approx - float32).abs() <= radius).all())
    # and it is no looser than Cauchy-Schwarz makes it: the worst error reaches a few percent of it
    assert float(((approx - exact).abs() / radius).max()) > 0.01


def test_the_factor_follows_the_rounding_units():
    u, n = 2.0 ** -8, 576 * 2.0 ** -24
    # two rounded operands and a rounded result: about 3u, plus the float32 accumulations' 2 gamma
    assert error_factor(576) == pytest.approx(3 * u + 2 * n, rel=0.01)
    with pytest.raises(ValueError):
        error_factor(2 ** 23)


def near_ties(vocab: int, hidden_size: int, gap: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden state and a weight whose eight top logits are ``gap`` apart (relative to the top one), closer than
    bfloat16 resolves them: random rows, each moved along the hidden state to its logit, so that each row's rounding
    errs its own way."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=g)
    hidden = torch.randn(1, hidden_size, generator=g)
    top = float(F.linear(hidden, weight).max())
    rows = torch.randperm(vocab, generator=g)[:8]
    want = top * (1 + gap * torch.arange(8, dtype=torch.float32))  # above the old top, each gap apart
    direction = hidden[0] / hidden[0].dot(hidden[0])
    weight[rows] += (want - weight[rows] @ hidden[0])[:, None] * direction
    return hidden, weight


@pytest.mark.parametrize("gap", [3e-4, 1e-4, 1e-5])
def test_the_argmax_is_the_float32_products_on_near_ties(gap):
    wrong_without_bound = 0
    for seed in range(20):
        hidden, weight = near_ties(1000, 256, gap, seed)
        head = GreedyHead(weight)
        want = int(F.linear(hidden, weight).argmax())
        assert int(head.logits(hidden).argmax()) == want
        head.factor = 0.0  # the largest bfloat16 logits alone, recomputed in float32
        wrong_without_bound += int(head.logits(hidden).argmax()) != want
    # without the bound some of these go wrong: the bound is what keeps them exact
    assert wrong_without_bound > 0


def test_candidates_stay_few_on_well_separated_logits():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 256, generator=g)
    hidden = torch.randn(8, 256, generator=g) * 3
    head = GreedyHead(weight)
    logits = head.logits(hidden)
    assert torch.equal(logits.argmax(dim=1), F.linear(hidden, weight).argmax(dim=1))
    assert head.positions == 8 and head.candidates < 8 * 40  # not the whole vocabulary in float32 again


def test_a_non_finite_hidden_state_takes_the_float32_head():
    weight = torch.randn(64, 16)
    hidden = torch.randn(2, 16)
    hidden[1, 3] = float("inf")
    out = GreedyHead(weight).logits(hidden)
    assert torch.equal(out.argmax(dim=1), F.linear(hidden, weight).argmax(dim=1))


CPU_ONLY = "the bfloat16 greedy head is made for a CPU's float32 LM head only (cpu_kernels/greedy_head.py: greedy_head)"


def reference(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_engine_greedy_with_the_head_equals_generate(request, fixture, fresh_heads):
    # Random tiny targets have logits close together: many positions where bfloat16 alone would pick another token.
    model, _ = request.getfixturevalue(fixture)
    if model.device.type != "cpu":
        pytest.skip(CPU_ONLY)
    prompt = torch.arange(30, 42)
    ref = reference(model, prompt, 48)
    engine = SpeculativeDecoder(model, OracleDrafter(ref, depth=5), eos_token_ids=[], linear_kernel="small_batch")
    result = engine.generate(prompt, max_new_tokens=48)
    head = greedy_head(model)
    assert head is not None and head.positions > 0  # the head verified the steps
    assert result.tokens == ref
    assert result.stats.tau > 3.0  # drafts of 5 were accepted, so every node's argmax counted


def test_the_engine_leaves_the_head_alone_where_it_does_not_apply(tiny_llama, fresh_heads):
    model, _ = tiny_llama
    prompt = torch.arange(30, 42)
    ref = reference(model, prompt, 16)
    for kernel, sampling in (("torch", Sampling()), ("small_batch", Sampling(acceptance="sample"))):
        SpeculativeDecoder(model, OracleDrafter(ref, depth=3), eos_token_ids=[],
                           linear_kernel=kernel).generate(prompt, max_new_tokens=16, sampling=sampling)
    assert greedy_module._HEADS.get(model) is None  # not even made: PyTorch's kernels, or sampling
    engine = SpeculativeDecoder(model, OracleDrafter(ref, depth=3), eos_token_ids=[], linear_kernel="small_batch",
                                greedy_head=False)
    assert engine.generate(prompt, max_new_tokens=16).tokens == ref
    assert greedy_module._HEADS.get(model) is None


def test_a_model_whose_logits_are_not_its_head_keeps_its_own(fresh_heads, device):
    if device.type != "cpu":
        pytest.skip(CPU_ONLY)
    model, _ = build_tiny("llama", seed=3)
    model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out.logits * 2.0) or out)
    prompt = torch.arange(30, 42)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    assert not matches_model(model, out.hidden_states[-1][0], out.logits[0])
    ref = reference(model, prompt, 16)
    engine = SpeculativeDecoder(model, OracleDrafter(ref, depth=3), eos_token_ids=[], linear_kernel="small_batch")
    assert engine.generate(prompt, max_new_tokens=16).tokens == ref
    head = greedy_module._HEADS[model][1]
    assert head is not None and head.positions == 0  # made, found not to be the model's logits, never used
