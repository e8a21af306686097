"""EAGLE drafters.

- Module: shapes, a Llama draft layer, target parts used but not owned, cache and unrolled-step consistency.
- Losses (pure functions) and the draft vocabulary maps.
- Decoding with EAGLE-2 dynamic trees (both variants, tiny Llama and tiny Qwen2, drafters briefly trained so drafts
  are often accepted): greedy output equals HF generate on 12 prompts (EOS inside accepted drafts, the
  max_new_tokens boundary); the draft's KV cache equals a fresh draft forward over the committed prefix after every
  commit; sampled tokens follow the target's distribution.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from selfspec.decode.eagle_drafter import EagleTreeDrafter
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.types import ROOT
from selfspec.decode.verify import Sampling, target_probs
from selfspec.core.layers import causal_mask, shift_left
from selfspec.heads.eagle import EagleConfig, EagleHeads, default_layer_ids
from selfspec.heads.eagle_loss import (
    EagleLossWeights,
    add_uniform_noise,
    drafter_loss,
    eagle_loss,
    feature_regression_loss,
    step_counts,
    token_ce_loss,
    token_kl_loss,
)
from selfspec.core.errors import SettingError
from selfspec.core.target import build_tiny
from selfspec.heads.vocab import build_draft_vocab, count_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


VARIANTS = ["eagle", "eagle3", "eagle3-mid"]  # eagle3-mid: eagle3 with the midlayer layout (EAGLE-3 as published)


def make(model, variant, **kw):
    """``variant``: one of VARIANTS."""
    if variant == "eagle3-mid":
        variant, kw = "eagle3", {"layout": "midlayer", **kw}
    return EagleHeads(EagleConfig.from_target(model, variant=variant, **kw), model).to(model.device)


def heads_overrides(option):
    """A VARIANTS entry -> the training config overrides that select it."""
    return ["heads=eagle3", "heads.layout=midlayer"] if option == "eagle3-mid" else [f"heads={option}"]


def sequence(batch=2, length=10, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (batch, length), generator=g).to(device)


# --- module ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_ownership(request, arch, variant):
    model, _ = request.getfixturevalue(arch)
    drafter = make(model, variant, draft_vocab_size=100)
    ids = sequence(device=model.device)
    hs = model(ids, output_hidden_states=True).hidden_states
    feats = drafter.target_features(hs)
    assert feats.shape == (2, 10, 64)
    out = drafter(feats, ids, torch.arange(10, device=model.device)[None].expand(2, 10))
    assert out.shape == (2, 10, 64)
    assert drafter.logits(out).shape == (2, 10, 100)  # eagle: the target LM head's rows of the draft vocabulary
    assert type(drafter.layer) is LlamaDecoderLayer  # a Llama layer whatever the target, no biases
    assert not any(k.endswith("bias") for k in drafter.layer.state_dict())
    # The target's embedding / LM head are used, not owned: not in state_dict, not trainable through the drafter.
    target_ids = {id(p) for p in model.parameters()}
    assert not any(id(p) in target_ids for p in drafter.parameters())
    assert not any(k.startswith(("embed_tokens", "model.", "_target")) or "embed_tokens" in k for k in drafter.state_dict())
    assert all(p.requires_grad for p in drafter.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    if variant.startswith("eagle3"):
        assert drafter.fuse.weight.shape == (64, 192)
        assert {"d2t", "t2d", "lm_head.weight", "norm.weight"} <= set(drafter.state_dict())
    if variant == "eagle3-mid":  # q/k/v read [embedding, feature]; no fc, no input norm in the layer
        keys = set(drafter.state_dict())
        assert drafter.layer.self_attn.q_proj.weight.shape[1] == 128 and "fc.weight" not in keys
        assert not any("input_layernorm" in k for k in keys)
    else:
        assert drafter.fc.weight.shape == (64, 128)
    if variant == "eagle":
        assert "lm_head.weight" not in drafter.state_dict() and {"d2t", "t2d"} <= set(drafter.state_dict())


def test_feature_sources():
    """eagle reads the post-norm last hidden state; eagle3 fuses the inputs of its three layers."""

    model, _ = build_tiny("llama", num_hidden_layers=6)
    assert default_layer_ids(32) == [2, 16, 29] and default_layer_ids(8) == [2, 4, 5]  # the engines' choice
    # shallow targets: three different layers in ascending order (the engines capture each layer once, in order)
    assert default_layer_ids(6) == [2, 3, 4] and default_layer_ids(4) == [1, 2, 3] and default_layer_ids(5) == [1, 2, 4]
    ids = sequence(1, 5, device=model.device)
    out = model(ids, output_hidden_states=True)
    eagle = make(model, "eagle")
    assert torch.equal(eagle.target_features(out.hidden_states), model.model(ids).last_hidden_state)
    e3 = make(model, "eagle3", layer_ids=[1, 2, 4])
    expected = e3.fuse(torch.cat([out.hidden_states[1], out.hidden_states[2], out.hidden_states[4]], -1))
    torch.testing.assert_close(e3.target_features(out.hidden_states), expected)
    with pytest.raises(ValueError, match="exactly 3"):
        EagleConfig(variant="eagle3", layer_ids=[1, 2])
    with pytest.raises(ValueError, match="outside the target"):
        make(model, "eagle3", layer_ids=[1, 2, 6])
    with pytest.raises(ValueError, match="Unknown EAGLE variant"):
        EagleConfig(variant="medusa")
    with pytest.raises(ValueError, match="Unknown EAGLE layout"):
        EagleConfig(variant="eagle3", layout="wide")
    with pytest.raises(ValueError, match="EAGLE-1 uses 'fc'"):
        EagleConfig(variant="eagle", layout="midlayer")


def test_a_bfloat16_drafter_keeps_its_positions(tiny_llama):
    """A drafter cast to bfloat16 (as heads.load casts it to a bfloat16 target) rotates by the angles it was trained
    with, thousands of positions in: its rotary frequencies stay float32 (rounded to bfloat16, a relative error up to
    2**-9, the angle at position 4000 would be off by radians), and only the cos/sin values are rounded."""
    model, _ = tiny_llama
    drafter = make(model, "eagle3")
    positions = torch.tensor([[0, 1, 1000, 4000]], device=model.device)
    x = torch.zeros(1, 4, 64, device=model.device)
    full = drafter.position_embeddings(x, positions)
    drafter.to(torch.bfloat16)
    rounded = drafter.position_embeddings(x.to(torch.bfloat16), positions)
    for a, b in zip(full, rounded, strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, rtol=0, atol=2**-8)  # values in [-1, 1], 8 bits of mantissa


def test_init_layer_from_copies_target_layer(tiny_llama):
    model, _ = tiny_llama
    drafter = make(model, "eagle", init_layer_from=-1)
    for k, v in model.model.layers[-1].state_dict().items():
        assert torch.equal(drafter.layer.state_dict()[k], v)
    # midlayer: the widened q/k/v take the target's weights in their feature half; the input norm is not there.
    mid = make(model, "eagle3-mid", init_layer_from=-1).layer.state_dict()
    for k, v in model.model.layers[-1].state_dict().items():
        if k.startswith("input_layernorm"):
            assert k not in mid
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            assert torch.equal(mid[k][:, 64:], v) and not torch.equal(mid[k][:, :64], v)
        else:
            assert torch.equal(mid[k], v), k


def test_init_layer_from_takes_only_a_llama_shaped_layer(tiny_qwen2):
    """A Qwen2 layer is a Llama layer with q/k/v biases: its weights are copied, the biases left out; a Qwen3 layer
    (q/k norms) has no place in the Llama draft layer and is refused."""
    from selfspec.core.errors import SettingError

    model, _ = tiny_qwen2
    source = model.model.layers[-1].state_dict()
    mine = make(model, "eagle", init_layer_from=-1).layer.state_dict()
    assert set(source) - set(mine) == {f"self_attn.{p}_proj.bias" for p in "qkv"}
    assert all(torch.equal(mine[k], v) for k, v in source.items() if k in mine)
    qwen3, _ = build_tiny("qwen3")
    with pytest.raises(SettingError, match="q_norm.weight.*heads.init_layer_from=null"):
        make(qwen3, "eagle3", init_layer_from=-1)


class SavedBefore(torch.nn.Module):
    """EagleHeads as saved before the draft layer was a Llama layer whatever the target: a layer of the target's own
    class built from the target's config, the three eagle3 norms copies of the target's final norm, and a forward that
    took the target's rotary embedding."""

    def __init__(self, model, variant):
        import copy

        super().__init__()
        base, hidden = model.model, model.config.hidden_size
        self.variant, self.layout = ("eagle3", "midlayer") if variant == "eagle3-mid" else (variant, "fc")
        self.head_config = {"variant": self.variant, "hidden_size": hidden, "vocab_size": 320, "fc_bias": True,
                            "init_layer_from": None, "layout": self.layout, "draft_vocab_size": None,
                            "layer_ids": [1, 2, 3] if self.variant == "eagle3" else None}
        if self.variant == "eagle3":
            self.fuse = torch.nn.Linear(3 * hidden, hidden, bias=False)
            self.embed_norm, self.feature_norm = copy.deepcopy(base.norm), copy.deepcopy(base.norm)
        if self.layout == "fc":
            self.fc = torch.nn.Linear(2 * hidden, hidden)
        self.layer = type(base.layers[0])(copy.deepcopy(model.config), layer_idx=0)
        if self.layout == "midlayer":
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.layer.self_attn, name)
                setattr(self.layer.self_attn, name, torch.nn.Linear(2 * hidden, old.out_features,
                                                                    bias=old.bias is not None))
            del self.layer.input_layernorm
        if self.variant == "eagle3":
            self.norm = copy.deepcopy(base.norm)
            self.lm_head = torch.nn.Linear(hidden, 320, bias=False)
            self.register_buffer("d2t", torch.zeros(320, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(320, dtype=torch.bool))
        with torch.no_grad():
            for p in self.parameters():  # trained-looking weights
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1
                        + (1.0 if p.dim() == 1 else 0.0))
        self._model = [model]

    def forward(self, hidden_states, ids, positions):
        """-> (features, logits) of the old module."""
        model = self._model[0]
        feats = self.fuse(torch.cat([hidden_states[i] for i in self.head_config["layer_ids"]], -1)) \
            if self.variant == "eagle3" else hidden_states[-1]
        emb = model.get_input_embeddings()(ids)
        pe = model.model.rotary_emb(feats, positions)
        mask = causal_mask(ids.shape[1], 0, feats.dtype, device=feats.device)
        if self.layout == "midlayer":
            x = torch.cat([self.embed_norm(emb), self.feature_norm(feats)], -1)
            h = feats + self.layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=mask)[0]
            out = h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        else:
            if self.variant == "eagle3":
                emb, feats = self.embed_norm(emb), self.feature_norm(feats)
            out = self.layer(self.fc(torch.cat([emb, feats], -1)), attention_mask=mask, position_ids=positions,
                             position_embeddings=pe)
            out = out[0] if isinstance(out, tuple) else out
        return out, (self.lm_head(self.norm(out)) if self.variant == "eagle3" else model.lm_head(out))


