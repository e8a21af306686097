"""Lean Llama-form layers (cpu_kernels/lean_layers.py): the same logits as transformers' forwards, bit for bit, on a
plain step and a tree-verify step under the engine's kernels; the engine's greedy output still HF generate's on
SmolLM2 with every draft accepted; the classes set back after the block with the state dict unchanged; a form not
covered keeps its own forward. Llama's whole stack in one forward: the same logits and hidden states as HF's, bit for
bit, and HF's forward wherever a hook, training or an argument it does not cover is present."""

import pytest
import torch
import torch.nn.functional as F

import selfspec.cpu_kernels.lean_layers as lean_module
from selfspec.core.target import build_tiny, cache_kwarg
from selfspec.cpu_kernels.lean_layers import LeanStack, lean_class, lean_layers
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


def _stack_steps(model, plan: RowPlan | None, lean: bool) -> list:
    """Outputs (logits and every hidden state) of _steps' three calls, hidden states asked for."""
    cache = {cache_kwarg(model): new_cache()}
    calls = [dict(input_ids=torch.arange(10, 16)[None]),
             dict(input_ids=torch.tensor([[30]]), position_ids=torch.tensor([[6]])),
             dict(input_ids=torch.arange(20, 24)[None], attention_mask=_tree_mask(7),
                  position_ids=torch.tensor([[7, 8, 8, 9]]))]
    with torch.no_grad(), decoding_kernels(model, plan=plan, lean=lean):
        return [model(**call, use_cache=True, output_hidden_states=True, **cache) for call in calls]


def _counting_stack(monkeypatch) -> dict[str, int]:
    """How often the whole-stack forward ran ("forwards") and how many layers it ran on its parts read once."""
    counts = {"forwards": 0, "layers": 0}
    width, layer = LeanStack.width, LeanStack.layer

    def counting_width(self, rows):
        counts["forwards"] += 1
        return width(self, rows)

    def counting_layer(self, *args):
        counts["layers"] += 1
        return layer(self, *args)

    monkeypatch.setattr(LeanStack, "width", counting_width)
    monkeypatch.setattr(LeanStack, "layer", counting_layer)
    return counts


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


@pytest.mark.parametrize("plan", PLANS)
def test_whole_stack_same_logits_and_hidden_states_bit_for_bit(plan, monkeypatch):
    # Llama's whole stack in one forward runs each layer's lean ops on its parts read once and collects the hidden
    # states as transformers' capture hooks would (the embedding, each layer's output, the last tied to the normed
    # one): every tensor equal to the last bit.
    if plan == "packed" and not can_pack(torch.zeros(2, 2)):
        pytest.skip("this PyTorch has no oneDNN packed product")
    model, _ = build_tiny("llama")
    reference = _stack_steps(model, PLANS[plan], lean=False)
    counts = _counting_stack(monkeypatch)
    lean = _stack_steps(model, PLANS[plan], lean=True)
    layers = model.config.num_hidden_layers
    if plan == "torch":  # no small-batch linears: no stack of the form, each module's lean forward
        assert counts == {"forwards": 0, "layers": 0}
    else:  # a call whose rows the plan leaves to PyTorch (the default plan's one row) runs HF's forward
        fused = sum(PLANS[plan].width(rows) != 0 for rows in (6, 1, 4))
        assert counts == {"forwards": 3, "layers": fused * layers} and fused >= 2
    for ours, theirs in zip(lean, reference):
        assert torch.equal(ours.logits, theirs.logits)
        assert len(ours.hidden_states) == len(theirs.hidden_states) == layers + 1
        for a, b in zip(ours.hidden_states, theirs.hidden_states):
            assert torch.equal(a, b)
    assert type(model).__name__ == "LlamaForCausalLM" and "_lean_stack" not in model.__dict__  # set back, cleared


def test_whole_stack_keeps_hf_forward_for_what_it_does_not_cover(monkeypatch):
    model, _ = build_tiny("llama")
    counts = _counting_stack(monkeypatch)
    ids = torch.arange(10, 14)[None]

    def run(**kwargs):
        cache = {cache_kwarg(model): new_cache()}
        return model(input_ids=ids, use_cache=True, **cache, **kwargs)

    with torch.no_grad(), decoding_kernels(model, plan=RowPlan.default(), lean=False):
        expected = run().logits  # the same products, HF's layers
    with decoding_kernels(model, plan=RowPlan.default()):
        with torch.no_grad():
            assert torch.equal(run().logits, expected) and counts["forwards"] == 1
            run(output_hidden_states=True)  # HF installs its capture hooks: the stack still runs, collecting itself
            assert counts["forwards"] == 2
            for module in (model.model, model.model.layers[1], model.model.layers[1].self_attn,
                           model.model.layers[0].mlp.down_proj, model.model.norm):
                seen = []
                handle = module.register_forward_hook(lambda *a: seen.append(1))
                assert torch.equal(run().logits, expected)
                handle.remove()
                assert seen == [1] and counts["forwards"] == 2, module  # a hooked part: HF's forward, hook run
            for kwargs in ({"output_attentions": True}, {"return_dict": True}, {"labels": ids}):
                assert torch.equal(run(**kwargs).logits, expected)
                assert counts["forwards"] == 2, kwargs
            assert torch.equal(run().logits, expected) and counts["forwards"] == 3  # hooks gone: the stack again
        run()  # gradients on
        model.train()
        with torch.no_grad():
            run()
        model.eval()
        assert counts["forwards"] == 3


@pytest.mark.real_model
def test_greedy_equals_hf_on_smollm2_through_lean_layers(smollm2, monkeypatch):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, return_dict=False)
    ref = model.generate(torch.tensor([ids], device=model.device), do_sample=False,
                         max_new_tokens=24)[0, len(ids):].tolist()
    calls = _counting_rotary(monkeypatch)
    counts = _counting_stack(monkeypatch)
    for drafter in (VanillaDrafter(), OracleDrafter(ref, depth=5)):  # plain steps; 6-token verifies, all accepted
        engine = SpeculativeDecoder(model, drafter, eos_token_ids=[], linear_kernel="auto")
        calls.clear()
        counts["layers"] = 0
        assert engine.generate(ids, max_new_tokens=24).tokens == ref
        assert calls, "the engine's steps should run the lean attention"
        assert counts["layers"], "the engine's steps should run SmolLM2's whole stack in one forward"
