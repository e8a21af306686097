"""The decoding engine on tiny Llama and Qwen2 targets (fp32).

- Greedy output ids equal HF ``generate(do_sample=False)`` on 20 prompts for the default tree, a chain, the root
  alone and a deep narrow tree, with random Medusa heads and with an oracle drafter whose branches often hold the
  target's true continuation (so long acceptances, EOS inside an accepted draft and the max_new_tokens boundary
  happen; the test asserts they did), and with a dynamic-tree drafter.
- After every commit the KV cache equals a fresh forward's cache over the accepted prefix, in every layer, and the
  state's hidden state is the fresh forward's.
- Sampling: the first emitted tokens follow the target's distribution (after temperature and top-p) over many
  seeds; a rule that accepts every draft fails the same test.
- Stop strings, and clear errors for bad input and for targets that cannot take a tree mask.
"""

from __future__ import annotations

import random

import pytest
import torch

import selfspec.decode.engine as engine_module
from selfspec.decode.drafters import MedusaDrafter, VanillaDrafter
from selfspec.decode.types import DrafterBase
from selfspec.decode.engine import SpeculativeDecoder, TreeAttentionError, check_tree_attention, tree_forward
from selfspec.decode.types import DecodeState, Draft
from selfspec.decode.cache import new_cache
from selfspec.decode.tree import Tree, TreeError, load_tree
from selfspec.decode.verify import Sampling, Verdict, target_probs
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.core.target import build_tiny, cache_kwarg

NUM_PROMPTS = 20
MAX_NEW = 20
DEEP_NARROW = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0],
               [0, 0, 0, 0, 1]]
TREES = {"default": "mc_sim_7b_63", "chain": "chain-4", "single": "single", "deep_narrow": DEEP_NARROW}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    model, tokenizer = request.getfixturevalue(f"tiny_{request.param}")
    return request.param, model, tokenizer


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 259, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g)
            for _ in range(NUM_PROMPTS)]


_REFERENCES: dict = {}