@pytest.mark.parametrize("variant", VARIANTS)
def test_heads_saved_with_the_targets_own_layer(tmp_path, tiny_llama, tiny_qwen2, variant):
    """Heads saved before the draft layer was a Llama layer whatever the target (config.json without draft_layer):
    for a Llama target their layer was a Llama layer, so they load unchanged and compute what they computed; for a
    Qwen2 target (q/k/v biases) they are refused, saying to retrain."""
    from selfspec import heads
    from selfspec.heads.eagle import OldDraftLayerError
    from selfspec.heads.io import save_heads

    model, _ = tiny_llama
    old = SavedBefore(model, variant).to(model.device)
    save_heads(tmp_path / "old", old, old.variant, old.head_config, model)
    loaded = heads.load(tmp_path / "old", model).module
    ids = sequence(2, 9, device=model.device)
    positions = torch.arange(9, device=model.device)[None].expand(2, 9)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        want, want_logits = old(hs, ids, positions)
        got = loaded(loaded.target_features(hs), ids, positions)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(loaded.logits(got), want_logits, atol=1e-4, rtol=1e-4)
    assert loaded.config.draft_layer["intermediate_size"] == model.config.intermediate_size
    if variant == "eagle":
        qwen, _ = tiny_qwen2
        old = SavedBefore(qwen, variant).to(qwen.device)
        save_heads(tmp_path / "qwen", old, "eagle", old.head_config, qwen)
        with pytest.raises(OldDraftLayerError, match="Qwen2DecoderLayer.*Retrain them"):
            heads.load(tmp_path / "qwen", qwen)


