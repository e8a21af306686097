"""DFlash training (train/dflash_method.py) through the shared loop: the block attention mask, training that lowers
the loss and raises the expected accepted length on the target's own greedy continuations with the target left
bit-identical, exact resume, the feature store (EAGLE-3's, reused), settings and configs."""

from __future__ import annotations

import pytest
import torch
from test_medusa_train import heads_weights

from selfspec.heads.dflash import DFlashHeads, block_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dflash_cfg(run_dir, *overrides):
    from conftest import compose

    base = ["experiment=debug", f"run_dir={run_dir}", "trainer.max_steps=8", "trainer.batch_size=4",
            "trainer.learning_rate=3e-3", "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.log_every=1", "heads.draft_vocab_size=64", "heads.anchors_per_sequence=8"]
    return compose("dflash", base + list(overrides))


# --- the block attention mask -------------------------------------------------------------------------------------


def test_block_mask_sees_earlier_context_and_its_own_block_only():
    bs, t = 4, 12
    anchors = torch.tensor([[2, 5, 9, -1], [0, 3, -1, -1]])
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, 7:] = False  # padding
    mask = block_mask(anchors, valid, bs)
    assert mask.shape == (2, 1, anchors.shape[1] * bs, t + anchors.shape[1] * bs) and mask.dtype == torch.bool
    for b in range(2):
        for q in range(anchors.shape[1] * bs):
            a, p = q // bs, int(anchors[b, q // bs])
            context, block = mask[b, 0, q, :t], mask[b, 0, q, t:].view(-1, bs)
            # every earlier real context position, nothing at or after the anchor (an anchor-less block: none)
            assert context.tolist() == [0 <= j < p and bool(valid[b, j]) for j in range(t)], (b, q)
            assert block[a].all(), (b, q)  # its whole block, both ways (non-causal inside)
            assert not block[torch.arange(anchors.shape[1]) != a].any(), (b, q)  # no other block


def test_scored_positions_are_the_trained_tokens_inside_each_block():
    from selfspec.heads.dflash import block_targets

    labels = torch.tensor([[-100, -100, 5, 6, 7, -100], [-100, 4, 5, 6, 7, 8]])
    anchors = torch.tensor([[1, 3, -1], [0, -1, -1]])  # -1: no block (as sample_anchors pads)
    b, a, k = block_targets(anchors, labels, block_size=3)
    scored = sorted(zip(b.tolist(), a.tolist(), k.tolist()))
    # sequence 0: anchor 1 scores positions 2, 3; anchor 3 scores 4 (5 is unlabelled); sequence 1: anchor 0 scores 1, 2
    assert scored == [(0, 0, 1), (0, 0, 2), (0, 1, 1), (1, 0, 1), (1, 0, 2)]


def copy_reference(ids: list[int], valid: list[bool], min_match: int, max_match: int) -> list[bool]:
    """By hand: for each j, the longest (capped) earlier match of the text ending at j - 1, the latest of the longest,
    and whether the token after it is ids[j]."""
    out = [False] * len(ids)
    for j in range(1, len(ids)):
        t, best, best_len = j - 1, None, 0
        for s in range(t):
            n = 0
            while n < max_match and s - n >= 0 and valid[t - n] and valid[s - n] and ids[t - n] == ids[s - n]:
                n += 1
            if n >= min_match and n >= best_len:
                best, best_len = s, n
        out[j] = valid[j] and best is not None and ids[best + 1] == ids[j]
    return out


