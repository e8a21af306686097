"""Exported heads compute what the trained heads compute, when read the way the serving engines read them.

The references below are written from those engines' published model code (vLLM's Medusa, SGLang's
LlamaForCausalLMEagle3, speculators' Eagle3Speculator), in plain tensor operations over the exported files only.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from selfspec.heads.eagle import EagleConfig, EagleHeads
from selfspec.heads.export import ExportError, export_heads, push_to_hub, resolve_format
from selfspec.heads.io import save_heads
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.core.target import build_tiny
from selfspec.heads.vocab import build_draft_vocab, count_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_export(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


# --- Medusa -> vLLM ------------------------------------------------------------------------------------------------------


def vllm_medusa_logits(config, w, hidden):
    """vLLM's Medusa: per head, x = x + SiLU(layer(x)) over its blocks, then its LM head (lm_heads.0 for all heads
    when original_lm_head) of truncated_vocab_size rows (a fuller one sliced by token_map at load); with a token_map
    the logits are scattered into a vocab_size row of -inf at the map's ids."""
    token_map = w.get("token_map") if config["truncated_vocab_size"] < config["vocab_size"] else None
    assert (config["truncated_vocab_size"] == config["vocab_size"]) or token_map is not None  # vLLM asserts this
    out = []
    for h in range(config["num_heads"]):
        x = hidden
        for i in range(config["num_hidden_layers"]):
            x = x + F.silu(x @ w[f"blocks.{h}.layers.{i}.weight"].T + w[f"blocks.{h}.layers.{i}.bias"])
        head = w["lm_heads.0.weight"] if config["original_lm_head"] else w[f"lm_heads.{h}.weight"]
        if token_map is not None and head.shape[0] > token_map.shape[0]:
            head = head[token_map]
        assert head.shape[0] == config["truncated_vocab_size"]
        logits = x @ head.T
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf)
            full[..., token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("vocab", ["auto", "draft"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_medusa_exports_to_vllm(tmp_path, tiny_llama, shared, mapped, vocab):
    model, _ = tiny_llama
    token_map = torch.tensor([2, 5, 7, 11, 64, 300]) if mapped else None
    heads = MedusaHeads(MedusaConfig(64, 320, num_heads=3, num_layers=2, shared_lm_head=shared,
                                     draft_vocab_size=None if token_map is None else len(token_map)), model.lm_head)
    if mapped:
        heads.set_token_map(token_map)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # trained-looking: blocks away from zero, heads away from the target's
    heads.to(model.device)  # drawn on the CPU: the same heads on every device
    save_heads(tmp_path / "heads", heads, "medusa", heads.config.to_dict(), model)
    folder, fmt = export_heads(tmp_path / "heads", tmp_path / "vllm", model, vocab=vocab)
    assert fmt == "vllm"
    config, w = read_export(folder)
    # auto: heads that share the target's LM head are written over the full vocabulary, without the token_map vLLM
    # 0.32 refuses (tests/test_serving.py loads both forms in vLLM)
    full = mapped and shared and vocab == "auto"
    if full:
        heads.token_map = None  # what the export drafts: the argmax over every row of the target's LM head
        mapped = False
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["num_hidden_layers"], config["original_lm_head"]) == (3, 2, shared)
    # vLLM renames every config key holding "num" and "heads" to num_heads: only that one may exist.
    assert [k for k in config if "num" in k and "heads" in k] == ["num_heads"]
    hidden = torch.randn(2, 5, 64)
    with torch.no_grad():
        expected = heads(hidden.to(model.device)).cpu()  # beside the exported (CPU) weights
        if mapped:  # the draft vocabulary's logits at their ids, nothing elsewhere
            outside = torch.ones(320, dtype=torch.bool)
            outside[token_map] = False
            expected[..., outside] = -torch.inf
        torch.testing.assert_close(vllm_medusa_logits(config, w, hidden), expected, atol=1e-5, rtol=1e-5)
    assert ("lm_heads.1.weight" in w) == (not shared)
    assert config["truncated_vocab_size"] == (len(token_map) if mapped else 320)
    assert ("token_map" in w) == mapped
    if mapped:
        assert torch.equal(w["token_map"], token_map) and w["lm_heads.0.weight"].shape == (len(token_map), 64)


def test_medusa_heads_of_their_own_have_no_full_vocabulary_form(tmp_path, tiny_llama):
    model, _ = tiny_llama
    heads = MedusaHeads(MedusaConfig(64, 320, num_heads=2, num_layers=1, shared_lm_head=False, draft_vocab_size=4),
                        model.lm_head)
    heads.set_token_map(torch.tensor([2, 5, 7, 11]))
    save_heads(tmp_path / "heads", heads.to(model.device), "medusa", heads.config.to_dict(), model)
    with pytest.raises(ExportError, match="vocab=draft"):
        export_heads(tmp_path / "heads", tmp_path / "vllm", model, vocab="full")
    with pytest.raises(ExportError, match="vocab='x'"):
        export_heads(tmp_path / "heads", tmp_path / "vllm", model, vocab="x")


# --- EAGLE-3 -> SGLang / speculators ----------------------------------------------------------------------------------


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, config):
    """Llama's rotary embedding on x [B, heads, T, d] (halves rotated), of the config's rope: the plain one written
    out; a scaled one (gpt-oss's YaRN) from transformers' rope functions, which vLLM's get_rope mirrors."""
    d = x.shape[-1]
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if rope.get("rope_type", "default") == "default":
        inv, scale = 1.0 / rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d), 1.0
    else:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fields = ("hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings", "rope_parameters")
        inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](LlamaConfig(**{k: config[k] for k in fields}), "cpu")
    angles = positions[:, None, :, None].float() * inv.to(x.device)  # [B, 1, T, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos() * scale, torch.cat([angles, angles], -1).sin() * scale
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def llama_attention_mlp(config, w, prefix, x, h, positions):
    """One Llama layer's attention over x [B, T, in] (causal) added to the residual h, then its MLP:
    (out, h + attention)."""
    eps, heads, kv, d = (config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"],
                         config["head_dim"])
    b, t, _ = x.shape
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(b, t, heads, d).transpose(1, 2)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(b, t, kv, d).transpose(1, 2)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(b, t, kv, d).transpose(1, 2)
    q, k = rotate(q, positions, config), rotate(k, positions, config)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=scores.device).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * d) @ w[prefix + "self_attn.o_proj.weight"].T
    h = h + attn
    m = rms(h, w[prefix + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T)) \
        @ w[prefix + "mlp.down_proj.weight"].T
    return h + mlp