def test_heads_saved_without_a_layout_load_as_fc(tiny_llama):
    """Heads saved before ``layout`` existed (all fc layout) rebuild as fc; the layout is saved and rebuilt."""
    from selfspec.heads.eagle import build_eagle_heads

    model, _ = tiny_llama
    saved = make(model, "eagle3").config.to_dict()
    del saved["layout"]
    assert build_eagle_heads(saved, model).config.layout == "fc"
    assert build_eagle_heads(make(model, "eagle3-mid").config.to_dict(), model).config.layout == "midlayer"


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_incremental_equals_full_forward(tiny_qwen2, variant):
    model, _ = tiny_qwen2
    drafter = make(model, variant)
    ids = sequence(1, 9, device=model.device)
    feats = torch.randn(1, 9, 64).to(model.device)
    pos = torch.arange(9, device=model.device)[None]
    with torch.no_grad():
        full = drafter(feats, ids, pos)
        cache = DynamicCache()
        parts = [drafter(feats[:, a:b], ids[:, a:b], pos[:, a:b], None, cache) for a, b in [(0, 4), (4, 5), (5, 9)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 9


def test_causal_mask_values():
    m = causal_mask(2, 3, torch.float32, key_padding=torch.tensor([[False, True, True, True, True]]))
    allowed = m == 0
    assert allowed.shape == (1, 1, 2, 5)
    assert allowed[0, 0].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    assert float(m.min()) == torch.finfo(torch.float32).min


@pytest.mark.parametrize("variant", VARIANTS)
def test_unrolled_steps_equal_test_time_chain(tiny_llama, variant):
    """Unrolled step j at index t = what the draft computes at test time after reading t+1 real positions and then
    its own j previous guesses (the chain a dynamic-tree branch shows it)."""
    model, _ = tiny_llama
    drafter = make(model, variant).eval()
    ids = sequence(1, 8, device=model.device)
    with torch.no_grad():
        feats = drafter.target_features(model(ids, output_hidden_states=True).hidden_states)
        steps = drafter.unrolled_forward(feats, ids, steps=3)
        for t in (0, 2, 4):  # t + 3 < 8: every token read is real
            cache = DynamicCache()
            x = drafter(feats[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1, device=model.device)[None], None,
                        cache)[:, -1:]
            torch.testing.assert_close(x[0, 0], steps[0][0, t], atol=1e-5, rtol=1e-4)
            for j in (1, 2):
                x = drafter(x, ids[:, t + j + 1 : t + j + 2], torch.tensor([[t + j]], device=model.device), None,
                            cache)
                torch.testing.assert_close(x[0, 0], steps[j][0, t], atol=1e-5, rtol=1e-4)


# --- losses ----------------------------------------------------------------------------------------------------------


def test_feature_regression_loss():
    pred, target = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)
    target[0, 2] = 10.0  # only at a masked-out position
    mask = torch.tensor([[True, True, False]])
    assert float(feature_regression_loss(pred, target, mask)) == 0.0
    target[0, 0] = 0.5  # smooth-L1 of 0.5 is 0.5 * 0.5**2 = 0.125, averaged over 2 valid positions
    assert float(feature_regression_loss(pred, target, mask)) == pytest.approx(0.125 / 2)


def test_token_losses():
    g = torch.Generator().manual_seed(1)
    logits, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert float(token_kl_loss(teacher, teacher, mask)) == pytest.approx(0.0, abs=1e-6)
    kl = float(token_kl_loss(logits, teacher, mask))
    manual = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(logits, -1))).sum(-1).mean()
    assert kl == pytest.approx(float(manual), rel=1e-5) and kl > 0
    mask[1] = False  # masked rows do not count
    assert float(token_kl_loss(logits, teacher, mask)) == pytest.approx(float(token_kl_loss(logits[:1], teacher[:1],
                                                                                             mask[:1])), rel=1e-6)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 1] = -100
    ce = token_ce_loss(logits, labels, torch.ones(2, 5, dtype=torch.bool))
    assert float(ce) == pytest.approx(float(F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))), rel=1e-5)


def test_eagle_loss_alignment_and_decay():
    """Step j at index t is scored against feature t+j+1, teacher row t+j+1 and label t+j+2."""
    g = torch.Generator().manual_seed(2)
    length, hidden, vocab = 7, 4, 9
    target_feats = torch.randn(1, length, hidden, generator=g)
    teacher = torch.randn(1, length, vocab, generator=g)
    labels = torch.randint(0, vocab, (1, length), generator=g)
    weights = EagleLossWeights(regression=1.0, token=0.1, step_decay=0.5, token_loss="kl")
    perfect_f = [shift_left(target_feats, j + 1, 0.0) for j in range(3)]
    perfect_l = [shift_left(teacher, j + 1, 0.0) for j in range(3)]
    loss, metrics = eagle_loss(perfect_f, perfect_l, labels, weights, target_feats, teacher)
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert metrics["acc_0"] == metrics["acc_2"] == 1.0
    # Off by one step: nonzero loss, and later steps weigh step_decay**j as much.
    wrong = [shift_left(target_feats, j, 0.0) for j in range(3)]
    loss_wrong, m = eagle_loss(wrong, perfect_l, labels, weights, target_feats, teacher)
    expected = sum(0.5**j * float(m[f"regression_{j}"]) for j in range(3))
    assert float(loss_wrong) == pytest.approx(expected, rel=1e-5) and expected > 0
    # Positions whose drafted token is not trained on (label -100) do not count.
    labels_masked = labels.clone()
    labels_masked[0, 2:] = -100  # step 0 then trains only index 0 (label 2 is masked, so nothing at all)
    zero, _ = eagle_loss(wrong[:1], perfect_l[:1], labels_masked, weights, target_feats, teacher)
    assert float(zero) == 0.0
    ce_weights = EagleLossWeights(regression=0.0, token=1.0, token_loss="ce")
    ce, _ = eagle_loss(perfect_f[:1], perfect_l[:1], labels, ce_weights)
    expect_ce = F.cross_entropy(perfect_l[0][0, : length - 2], labels[0, 2:])
    assert float(ce) == pytest.approx(float(expect_ce), rel=1e-5)
    with pytest.raises(ValueError, match="target_features"):
        eagle_loss(perfect_f, perfect_l, labels, weights)


def test_loss_trains_the_draft(tiny_llama):
    """A few steps of the EAGLE loss on one batch lower it (gradients reach the draft, not the target)."""
    model, _ = tiny_llama
    drafter = make(model, "eagle")
    ids = sequence(2, 12, device=model.device)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    target_feats = out.hidden_states[-1]
    weights = EagleLossWeights()
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        steps = drafter.unrolled_forward(drafter.target_features(out.hidden_states), ids, steps=2)
        loss, _ = eagle_loss(steps, [drafter.logits(s) for s in steps], ids, weights, target_feats, out.logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())


