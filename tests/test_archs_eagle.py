"""EAGLE-1 and EAGLE-3 drafters for every target architecture of core/archs.py (``TINY_ARCHS``).

The draft layer is a Llama layer whatever the target (selfspec.heads.eagle). For each architecture and each drafter (eagle;
eagle3 in the fc and midlayer layouts):

- trained through the real loop on the target's own greedy continuations from the feature store, the loss falls;
  online, the first steps have the same losses (a float32 store, a constant learning rate: the same features feed the
  same updates); the target does not change;
- greedy decoding with the trained heads, loaded from their folder, equals HF ``generate`` token for token, with
  drafts accepted;
- the serving formats (eagle3 and speculators for midlayer EAGLE-3 heads, vLLM's EAGLE-1 for EAGLE-1 heads without
  fc bias and input norm) compute the drafter when read as the engines read them (tests/test_export.py's
  references), their config naming the Llama draft layer with the fields saved with the heads.

One architecture's runs share a module fixture (built on first use), so each is trained once per variant. Sampling
is checked on one architecture, the one furthest from Llama: on a 12-token Gemma 3 (soft-capped logits, a sliding and
a full layer) the sampled tokens follow the target's distribution with EAGLE-1 and EAGLE-3 drafts accepted.
"""

from __future__ import annotations

import pytest
import torch

from selfspec.core.archs import TINY_ARCHS
from selfspec.core.target import Target, build_tiny
from selfspec.decode.eagle_drafter import EagleTreeDrafter
from selfspec.decode.engine import SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = list(TINY_ARCHS)
VARIANTS = {"eagle": ["heads=eagle", "heads.draft_vocab_size=null"],  # the whole LM head; test_eagle.py: a draft vocabulary
            "eagle3": ["heads=eagle3"],
            "eagle3-mid": ["heads=eagle3", "heads.layout=midlayer"]}
STEPS = 16  # from the store: drafts are accepted after them on every architecture (eagle3-mid, the slowest to learn: tau >= 1.2)
ONLINE_STEPS = 4  # online: the store run's first steps again
MAX_NEW = 20


def test_the_llama_layer_for_a_target():
    """selfspec.core.archs.llama_layer_fields on the architectures' default (full-size) configs: a mixture of experts gets a
    dense MLP as wide as the experts a token passes through, which for Qwen3-MoE and DeepSeek-V3 is their own dense
    layers' width; DeepSeek-V3's latent attention gets SpecForge's drafter heads (hidden / v_head_dim of them on 8);
    Gemma 3 the full-attention layers' rope; no partial rotation."""
    import transformers

    from selfspec.core.archs import llama_layer_fields

    for name in ("Qwen3MoeConfig", "DeepseekV3Config"):
        config = getattr(transformers, name)()
        assert llama_layer_fields(config)["intermediate_size"] == config.intermediate_size
    gpt_oss = transformers.GptOssConfig()
    assert llama_layer_fields(gpt_oss)["intermediate_size"] == gpt_oss.num_experts_per_tok * gpt_oss.intermediate_size
    assert llama_layer_fields(gpt_oss)["rope_parameters"]["rope_type"] == "yarn"
    deepseek = transformers.DeepseekV3Config()
    fields = llama_layer_fields(deepseek)
    assert fields["head_dim"] == deepseek.v_head_dim and fields["num_attention_heads"] * fields["head_dim"] == 7168
    assert fields["num_key_value_heads"] == 8
    gemma = transformers.Gemma3TextConfig()
    assert llama_layer_fields(gemma)["rope_parameters"] == gemma.rope_parameters["full_attention"]
    phi = transformers.Phi3Config(partial_rotary_factor=0.75)
    assert "partial_rotary_factor" not in llama_layer_fields(phi)["rope_parameters"]
    for arch in ARCHS:  # the tiny rows: the target's attention where it is the plain kind, no biases
        config = build_tiny(arch)[0].config
        fields = llama_layer_fields(config)
        assert not fields["attention_bias"] and not fields["mlp_bias"] and fields["hidden_act"] == "silu"
        if not getattr(config, "kv_lora_rank", None):
            assert fields["num_attention_heads"] == config.num_attention_heads
            assert fields["num_key_value_heads"] == config.num_key_value_heads