def test_retrieval_hits_are_where_copying_the_longest_latest_match_is_right():
    from selfspec.heads.dflash import retrieval_hits

    # "a b c x a b c y a b c": after the third "a b", the longest match is the second (latest) "a b", followed by c
    ids = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]])
    hits = retrieval_hits(ids, torch.ones_like(ids, dtype=torch.bool), min_match=2)
    assert hits[0].nonzero().flatten().tolist() == [6, 10]  # the two "c"s after a repeated "a b"
    # after "a b c" (third time) copying says y, the latest of the longest: a different token scores no hit
    ids2 = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 9]])
    assert not retrieval_hits(ids2, torch.ones_like(ids2, dtype=torch.bool), min_match=2)[0, 11]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = int(torch.randint(2, 30, (1,), generator=gen))
        ids = torch.randint(0, 4, (3, t), generator=gen)  # 4 symbols: many repeats and ties
        valid = torch.ones(3, t, dtype=torch.bool)
        valid[1, t // 2:] = False  # padding never matches and is never a hit
        for min_match, max_match in ((1, 8), (2, 8), (3, 4), (2, 2)):
            got = retrieval_hits(ids, valid, min_match, max_match)
            for b in range(3):
                assert got[b].tolist() == copy_reference(ids[b].tolist(), valid[b].tolist(), min_match, max_match)
    with pytest.raises(ValueError, match="min_match"):
        retrieval_hits(ids, valid, min_match=0)


def test_retrieved_weight_scales_exactly_the_retrieved_positions(tmp_path):
    from test_medusa_train import tiny_target

    from selfspec.heads.dflash import block_targets, position_weights, retrieval_hits
    from selfspec.train.dflash_method import DFlashMethod

    t = tiny_target()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 4]] * 2,  # repeats: many positions copyable
                       device=t.model.device)
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    hits = retrieval_hits(ids, torch.ones_like(ids, dtype=torch.bool), 2)
    ce = "heads.loss.token_loss=ce"  # the target's greedy tokens as the teacher: no method state beyond the settings
    plain = DFlashMethod(dflash_cfg(tmp_path / "a", ce, "heads.loss.retrieved_weight=1"))
    weighted = DFlashMethod(dflash_cfg(tmp_path / "b", ce, "heads.loss.retrieved_weight=0.25"))
    module = plain.build_module(t)
    torch.manual_seed(0)
    n_plain = plain.count_items(batch)
    anchors = batch["anchors"]
    torch.manual_seed(0)
    n_weighted = weighted.count_items(batch)
    assert torch.equal(batch["anchors"], anchors)  # the same anchors: the weighting draws no random numbers
    b, a, k = block_targets(anchors, labels, plain.settings.block_size)
    base = position_weights(plain.settings.block_size, plain.gamma, k.device)[k]
    copied = hits[b, anchors[b, a] + k]
    assert 0 < int(copied.sum()) < copied.numel()  # both kinds of position are scored
    assert torch.isclose(n_plain, base.sum())
    assert torch.isclose(n_weighted, base.sum() - 0.75 * base[copied].sum())
    # the loss: the same per-position terms, reweighted (the drafter and teacher are the same in all three)
    loss_plain, _ = plain.compute_loss(dict(batch, anchors=anchors), t, module, n_plain)
    loss_weighted, _ = weighted.compute_loss(dict(batch, anchors=anchors), t, module, n_weighted)
    zero = DFlashMethod(dflash_cfg(tmp_path / "c", ce, "heads.loss.retrieved_weight=0"))
    loss_zero, _ = zero.compute_loss(dict(batch, anchors=anchors), t, module, base[~copied].sum())
    # loss_plain = (S_novel + S_copied) / W, loss_weighted = (S_novel + 0.25 S_copied) / W', loss_zero = S_novel / W0
    s_novel = loss_zero * base[~copied].sum()
    s_copied = loss_plain * n_plain - s_novel
    assert torch.isclose(loss_weighted * n_weighted, s_novel + 0.25 * s_copied, rtol=1e-5)
    for bad in ("heads.loss.retrieved_weight=1.5", "heads.loss.retrieval_min_match=0"):
        with pytest.raises(ValueError, match=bad.split("=")[0].split(".")[-1]):
            DFlashMethod(dflash_cfg(tmp_path / "d", bad))