def reference(arch: str, model, i: int) -> tuple[list[int], int]:
    """HF greedy new tokens for prompt i, and the EOS id used. Every third prompt gets an EOS id taken from the
    middle of its own continuation, so decoding must stop inside a run of tokens the oracle drafts."""
    key = (arch, i)
    if key in _REFERENCES and _REFERENCES[key][0] is not model:  # another model under this name: compute anew
        del _REFERENCES[key]
    if key not in _REFERENCES:
        ids = prompts()[i].to(model.device)
        eos = 2
        if i % 3 == 0:
            free = model.generate(ids[None], do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
            eos = free[5 + i % 7]
        out = model.generate(ids[None], do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        _REFERENCES[key] = (model, out[0, len(ids):].tolist(), eos)
    return _REFERENCES[key][1:]


def random_heads(model, num_heads: int = 6, seed: int = 0) -> MedusaHeads:
    config = model.config
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=num_heads, num_layers=1,
                                     shared_lm_head=False, draft_vocab_size=None), model.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return heads.to(model.device)


class OracleDrafter(DrafterBase):
    """Knows the target's greedy continuation and hides it in some branches.

    Static: like Medusa heads, each depth gets a candidate list (top-k) where the true token sits at a random
    rank (rank 0 most often) or is missing; nodes read candidates by their rank path. Dynamic: a random tree each
    step (like EAGLE), true tokens on some branches, duplicates allowed. Records what the engine did.
    """

    def __init__(self, tree: Tree | None, vocab: int, seed: int = 0):
        self.tree = tree
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.eos: set[int] = set()
        self.truth: list[int] = []
        self.longest_accept = 0
        self.eos_inside_draft = 0

    def reset(self, truth: list[int], eos: int) -> None:
        self.truth, self.eos = truth, {eos}

    def future(self, state: DecodeState) -> list[int]:
        return self.truth[len(state.new_tokens):]  # the target's tokens after the root

    def random_token(self) -> int:
        return self.rng.randrange(3, 259)

    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        future = self.future(state)
        if self.tree is None:
            return self.dynamic(state, future)
        depth, k = self.tree.max_depth, self.tree.max_rank + 1
        cand = [[self.random_token() for _ in range(k)] for _ in range(depth)]
        for d in range(min(depth, len(future))):
            if self.rng.random() < 0.85:
                cand[d][0 if self.rng.random() < 0.6 else self.rng.randrange(k)] = future[d]
        flat = torch.tensor(cand, dtype=torch.long).reshape(-1)
        tokens = torch.cat([torch.tensor([state.next_token]), flat[self.tree.candidate_index(k)]])
        return Draft(tokens=tokens, tree=self.tree)

    def dynamic(self, state: DecodeState, future: list[int]) -> Draft:
        parents, tokens, on_truth, depth = [-1], [state.next_token], [True], [0]
        for i in range(1, 1 + self.rng.randrange(1, 14)):
            p = self.rng.randrange(i)
            d = depth[p] + 1
            if on_truth[p] and d - 1 < len(future) and self.rng.random() < 0.6:
                tok = future[d - 1]
            else:
                tok = self.random_token()
            parents.append(p)
            tokens.append(tok)
            depth.append(d)
            on_truth.append(on_truth[p] and d - 1 < len(future) and tok == future[d - 1])
        return Draft(tokens=torch.tensor(tokens), tree=Tree.from_parents(parents))

    def on_commit(self, state, draft, verdict, out) -> None:
        accepted = draft.tokens[verdict.path[1:]].tolist()
        self.longest_accept = max(self.longest_accept, len(accepted))
        self.eos_inside_draft += any(t in self.eos for t in accepted)


def run_greedy(model, drafter, arch: str, oracle: OracleDrafter | None = None, num_prompts=NUM_PROMPTS,
               linear_kernel: str = "auto") -> list:
    decoder = SpeculativeDecoder(model, drafter, linear_kernel=linear_kernel)
    results = []
    for i, ids in enumerate(prompts()[:num_prompts]):
        ref, eos = reference(arch, model, i)
        decoder.eos_token_ids = frozenset([eos])
        if oracle is not None:
            oracle.reset(ref, eos)
        res = decoder.generate(ids, max_new_tokens=MAX_NEW)
        assert res.tokens == ref, f"prompt {i}: {res.tokens} != HF {ref}"
        assert 1 <= res.stats.new_tokens <= MAX_NEW and res.stats.tau >= 1.0
        assert all(1 <= n <= draft_depth(drafter) + 1 for n in res.stats.accept_lengths)
        results.append(res)
    return results


def draft_depth(drafter) -> int:
    tree = getattr(drafter, "tree", None)
    return tree.max_depth if tree is not None else 64


@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_equals_hf_with_random_medusa_heads(target, tree_name):
    arch, model, _ = target
    drafter = MedusaDrafter(random_heads(model), TREES[tree_name])
    results = run_greedy(model, drafter, arch)
    assert any(r.finish_reason == "eos" for r in results) and any(r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("tree_name", ["default", "chain", "deep_narrow"])  # the root alone drafts nothing
def test_greedy_equals_hf_with_oracle_drafts(target, tree_name):
    arch, model, _ = target
    tree = load_tree(TREES[tree_name])
    oracle = OracleDrafter(tree, model.config.vocab_size, seed=len(tree_name))
    results = run_greedy(model, oracle, arch, oracle)
    assert oracle.longest_accept >= min(tree.max_depth, 3)  # long acceptances happened
    assert oracle.eos_inside_draft > 0  # EOS was an accepted drafted token, and decoding stopped right there
    # The max_new_tokens boundary was reached by a step that emitted several tokens (the tree was cut to fit).
    assert any(r.finish_reason == "length" and r.stats.accept_lengths[-1] > 1 for r in results)
    assert sum(r.stats.tau for r in results) / len(results) > 1.5


@pytest.mark.parametrize("kernel", ["torch", "small_batch"])
def test_greedy_equals_hf_under_either_linear_kernel(target, kernel):
    """The engine's CPU default (small_batch) runs every test here; PyTorch's own linears must verify the same."""
    arch, model, _ = target
    tree = load_tree(TREES["default"])
    oracle = OracleDrafter(tree, model.config.vocab_size, seed=3)
    run_greedy(model, oracle, arch, oracle, linear_kernel=kernel)
    assert oracle.longest_accept >= 3
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("kernel", ["packed", "padded"])
def test_greedy_equals_hf_under_each_small_batch_product(monkeypatch, target, kernel):
    """A machine's plan may choose oneDNN's product on packed weights or the padded (W @ x.T).T for any row count:
    each, forced for every count, verifies what HF generate decodes."""
    import selfspec.decode.engine
    from selfspec.cpu_kernels.linear_kernels import MAX_ROWS, PACKED, RowPlan, can_pack

    if kernel == "packed" and not can_pack(torch.zeros(1)):
        pytest.skip("this PyTorch cannot pack weights for oneDNN here")
    plan = RowPlan((PACKED,) * MAX_ROWS if kernel == "packed" else tuple([2] + list(range(2, MAX_ROWS + 1))))
    monkeypatch.setattr(selfspec.decode.engine, "measured_row_plan", lambda model: plan)
    arch, model, _ = target
    oracle = OracleDrafter(load_tree(TREES["default"]), model.config.vocab_size, seed=5)
    run_greedy(model, oracle, arch, oracle, linear_kernel="small_batch")
    assert oracle.longest_accept >= 3


def test_greedy_equals_hf_with_a_dynamic_tree_drafter(target):
    arch, model, _ = target
    oracle = OracleDrafter(None, model.config.vocab_size, seed=7)
    run_greedy(model, oracle, arch, oracle)
    assert oracle.longest_accept >= 3 and oracle.eos_inside_draft > 0


def test_vanilla_drafter_is_plain_decoding(target):
    arch, model, _ = target
    results = run_greedy(model, VanillaDrafter(), arch, num_prompts=5)
    assert all(r.stats.tau == 1.0 and r.stats.steps == r.stats.new_tokens - 1 for r in results)


class CacheCheck(DrafterBase):
    """Wraps a drafter; after every commit compares the engine's cache and hidden state with a fresh forward."""

    def __init__(self, inner, model):
        self.inner, self.model, self.checks = inner, model, 0

    def propose(self, state, max_depth):
        return self.inner.propose(state, max_depth)

    def on_commit(self, state, draft, verdict, out):
        self.inner.on_commit(state, draft, verdict, out)
        new_tokens = torch.tensor(state.new_tokens, device=state.prompt_ids.device)
        committed = torch.cat([state.prompt_ids, new_tokens, draft.tokens[verdict.path[1:]]])
        assert len(committed) == state.length
        fresh = new_cache()
        with torch.no_grad():
            ref = self.model(input_ids=committed[None], **{cache_kwarg(self.model): fresh}, use_cache=True,
                             output_hidden_states=True)
        for mine, theirs in zip(state.cache.layers, fresh.layers):
            assert mine.keys.shape[-2] == mine.values.shape[-2] == state.length
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(mine.values, theirs.values, atol=1e-5)
        assert torch.allclose(state.hidden, ref.hidden_states[-1][0, -1], atol=1e-5)
        assert state.next_token == int(ref.logits[0, -1].argmax())
        self.checks += 1


@pytest.mark.parametrize("tree_name", ["default", "dynamic"])
def test_cache_equals_fresh_forward_after_every_commit(target, tree_name):
    arch, model, _ = target
    oracle = OracleDrafter(load_tree("mc_sim_7b_63") if tree_name == "default" else None, model.config.vocab_size)
    checker = CacheCheck(oracle, model)
    decoder = SpeculativeDecoder(model, checker)
    for i in range(3):
        ref, eos = reference(arch, model, i)
        oracle.reset(ref, eos)
        decoder.eos_token_ids = frozenset([eos])
        assert decoder.generate(prompts()[i], max_new_tokens=MAX_NEW).tokens == ref
    assert checker.checks > 5 and oracle.longest_accept >= 2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_tree_node_gets_the_logits_of_its_own_branch(attn):
    model, _ = build_tiny("qwen2", attn_implementation=attn)
    tree = load_tree("mc_sim_7b_63").to(model.device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (7,), generator=g).to(model.device)
    tokens = torch.randint(3, 259, (tree.num_nodes,), generator=g).to(model.device)
    with torch.no_grad():
        cache = new_cache()
        model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): cache})
        state = DecodeState(cache=cache, prompt_ids=prompt, length=7, next_token=int(tokens[0]), hidden=torch.empty(0))
        out = tree_forward(model, state, Draft(tokens=tokens, tree=tree))
        for leaf_path in tree.leaf_paths:
            branch = leaf_path[leaf_path >= 0]
            ref = model(input_ids=torch.cat([prompt, tokens[branch]])[None], output_hidden_states=True)
            assert torch.allclose(out.logits[branch], ref.logits[0, 7:], atol=1e-4)
            assert torch.allclose(out.hidden[branch], ref.hidden_states[-1][0, 7:], atol=1e-4)