def eagle3_reference(config, w, prefix, hidden3, ids, positions):
    """SGLang's / speculators' EAGLE-3 draft step over a sequence (causal): returns (output feature, target ids of
    the draft's top tokens). ``hidden3`` [B, T, 3H]: the target's three captured hidden states side by side."""
    eps = config["rms_norm_eps"]
    feature = hidden3 @ w["fc.weight"].T
    x = torch.cat([rms(w["embed_tokens.weight"][ids], w[prefix + "input_layernorm.weight"], eps),
                   rms(feature, w[prefix + "hidden_norm.weight"], eps)], -1)
    out = llama_attention_mlp(config, w, prefix, x, feature, positions)
    top = (rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax(-1)
    return out, top + w["d2t"][top]


def eagle_reference(config, w, feature, ids, positions, lm_head):
    """vLLM's EAGLE-1 draft step (``EagleLlamaForCausalLM``) over a sequence (causal): fc (no bias) over [embedding,
    feature], layer 0 without input norm, no final norm, the target's LM head: (output feature, top target ids)."""
    x = torch.cat([w["embed_tokens.weight"][ids], feature], -1) @ w["fc.weight"].T
    out = llama_attention_mlp(config, w, "layers.0.", x, x, positions)
    return out, (out @ lm_head.T).argmax(-1)


def midlayer_drafter(model, layer_ids=None):
    drafter = EagleHeads(EagleConfig.from_target(model, variant="eagle3", layout="midlayer", draft_vocab_size=100,
                                                   layer_ids=layer_ids), model).to(model.device)
    ids = torch.randint(3, 320, (4, 30), generator=torch.Generator().manual_seed(1))
    drafter.set_draft_vocab(build_draft_vocab(count_tokens(ids, 320), 100)[0], init_lm_head_from=model.lm_head)
    with torch.no_grad():
        for p in drafter.parameters():  # drawn on the CPU: the same drafter on every device
            p.add_(torch.randn(p.shape, dtype=p.dtype).to(p.device) * 0.05)
    return drafter.eval()


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("layer_ids", [None, [3, 1, 2]])
def test_eagle3_exports_compute_the_drafter(tmp_path, tiny_llama, fmt, layer_ids):
    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = midlayer_drafter(model, layer_ids=layer_ids)
    save_heads(tmp_path / "heads", drafter, "eagle3", drafter.config.to_dict(), model, extra_meta={"tree": {"depth": 4}})
    folder, used = export_heads(tmp_path / "heads", tmp_path / fmt, model, fmt=fmt)
    assert used == fmt
    config, w = read_export(folder)
    if fmt == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
        assert config["draft_vocab_size"] == 100 and config["tie_word_embeddings"] is False
        # the 4-layer target's default layers (1, 2, 3) are not the engines' own (2, 2, 1): named for both engines
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: inputs of layers
        assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # SGLang: outputs
        layer_cfg, prefix = config, "midlayer."
    else:
        assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
        assert config["eagle_aux_hidden_state_layer_ids"] == sorted(drafter.config.layer_ids)
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 100
        layer_cfg, prefix = config["transformer_layer_config"], "layers.0."
    card = (folder / "README.md").read_text()  # a model card naming the format and how to serve it
    assert f"exported as `{fmt}`" in card and ("vllm serve" in card)
    assert w["fc.weight"].shape == (64, 192) and w[prefix + "self_attn.q_proj.weight"].shape[1] == 128
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 100

    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(2)).to(model.device)
    positions = torch.arange(9, device=model.device)[None].expand(2, 9)
    w = {k: v.to(model.device) for k, v in w.items()}  # the exported files, read onto the drafter's device
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        mine = drafter(drafter.target_features(hs), ids, positions)
        my_top = drafter.draft_to_target(drafter.logits(mine).argmax(-1))
        # the engines fuse the captured layers in ascending order (vLLM's Llama appends them as it runs the layers)
        hidden3 = torch.cat([hs[i] for i in sorted(drafter.config.layer_ids)], -1)
        ref, ref_top = eagle3_reference(layer_cfg, w, prefix, hidden3, ids, positions)
    torch.testing.assert_close(ref, mine, atol=1e-5, rtol=1e-4)
    assert torch.equal(ref_top, my_top)