def test_earlier_all_and_the_on_path_chain_count_as_a_loop_over_each_block():
    from selfspec.heads.dflash import block_targets, chain_on_path, earlier_all, on_greedy_path

    gen = torch.Generator().manual_seed(0)
    for bs in (2, 3, 5):
        labels = torch.randint(0, 5, (3, 20), generator=gen)
        labels[torch.rand(3, 20, generator=gen) < 0.2] = -100  # unscored positions inside blocks
        anchors = torch.tensor([[0, 4, 9, 15], [2, 7, -1, -1], [1, 10, 16, -1]])
        scored = block_targets(anchors, labels, bs)
        n = scored[0].numel()
        values, hits = torch.rand(n, generator=gen) < 0.7, torch.rand(n, generator=gen) < 0.6
        greedy = torch.randint(0, 3, (n,), generator=gen)
        data = torch.where(torch.rand(n, generator=gen) < 0.75, greedy, greedy + 1)  # mostly on the path
        where = {(b, a, k): i for i, (b, a, k) in enumerate(zip(*(t.tolist() for t in scored)))}

        def before(flags, b, a, k):  # every earlier position of the block scored and flagged
            return all((b, a, j) in where and bool(flags[where[(b, a, j)]]) for j in range(1, k))

        shape = (*anchors.shape, bs)
        got = earlier_all(scored, values, shape)
        on = on_greedy_path(scored, greedy, data, shape)
        right, reached = chain_on_path(scored, hits, on, shape)
        want_right, want_reached = [0.0] * bs, [0.0] * bs
        for (b, a, k), i in where.items():
            assert bool(got[i]) == before(values, b, a, k)
            assert bool(on[i]) == before(greedy == data, b, a, k)
            if before(greedy == data, b, a, k) and before(hits, b, a, k):
                want_reached[k] += 1
                want_right[k] += float(hits[i])
        assert right.tolist() == want_right and reached.tolist() == want_reached
        if bs > 2:  # both kinds of later position occur
            assert 0 < sum(want_reached[2:]) < sum(1 for _, _, k in where if k >= 2)


def off_path_batch(target):
    """The tiny target's own greedy continuation of one prompt, twice: the second row's text leaves the greedy path
    at a few answer positions, so some blocks there are off the path and the rest on it."""
    prompt = torch.tensor([[5, 17, 40, 9, 23, 61]], device=target.model.device)
    out = target.model.generate(prompt, do_sample=False, max_new_tokens=26, min_new_tokens=26, pad_token_id=0,
                                eos_token_id=None)
    ids = torch.cat([out, out]).clone()
    for j in (10, 17, 25):
        ids[1, j] = 3 + (int(ids[1, j]) - 3 + 7) % 256  # another byte token: the text leaves the greedy path
    labels = ids.clone()
    labels[:, :6] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def test_off_path_weight_scales_exactly_the_positions_after_the_text_leaves_the_greedy_path(tmp_path):
    from test_medusa_train import tiny_target

    from selfspec.heads.dflash import block_targets, position_weights
    from selfspec.train.dflash_method import DFlashMethod, target_greedy

    t = tiny_target()
    batch = off_path_batch(t)
    ids = batch["input_ids"]
    ce = "heads.loss.token_loss=ce"
    methods = {w: DFlashMethod(dflash_cfg(tmp_path / str(w), ce, "heads.loss.retrieved_weight=1",
                                          f"heads.loss.off_path_weight={w}", "heads.draft_vocab_size=null"))
               for w in (1, 0.5, 0)}
    module = methods[1].build_module(t)
    torch.manual_seed(0)
    n = methods[1].count_items(batch)
    anchors = batch["anchors"]
    for w, method in methods.items():  # count_items is the same for every weight: the normaliser does not move
        torch.manual_seed(0)
        assert torch.equal(method.count_items(dict(batch)), n)
    b, a, k = block_targets(anchors, batch["labels"], methods[1].settings.block_size)
    base = position_weights(methods[1].settings.block_size, methods[1].gamma, k.device)[k]
    with torch.no_grad():  # the target's greedy token after every prefix of the text, by a plain forward
        greedy_next = torch.cat([torch.zeros(2, 1, dtype=torch.long, device=ids.device),
                                 t.model(input_ids=ids).logits.argmax(-1)[:, :-1]], dim=1)
        assert torch.equal(greedy_next[0, 6:], ids[0, 6:])  # row 0 is the target's own continuation
    on = torch.tensor([all(int(ids[bb, p + j]) == int(greedy_next[bb, p + j]) for j in range(1, kk))
                       for bb, p, kk in zip(b.tolist(), anchors[b, a].tolist(), k.tolist())], device=b.device)
    assert on[b == 0].all() and 0 < int((~on).sum()) and int((on & (b == 1) & (k >= 2)).sum()) > 0
    with torch.no_grad():
        losses = {w: m.compute_loss(dict(batch, anchors=anchors), t, module, n)[0] for w, m in methods.items()}
    # loss_w * n = S_on + w * S_off, with the same per-position terms in all three
    s_on = losses[0] * n
    s_off = losses[1] * n - s_on
    assert float(s_off) > 0 and float(s_on) > 0
    assert torch.isclose(losses[0.5] * n, s_on + 0.5 * s_off, rtol=1e-5)
    # S_on by hand: the on-path positions' cross-entropy to the target's greedy token, weighted by position
    blocks = methods[1]._scored_blocks(dict(batch), t, module, anchors)
    assert torch.equal(target_greedy(t.model, blocks.target_rows), greedy_next[b, anchors[b, a] + k])
    ce_terms = torch.nn.functional.cross_entropy(blocks.logits.float(), blocks.teacher, reduction="none")
    assert torch.isclose(s_on, (ce_terms * base * on).sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="off_path_weight"):
        DFlashMethod(dflash_cfg(tmp_path / "bad", "heads.loss.off_path_weight=2"))