def test_stop_strings_end_the_answer(tiny_llama):
    model, tokenizer = tiny_llama
    decoder = SpeculativeDecoder(model, MedusaDrafter(random_heads(model), "mc_sim_7b_63"), decode=tokenizer.decode)
    ids = prompts()[1]
    full = decoder.generate(ids, max_new_tokens=MAX_NEW).tokens
    stop = tokenizer.decode(full[6:8])
    res = decoder.generate(ids, max_new_tokens=MAX_NEW, stop=[stop])
    assert res.finish_reason == "stop" and full[: len(res.tokens)] == res.tokens
    assert stop in tokenizer.decode(res.tokens) and stop not in tokenizer.decode(res.tokens[:-1])


# --- sampling through the engine ------------------------------------------------------------------------------------

SAMPLING = Sampling(acceptance="sample", temperature=0.9, top_p=0.9)
SAMPLE_TREE = [[0], [1], [2], [3], [4], [0, 0], [0, 1], [1, 0], [2, 0]]  # several siblings per level


def small_vocab_target():
    model, _ = build_tiny("llama", vocab_size=12, hidden_size=32, num_hidden_layers=1, intermediate_size=64, seed=1)
    return model


def exact_first_three(model, prompt) -> torch.Tensor:
    """The target's own distribution of the first three new tokens, [V, V, V] (on the CPU, beside the counts of
    :func:`sampled_first_three`)."""
    v = model.config.vocab_size
    prompt = prompt.to(model.device)
    vocab = torch.arange(v, device=model.device)
    with torch.no_grad():
        p1 = target_probs(model(input_ids=prompt[None]).logits[0, -1], 0.9, 0, 0.9)  # [V]
        one = torch.cat([prompt.expand(v, -1), vocab[:, None]], 1)
        p2 = target_probs(model(input_ids=one).logits[:, -1], 0.9, 0, 0.9)  # [V, V]
        two = torch.cat([prompt.expand(v * v, -1), torch.cartesian_prod(vocab, vocab)], 1)
        p3 = target_probs(model(input_ids=two).logits[:, -1], 0.9, 0, 0.9).reshape(v, v, v)
    return (p1[:, None, None] * p2[:, :, None] * p3).cpu()