def dense_reference_loss(drafter, hidden_states, target_logits, ids, labels, weights, steps_n, attention_mask):
    """The EAGLE loss written the plain way: every step's logits over every position, masks over [B, T]; each step's
    terms are means over its mask. Returns (loss, each step's positions [steps_n])."""
    steps = drafter.unrolled_forward(drafter.target_features(hidden_states), ids, steps_n, key_padding=attention_mask)
    draft_labels = drafter.target_to_draft(labels)
    teacher, valid = drafter.teacher_logits(target_logits)
    total, counts = torch.zeros((), device=ids.device), []
    for j, feat in enumerate(steps):
        mask = (shift_left(draft_labels, j + 2, fill=-100) != -100) & shift_left(valid, j + 1, fill=False)
        step = weights.token * token_kl_loss(drafter.logits(feat), shift_left(teacher, j + 1, fill=0.0), mask)
        if weights.regression > 0:
            step = step + weights.regression * feature_regression_loss(
                feat, shift_left(hidden_states[-1], j + 1, fill=0.0), mask)
        total = total + weights.step_decay**j * step
        counts.append(mask.sum())
    return total, torch.stack(counts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_drafter_loss_at_trained_positions_equals_the_dense_loss(tiny_llama, variant):
    """drafter_loss projects only the positions it trains on (assistant tokens, not padding, in the draft
    vocabulary); loss and gradients equal the dense formulation's, with the target's logits given as a tensor or as
    a function of the rows."""
    model, _ = tiny_llama
    ids = sequence(3, 14, seed=4, device=model.device)
    attention_mask = torch.ones_like(ids, dtype=torch.bool)
    attention_mask[1, :5] = False  # left padding
    labels = ids.clone()
    labels[1:, :4] = -100  # a prompt (row 0 trains from its start: early positions have fewer unrolled steps)
    labels[~attention_mask] = -100
    labels[2, 9:] = -100
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask.long(), output_hidden_states=True)
    # A draft vocabulary of the sequence's tokens and the target's top tokens but two (one label, one top
    # token), so some positions fall outside it both ways.
    counts = (count_tokens(ids.cpu(), model.config.vocab_size)
              + count_tokens(out.logits.argmax(-1).cpu(), model.config.vocab_size))  # counted on the CPU
    counts[int(ids[0, 6])] = counts[int(out.logits[2, 7].argmax())] = 0
    size = int((counts > 0).sum())
    torch.manual_seed(0)
    drafter = make(model, variant, draft_vocab_size=size)
    drafter.set_draft_vocab(build_draft_vocab(counts, size)[0], init_lm_head_from=model.lm_head)
    weights = EagleLossWeights(regression=1.0 if variant == "eagle" else 0.0, token=0.5, step_decay=0.7)

    def grads(loss):
        drafter.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    dense, counts = dense_reference_loss(drafter, out.hidden_states, out.logits, ids, labels, weights, 3,
                                         attention_mask)
    dense_grads = grads(dense)
    lm_head = model.lm_head
    for teacher in (out.logits, lambda b, p: lm_head(out.hidden_states[-1][b, p])):
        # normalised by the dense loss's counts: the positions whose teacher is in the draft vocabulary
        loss, metrics = drafter_loss(drafter, out.hidden_states, teacher, ids, labels, weights, counts, unroll_steps=3,
                                     attention_mask=attention_mask)
        assert float(loss.detach()) == pytest.approx(float(dense.detach()), rel=1e-5) and float(loss.detach()) > 0
        assert metrics["count_0"] > metrics["count_2"] > 0
        for g_compact, g_dense in zip(grads(loss), dense_grads, strict=True):
            torch.testing.assert_close(g_compact, g_dense, rtol=1e-4, atol=1e-6)
    # Nothing trained on: a zero loss that still reaches every parameter.
    loss, metrics = drafter_loss(drafter, out.hidden_states, out.logits, ids, torch.full_like(labels, -100), weights,
                                 torch.zeros(2), unroll_steps=2, attention_mask=attention_mask)
    assert float(loss.detach()) == 0.0 and metrics["count_0"] == 0.0
    assert all(g is not None and float(g.abs().sum()) == 0.0 for g in grads(loss))


def test_a_draft_vocabulary_teacher_trains_on_the_draft_rows_of_the_lm_head(tiny_llama):
    """heads.loss.teacher_vocab=draft: the teacher is the LM head's draft-vocabulary rows alone. The loss equals the
    dense loss over the target's logits restricted to the draft tokens (the same softmax over them), and it trains
    where the full teacher skips a row whose target top token is outside the draft vocabulary."""
    model, _ = tiny_llama
    ids = sequence(3, 14, seed=4, device=model.device)
    labels = ids.clone()
    labels[1:, :4] = -100
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    counts = (count_tokens(ids.cpu(), model.config.vocab_size)
              + count_tokens(out.logits.argmax(-1).cpu(), model.config.vocab_size))
    counts[int(out.logits[2, 7].argmax())] = 0  # one top token outside the draft vocabulary (its label inside)
    assert int(ids[2, 8]) != int(out.logits[2, 7].argmax())
    size = int((counts > 0).sum())
    torch.manual_seed(0)
    drafter = make(model, "eagle3", draft_vocab_size=size)
    drafter.set_draft_vocab(build_draft_vocab(counts, size)[0], init_lm_head_from=model.lm_head)
    weights = EagleLossWeights(regression=0.0, token=1.0, teacher_vocab="draft")
    rows = drafter.draft_token_ids()
    restricted = out.logits[..., rows]
    dense, dense_counts = dense_reference_loss(drafter, out.hidden_states, restricted, ids, labels, weights, 2, None)
    _, full_counts = dense_reference_loss(drafter, out.hidden_states, out.logits, ids, labels, weights, 2, None)
    assert int(dense_counts[0]) == int(full_counts[0]) + 1  # row [2, 7] trains with the draft teacher only
    head = model.lm_head.weight[rows]
    loss, _ = drafter_loss(drafter, out.hidden_states, lambda b, p: F.linear(out.hidden_states[-1][b, p], head), ids,
                           labels, weights, dense_counts, unroll_steps=2)
    assert float(loss.detach()) == pytest.approx(float(dense.detach()), rel=1e-5) and float(loss.detach()) > 0
    with pytest.raises(SettingError, match="teacher_vocab must be 'full' or 'draft'"):
        EagleLossWeights(teacher_vocab="top")


@pytest.mark.parametrize("heads_option", ["eagle", "eagle3"])
def test_the_trainer_runs_only_the_draft_rows_for_a_draft_vocabulary_teacher(tmp_path, heads_option):
    """EagleMethod's teacher with heads.loss.teacher_vocab=draft: the target's LM head (soft-capped as the target's)
    over the draft vocabulary's rows, equal to the full head's logits at those columns (eagle's counted draft
    vocabulary as eagle3's)."""
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.data import collate
    from selfspec.train.eagle_method import EagleMethod

    target, datasets = tiny_target(), tiny_datasets()
    logits = {}
    for vocab in ("full", "draft"):
        method = EagleMethod(eagle_cfg(tmp_path / vocab, f"heads={heads_option}", "heads.draft_vocab_size=64",
                                       f"heads.loss.teacher_vocab={vocab}"))
        method.prepare_data(datasets, target, None, None)
        core = method.build_module(target).drafter
        batch = collate([datasets["train"][i] for i in range(2)], target.tokenizer.pad_token_id)
        batch = {k: v.to(target.model.device) for k, v in batch.items()}
        _, teacher = method._target_outputs(batch, target, core.config.layer_ids, core)
        b, p = (batch["labels"] != -100).nonzero(as_tuple=True)
        logits[vocab] = teacher(b, p)
    rows = core.draft_token_ids()
    assert logits["draft"].shape == (len(b), 64) and logits["full"].shape[-1] == target.model.config.vocab_size
    torch.testing.assert_close(logits["draft"], logits["full"][:, rows], rtol=1e-5, atol=1e-5)
    # the rows are gathered once per run, and again when the draft map changes in place
    lm_head = target.model.get_output_embeddings()
    assert method._draft_rows_head(lm_head, core) is method._draft_rows_head(lm_head, core)
    core.d2t.copy_(torch.arange(64) * 2 + 1 - torch.arange(64))  # draft ids -> target ids 1, 3, 5, ...
    _, moved = method._target_outputs(batch, target, core.config.layer_ids, core)
    torch.testing.assert_close(moved(b, p), logits["full"][:, 1:128:2], rtol=1e-5, atol=1e-5)