def test_the_on_path_evaluation_counts_what_decoding_would_verify(tmp_path, monkeypatch):
    """A drafter right at known positions (an oracle pattern): the evaluation's on-path acceptance at k is, over the
    blocks whose text before k is the target's greedy path and whose draft was right before k, the share right at k,
    counted here by a loop over the blocks."""
    import dataclasses

    from test_medusa_train import tiny_target

    from selfspec.train.dflash_method import DFlashMethod, target_greedy

    t = tiny_target()
    batch = off_path_batch(t)  # row 0 on the greedy path everywhere, row 1 leaving it in places
    ids = batch["input_ids"]
    method = DFlashMethod(dflash_cfg(tmp_path, "heads.draft_vocab_size=null", "heads.anchors_per_sequence=16"))
    module = method.build_module(t)
    vocab = t.model.config.vocab_size
    pattern = torch.Generator().manual_seed(3)
    seen = {}
    scored_blocks = method._scored_blocks

    def oracle(batch, target, drafter, anchors):  # the draft's token: the greedy one where the pattern says right
        blocks = scored_blocks(batch, target, drafter, anchors)
        greedy = target_greedy(target.model, blocks.target_rows)
        right = torch.rand(greedy.shape, generator=pattern).to(greedy.device) < 0.7
        tokens = torch.where(right, greedy, (greedy + 1) % vocab)
        logits = torch.full_like(blocks.logits, -10.0)
        logits[torch.arange(tokens.numel(), device=tokens.device), tokens] = 10.0
        for i, (b, a, k) in enumerate(zip(*(x.tolist() for x in blocks.scored))):
            seen[(b, int(anchors[b, a]), k)] = bool(right[i])
        return dataclasses.replace(blocks, logits=logits)

    monkeypatch.setattr(method, "_scored_blocks", oracle)

    class Acc:
        device = t.model.device

        @staticmethod
        def reduce(x, reduction):
            return x

    with torch.no_grad():
        metrics = method.evaluate([batch], t, module, Acc())
        greedy_next = t.model(input_ids=ids).logits.argmax(-1)  # [b, j]: the greedy token after ids[b, :j + 1]
    bs = method.settings.block_size
    right_at, reached_at = [0] * bs, [0] * bs
    for (b, p, k), right in seen.items():
        on_path = all(int(ids[b, p + j]) == int(greedy_next[b, p + j - 1]) for j in range(1, k))
        if on_path and all(seen.get((b, p, j), False) for j in range(1, k)):
            reached_at[k] += 1
            right_at[k] += right
    assert reached_at[2] > 0 and reached_at[3] > 0 and reached_at[2] < sum(1 for _, _, k in seen if k == 2)
    for k in range(1, bs):
        assert metrics[f"eval/acc_on_path_pos{k}"] == pytest.approx(right_at[k] / reached_at[k]), k
    rates = [right_at[k] / reached_at[k] for k in range(1, bs)]
    assert metrics["eval/accept_length_on_path"] == pytest.approx(sum(
        torch.tensor(rates[:n + 1]).prod().item() for n in range(bs - 1)))
    assert metrics["eval/acc_on_path_pos1"] == pytest.approx(metrics["eval/acc_pos1"])


# --- settings -----------------------------------------------------------------------------------------------------