def test_eagle3_export_names_custom_layers_in_sglang_terms(tmp_path, tiny_llama):
    """SGLang's ids name layer outputs (it captures the input of id + 1); ours name layer inputs."""
    model, _ = tiny_llama
    drafter = midlayer_drafter(model, layer_ids=[1, 2, 3])
    save_heads(tmp_path / "heads", drafter, "eagle3", drafter.config.to_dict(), model)
    config, _ = read_export(export_heads(tmp_path / "heads", tmp_path / "out", model, include_embeddings=False)[0])
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    _, w = read_export(tmp_path / "out")
    assert "embed_tokens.weight" not in w


def test_eagle3_export_refuses_a_layer_fused_twice(tmp_path, tiny_llama):
    model, _ = tiny_llama
    drafter = midlayer_drafter(model, layer_ids=[2, 2, 1])  # what the 4-layer default used to be
    save_heads(tmp_path / "heads", drafter, "eagle3", drafter.config.to_dict(), model)
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(ExportError, match="name a layer twice"):
            export_heads(tmp_path / "heads", tmp_path / fmt, model, fmt=fmt)


def test_export_refuses_what_no_engine_loads(tmp_path, tiny_llama):
    model, _ = tiny_llama
    fc = EagleHeads(EagleConfig.from_target(model, variant="eagle3", draft_vocab_size=50), model)
    save_heads(tmp_path / "fc", fc, "eagle3", fc.config.to_dict(), model)
    with pytest.raises(ExportError, match="heads.layout=midlayer"):
        export_heads(tmp_path / "fc", tmp_path / "out", model)
    assert not (tmp_path / "out").exists()
    # ... but selfspec's own format copies any heads folder, checked against the target
    folder, fmt = export_heads(tmp_path / "fc", tmp_path / "copy", model, fmt="selfspec")
    assert fmt == "selfspec" and (folder / "model.safetensors").read_bytes() == (
        tmp_path / "fc" / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="format=vllm"):
        resolve_format("eagle3", "medusa", {})
    with pytest.raises(ExportError, match="one of"):
        resolve_format("onnx", "medusa", {})
    # EAGLE-1 heads export only in vLLM's shape (no fc bias, no input norm); EAGLE-3 heads have no EAGLE-1 form
    eagle = EagleHeads(EagleConfig.from_target(model, variant="eagle"), model)
    save_heads(tmp_path / "eagle", eagle, "eagle", eagle.config.to_dict(), model)
    for fmt in ("auto", "eagle"):
        with pytest.raises(ExportError, match="heads.fc_bias=false heads.input_norm=false"):
            export_heads(tmp_path / "eagle", tmp_path / "out", model, fmt=fmt)
    with pytest.raises(ExportError, match="format=eagle3 or speculators"):
        resolve_format("eagle", "eagle3", {"layout": "midlayer"})
    with pytest.raises(ExportError, match="does not fit these eagle heads: use format=eagle "):
        resolve_format("speculators", "eagle", {"fc_bias": False, "input_norm": False})
    assert not (tmp_path / "out").exists()
    # heads trained for another target are refused by the fingerprint check
    from selfspec.core.target import TargetMismatchError

    other, _ = build_tiny("llama", seed=7)
    with pytest.raises(TargetMismatchError):
        export_heads(tmp_path / "fc", tmp_path / "x", other, fmt="selfspec")


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create", repo_id, kw["private"], kw["exist_ok"]))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, **kw):
            calls.append(("upload", folder_path, repo_id))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    url = push_to_hub(tmp_path, "org/heads", private=True)
    assert url.endswith("org/heads")
    assert calls[1:] == [("create", "org/heads", True, True), ("upload", str(tmp_path), "org/heads")]

    class Offline(FakeApi):
        def create_repo(self, repo_id, **kw):
            raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    with pytest.raises(ExportError, match="exported folder is kept"):
        push_to_hub(tmp_path, "org/heads")


