"""DFlash block drafting (decode/dflash_drafter.py) on tiny Llama and Qwen2 targets, with a drafter trained briefly on
the target's own continuations so that its chains are accepted: greedy output equals HF generate and sampled tokens
follow the target's distribution, for the chain and the top-k tree, alone and merged with the suffix drafter, with
adaptive depth on and off; after every commit the drafter's context equals a fresh computation over the committed
text; the heads folder round trip decodes identically; the registry entry builds the hybrid from a folder."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.adaptive import AdaptiveDepth, CostCurve
from selfspec.decode.cache import CacheError
from selfspec.decode.dflash_drafter import DFlashBlockDrafter
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.hybrid import HybridDrafter
from selfspec.decode.suffix import SuffixArray
from test_suffix import suffix_drafter
from selfspec.heads.dflash import (
    DFlashConfig, DFlashHeads, block_mask, block_targets, dflash_block_loss, position_weights, sample_anchors,
)
from test_eagle import MAX_NEW, OffAndOn, decode_prompts, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAT = CostCurve.from_relative({1: 1.0, 64: 1.0})  # verifying is free: adaptive depth drafts whenever drafts pay


def continuations(model, rows=32, new=40, prompt=None, do_sample=False, seed=0) -> torch.Tensor:
    """[rows, 4 + new] the target's own continuations of random 4-token prompts (ids < 259, the tokenizer's text),
    or of ``prompt`` [4] in every row."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, min(259, model.config.vocab_size), (rows, 4), generator=g)
    prompts = (prompts if prompt is None else prompt.expand(rows, -1)).to(model.device)
    torch.manual_seed(seed)
    return model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=do_sample, pad_token_id=0)


def block_loss(drafter: DFlashHeads, features, seqs, teacher_ids, labels, anchors, weights) -> torch.Tensor:
    """The drafter's weighted CE over every block at ``anchors`` [B, A] of ``seqs`` [B, T] against the target's
    argmax tokens ``teacher_ids`` [B, T] (row j: its choice of token j + 1)."""
    bsz, t = labels.shape
    bs = drafter.block_size
    context_kv = drafter.context_kv(drafter.context(features), torch.arange(t, device=labels.device).expand(bsz, -1))
    starts = anchors.clamp(min=0)
    block = drafter.block_inputs(seqs.gather(1, starts))  # [B, A*bs, H]
    positions = (starts[:, :, None] + torch.arange(bs, device=labels.device)).reshape(bsz, -1)
    mask = block_mask(anchors, torch.ones_like(labels, dtype=torch.bool), bs)
    hidden = drafter(block, positions, context_kv, mask).reshape(bsz, anchors.shape[1], bs, -1)
    b, a, k = block_targets(anchors, labels, bs)
    teacher = drafter.target_to_draft(teacher_ids[b, anchors[b, a] + k - 1])  # the target's own choice of p + k
    num_items = (weights[k] * (teacher != -100)).sum()  # the batch is the whole step: its scored positions' weight
    return dflash_block_loss(drafter.logits(hidden[b, a, k]), teacher, weights[k], "ce", num_items)