def test_rms_norm_scale_reads_what_the_norm_multiplies_by():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from selfspec.core.layers import rms_norm_scale

    weight = torch.randn(16, generator=torch.Generator().manual_seed(0))
    llama, gemma = LlamaRMSNorm(16), Gemma3RMSNorm(16)
    with torch.no_grad():
        llama.weight.copy_(weight)
        gemma.weight.copy_(weight)  # Gemma's norm multiplies by 1 + weight
    # a constant input of 1e3 normalises to 1 / sqrt(1 + eps / 1e6): float32 rounding is all that is left
    torch.testing.assert_close(rms_norm_scale(llama, 16), weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm_scale(gemma, 16), 1 + weight, rtol=1e-6, atol=1e-6)
    assert rms_norm_scale(torch.nn.LayerNorm(16), 16) is None  # a norm that centres its input has no such scale


def own_continuations(model, n: int, seed: int, prompt: int = 6, answer: int = 34):
    """The target's greedy continuations of random byte prompts: the prompt unlabelled, the answer labelled."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 259, (n, prompt), generator=g).to(model.device)
    with torch.no_grad():
        out = model.generate(prompts, do_sample=False, max_new_tokens=answer, min_new_tokens=answer, pad_token_id=0,
                             eos_token_id=None).cpu().tolist()
    return datasets.Dataset.from_dict({"input_ids": out, "labels": [[-100] * prompt + r[prompt:] for r in out]})


def run_cfg(run_dir, arch, variant, *overrides):
    from conftest import compose

    return compose("eagle", [
        "experiment=debug", f"model.tiny.arch={arch}", f"run_dir={run_dir}", "trainer.batch_size=8",
        "trainer.learning_rate=1e-2", "trainer.lr_scheduler=constant", "trainer.warmup_steps=0", "trainer.eval_every=0",
        "trainer.eval_max_examples=4", "trainer.save_every=0", "trainer.log_every=1", "speed_check.prompts=null",
        "heads.draft_vocab_size=128", "feature_store.dtype=float32", *VARIANTS[variant], *overrides])


def decode_prompts(n: int = 4):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 259, (int(torch.randint(4, 14, (1,), generator=g)),), generator=g) for _ in range(n)]


_RUNS: dict = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """arch -> (target, {variant: (online run, store run)}, HF greedy answers to decode_prompts()), trained on
    first use."""
    import datasets

    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    def get(arch):
        if arch not in _RUNS:
            model, tokenizer = build_tiny(arch)
            target = Target(model=model, tokenizer=tokenizer, name=f"tiny-{arch}")
            before = {k: v.clone() for k, v in model.state_dict().items()}
            data = datasets.DatasetDict({"train": own_continuations(model, 16, 0),
                                         "eval": own_continuations(model, 4, 1)})
            root = tmp_path_factory.mktemp(arch)
            out = {}
            for variant in VARIANTS:
                done = []
                for source, steps in (("online", ONLINE_STEPS), ("store", STEPS)):
                    cfg = run_cfg(root / f"{variant}-{source}", arch, variant, f"features={source}",
                                  f"trainer.max_steps={steps}",
                                  f"feature_store.dir={root / ('store-' + variant.split('-')[0])}")
                    done.append(train(cfg, EagleMethod(cfg), target=target, datasets=data))
                out[variant] = tuple(done)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the target is frozen
            answers = [model.generate(ids[None].to(model.device), do_sample=False, max_new_tokens=MAX_NEW,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                       for ids in decode_prompts()]
            _RUNS[arch] = (target, out, answers)
        return _RUNS[arch]

    return get


def saved_weights(run):
    from safetensors.torch import load_file

    return load_file(str(run.run_dir / "heads" / "model.safetensors"))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_trains_online_and_from_the_feature_store(runs, arch, variant):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from selfspec import heads
    target, out, _ = runs(arch)
    online, store = out[variant]
    losses = torch.tensor([h["loss"] for h in store.history])
    assert len(losses) == STEPS and bool(torch.isfinite(losses).all())
    assert losses[-4:].sum() < 0.7 * losses[:4].sum()
    # online: the same losses step for step (the same features, up to float32 summation order in the forward)
    torch.testing.assert_close(torch.tensor([h["loss"] for h in online.history]), losses[:ONLINE_STEPS], rtol=1e-4,
                               atol=1e-5)
    assert saved_weights(online).keys() == saved_weights(store).keys()
    assert (store.run_dir.parent / f"store-{variant.split('-')[0]}" / "meta.json").is_file()
    loaded = heads.load(store.run_dir / "heads", target).module
    assert type(loaded.layer) is LlamaDecoderLayer and loaded.config.draft_layer["attention_bias"] is False
    assert not any(k.endswith(".bias") for k in loaded.layer.state_dict())  # a Llama layer whatever the target
    # every parameter is a linear layer's (initialised by init_linears) or a norm's: none left as torch.empty memory,
    # which a MoE draft layer's stacked expert matrices were (Qwen3-MoE's NaN losses before the layer was Llama's)
    owners = {type(m) for m in loaded.modules() if any(True for _ in m.parameters(recurse=False))}
    assert owners <= {torch.nn.Linear, LlamaRMSNorm}, owners


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_is_lossless_with_accepted_drafts(runs, arch, variant):
    from selfspec import heads
    target, out, answers = runs(arch)
    model = target.model
    drafter = heads.load(out[variant][1].run_dir / "heads", target).module
    decoder = SpeculativeDecoder(model, EagleTreeDrafter(drafter, depth=4, top_k=2, total_tokens=8),
                                 eos_token_ids=[])
    accepted = emitted = forwards = 0
    for ids, ref in zip(decode_prompts(), answers, strict=True):
        res = decoder.generate(ids, max_new_tokens=MAX_NEW)
        assert res.tokens == ref
        accepted += res.stats.accepted
        emitted, forwards = emitted + sum(res.stats.accept_lengths), forwards + res.stats.steps
    assert accepted > 0 and emitted / forwards > 1.1  # tokens per target forward: drafts were accepted


def exported(folder):
    import json

    from safetensors.torch import load_file

    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def assert_llama_draft_config(config, drafter):
    """The exported layer config is a Llama layer of the fields saved with the heads, attending to the whole context:
    no window, or on a target whose every layer slides (where vLLM would give the drafter the target's window) its
    own window as long as any context (selfspec.core.archs.whole_context_window)."""
    layer = drafter.config.draft_layer
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_parameters"):
        assert config[key] == layer[key], key
    assert config["hidden_size"] == drafter.config.hidden_size and config["vocab_size"] == drafter.config.vocab_size
    assert not config["attention_bias"] and not config["mlp_bias"]
    from selfspec.core.archs import SLIDING, layer_kinds

    target = drafter.target.config
    if set(layer_kinds(target)) == {SLIDING}:
        assert config["layer_types"] == [SLIDING] and config["sliding_window"] == target.max_position_embeddings
    else:
        assert "layer_types" not in config and "sliding_window" not in config


@pytest.mark.parametrize("arch", ARCHS)
def test_serving_formats_compute_the_drafter(runs, arch, tmp_path):
    """midlayer EAGLE-3 heads (trained) -> eagle3 and speculators; EAGLE-1 heads of vLLM's shape -> eagle: read
    back the way the engines read them, they compute the drafter's features and top tokens."""
    from test_export import eagle3_reference, eagle_reference

    from selfspec import heads
    from selfspec.heads.eagle import EagleConfig, EagleHeads
    from selfspec.heads.export import export_heads
    from selfspec.heads.io import save_heads

    target, out, _ = runs(arch)
    model = target.model
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(2)).to(model.device)
    positions = torch.arange(9, device=model.device)[None].expand(2, 9)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states

    mid_dir = out["eagle3-mid"][1].run_dir / "heads"
    drafter = heads.load(mid_dir, target).module
    with torch.no_grad():
        mine = drafter(drafter.target_features(hs), ids, positions)
        my_top = drafter.draft_to_target(drafter.logits(mine).argmax(-1))
    hidden3 = torch.cat([hs[i] for i in sorted(drafter.config.layer_ids)], -1)
    for fmt, prefix in (("eagle3", "midlayer."), ("speculators", "layers.0.")):
        folder, used = export_heads(mid_dir, tmp_path / fmt, target, fmt=fmt)
        config, w = exported(folder)
        assert used == fmt
        layer_config = config if fmt == "eagle3" else config["transformer_layer_config"]
        assert config["architectures"] == (["LlamaForCausalLMEagle3"] if fmt == "eagle3" else ["Eagle3Speculator"])
        assert_llama_draft_config(layer_config, drafter)
        w = {k: v.to(model.device) for k, v in w.items()}
        with torch.no_grad():
            ref, ref_top = eagle3_reference(layer_config, w, prefix, hidden3, ids, positions)
        torch.testing.assert_close(ref, mine, atol=1e-5, rtol=1e-4)
        assert torch.equal(ref_top, my_top)

    # EAGLE-1 in vLLM's shape (fc without bias, no input norm), weights drawn away from their start
    torch.manual_seed(0)
    eagle = EagleHeads(EagleConfig.from_target(model, variant="eagle", fc_bias=False, input_norm=False), model)
    with torch.no_grad():
        for p in eagle.parameters():  # drawn on the CPU: the same drafter on every device
            p.add_(torch.randn(p.shape, dtype=p.dtype).to(p.device) * 0.05)
    save_heads(tmp_path / "eagle", eagle, "eagle", eagle.config.to_dict(), model)
    folder, used = export_heads(tmp_path / "eagle", tmp_path / "eagle-vllm", target)  # auto
    config, w = exported(folder)
    assert used == "eagle" and config["architectures"] == ["EagleLlamaForCausalLM"]
    assert_llama_draft_config(config, eagle)
    assert "fc.bias" not in w and not any("input_layernorm" in k or k.startswith("norm") for k in w)
    w = {k: v.to(model.device) for k, v in w.items()}
    with torch.no_grad():
        feature = hs[-1]
        mine = eagle.eval()(feature, ids, positions)
        ref, ref_top = eagle_reference(config, w, feature, ids, positions, model.get_output_embeddings().weight)
    torch.testing.assert_close(ref, mine, atol=1e-5, rtol=1e-4)
    assert torch.equal(ref_top, eagle.logits(mine).argmax(-1))