def test_export_script_writes_beside_the_heads(tmp_path):
    """scripts/export.py's run: the target comes from the heads' own record; the default folder is <heads>-<format>."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from selfspec.serve.cli import run_export

    from selfspec.core.target import Target

    model, tokenizer = build_tiny("llama")
    heads = MedusaHeads(MedusaConfig(64, 320, num_heads=2, num_layers=1, shared_lm_head=False,
                                     draft_vocab_size=None), model.lm_head)
    save_heads(tmp_path / "heads", heads, "medusa", heads.config.to_dict(), Target(model, tokenizer, "tiny-llama"))
    from selfspec.core.config import store_open_dict

    conf = Path(__file__).resolve().parents[1] / "conf" / "decode"
    store_open_dict()  # as core/config.py's compose and hydra_app do: decode.yaml's draft node needs it
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("export", [f"heads={tmp_path / 'heads'}"])
    result = run_export(cfg)
    assert result == {"out": str(tmp_path / "heads-vllm"), "format": "vllm", "url": None}
    card = (tmp_path / "heads-vllm" / "README.md").read_text()
    assert "base_model: tiny-llama" in card and '"method": "medusa"' in card
    config, w = read_export(tmp_path / "heads-vllm")
    assert config["num_heads"] == 2 and torch.equal(w["lm_heads.1.weight"], heads.lm_heads[1].weight)


def test_speculators_loads_the_export_and_drafts_the_same_tokens(tmp_path, tiny_llama):
    """With vLLM's speculators installed (not a dependency: `pip install speculators`), its own EAGLE-3 model loads
    the exported folder (missing only the verifier parts it takes from the target for training) and drafts the same
    tokens as the drafter."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    model, _ = tiny_llama
    torch.manual_seed(0)
    drafter = midlayer_drafter(model)
    save_heads(tmp_path / "heads", drafter, "eagle3", drafter.config.to_dict(), model)
    folder, _ = export_heads(tmp_path / "heads", tmp_path / "spec", model, fmt="speculators")
    theirs = Eagle3DraftModel(Eagle3SpeculatorConfig.from_pretrained(str(folder))).eval()
    result = theirs.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not result.unexpected_keys and all(k.startswith("verifier_") for k in result.missing_keys)
    theirs.to(model.device)
    ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(5)).to(model.device)
    positions = torch.arange(12, device=model.device)[None]
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        mine = drafter.logits(drafter(drafter.target_features(hs), ids, positions)).argmax(-1)
        drafted = theirs(hidden_states=torch.cat([hs[i] for i in drafter.config.layer_ids], -1), input_ids=ids,
                         position_ids=positions, document_ids=torch.zeros(1, 12, dtype=torch.long, device=model.device),
                         ttt_steps=1)
    assert torch.equal(drafted[0], mine)