def test_eagle1_logits_are_the_lm_heads_draft_rows(tiny_llama):
    """EAGLE-1 with a draft vocabulary: its logits are the target LM head's logits at the draft tokens (no head of
    its own), its draft ids map back to those tokens, and a new vocabulary set in place is read, not the old rows."""
    model, _ = tiny_llama
    drafter = make(model, "eagle", draft_vocab_size=50)
    counts = torch.zeros(model.config.vocab_size)
    counts[torch.arange(7, 307, 6)] = 1.0  # target ids 7, 13, ..., 301
    drafter.set_draft_vocab(build_draft_vocab(counts, 50)[0])
    features = torch.randn(3, 64, device=model.device)
    full = model.lm_head(features)
    rows = drafter.draft_token_ids()
    assert rows.tolist() == list(range(7, 307, 6)) and "lm_head.weight" not in drafter.state_dict()
    torch.testing.assert_close(drafter.logits(features), full[:, rows], rtol=1e-5, atol=1e-5)
    top = drafter.logits(features).argmax(-1)
    assert torch.equal(drafter.draft_to_target(top), rows[top])
    drafter.set_draft_vocab(torch.zeros(50, dtype=torch.long))  # the first 50 ids
    torch.testing.assert_close(drafter.logits(features), full[:, :50], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        make(model, "eagle").set_draft_vocab(torch.zeros(50, dtype=torch.long))
    # vLLM's EAGLE-1 form drafts over the target's whole head: the map stays out of the export
    from selfspec.heads.export import eagle_to_vllm

    config, state = eagle_to_vllm(make(model, "eagle", draft_vocab_size=50, fc_bias=False, input_norm=False))
    assert config["vocab_size"] == model.config.vocab_size and not {"d2t", "t2d"} & set(state)


def test_uniform_noise_bounds():
    x = torch.zeros(1000)
    noisy = add_uniform_noise(x, 0.2, torch.Generator().manual_seed(0))
    assert float(noisy.abs().max()) <= 0.2 and float(noisy.std()) > 0.05
    assert add_uniform_noise(x, 0.0) is x


# --- draft vocabulary ------------------------------------------------------------------------------------------------


def test_build_draft_vocab_round_trip():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 1000, (50,), generator=g)
    counts[[4, 17, 49]] = 5000  # the three most frequent
    d2t, t2d = build_draft_vocab(counts, 10)
    target_ids = torch.arange(10) + d2t
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert t2d.sum() == 10 and t2d[target_ids].all()
    assert target_ids.tolist() == sorted(target_ids.tolist())  # draft ids follow target order
    assert {4, 17, 49} <= set(target_ids.tolist())
    top10 = set(torch.sort(counts, descending=True, stable=True).indices[:10].tolist())
    assert set(target_ids.tolist()) == top10
    d2t_full, t2d_full = build_draft_vocab(counts, 80)  # larger than the vocabulary: identity
    assert torch.equal(d2t_full, torch.zeros(50, dtype=torch.long)) and t2d_full.all()
    # Ties go to lower ids.
    d2t_tie, _ = build_draft_vocab(torch.ones(6), 3)
    assert (torch.arange(3) + d2t_tie).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="positive"):
        build_draft_vocab(counts, 0)


def test_count_tokens():
    ids = torch.tensor([[1, 2, 2, 0], [2, 3, 3, 3]])
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    assert count_tokens(ids, 5, mask).tolist() == [0, 1, 2, 3, 0]


def test_drafter_vocabulary_maps(tiny_llama):
    model, _ = tiny_llama
    device = model.device
    counts = torch.zeros(320)
    counts[torch.arange(100, 300, 2)] = torch.arange(100).float() + 1  # 100 candidate tokens, distinct counts
    d2t, t2d = (m.to(device) for m in build_draft_vocab(counts, 64))
    cfg = EagleConfig.from_target(model, variant="eagle3", draft_vocab_size=64)
    drafter = EagleHeads(cfg, model, d2t=d2t).to(device)
    assert torch.equal(drafter.t2d, t2d)
    draft_ids = torch.arange(64, device=device)
    target_ids = drafter.draft_to_target(draft_ids)
    assert torch.equal(drafter.target_to_draft(target_ids), draft_ids)
    outside = (~t2d).nonzero()[:5, 0]
    assert (drafter.target_to_draft(outside) == -100).all()
    assert drafter.target_to_draft(torch.tensor([-100], device=device)).item() == -100
    # The draft LM head starts as the target's rows for the draft vocabulary.
    assert torch.equal(drafter.lm_head.weight, model.lm_head.weight[target_ids])
    logits = torch.randn(3, 320).to(device)
    restricted, in_vocab = drafter.teacher_logits(logits)
    assert torch.equal(restricted, logits[:, target_ids])
    assert torch.equal(in_vocab, t2d[logits.argmax(-1)])
    with pytest.raises(ValueError, match="expected \\(64,\\)"):
        EagleHeads(cfg, model, d2t=torch.zeros(10, dtype=torch.long))


# --- decoding with dynamic trees -------------------------------------------------------------------------------------

NUM_PROMPTS = 12
MAX_NEW = 24


