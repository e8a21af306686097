"""Lean Llama-form layers (cpu_kernels/lean_layers.py): the same logits as transformers' forwards, bit for bit, on a
plain step and a tree-verify step under the engine's kernels; the engine's greedy output still HF generate's on
SmolLM2 with every draft accepted; the classes set back after the block with the state dict unchanged; a form not
covered keeps its own forward."""

import pytest
import torch
import torch.nn.functional as F

import selfspec.cpu_kernels.lean_layers as lean_module
from selfspec.core.target import build_tiny, cache_kwarg
from selfspec.cpu_kernels.lean_layers import lean_class, lean_layers
from selfspec.cpu_kernels.linear_kernels import MAX_ROWS, PACKED, RowPlan, can_pack, decoding_kernels
from selfspec.decode.cache import new_cache
from selfspec.decode.drafters import OracleDrafter, VanillaDrafter
from selfspec.decode.engine import SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEG = torch.finfo(torch.float32).min


def _tree_mask(past: int) -> torch.Tensor:
    """An additive [1, 1, 4, past + 4] tree mask: the past, a root, two siblings under it, a child of the second."""
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 4, past + 4)
    mask[..., past:] = torch.zeros(4, 4).masked_fill(~allowed, NEG)
    return mask


def _steps(model, plan: RowPlan | None, lean: bool) -> list[torch.Tensor]:
    """Logits of a 6-token prefill, a plain one-token step and a 4-node tree-verify step (positions by depth), under
    the engine's kernels with or without the lean layers."""
    cache = {cache_kwarg(model): new_cache()}
    with torch.no_grad(), decoding_kernels(model, plan=plan, lean=lean):
        prefill = model(input_ids=torch.arange(10, 16)[None], use_cache=True, **cache).logits
        plain = model(input_ids=torch.tensor([[30]]), position_ids=torch.tensor([[6]]), use_cache=True,
                      **cache).logits
        tree = model(input_ids=torch.arange(20, 24)[None], attention_mask=_tree_mask(7),
                     position_ids=torch.tensor([[7, 8, 8, 9]]), use_cache=True, **cache).logits
    return [prefill, plain, tree]


def _counting_rotary(monkeypatch) -> list[int]:
    calls = []
    real = lean_module.rotated
    monkeypatch.setattr(lean_module, "rotated", lambda *a: calls.append(1) or real(*a))
    return calls


PLANS = {"torch": None, "padded": RowPlan.default(), "packed": RowPlan((PACKED,) * MAX_ROWS)}


LEAN_ATTENTION = ("llama", "qwen2", "qwen3", "mistral")  # the rest: Llama-form norms, MLPs or decoder layers only


@pytest.mark.parametrize("arch", [*LEAN_ATTENTION, "phi3", "deepseek_v3", "gemma3"])
@pytest.mark.parametrize("plan", PLANS)
def test_same_logits_as_hf_bit_for_bit(arch, plan, monkeypatch):
    # The same elementwise maths in the same order (F.rms_norm gives HF's RMSNorm's bits in float32; the rotary's
    # roll times the signed sin is rotate_half times sin), so equal to the last bit, not merely close; the grouped
    # product is the one the first projection computes anyway.
    if plan == "packed" and not can_pack(torch.zeros(2, 2)):
        pytest.skip("this PyTorch has no oneDNN packed product")
    model, _ = build_tiny(arch)
    reference = _steps(model, PLANS[plan], lean=False)
    calls = _counting_rotary(monkeypatch)
    lean = _steps(model, PLANS[plan], lean=True)
    assert bool(calls) == (arch in LEAN_ATTENTION)
    for ours, theirs in zip(lean, reference):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("plan", ["torch", "packed"])
