"""Target loading: tiny random models are deterministic and frozen; the embedded SmolLM2 loads; bad ids fail clearly."""

from __future__ import annotations

import pytest
import torch

from selfspec.core.archs import TINY_ARCHS
from selfspec.core.target import (
    Target,
    TargetLoadError,
    TargetMismatchError,
    build_tiny,
    check_fingerprint,
    fingerprint,
    load_target,
    resolve_dtype,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_is_deterministic_frozen_and_generates(arch):
    a, tok = build_tiny(arch, seed=3)
    b, _ = build_tiny(arch, seed=3)
    c, _ = build_tiny(arch, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.model_type == arch
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    out = a.generate(torch.tensor([ids], device=a.device), max_new_tokens=8, do_sample=False)
    assert out.shape[1] == len(ids) + 8 or out[0, -1].item() == tok.eos_token_id


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_every_tiny_arch_builds_at_another_head_size_and_depth_and_is_rebuilt_from_its_name(arch):
    """Every row of core/archs.py takes build_tiny's head size (vLLM's CPU attention needs heads of 32) and depth:
    the attention weights, and only they, change shape; a deeper mixed model repeats its layer kinds; the target
    heads record (its name and fingerprint) is built again."""
    from selfspec.core.archs import layer_kinds
    from selfspec.decode.settings import target_config_from_heads

    shapes = {k: v.shape for k, v in build_tiny(arch)[0].state_dict().items()}
    wider = {k: v.shape for k, v in build_tiny(arch, head_dim=32)[0].state_dict().items()}
    changed = {k for k in shapes if shapes[k] != wider[k]}
    assert changed and all(".self_attn." in k for k in changed), changed
    target = load_target({"source": "tiny", "dtype": "float32", "device": "cpu",
                          "tiny": {"arch": arch, "hidden_size": 128, "num_hidden_layers": 6}})
    assert target.name == f"tiny-{arch}"
    assert layer_kinds(target.model.config) == (layer_kinds(build_tiny(arch)[0].config) * 2)[:6]
    again = load_target(target_config_from_heads({"base_model": target.name,
                                                  "target_fingerprint": fingerprint(target.model)}))
    assert all(torch.equal(v, again.model.state_dict()[k]) for k, v in target.model.state_dict().items())


def test_heads_record_the_whole_tiny_recipe_and_decoding_builds_the_same_target(tmp_path):
    """A tiny target with a head size and a config field of its own (what tests/test_serving_archs.py builds for
    vLLM's MLA kernel): heads saved on it name how to build it, so ``heads=`` alone loads that target, not the default
    shape of its name (whose weights differ, and which the fingerprint check would refuse)."""
    from selfspec.decode.settings import target_config_from_heads
    from selfspec.heads.io import read_heads_config, save_heads

    model, tokenizer = build_tiny("deepseek_v3", hidden_size=128, head_dim=32, config={"kv_lora_rank": 64})
    head = torch.nn.Linear(128, 8)
    target = Target(model=model, tokenizer=tokenizer, name="tiny-deepseek_v3")
    path = save_heads(tmp_path / "heads", head, "medusa", {"num_heads": 1}, target)
    meta = read_heads_config(path)
    again = load_target(target_config_from_heads(meta))
    assert again.model.config.kv_lora_rank == 64 and again.model.config.v_head_dim == 32
    # the recorded recipe builds on the CPU (decoding moves it where its device setting says)
    assert all(torch.equal(v.cpu(), again.model.state_dict()[k]) for k, v in model.state_dict().items())
    check_fingerprint(meta["target_fingerprint"], again.model, what="heads")
    # the name and fingerprint alone (heads saved before this) build the default shape, which is another target
    with pytest.raises(TargetMismatchError):
        default = load_target(target_config_from_heads({k: v for k, v in meta.items() if k != "model"}))
        check_fingerprint(meta["target_fingerprint"], default.model, what="heads")


def test_tiny_from_config_matches_build(device):
    target = load_target({"source": "tiny", "device": str(device), "dtype": "float32",
                          "tiny": {"arch": "qwen2", "seed": 0}})
    ref, _ = build_tiny("qwen2", seed=0)
    assert target.name == "tiny-qwen2"
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in target.model.state_dict().items())


def test_fingerprint_tells_targets_apart(tiny_llama, tiny_qwen2):
    llama, _ = tiny_llama
    check_fingerprint(fingerprint(llama), llama)
    with pytest.raises(TargetMismatchError, match="another target"):
        check_fingerprint(fingerprint(tiny_qwen2[0]), llama)
    other_seed, _ = build_tiny("llama", seed=1)  # same shapes, different weights
    with pytest.raises(TargetMismatchError, match="embedding weights differ"):
        check_fingerprint(fingerprint(other_seed), llama)


def test_fingerprint_survives_dtype_change(tiny_llama):
    import copy

    model = copy.deepcopy(tiny_llama[0])  # the round trip rounds the weights: not the shared fixture's
    stored = fingerprint(model)
    check_fingerprint(stored, model.to(torch.bfloat16))


def test_unreachable_hub_id_says_how_to_use_a_local_folder(monkeypatch):
    import huggingface_hub.constants

    # Offline mode answers at once; the message is the same one a failed download gives after its retries.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TargetLoadError, match="model.name_or_path=DIR"):
        load_target({"source": "hub", "name_or_path": "no-such-org/no-such-model", "device": "cpu"})


def test_bad_device_and_dtype_are_named():
    with pytest.raises(ValueError, match="Unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(TargetLoadError, match="CUDA is not available"):
            load_target({"source": "tiny", "device": "cuda"})


@pytest.mark.real_model
def test_smollm2_loads_from_cache_and_is_the_real_model(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    assert smollm2.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert not any(p.requires_grad for p in model.parameters())
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])


def test_a_converted_smollm2_folder_is_read_without_the_lock_and_a_stale_config_is_mended(tmp_path, monkeypatch):
    import json

    import selfspec.core.target as target

    monkeypatch.setattr(target, "_find_smollm2_gguf", lambda: pytest.fail("a converted folder was converted again"))
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"x": 1}}))
    assert target.ensure_smollm2(tmp_path) == folder  # the stale config needs the lock: it is mended under it
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}
    lock = tmp_path / "models" / ".SmolLM2-135M-Instruct.lock"
    lock.unlink(missing_ok=True)
    assert target.ensure_smollm2(tmp_path) == folder
    assert not lock.exists()  # whole and mended: returned without taking (or making) the lock file