def test_mask_token_is_an_unused_special_token_or_the_last_row():
    from selfspec.core.target import build_tiny_tokenizer
    from selfspec.train.dflash_method import choose_mask_token_id

    tokenizer = build_tiny_tokenizer()  # only pad / bos / eos specials, all in use
    assert choose_mask_token_id(tokenizer, 320) == 319
    tokenizer.add_tokens(["<|a|>", "<|b|>"], special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(["<|a|>", "<|b|>"])
    assert choose_mask_token_id(tokenizer, 320) == max(ids) and max(ids) > 258


def test_configs_compose_and_bad_options_fail_clearly(tmp_path):
    from conftest import compose
    from test_medusa_train import tiny_target

    from selfspec.train.config import TrainerConfig
    from selfspec.train.dflash_method import DFlashMethod

    default = compose("dflash")
    assert default.heads.type == "dflash" and default.run_dir == "outputs/dflash-smollm2"
    for experiment in ("debug", "dflash_cpu_1h"):
        cfg = compose("dflash", [f"experiment={experiment}", f"run_dir={tmp_path}"])
        assert DFlashMethod(cfg).name == "dflash" and TrainerConfig.from_cfg(cfg.trainer).max_steps >= 1
    recipe = compose("dflash", ["experiment=dflash_cpu_1h"])
    eagle3 = compose("eagle", ["experiment=eagle3_cpu_1h"])
    assert recipe.data == eagle3.data and recipe.features == eagle3.features == "store"
    assert recipe.feature_store == eagle3.feature_store
    # the hour recipe keeps the target's LM head rows (measured there); the family's default trains them
    assert recipe.heads.freeze_lm_head is True and default.heads.freeze_lm_head is False
    module = DFlashMethod(dflash_cfg(tmp_path)).build_module(tiny_target())
    assert all(p.requires_grad for p in module.parameters())
    assert module.drafter.config.mask_token_id == 319 and module.drafter.config.target_layer_ids == [0, 1, 2]
    bad = {"token_loss": ["heads.loss.token_loss=mse"], "anchors": ["heads.anchors_per_sequence=0"],
           "mask_token_id": ["heads.mask_token_id=-3"], "heads.loss": ["+heads.loss.decay=1"],
           "Unknown heads option": ["+heads.num_heads=3"],
           "draft_vocab_coverage": ["heads.draft_vocab_size=auto", "heads.draft_vocab_coverage=null"]}
    for match, overrides in bad.items():
        with pytest.raises(ValueError, match=match):
            DFlashMethod(dflash_cfg(tmp_path, *overrides))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_init_from_layer_copies_a_target_layer_and_leaves_the_target(tmp_path, arch):
    from selfspec.core.layers import decoder_of
    from selfspec.core.target import Target, build_tiny
    from selfspec.train.dflash_method import DFlashMethod

    model, tokenizer = build_tiny(arch)
    t = Target(model=model, tokenizer=tokenizer, name=f"tiny-{arch}")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = DFlashMethod(dflash_cfg(tmp_path / "r")).build_module(t).drafter  # random start
    for layer in (-1, 0):
        drafter = DFlashMethod(dflash_cfg(tmp_path / f"l{layer}", "heads.num_layers=2",
                                          f"heads.init_from_layer={layer}")).build_module(t).drafter
        source = dict(decoder_of(model).layers[layer].named_parameters())
        for mine in drafter.layers:
            for name, p in mine.named_parameters():
                if name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                    assert torch.equal(p, torch.ones_like(p))  # the target has none: they keep their start
                else:
                    assert torch.equal(p, source[name]), name
                    assert p.data_ptr() != source[name].data_ptr()  # a copy: training cannot reach the target
        assert not torch.equal(fresh.layers[0].mlp.up_proj.weight, drafter.layers[0].mlp.up_proj.weight)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for bad, match in (("heads.init_from_layer=7", "layers 0..3"), ("heads.init_from_layer=last", "init_from_layer")):
        with pytest.raises(ValueError, match=match):
            DFlashMethod(dflash_cfg(tmp_path / "bad", bad)).build_module(t)


# --- training -----------------------------------------------------------------------------------------------------


def greedy_continuations(target, n: int, prompt: int = 6, answer: int = 34, seed: int = 0):
    """The target's own greedy continuations of random byte prompts: the prompt unlabelled, the answer labelled."""
    import datasets

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 259, (n, prompt), generator=gen).to(target.model.device)
    out = target.model.generate(prompts, do_sample=False, max_new_tokens=answer, min_new_tokens=answer,
                                pad_token_id=0, eos_token_id=None).cpu()
    return datasets.Dataset.from_dict({"input_ids": out.tolist(),
                                       "labels": [[-100] * prompt + row[prompt:] for row in out.tolist()]})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_lowers_the_loss_raises_acceptance_and_leaves_the_target(tmp_path, arch):
    import datasets

    from selfspec import heads
    from selfspec.core.target import Target, build_tiny
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    def target():
        model, tokenizer = build_tiny(arch)
        return Target(model=model, tokenizer=tokenizer, name=f"tiny-{arch}")

    t = target()
    continuations = greedy_continuations(t, 16)  # evaluated on the same continuations: does the drafter fit them?
    data = datasets.DatasetDict({"train": continuations, "eval": continuations})
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    runs = {}
    for steps in (1, 80):
        cfg = dflash_cfg(tmp_path / f"s{steps}", f"trainer.max_steps={steps}", "heads.block_size=4",
                         "trainer.learning_rate=1e-2", "heads.draft_vocab_size=200", "heads.anchors_per_sequence=16",
                         "trainer.eval_max_examples=16")
        runs[steps] = train(cfg, DFlashMethod(cfg), target=t, datasets=data)
    losses = [h["loss"] for h in runs[80].history]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    first, last = runs[1].eval_metrics, runs[80].eval_metrics
    assert last["eval/loss"] < 0.5 * first["eval/loss"]
    assert last["eval/accept_length_chain"] > first["eval/accept_length_chain"] + 0.3
    assert last["eval/acc_pos1"] > 0.25 and set(last) >= {"eval/acc_pos2", "eval/acc_pos3", "eval/positions"}
    after = t.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target is bit-identical
    loaded = heads.load(tmp_path / "s80" / "heads", t)
    assert loaded.config["head_type"] == "dflash" and isinstance(loaded.module, DFlashHeads)
    assert loaded.module.config.block_size == 4 and loaded.module.config.mask_token_id == 319
    assert loaded.config["eval"]["eval/accept_length_chain"] == pytest.approx(last["eval/accept_length_chain"])
    trained = heads_weights(tmp_path / "s80")
    for k, v in loaded.module.state_dict().items():
        assert torch.equal(v.cpu(), trained[k]), k
    assert int(loaded.module.t2d.sum()) == 200 and loaded.config["draft_vocab_coverage"] > 0.5