def train_briefly(model, variant, draft_vocab_size=200, steps=30, do_sample=False, seed=0):
    """A drafter trained for a few steps on the target's own continuations (so drafts get accepted often)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, min(259, model.config.vocab_size), (32, 4), generator=g).to(model.device)
    torch.manual_seed(seed)
    seqs = model.generate(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=do_sample, pad_token_id=0)
    with torch.no_grad():
        out = model(seqs, output_hidden_states=True)
    d2t, _ = build_draft_vocab(count_tokens(seqs.cpu(), model.config.vocab_size), draft_vocab_size)
    if variant == "eagle3-mid":
        steps *= 5  # the midlayer layout learns more slowly (selfspec.heads.eagle)
    drafter = make(model, variant, draft_vocab_size=draft_vocab_size, init_layer_from=None)
    drafter.set_draft_vocab(d2t, init_lm_head_from=model.lm_head)  # eagle: no head of its own, the target's rows
    weights = EagleLossWeights(regression=1.0 if variant == "eagle" else 0.0, token=1.0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    num_items = step_counts(drafter.target_to_draft(seqs), 2)  # the batch is the whole step
    for _ in range(steps):
        loss, _ = drafter_loss(drafter, out.hidden_states, out.logits, seqs, seqs, weights, num_items, unroll_steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


_TRAINED: dict = {}


@pytest.fixture(params=[f"{arch}-{variant}" for arch in ("llama", "qwen2") for variant in VARIANTS])
def trained(request):
    arch, variant = request.param.split("-", 1)
    model, _ = request.getfixturevalue(f"tiny_{arch}")
    if request.param not in _TRAINED:
        _TRAINED[request.param] = train_briefly(model, variant)
    return model, _TRAINED[request.param]


def decode_prompts():
    g = torch.Generator().manual_seed(321)
    return [torch.randint(3, 259, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g)
            for _ in range(NUM_PROMPTS)]


def hf_greedy(model, ids, i):
    """HF greedy new tokens and the EOS id: every third prompt stops at a token from the middle of its own
    continuation, so EOS arrives inside runs of tokens a good draft proposes."""
    eos = 2
    ids = ids.to(model.device)
    if i % 3 == 0:
        free = model.generate(ids[None], do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0)
        eos = int(free[0, len(ids) + 4 + i % 5])
    out = model.generate(ids[None], do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist(), eos


class DraftCacheCheck(EagleTreeDrafter):
    """After every commit: the draft cache holds exactly the committed positions and equals a fresh draft forward
    over them (the target's true features, the tokens that followed), and the next tree's root feature is its last
    output. Also records accepted lengths and EOS inside accepted drafts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks = self.longest_accept = self.eos_inside = 0
        self.eos: set[int] = set()

    def start(self, state, prefill):
        super().start(state, prefill)
        self.seq = state.prompt_ids.tolist() + [state.next_token]
        self.check(state)

    def on_commit(self, state, draft, verdict, out):
        super().on_commit(state, draft, verdict, out)
        accepted = draft.tokens[verdict.path[1:]].tolist()
        self.seq += accepted + [verdict.next_token]
        self.longest_accept = max(self.longest_accept, len(accepted))
        self.eos_inside += any(t in self.eos for t in accepted)
        self.check(state)

    def check(self, state):
        assert self.seq[state.length] == state.next_token and len(self.seq) == state.length + 1
        self._catch_up()  # what the next propose does first (the catch-up is lazy)
        model, drafter = self.drafter.target, self.drafter
        seq = torch.tensor(self.seq, device=model.device)
        fresh = DynamicCache()
        with torch.no_grad():
            hs = model(seq[None, : state.length], output_hidden_states=True).hidden_states
            positions = torch.arange(state.length, device=model.device)[None]
            out = drafter(drafter.target_features(hs), seq[None, 1:], positions, None, fresh)
        mine = self.cache.layers[0]
        assert mine.keys.shape[-2] == state.length
        torch.testing.assert_close(mine.keys, fresh.layers[0].keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, fresh.layers[0].values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(self.root_feature, out[0, -1], atol=1e-4, rtol=1e-4)
        self.checks += 1


def test_greedy_equals_hf_with_dynamic_trees(trained):
    model, drafter = trained
    tree_drafter = DraftCacheCheck(drafter, depth=5, top_k=3, total_tokens=12)
    decoder = SpeculativeDecoder(model, tree_drafter)
    results = []
    for i, ids in enumerate(decode_prompts()):
        ref, eos = hf_greedy(model, ids, i)
        decoder.eos_token_ids = frozenset([eos])
        tree_drafter.eos = {eos}
        res = decoder.generate(ids, max_new_tokens=MAX_NEW)
        assert res.tokens == ref, f"prompt {i}: {res.tokens} != HF {ref}"
        assert all(1 <= n <= 6 for n in res.stats.accept_lengths)
        results.append(res)
    assert tree_drafter.checks > len(results)
    slow = drafter.config.layout == "midlayer"  # learns more slowly: shorter drafts after the same training
    assert tree_drafter.longest_accept >= (3 if slow else 4) and tree_drafter.eos_inside > 0  # long drafts, EOS inside
    assert any(r.finish_reason == "eos" for r in results) and any(r.finish_reason == "length" for r in results)
    assert sum(r.stats.tau for r in results) / len(results) > (1.4 if slow else 1.8)  # drafts are accepted often


class OffAndOn:
    """A depth policy that turns drafting off for three steps out of four."""

    def __init__(self):
        self.steps = 0

    def choose(self, max_depth, beside=ROOT):
        self.steps += 1
        return max_depth if self.steps % 4 == 0 else 0

    def observe(self, asked, draft, accepted, draft_seconds):
        pass


class CacheAtPropose(DraftCacheCheck):
    """Checks the draft cache when a propose has caught up (not after each commit), and counts draft forwards over
    committed entries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.catch_ups = self.proposals = 0

    def start(self, state, prefill):
        EagleTreeDrafter.start(self, state, prefill)
        self.seq = state.prompt_ids.tolist() + [state.next_token]

    def on_commit(self, state, draft, verdict, out):
        EagleTreeDrafter.on_commit(self, state, draft, verdict, out)
        self.seq += draft.tokens[verdict.path[1:]].tolist() + [verdict.next_token]

    def _advance(self, *args):
        self.catch_ups += 1
        super()._advance(*args)

    def propose(self, state, max_depth):
        draft = super().propose(state, max_depth)
        self.proposals += 1
        self.check(state)
        return draft


def test_catch_up_is_lazy_while_drafting_is_off(trained):
    model, drafter = trained
    tree_drafter = CacheAtPropose(drafter, depth=4, top_k=3, total_tokens=8)
    decoder = SpeculativeDecoder(model, tree_drafter, depth_policy=OffAndOn())
    for i, ids in enumerate(decode_prompts()[:3]):
        ref, eos = hf_greedy(model, ids, i)
        decoder.eos_token_ids = frozenset([eos])
        res = decoder.generate(ids, max_new_tokens=MAX_NEW)
        assert res.tokens == ref
    # one draft forward per proposal (everything since the last one, in one batch), none while drafting is off
    assert tree_drafter.proposals > 0 and tree_drafter.catch_ups == tree_drafter.proposals
    assert tree_drafter.checks == tree_drafter.proposals


def test_tree_settings_bound_the_tree(tiny_llama):
    model, _ = tiny_llama
    tree_drafter = EagleTreeDrafter(make(model, "eagle3"), depth=3, top_k=2, total_tokens=5)
    decoder = SpeculativeDecoder(model, tree_drafter)
    seen = []
    original = tree_drafter.propose

    def propose(state, max_depth):
        draft = original(state, max_depth)
        seen.append((draft.tree.num_nodes, draft.tree.max_depth, max_depth))
        return draft

    tree_drafter.propose = propose
    decoder.generate(torch.tensor([5, 6, 7]), max_new_tokens=6)
    assert all(n == min(6, 1 + 2 + 2 * 2 * 2) and d <= min(3, budget) for n, d, budget in seen if budget >= 3)
    assert any(budget < 3 and d <= budget for n, d, budget in seen)  # cut to the token budget at the end
    with pytest.raises(ValueError, match="top_k >= 1"):
        EagleTreeDrafter(make(model, "eagle"), depth=5, top_k=0, total_tokens=48)


SAMPLING = Sampling(acceptance="sample", temperature=0.9, top_p=0.9)
SEEDS = 1500


@pytest.mark.parametrize("variant", VARIANTS)
def test_sampled_tokens_follow_the_target_distribution(variant):
    """The first three sampled tokens over many seeds follow the target's own distribution (chi-square and total
    variation), with drafts from a dynamic tree accepted often."""
    from test_verify import chi_square_pvalue

    model, _ = build_tiny("llama", vocab_size=12, hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=1)
    device = model.device
    prompt = torch.tensor([3, 5, 7, 1], device=device)
    v = model.config.vocab_size
    vocab = torch.arange(v, device=device)
    with torch.no_grad():
        p1 = target_probs(model(input_ids=prompt[None]).logits[0, -1], 0.9, 0, 0.9)
        one = torch.cat([prompt.expand(v, -1), vocab[:, None]], 1)
        p2 = target_probs(model(input_ids=one).logits[:, -1], 0.9, 0, 0.9)
        two = torch.cat([prompt.expand(v * v, -1), torch.cartesian_prod(vocab, vocab)], 1)
        p3 = target_probs(model(input_ids=two).logits[:, -1], 0.9, 0, 0.9).reshape(v, v, v)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1).cpu()  # beside the counts, on the CPU

    drafter = train_briefly(model, variant, draft_vocab_size=9, do_sample=True)  # eagle3: 9 of the 12 tokens
    assert variant == "eagle" or int(drafter.t2d.sum()) == 9
    decoder = SpeculativeDecoder(model, EagleTreeDrafter(drafter, depth=2, top_k=3, total_tokens=6), eos_token_ids=[])
    counts = torch.zeros(v**3)
    accepted = 0
    for seed in range(SEEDS):
        res = decoder.generate(prompt, max_new_tokens=3, sampling=SAMPLING, seed=seed)
        a, b, c = res.tokens
        counts[(a * v + b) * v + c] += 1
        accepted += res.stats.accepted
    assert accepted / SEEDS > 0.5  # drafts were accepted often enough for the test to mean something
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


# --- training through the shared loop ---------------------------------------------------------------------------------


def eagle_cfg(run_dir, *overrides):
    from conftest import compose

    base = ["experiment=debug", f"run_dir={run_dir}", "trainer.max_steps=8", "trainer.batch_size=4",
            "trainer.learning_rate=3e-3", "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.log_every=1"]
    return compose("eagle", base + list(overrides))


def saved_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "heads" / "model.safetensors"))


@pytest.mark.parametrize("heads_option", VARIANTS)
def test_training_changes_the_draft_and_not_the_target(tmp_path, heads_option):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec import heads
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    target = tiny_target()
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    cfg = eagle_cfg(tmp_path / "run", *heads_overrides(heads_option), "heads.draft_vocab_size=64", "trainer.max_steps=12",
                    "heads.unroll_steps=2")
    method = EagleMethod(cfg)
    initial = {k: v.clone().cpu() for k, v in method.build_module(target).drafter.state_dict().items()}
    result = train(cfg, method, target=target, datasets=tiny_datasets())

    losses = [h["loss"] for h in result.history]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.9 * sum(losses[:3])
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target is bit-identical
    trained = saved_weights(result.run_dir)
    moved = [k for k in trained if trained[k].is_floating_point() and not torch.equal(trained[k], initial[k])]
    assert ("fuse.weight" if heads_option == "eagle3-mid" else "fc.weight") in moved
    assert any(k.startswith("layer.self_attn") for k in moved)
    loaded = heads.load(result.run_dir / "heads", target)
    assert loaded.config["head_type"] == heads_option.split("-")[0] and isinstance(loaded.module, EagleHeads)
    assert loaded.module.config.layout == ("midlayer" if heads_option == "eagle3-mid" else "fc")
    assert loaded.config["eval"]["eval/accept_length_chain"] >= 0 and loaded.config["tree"]["top_k"] >= 1
    # The draft vocabulary (eagle's too: its logits are the target LM head's rows of it) is the 64 most frequent
    # assistant tokens of the training split, saved with the heads.
    from selfspec.train.data import draft_vocab_counts

    counts = draft_vocab_counts(tiny_datasets()["train"], 320)
    d2t, t2d = build_draft_vocab(counts, 64)
    assert torch.equal(loaded.module.d2t.cpu(), d2t) and torch.equal(loaded.module.t2d.cpu(), t2d)
    assert int(t2d.sum()) == 64 and loaded.config["draft_vocab_coverage"] > 0.3
    for k, v in loaded.module.state_dict().items():
        assert torch.equal(v.cpu(), trained[k]), k


class KilledEagle(Exception):
    pass


@pytest.mark.parametrize("heads_option", ["eagle", "eagle3", "eagle3-packed"])
def test_killed_and_resumed_run_ends_with_the_same_parameters(tmp_path, heads_option, deterministic):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.checkpoint import list_checkpoints
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    class KilledAt(EagleMethod):
        def __init__(self, cfg, kill_call):
            super().__init__(cfg)
            self.calls, self.kill_call = 0, kill_call

        def compute_loss(self, batch, target, drafter, num_items):
            self.calls += 1
            if self.calls == self.kill_call:
                raise KilledEagle
            return super().compute_loss(batch, target, drafter, num_items)

    # feature_noise on: random draws every step, so the RNG states must be restored as well.
    opts = [f"heads={heads_option.split('-')[0]}", "heads.feature_noise=0.1", "heads.draft_vocab_size=64",
            "trainer.gradient_accumulation_steps=2", "trainer.save_every=2", "trainer.max_steps=6"]
    if heads_option.endswith("-packed"):  # rows of 96 tokens hold two or three of the 20-40 token examples
        opts += ["trainer.packing=true", "trainer.pack_length=96"]
    data = tiny_datasets()
    full_cfg = eagle_cfg(tmp_path / "full", *opts)
    train(full_cfg, EagleMethod(full_cfg), target=tiny_target(), datasets=data)
    cfg = eagle_cfg(tmp_path / "killed", *opts)
    with pytest.raises(KilledEagle):
        train(cfg, KilledAt(cfg, kill_call=(5 - 1) * 2 + 1), target=tiny_target(), datasets=data)  # dies in step 5
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [2, 4]
    resumed_cfg = eagle_cfg(tmp_path / "killed", *opts, "trainer.resume=true")
    result = train(resumed_cfg, EagleMethod(resumed_cfg), target=tiny_target(), datasets=data)
    assert result.steps == 6 and len(result.history) == 2  # steps 5 and 6 only
    full, resumed = saved_weights(tmp_path / "full"), saved_weights(tmp_path / "killed")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_feature_store_trains_the_same_drafter_as_online_features(tmp_path):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    data = tiny_datasets()
    common = ["heads=eagle3", "heads.draft_vocab_size=64", "trainer.max_steps=4", "feature_store.dtype=float32"]
    online_cfg = eagle_cfg(tmp_path / "online", *common)
    online = train(online_cfg, EagleMethod(online_cfg), target=tiny_target(), datasets=data)
    store_cfg = eagle_cfg(tmp_path / "store", *common, "features=store")
    store = train(store_cfg, EagleMethod(store_cfg), target=tiny_target(), datasets=data)
    assert (tmp_path / "store" / "features" / "meta.json").is_file()
    a, b = saved_weights(tmp_path / "online"), saved_weights(tmp_path / "store")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    for key, value in online.eval_metrics.items():
        assert store.eval_metrics[key] == pytest.approx(value, abs=1e-4), key


def test_configs_compose_and_bad_options_fail_clearly(tmp_path):
    from conftest import compose
    from test_medusa_train import tiny_target

    from selfspec.train.eagle_method import EagleMethod

    default = compose("eagle")
    assert default.model.source == "smollm2" and default.heads.type == "eagle" and default.run_dir == "outputs/eagle-smollm2"
    assert compose("eagle", ["heads=eagle3"]).run_name == "eagle3-smollm2"
    for option in ("eagle", "eagle3"):
        cfg = compose("eagle", [f"heads={option}", "experiment=debug", f"run_dir={tmp_path}"])
        module = EagleMethod(cfg).build_module(tiny_target())
        assert module.drafter.variant == option and all(p.requires_grad for p in module.parameters())
    from conftest import experiments_for

    from selfspec.train.config import TrainerConfig

    experiments = experiments_for(("eagle", "eagle3"))
    assert "eagle3_llama8b_gpu" in experiments and "gemma_eagle3_1h" in experiments and "gemma_dflash_1h" not in experiments
    for experiment in experiments:  # shared overlays (debug, cpu_1h) and the EAGLE ones
        cfg = compose("eagle", [f"experiment={experiment}", f"run_dir={tmp_path}"])
        assert EagleMethod(cfg).name == cfg.heads.type and TrainerConfig.from_cfg(cfg.trainer).max_steps >= 1
    gemma = compose("eagle", ["experiment=gemma_eagle_1h", f"run_dir={tmp_path}"])  # Gemma's 262k head: draft rows
    assert gemma.heads.type == "eagle" and gemma.heads.draft_vocab_size == "auto"
    assert gemma.heads.loss.teacher_vocab == "draft"
    with pytest.raises(ValueError, match="heads.layout=midlayer"):
        EagleMethod(compose("eagle", ["heads.layout=midlayer"]))
    with pytest.raises(ValueError, match="use fc or midlayer"):
        EagleMethod(compose("eagle", ["heads=eagle3", "heads.layout=wide"]))
    with pytest.raises(ValueError, match="input_norm=false is for heads.layout=fc"):
        EagleMethod(compose("eagle", ["heads=eagle3", "heads.layout=midlayer", "heads.input_norm=false"]))
    cfg = compose("eagle", ["heads.fc_bias=false", "heads.input_norm=false", "experiment=debug", f"run_dir={tmp_path}"])
    drafter = EagleMethod(cfg).build_module(tiny_target()).drafter  # vLLM's EAGLE-1: no fc bias, no input norm
    assert drafter.fc.bias is None and isinstance(drafter.layer.input_layernorm, torch.nn.Identity)
    with pytest.raises(ValueError, match="no feature regression"):
        EagleMethod(compose("eagle", ["heads=eagle3", "heads.loss.regression=1.0"]))
    with pytest.raises(ValueError, match="token_loss"):
        EagleMethod(compose("eagle", ["heads.loss.token_loss=mse"]))
    with pytest.raises(ValueError, match="Unknown heads option"):
        EagleMethod(compose("eagle", ["+heads.num_heads=3"]))


def test_decode_run_picks_the_eagle_drafter_for_eagle_heads(tmp_path):
    """decode/run.py's session: EAGLE heads from a training run get the EAGLE drafter with the tree settings saved with
    them and decode exactly the target's greedy tokens; draft.* overrides them; drafter=eagle refuses Medusa heads."""
    from conftest import compose
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.decode.session import load_session
    from selfspec.decode.types import DecodeSetupError
    from selfspec.heads.io import save_heads
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    cfg = eagle_cfg(tmp_path / "run", "heads=eagle3", "heads.draft_vocab_size=64", "trainer.max_steps=2",
                    "heads.tree.depth=3", "heads.tree.top_k=2", "heads.tree.total_tokens=4")
    train(cfg, EagleMethod(cfg), target=tiny_target(), datasets=tiny_datasets())
    session = load_session(compose("decode", ["max_new_tokens=8", f"heads={tmp_path / 'run' / 'heads'}"]))
    drafter = session.decoder.drafter.inner  # a hybrid tree by default
    assert isinstance(drafter, EagleTreeDrafter) and drafter.drafter.variant == "eagle3"
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (3, 2, 4)
    ids = [5, 6, 7, 8, 9]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=8, pad_token_id=0)
    assert session.decoder.generate(ids, max_new_tokens=8).tokens == ref[0, 5:].tolist()
    # draft.* overrides the saved settings one by one
    tuned = load_session(compose("decode", ["draft.total_tokens=6", f"heads={tmp_path / 'run' / 'heads'}"]))
    assert (tuned.decoder.drafter.inner.depth, tuned.decoder.drafter.inner.total_tokens) == (3, 6)
    # drafter=eagle3 names the heads' own family: the saved settings, draft.* on top; Medusa heads: a clear error.
    chosen = load_session(compose("decode", ["drafter=eagle3", "draft.top_k=3", f"heads={tmp_path / 'run' / 'heads'}"]))
    assert chosen.decoder.drafter.inner.top_k == 3 and chosen.decoder.drafter.inner.depth == 3
    medusa = load_session(compose("decode", ["model=tiny"])).heads
    save_heads(tmp_path / "medusa", medusa, "medusa", medusa.config.to_dict(), session.target)
    with pytest.raises(DecodeSetupError, match="drafter=eagle drafts with eagle heads"):
        load_session(compose("decode", ["drafter=eagle", f"heads={tmp_path / 'medusa'}"]))


def test_eagle3_draft_vocabulary_size_is_chosen_by_coverage(tmp_path):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.heads.vocab import size_for_coverage
    from selfspec.train.data import draft_vocab_counts
    from selfspec.train.eagle_method import EagleMethod

    cfg = eagle_cfg(tmp_path / "run", "heads=eagle3", "heads.draft_vocab_coverage=0.8")
    assert cfg.heads.draft_vocab_size == "auto"  # the default: sized by coverage
    method, target, data = EagleMethod(cfg), tiny_target(), tiny_datasets()
    method.prepare_data(data, target, None, None)
    counts = draft_vocab_counts(data["train"], 320)
    size = size_for_coverage(counts, 0.8)
    drafter = method.build_module(target).drafter
    assert drafter.d2t.numel() == size < 256 and method.draft_vocab_coverage >= 0.8
    with pytest.raises(ValueError, match="draft_vocab_coverage"):
        EagleMethod(eagle_cfg(tmp_path / "run", "heads=eagle3", "heads.draft_vocab_coverage=null"))