SAMPLING_ARCH = "gemma3"  # the one that differs most from Llama: alternating layers, soft-capping, scaled embeddings


@pytest.fixture(scope="module")
def sampling_trained(tmp_path_factory):
    """A 12-token two-layer Gemma 3 target (the sampling tests' shape) and EAGLE-1 and EAGLE-3 drafters trained by
    the real loop on its own samples after the sampling prompt."""
    import datasets

    from test_engine import exact_first_three

    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    shape = dict(vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    model, tokenizer = build_tiny(SAMPLING_ARCH, **shape)
    target = Target(model=model, tokenizer=tokenizer, name=f"tiny-{SAMPLING_ARCH}")
    prompt = torch.tensor([3, 5, 7, 1])
    torch.manual_seed(0)
    with torch.no_grad():
        seqs = model.generate(prompt.expand(64, -1).to(model.device), max_new_tokens=8, min_new_tokens=8,
                              do_sample=True, pad_token_id=0, eos_token_id=None).tolist()
    split = datasets.Dataset.from_dict({"input_ids": seqs, "labels": [[-100] * 4 + s[4:] for s in seqs]})
    data = datasets.DatasetDict({"train": split, "eval": split.select(range(8))})
    root = tmp_path_factory.mktemp("eagle-sampling")
    runs = {}
    for variant in ("eagle", "eagle3"):
        cfg = run_cfg(root / variant, SAMPLING_ARCH, variant, f"trainer.max_steps={STEPS}",
                      *[f"model.tiny.{k}={v}" for k, v in shape.items()], "heads.draft_vocab_size=9")
        runs[variant] = train(cfg, EagleMethod(cfg), target=target, datasets=data)
    return target, runs, exact_first_three(model, prompt).reshape(-1)


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_sampled_tokens_follow_the_target_distribution(sampling_trained, variant):
    """The first three sampled tokens over 300 seeds follow the target's own distribution (soft-capped logits, a
    sliding and a full layer), with drafts from a dynamic tree accepted often."""
    from test_engine import sampled_first_three
    from test_verify import chi_square_pvalue

    from selfspec import heads
    target, runs, exact = sampling_trained
    drafter = heads.load(runs[variant].run_dir / "heads", target).module
    counts, accepted = sampled_first_three(target.model, EagleTreeDrafter(drafter, depth=2, top_k=3, total_tokens=6),
                                           seeds=300)
    assert accepted > 0.3  # drafts were accepted often enough for the test to mean something
    assert chi_square_pvalue(counts, exact) > 1e-3