def test_ce_loss_trains(tmp_path):
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    cfg = dflash_cfg(tmp_path / "run", "heads.loss.token_loss=ce", "trainer.max_steps=12")
    result = train(cfg, DFlashMethod(cfg), target=tiny_target(), datasets=tiny_datasets())
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]) and result.eval_metrics["eval/positions"] > 0


def test_killed_and_resumed_run_ends_with_the_same_parameters(tmp_path, deterministic):
    from test_medusa_train import KilledAt, Killed, assert_same_weights, tiny_datasets, tiny_target

    from selfspec.train.checkpoint import list_checkpoints
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    # anchors are drawn from the global RNG every step, so its restored state must resume them exactly
    opts = ["trainer.gradient_accumulation_steps=2", "trainer.save_every=2", "trainer.max_steps=6"]
    data = tiny_datasets()
    full_cfg = dflash_cfg(tmp_path / "full", *opts)
    train(full_cfg, DFlashMethod(full_cfg), target=tiny_target(), datasets=data)
    cfg = dflash_cfg(tmp_path / "killed", *opts)
    killed = type("KilledAt", (KilledAt, DFlashMethod), {})(cfg, 5, 2)  # dies in step 5
    with pytest.raises(Killed):
        train(cfg, killed, target=tiny_target(), datasets=data)
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [2, 4]
    resumed_cfg = dflash_cfg(tmp_path / "killed", *opts, "trainer.resume=true")
    result = train(resumed_cfg, DFlashMethod(resumed_cfg), target=tiny_target(), datasets=data)
    assert result.steps == 6 and len(result.history) == 2  # steps 5 and 6 only
    assert_same_weights(heads_weights(tmp_path / "full"), heads_weights(tmp_path / "killed"))