def train_dflash(model, seqs: torch.Tensor, block_size=4, steps=300, seed=0, freeze_lm_head=False) -> DFlashHeads:
    """A one-layer DFlash drafter trained on ``seqs`` [B, 4 + n] (the target's own continuations of 4-token prompts)
    against the target's argmax at each block position. A few hundred steps on so little data memorise it: the
    tests decode prompts the data continues, where its chains are accepted, and others, where they are rejected.
    ``freeze_lm_head``: the draft LM head stays the target's rows it starts from (heads.freeze_lm_head=true)."""
    with torch.no_grad():
        out = model(seqs, output_hidden_states=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashHeads(DFlashConfig.from_target(model, block_size=block_size, num_layers=1), model)
    features = drafter.target_features(out.hidden_states)  # [B, T, n * H]
    teacher_ids = out.logits.argmax(-1)  # [B, T] the target's choice of the next token
    labels = seqs.clone()
    labels[:, :4] = -100  # the prompt is not trained
    weights = position_weights(block_size, gamma=4.0, device=seqs.device)
    g = torch.Generator().manual_seed(seed)
    drafter.lm_head.weight.requires_grad_(not freeze_lm_head)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        anchors = sample_anchors(labels, 8, generator=g)
        loss = block_loss(drafter, features, seqs, teacher_ids, labels, anchors, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


# --- greedy decoding ---------------------------------------------------------------------------------------------------

_TRAINED: dict = {}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request):
    """(target, trained drafter, prompts): 8 beginnings of the training data (no special ids, which HF generate
    would read as padding or EOS) and 4 random prompts."""
    model, _ = request.getfixturevalue(f"tiny_{request.param}")
    if request.param not in _TRAINED:
        seqs = continuations(model)
        rows = [r.cpu() for r in seqs if bool((r[:10] > 2).all())]
        prompts = [rows[i][: 4 + i % 6] for i in range(8)] + decode_prompts()[:4]
        _TRAINED[request.param] = model, train_dflash(model, seqs), prompts
    return _TRAINED[request.param]


class ContextCheck(DFlashBlockDrafter):
    """After the prefill and every commit: the context holds exactly the committed positions and equals a fresh
    computation over the committed text (the target's features of one plain forward, fused and projected). Also
    counts the chain tokens it proposed and how many of them were accepted (as the head of the accepted branch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks = self.proposed = self.accepted = 0
        self._chain: list[int] = []

    def start(self, state, prefill):
        super().start(state, prefill)
        self.seq = state.prompt_ids.tolist() + [state.next_token]
        self.check(state)

    def propose(self, state, max_depth):
        draft = super().propose(state, max_depth)
        self._chain = draft.tokens[1 : 1 + int(draft.tree.max_depth)].tolist()
        self.proposed += len(self._chain)
        return draft

    def on_commit(self, state, draft, verdict, out):
        super().on_commit(state, draft, verdict, out)
        accepted = draft.tokens[verdict.path[1:]].tolist()
        self.accepted += next((i for i, (a, c) in enumerate(zip(accepted, self._chain)) if a != c),
                              min(len(accepted), len(self._chain)))
        self._chain = []
        self.seq += accepted + [verdict.next_token]
        self.check(state)

    def check(self, state):
        assert len(self.seq) == state.length + 1 and self.seq[state.length] == state.next_token
        self._catch_up()  # what the next propose does first (the catch-up is lazy)
        model, drafter = self.drafter.target, self.drafter
        with torch.no_grad():
            hs = model(torch.tensor([self.seq[: state.length]], device=model.device),
                       output_hidden_states=True).hidden_states
            features = torch.cat([hs[i] for i in drafter.feature_layers], dim=-1)  # [1, length, n * H]
            positions = torch.arange(state.length, device=model.device)[None]
            fresh = drafter.context_kv(drafter.context(features), positions)
        assert len(self.kv) == len(fresh) == drafter.config.num_layers
        for (k, v), (fk, fv) in zip(self.kv, fresh):
            assert k.shape[-2] == v.shape[-2] == state.length
            if self.dtype == torch.float32:  # the same arithmetic in another summation order
                torch.testing.assert_close(k, fk, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v, fv, atol=1e-4, rtol=1e-4)
            else:
                assert relative_error(k, fk) < BF16_PATH and relative_error(v, fv) < BF16_PATH
        self.checks += 1


# bfloat16 rounds to 8 significant bits (relative error 2^-9 a rounding); the decode form's path from the features
# to a key, value or logit rounds about ten times in sequence (the inputs, the weights, each product, each norm), so
# its result is within some 10 * 2^-9 ~ 0.02 of the float32 one in norm. Twice that is the bound.
BF16_PATH = 20 * 2.0 ** -9


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def adaptive_policy():
    return AdaptiveDepth(FLAT, measure_draft=False, explore_every=2)


def decoder_for(model, drafter, hybrid: bool, adaptive: bool, corpus=None) -> SpeculativeDecoder:
    """The engine over ``drafter`` alone or merged with a suffix drafter, with adaptive depth or the whole block."""
    policy = adaptive_policy() if adaptive else None
    if hybrid:
        suffix = suffix_drafter(model, corpus=corpus, max_nodes=8, cost_curve=FLAT)
        drafter = HybridDrafter(drafter, suffix, max_nodes=16, marginal=True, splice=True)
    return SpeculativeDecoder(model, drafter, depth_policy=policy)


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("hybrid", [False, True], ids=["alone", "hybrid"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["whole", "adaptive"])
def test_greedy_equals_hf_generate(trained, top_k, hybrid, adaptive):
    model, heads, prompts = trained
    drafter = ContextCheck(heads, top_k=top_k)
    decoder = decoder_for(model, drafter, hybrid, adaptive, corpus=SuffixArray.build([list(range(20, 60))]))
    steps = 0
    for i, ids in enumerate(prompts):
        ref, eos = hf_greedy(model, ids, i)
        decoder.eos_token_ids = frozenset([eos])
        res = decoder.generate(ids, max_new_tokens=MAX_NEW)
        assert res.tokens == ref, f"prompt {i}: {res.tokens} != HF {ref}"
        assert all(1 <= n <= heads.block_size for n in res.stats.accept_lengths) or hybrid
        steps += res.stats.steps
    assert drafter.checks == steps + len(prompts)  # the context checked after every prefill and every commit
    # the chains were accepted, clearly (most of them on the prompts the drafter learned)
    assert drafter.accepted >= 0.25 * drafter.proposed and drafter.accepted > 0, (drafter.accepted, drafter.proposed)


def test_bfloat16_drafts_are_accepted_and_greedy_output_is_unchanged(trained):
    """The decode form in bfloat16 (``draft.dtype=auto`` on a CPU with native bf16): its context stays within
    bfloat16's rounding of the module's, its chains are accepted as often, and the output is the target's."""
    model, heads, prompts = trained
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        drafter = ContextCheck(heads, top_k=1, dtype=dtype)
        decoder = decoder_for(model, drafter, hybrid=False, adaptive=False)
        for i, ids in enumerate(prompts):
            ref, eos = hf_greedy(model, ids, i)
            decoder.eos_token_ids = frozenset([eos])
            assert decoder.generate(ids, max_new_tokens=MAX_NEW).tokens == ref, f"{dtype}, prompt {i}"
        runs[dtype] = drafter.accepted / drafter.proposed
    assert runs[torch.bfloat16] >= 0.25 and runs[torch.bfloat16] > runs[torch.float32] - 0.1, runs


def test_the_decode_form_computes_the_modules_block(trained):
    """BlockForward (merged projections, the context in the engine's cache layers) gives the module's own logits
    for the block after a context long enough to grow its buffers twice: float32 to rounding, bfloat16 within its
    bound."""
    from selfspec.decode.dflash_drafter import BlockForward

    model, heads, _ = trained
    g = torch.Generator().manual_seed(0)
    n = 600  # the cache buffers start at 256 rows and grow
    device = model.device
    ids = torch.randint(3, 200, (1, n), generator=g).to(device)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        features = heads.target_features(hs)[0]  # [n, layers * H]
        kv = heads.context_kv(heads.context(features[None]), torch.arange(n, device=device)[None])
        block = heads.block_inputs(torch.tensor([[7]], device=device))
        ref = heads.logits(heads(block, torch.arange(n, n + heads.block_size, device=device)[None], kv, None)[0, 1:])
        for dtype in (torch.float32, torch.bfloat16):
            form = BlockForward(heads, dtype)
            for start, end in ((0, 100), (100, 101), (101, 350), (350, n)):  # commits of several sizes
                form.extend(features[start:end], start)
            assert form.length == n and form.context_kv()[0][0].shape[2] == n
            logits = form.logits(7, heads.block_size - 1).float()
            if dtype == torch.float32:  # sums of up to 1,728 float32 products in another order: n * 2^-24 ~ 1e-4
                torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
            else:
                assert relative_error(logits, ref) < BF16_PATH
        with pytest.raises(CacheError, match="position 5"):
            form.extend(features[5:9], 5)


def test_the_decode_form_follows_the_modules_weights(trained):
    """A drafter whose module is trained further (its parameters written in place) drafts from the new weights at
    the next decode: the decode form is made again."""
    model, heads, prompts = trained
    heads = copy_drafter(heads, model)
    drafter = DFlashBlockDrafter(heads, top_k=1)
    decoder = SpeculativeDecoder(model, drafter)
    ids = prompts[0]
    before = decoder.generate(ids, max_new_tokens=MAX_NEW).stats.accepted_per_step
    form = drafter.modules()[0]
    with torch.no_grad():
        heads.lm_head.weight.zero_()  # every draft position's logits tie: the draft is token 0's, rarely right
    assert drafter.modules()[0] is not form and not drafter.modules()[0].lm_head.weight.any()
    after = decoder.generate(ids, max_new_tokens=MAX_NEW).stats.accepted_per_step
    assert sum(before) > 0 and sum(after) < sum(before)


def copy_drafter(heads: DFlashHeads, model) -> DFlashHeads:
    """A drafter with ``heads``' weights, to change without touching the module-scoped one."""
    other = DFlashHeads(DFlashConfig(**heads.config.to_dict()), model)
    other.load_state_dict(heads.state_dict())
    return other.eval()


def test_the_draft_dtype_setting(tiny_llama, monkeypatch):
    """``draft.dtype=auto`` is bfloat16 exactly where the CPU multiplies it natively; names are checked."""
    import selfspec.decode.dflash_drafter as dd
    from selfspec.core.errors import SettingError

    model, _ = tiny_llama
    heads = DFlashHeads(DFlashConfig.from_target(model, block_size=3), model)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(dd, "native_bf16", lambda device, native=native: native)
        assert dd.draft_dtype("auto", heads) == expected and dd.draft_dtype(None, heads) == expected
    assert dd.draft_dtype("float32", heads) == torch.float32 and dd.draft_dtype("bfloat16", heads) == torch.bfloat16
    monkeypatch.setattr(dd, "native_bf16", lambda device: True)
    assert dd.draft_dtype("own", heads) == torch.float32  # the heads' own, even where bfloat16 is native
    with pytest.raises(SettingError, match="draft.dtype='fp8'"):
        dd.draft_dtype("fp8", heads)


def test_the_context_catches_up_lazily_while_drafting_is_off(trained):
    model, heads, prompts = trained
    drafter = DFlashBlockDrafter(heads, top_k=1)
    projections = []
    original = drafter._catch_up

    def counted():
        projections.append(drafter._backlog.end - drafter._backlog.start)
        original()

    drafter._catch_up = counted
    decoder = SpeculativeDecoder(model, drafter, depth_policy=OffAndOn())
    for i, ids in enumerate(prompts[:4]):
        ref, eos = hf_greedy(model, ids, i)
        decoder.eos_token_ids = frozenset([eos])
        assert decoder.generate(ids, max_new_tokens=MAX_NEW).tokens == ref
    # one projection per proposal, over every position committed since the last one
    assert projections and all(n > 0 for n in projections) and len(projections) < sum(projections)


# --- sampling ----------------------------------------------------------------------------------------------------------

SAMPLE_PROMPT = torch.tensor([3, 5, 7, 1])  # the prompt of test_engine.sampled_first_three


@pytest.fixture(scope="module")
def small_vocab():
    """The sampling tests' 12-token target and a drafter trained on its own samples after their prompt."""
    from test_engine import small_vocab_target

    model = small_vocab_target()
    seqs = continuations(model, rows=64, new=8, prompt=SAMPLE_PROMPT, do_sample=True)
    return model, train_dflash(model, seqs, block_size=3, steps=200)


@pytest.mark.parametrize("top_k, hybrid, adaptive", [(1, False, False), (3, False, True), (1, True, True),
                                                      (3, True, False)])
def test_sampled_tokens_follow_the_target_distribution(small_vocab, top_k, hybrid, adaptive):
    """The first three sampled tokens over many seeds follow the target's own distribution (chi-square and total
    variation), with the block's drafts accepted often."""
    from test_engine import sampled_first_three
    from test_suffix import own_samples_corpus
    from test_verify import chi_square_pvalue

    model, heads = small_vocab
    exact, corpus = own_samples_corpus(model)
    drafter = ContextCheck(heads, top_k=top_k)
    policy = adaptive_policy() if adaptive else None
    if hybrid:
        drafter = HybridDrafter(drafter, suffix_drafter(model, corpus=corpus, budget=4), max_nodes=12, marginal=True,
                                splice=True)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1500, depth_policy=policy)
    inner = drafter.inner if hybrid else drafter
    assert accept_rate > 0.3 and inner.accepted >= 0.3 * inner.proposed  # the block's own drafts were accepted often
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