# --- DFlash -> vLLM ------------------------------------------------------------------------------------------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """Neox-style rotary embedding (vLLM's default for DFlash) over the last dim of x [..., S, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = hd // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def vllm_dflash_logits(folder, embed, features, ctx_pos, block_ids, block_pos):
    """vLLM's DFlashQwen3ForCausalLM from the exported files only: context K/V = k_norm/rope(k_proj(hidden_norm(fc(
    features)))), v_proj(...) per layer; the block's queries (token embeddings, the mask id's replaced by
    mask_embedding.pt) attend non-causally to [context; block]; logits over draft_vocab_size scattered to the full
    vocabulary by d2t (target id = draft id + d2t)."""
    config, w = read_export(folder)
    mask = torch.load(folder / "mask_embedding.pt")
    eps, hd = config["rms_norm_eps"], config["head_dim"]
    nh, nkv, theta = config["num_attention_heads"], config["num_key_value_heads"], config["rope_theta"]
    assert mask["mask_token_id"] == config["dflash_config"]["mask_token_id"]
    x = embed[block_ids]
    x[block_ids == mask["mask_token_id"]] = mask["embedding"]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)

    def heads(t, n):
        return t.view(t.shape[0], n, hd).transpose(0, 1)  # [n, S, hd]

    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms(heads(h @ w[p + "self_attn.q_proj.weight"].T, nh), w[p + "self_attn.q_norm.weight"], eps),
                 block_pos, theta)
        keys = [rope(rms(heads(s @ w[p + "self_attn.k_proj.weight"].T, nkv), w[p + "self_attn.k_norm.weight"], eps),
                     pos, theta) for s, pos in ((ctx, ctx_pos), (h, block_pos))]
        vals = [heads(s @ w[p + "self_attn.v_proj.weight"].T, nkv) for s in (ctx, h)]
        k, v = (torch.cat(t, 1).repeat_interleave(nh // nkv, 0) for t in (keys, vals))
        att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, -1) @ v
        x = x + att.transpose(0, 1).reshape(x.shape[0], -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    logits = rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((x.shape[0], config["vocab_size"]), float("-inf"))
    full[:, torch.arange(config["draft_vocab_size"]) + w["d2t"]] = logits
    return full


def test_dflash_export_computes_the_drafter(tmp_path, tiny_llama):
    from selfspec.heads.dflash import DFlashConfig, DFlashHeads

    model, _ = tiny_llama
    torch.manual_seed(0)
    counts = count_tokens(torch.randint(0, model.config.vocab_size, (400,)), model.config.vocab_size)
    d2t, _ = build_draft_vocab(counts, 96)
    cfg = DFlashConfig.from_target(model, block_size=4, num_layers=2, mask_token_id=7, draft_vocab_size=96)
    drafter = DFlashHeads(cfg, model, d2t=d2t)
    with torch.no_grad():  # a trained-looking drafter: norms and the mask vector away from their init
        for name, p in drafter.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "mask" in name else 0.02))
    save_heads(tmp_path / "heads", drafter, "dflash", cfg.to_dict(), model)
    out, fmt = export_heads(tmp_path / "heads", tmp_path / "export", model)
    assert fmt == "dflash"
    config, w = read_export(out)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": cfg.target_layer_ids}
    assert "t2d" not in w and not any(k.startswith(("model.", "embed_tokens")) for k in w)

    device = model.device
    ids = torch.randint(3, 300, (1, 12)).to(device)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i][0] for i in drafter.feature_layers], -1)
        ctx_pos, block_pos = torch.arange(12), torch.arange(12, 16)
        kv = drafter.context_kv(drafter.context(features)[None], ctx_pos[None].to(device))
        first = torch.tensor([[int(ids[0, -1])]], device=device)
        mine = drafter.logits(drafter(drafter.block_inputs(first), block_pos[None].to(device), kv, None))[0].cpu()
        block_ids = torch.tensor([int(ids[0, -1])] + [7] * 3)
        # the reference reads the exported files on the CPU
        ref = vllm_dflash_logits(out, model.get_input_embeddings().weight.cpu(), features.cpu(), ctx_pos, block_ids,
                                 block_pos)
    targets = torch.arange(96) + d2t
    torch.testing.assert_close(ref[:, targets], mine, rtol=1e-4, atol=1e-4)
    assert torch.isinf(ref[:, [t for t in range(model.config.vocab_size) if t not in set(targets.tolist())]]).all()