def test_same_logits_in_bfloat16(arch, plan):
    # The attention, MLP and layer forwards run in any dtype (the norms keep HF's below float32): the same elementwise
    # ops in the same dtype, so the same bits in bfloat16 too.
    if plan == "packed" and not can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("this PyTorch has no oneDNN packed product in bfloat16")
    model, _ = build_tiny(arch)
    model = model.to(torch.bfloat16)
    for ours, theirs in zip(_steps(model, PLANS[plan], lean=True), _steps(model, PLANS[plan], lean=False)):
        assert torch.equal(ours, theirs)


def test_rms_norm_bits_and_other_dtypes():
    model, _ = build_tiny("llama")
    norm = model.model.norm
    x = torch.randn(3, 5, 64) * 7
    with torch.no_grad():
        expected = norm(x)
        with lean_layers(model):
            assert type(norm).__name__ == "LeanLlamaRMSNorm"
            assert torch.equal(norm(x), expected)
            assert torch.equal(F.rms_norm(x, (64,), norm.weight, norm.variance_epsilon), expected)
            half = x.to(torch.bfloat16)  # HF's upcasts and rounds before the weight multiplies: its own forward
            assert torch.equal(norm(half), type(norm).__mro__[2].forward(norm, half))


def test_classes_set_back_and_state_dict_unchanged():
    model, _ = build_tiny("qwen3")
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with lean_layers(model) as swapped:
        assert swapped == 4 * 7 + 1  # per layer: itself, attention, MLP, 2 norms, q/k norms; the final norm
        inside = {name: type(m) for name, m in model.named_modules()}
        assert all(issubclass(inside[n], classes[n]) for n in classes)
        with lean_layers(model) as again:  # an inner block swaps nothing
            assert again == 0
        assert model.state_dict().keys() == state.keys()
    assert {name: type(m) for name, m in model.named_modules()} == classes
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])


def test_forms_not_covered_keep_their_forward():
    # Gemma 3's norm (1 + weight), its attention (soft-capping, q/k norms), gpt-oss's sinks, Phi-3's fused
    # projections and DeepSeek's MLA have other forwards: no lean class.
    for arch in ("gemma3", "gpt_oss", "phi3", "deepseek_v3"):
        model, _ = build_tiny(arch)
        attention = model.model.layers[0].self_attn
        assert lean_class(type(attention)) is None, arch
    gemma, _ = build_tiny("gemma3")
    assert lean_class(type(gemma.model.norm)) is None
    with torch.no_grad(), lean_layers(gemma):  # its MLP has Llama's form but GELU: its own forward runs
        mlp = gemma.model.layers[0].mlp
        x = torch.randn(1, 2, 64)
        assert torch.equal(mlp(x), type(mlp).__mro__[2].forward(mlp, x))


def test_training_gradients_and_hooks_take_hf_forward(monkeypatch):
    model, _ = build_tiny("llama")
    calls = _counting_rotary(monkeypatch)
    ids = torch.arange(10, 14)[None]
    with decoding_kernels(model, plan=RowPlan.default()):
        model(input_ids=ids)  # gradients on: HF's forward
        assert calls == []
        layer = model.model.layers[0]
        seen = []
        handle = layer.post_attention_layernorm.register_forward_hook(lambda *a: seen.append(1))
        with torch.no_grad():
            model(input_ids=ids)
        handle.remove()
        assert calls and seen == [1]  # the hooked norm is called, not only its forward


@pytest.mark.real_model
def test_greedy_equals_hf_on_smollm2_through_lean_layers(smollm2, monkeypatch):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, return_dict=False)
    ref = model.generate(torch.tensor([ids], device=model.device), do_sample=False,
                         max_new_tokens=24)[0, len(ids):].tolist()
    calls = _counting_rotary(monkeypatch)
    for drafter in (VanillaDrafter(), OracleDrafter(ref, depth=5)):  # plain steps; 6-token verifies, all accepted
        engine = SpeculativeDecoder(model, drafter, eos_token_ids=[], linear_kernel="auto")
        calls.clear()
        assert engine.generate(ids, max_new_tokens=24).tokens == ref
        assert calls, "the engine's steps should run the lean attention"