def test_a_frozen_lm_head_stays_the_targets_rows_through_a_killed_and_resumed_run(tmp_path, deterministic):
    from safetensors.torch import load_file
    from test_medusa_train import KilledAt, Killed, assert_same_weights, tiny_datasets, tiny_target

    from selfspec.train.checkpoint import list_checkpoints
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    common = ["trainer.target_dtype=float32", "trainer.save_every=2", "trainer.max_steps=6"]
    opts = [*common, "heads.freeze_lm_head=true"]
    data = tiny_datasets()
    free_cfg = dflash_cfg(tmp_path / "free", *common)
    train(free_cfg, DFlashMethod(free_cfg), target=tiny_target(), datasets=data)
    frozen_cfg = dflash_cfg(tmp_path / "frozen", *opts)
    train(frozen_cfg, DFlashMethod(frozen_cfg), target=tiny_target(), datasets=data)
    free, frozen = heads_weights(tmp_path / "free"), heads_weights(tmp_path / "frozen")
    assert torch.equal(free["d2t"], frozen["d2t"])
    rows = tiny_target().model.get_output_embeddings().weight.detach().cpu()[torch.arange(64) + frozen["d2t"]]
    assert torch.equal(frozen["lm_head.weight"], rows)  # the target's rows of the draft vocabulary, untouched
    assert not torch.equal(free["lm_head.weight"], rows)  # the same run with the head free moves it
    assert not torch.equal(free["fc.weight"], frozen["fc.weight"])  # and trains the rest differently
    # a checkpoint leaves the frozen head out; a run killed in step 5 resumes to the uninterrupted one's weights
    last = list_checkpoints(tmp_path / "frozen" / "checkpoints")[-1][1]
    kept = load_file(str(last / "model.safetensors"))
    assert "drafter.lm_head.weight" not in kept and "drafter.fc.weight" in kept
    cfg = dflash_cfg(tmp_path / "killed", *opts)
    killed = type("KilledAt", (KilledAt, DFlashMethod), {})(cfg, 5, 1)
    with pytest.raises(Killed):
        train(cfg, killed, target=tiny_target(), datasets=data)
    assert [s for s, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")] == [2, 4]
    resumed_cfg = dflash_cfg(tmp_path / "killed", *opts, "trainer.resume=true")
    train(resumed_cfg, DFlashMethod(resumed_cfg), target=tiny_target(), datasets=data)
    assert_same_weights(frozen, heads_weights(tmp_path / "killed"))


def test_feature_store_trains_the_same_drafter_as_online_features(tmp_path):
    from test_medusa_train import assert_same_weights, tiny_datasets, tiny_target

    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    data = tiny_datasets()
    common = ["trainer.max_steps=4", "feature_store.dtype=float32"]
    online_cfg = dflash_cfg(tmp_path / "online", *common)
    online = train(online_cfg, DFlashMethod(online_cfg), target=tiny_target(), datasets=data)
    store_cfg = dflash_cfg(tmp_path / "store", *common, "features=store")
    store = train(store_cfg, DFlashMethod(store_cfg), target=tiny_target(), datasets=data)
    assert (tmp_path / "store" / "features" / "meta.json").is_file()
    assert_same_weights(heads_weights(tmp_path / "online"), heads_weights(tmp_path / "store"), exact=False, atol=1e-5)
    for key, value in online.eval_metrics.items():
        assert store.eval_metrics[key] == pytest.approx(value, abs=1e-4), key


def test_the_eagle3_store_is_reused(tmp_path, monkeypatch):
    """DFlash's default layers are EAGLE-3's minus one: a store an EAGLE-3 run wrote is DFlash's store."""
    from test_eagle import eagle_cfg
    from test_medusa_train import tiny_datasets, tiny_target

    import selfspec.train.feature_store as feature_store
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    data = tiny_datasets()
    eagle = eagle_cfg(tmp_path / "eagle3", "heads=eagle3", "heads.draft_vocab_size=64", "features=store",
                      "trainer.max_steps=1")
    train(eagle, EagleMethod(eagle), target=tiny_target(), datasets=data)
    store = tmp_path / "eagle3" / "features"
    meta = (store / "meta.json").read_text()

    def rebuild(*args, **kwargs):
        raise AssertionError("the EAGLE-3 store was rebuilt")

    monkeypatch.setattr(feature_store, "_build", rebuild)
    cfg = dflash_cfg(tmp_path / "dflash", "features=store", f"feature_store.dir={store}", "trainer.max_steps=2")
    result = train(cfg, DFlashMethod(cfg), target=tiny_target(), datasets=data)
    assert result.steps == 2 and (store / "meta.json").read_text() == meta