# --- the heads folder and the registry ---------------------------------------------------------------------------------


def test_the_heads_folder_round_trip_decodes_identically(trained, tmp_path):
    from selfspec.heads.io import load_heads, save_heads

    model, heads, prompts = trained
    save_heads(tmp_path / "heads", heads, "dflash", heads.config.to_dict(), model)
    loaded = load_heads(tmp_path / "heads", target=model).module
    assert isinstance(loaded, DFlashHeads) and loaded.config == heads.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), heads.state_dict().values()))
    for top_k in (1, 3):
        runs = [SpeculativeDecoder(model, DFlashBlockDrafter(h, top_k=top_k)) for h in (heads, loaded)]
        for ids in prompts[:6]:
            first, again = (d.generate(ids, max_new_tokens=MAX_NEW) for d in runs)
            assert first.tokens == again.tokens and first.stats.accepted_per_step == again.stats.accepted_per_step


def test_decode_run_builds_the_hybrid_from_a_dflash_folder(tmp_path):
    from conftest import compose
    from selfspec.decode.session import load_session
    from selfspec.heads.io import save_heads

    target = load_session(compose("decode", ["model=tiny", "heads=null"])).target
    heads = train_dflash(target.model, continuations(target.model, rows=8, new=16), steps=20)
    save_heads(tmp_path / "heads", heads, "dflash", heads.config.to_dict(), target)
    args = ["max_new_tokens=12", f"heads={tmp_path / 'heads'}"]
    session = load_session(compose("decode", args))
    assert session.family == "dflash" and isinstance(session.decoder.drafter, HybridDrafter)
    assert isinstance(session.decoder.drafter.inner, DFlashBlockDrafter) and session.decoder.depth_policy is not None
    alone = load_session(compose("decode", args + ["draft.suffix=false", "draft.top_k=2", "draft.adaptive=false",
                                                   "draft.dtype=float32"]))
    assert isinstance(alone.decoder.drafter, DFlashBlockDrafter) and alone.decoder.drafter.top_k == 2
    assert alone.decoder.drafter.dtype == torch.float32
    assert alone.decoder.depth_policy is None and alone.decoder.drafter.max_draft_depth == heads.block_size - 1
    ids = [5, 6, 7, 8]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=12, pad_token_id=0)[0, 4:].tolist()
    assert session.decoder.generate(ids, max_new_tokens=12).tokens == ref
    assert alone.decoder.generate(ids, max_new_tokens=12).tokens == ref


def test_bad_settings_fail_clearly(tiny_llama):
    from selfspec.core.errors import SettingError

    model, _ = tiny_llama
    heads = DFlashHeads(DFlashConfig.from_target(model, block_size=3), model)
    with pytest.raises(SettingError, match="top_k=0"):
        DFlashBlockDrafter(heads, top_k=0)
    with pytest.raises(TypeError, match="DFlash heads"):
        DFlashBlockDrafter(torch.nn.Linear(2, 2), top_k=1)