def sampled_first_three(model, drafter, seeds: int, depth_policy=None) -> tuple[torch.Tensor, float]:
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=depth_policy)
    prompt = torch.tensor([3, 5, 7, 1])
    v = model.config.vocab_size
    counts = torch.zeros(v ** 3)
    accepted = 0
    for seed in range(seeds):
        res = decoder.generate(prompt, max_new_tokens=3, sampling=SAMPLING, seed=seed)
        a, b, c = res.tokens
        counts[(a * v + b) * v + c] += 1
        accepted += res.stats.accepted
    return counts, accepted / seeds


def test_sampled_tokens_follow_the_target_distribution():
    from test_verify import chi_square_pvalue

    model = small_vocab_target()
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    drafter = MedusaDrafter(random_heads(model, num_heads=2, seed=3), SAMPLE_TREE)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1000)
    assert accept_rate > 0.2  # drafts were accepted often enough for the test to mean something
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_accepting_every_draft_fails_the_same_sampling_test(monkeypatch):
    from test_verify import chi_square_pvalue

    def accept_first_branch(logits, tokens, tree, sampling, draft_probs=None, generator=None):
        node, path = 0, [0]
        while int(tree.children[node, 0]) >= 0:
            node = int(tree.children[node, 0])
            path.append(node)
        probs = target_probs(logits[node], sampling.temperature, sampling.top_k, sampling.top_p)
        return Verdict(path=path, next_token=int(torch.multinomial(probs, 1, generator=generator)))

    monkeypatch.setattr(engine_module, "verify", accept_first_branch)
    model = small_vocab_target()
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    drafter = MedusaDrafter(random_heads(model, num_heads=2, seed=3), SAMPLE_TREE)
    counts, _ = sampled_first_three(model, drafter, seeds=300)
    assert chi_square_pvalue(counts, exact) < 1e-6