@pytest.mark.parametrize("arch", ["mistral", "llama", "gemma3"])
def test_drafters_keep_the_whole_context_where_every_target_layer_slides(tmp_path, arch):
    """vLLM gives a target's window to every attention layer without one of its own when all the target's layers
    slide (Mistral), the drafter's too; the exports then declare their layers sliding over a window as long as any
    context, which vLLM takes per layer instead (tests/test_serving_archs.py serves them, drafts equal to selfspec's).
    A target with full layers (Llama; Gemma 3 mixes both) gets no such fields."""
    from selfspec.heads.dflash import DFlashConfig, DFlashHeads

    model, _ = build_tiny(arch)
    window = 512 if arch == "mistral" else None  # build_tiny's max_position_embeddings; its Mistral slides
    eagle = EagleHeads(EagleConfig.from_target(model, variant="eagle", fc_bias=False, input_norm=False), model)
    eagle3 = midlayer_drafter(model)
    dflash = DFlashHeads(DFlashConfig.from_target(model, block_size=4, num_layers=2, mask_token_id=7), model)
    for head_type, drafter, formats in (("eagle", eagle, ["eagle"]), ("eagle3", eagle3, ["eagle3", "speculators"]),
                                        ("dflash", dflash, ["dflash"])):
        save_heads(tmp_path / head_type, drafter, head_type, drafter.config.to_dict(), model)
        for fmt in formats:
            config, _ = read_export(export_heads(tmp_path / head_type, tmp_path / f"out-{fmt}", model, fmt=fmt)[0])
            layer = config["transformer_layer_config"] if fmt == "speculators" else config
            if fmt == "dflash":
                swa = {k: config["dflash_config"].get(k) for k in ("use_swa", "swa_window_size", "causal")}
                assert swa == ({"use_swa": True, "swa_window_size": window, "causal": False} if window
                               else {"use_swa": None, "swa_window_size": None, "causal": None})
                continue
            if window is None:
                assert "layer_types" not in layer and "sliding_window" not in layer and "target_layer_count" not in layer
                continue
            assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == window
            # vLLM's EAGLE-1 numbers its layer after the target's and reads layer_types at that number less this
            assert layer.get("target_layer_count") == (model.config.num_hidden_layers if fmt == "eagle" else None)