def test_sampling_is_reproducible_from_the_seed(tiny_llama):
    model, _ = tiny_llama
    decoder = SpeculativeDecoder(model, MedusaDrafter(random_heads(model), "mc_sim_7b_63"))
    sampling = Sampling(acceptance="sample", temperature=1.0, top_p=0.95)
    runs = [decoder.generate([5, 6, 7], max_new_tokens=16, sampling=sampling, seed=s).tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


# --- errors ---------------------------------------------------------------------------------------------------------


def test_bad_input_fails_clearly(tiny_llama):
    model, _ = tiny_llama
    decoder = SpeculativeDecoder(model, VanillaDrafter())
    with pytest.raises(ValueError, match="empty"):
        decoder.generate([])
    with pytest.raises(ValueError, match="context is 512"):
        decoder.generate(torch.full((600,), 5))
    with pytest.raises(ValueError, match="Batch size 1"):
        decoder.generate(torch.full((2, 5), 5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="decode function"):
        decoder.generate([5, 6], stop=["x"])
    with pytest.raises(TreeError, match="6 heads"):
        MedusaDrafter(random_heads(model), "chain-7")


def test_generation_stops_at_the_context_limit():
    model, _ = build_tiny("llama", max_position_embeddings=24)
    decoder = SpeculativeDecoder(model, OracleDrafter(load_tree("chain-4"), 320), eos_token_ids=[])
    res = decoder.generate(torch.arange(3, 23), max_new_tokens=50)
    assert res.finish_reason == "context" and len(res.tokens) == 4


def test_wrong_root_fails_clearly(tiny_llama):
    model, _ = tiny_llama

    class WrongRoot(DrafterBase):
        def propose(self, state, max_depth):
            return Draft(tokens=torch.tensor([state.next_token + 1]), tree=Tree.from_parents([-1]))

    with pytest.raises(RuntimeError, match="root must be state.next_token"):
        SpeculativeDecoder(model, WrongRoot()).generate([5, 6, 7])


def test_targets_that_cannot_take_a_tree_mask_fail_clearly():
    model, _ = build_tiny("llama", seed=5)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TreeAttentionError, match="attn_implementation='sdpa'"):
        SpeculativeDecoder(model, VanillaDrafter())

    class DropsMask(torch.nn.Module):
        """A CausalLM wrapper whose forward ignores custom attention masks (plain causal attention instead)."""

        def __init__(self):
            super().__init__()
            self.inner, _ = build_tiny("llama", seed=6)
            self.config = self.inner.config

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    with pytest.raises(TreeAttentionError, match="misreads the 4D tree attention mask"):
        check_tree_attention(DropsMask())

    class NoPositions(DropsMask):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None,
                    output_hidden_states=None, logits_to_keep=0):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values)

    with pytest.raises(TreeAttentionError, match="position_ids"):
        check_tree_attention(NoPositions())


@pytest.mark.real_model
def test_greedy_equals_hf_on_smollm2(smollm2):
    from selfspec.decode.drafters import random_medusa_heads

    model, tokenizer = smollm2.model, smollm2.tokenizer
    decoder = SpeculativeDecoder(model, MedusaDrafter(random_medusa_heads(model), "small_16"))
    for text in ["Name three colours.", "What is 12 times 7?"]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)
        ref = model.generate(torch.tensor([ids], device=model.device), do_sample=False,
                             max_new_tokens=24)[0, len(ids):].tolist()
        assert decoder.generate(ids, max_new_tokens=24).tokens == ref
