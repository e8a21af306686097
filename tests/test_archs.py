"""The engine on every architecture of core/archs.py (tiny random targets built from each one's transformers config
class, fp32): Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3, gpt-oss, Phi-3, DeepSeek-V2 and DeepSeek-V3.

- Every tree node gets the logits of its own branch under the architecture's own attention (sliding windows, sinks,
  MLA, MoE routing, soft-capping), after a prompt longer than the sliding window; for the sliding architectures a
  mask without the window would not (so the test can fail).
- Greedy output equals HF ``generate`` with an oracle drafter whose branches often hold the target's continuation
  (long acceptances happen: asserted), on a static and a dynamic tree.
- After every commit the KV cache equals a fresh forward's, in every layer.
- Sampling: the first three tokens follow the target's own distribution, with drafts accepted.
"""

from __future__ import annotations

import pytest
import torch

from selfspec.core.archs import SLIDING, TINY_ARCHS, layer_kinds
from selfspec.core.kv import additive_mask
from selfspec.core.target import build_tiny, cache_kwarg
from selfspec.decode.cache import new_cache
from selfspec.decode.engine import SpeculativeDecoder, tree_forward
from selfspec.decode.tree import Tree, load_tree
from selfspec.decode.types import DecodeState, Draft, DrafterBase
from test_engine import (SAMPLE_TREE, CacheCheck, OracleDrafter, exact_first_three, prompts, reference, run_greedy,
                         sampled_first_three)

ARCHS = sorted(TINY_ARCHS)
SLIDING_ARCHS = [a for a in ARCHS if SLIDING in layer_kinds(build_tiny(a, num_hidden_layers=1)[0].config)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    model, _ = build_tiny(request.param)
    return request.param, model


def test_the_matrix_has_the_architectures_users_bring():
    assert {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "gpt_oss", "phi3", "deepseek_v3"} <= set(ARCHS)
    assert {"mistral", "gemma3", "gpt_oss"} <= set(SLIDING_ARCHS)


def test_every_tree_node_gets_the_logits_of_its_own_branch(target):
    arch, model = target
    tree = load_tree("mc_sim_7b_63").to(model.device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (13,), generator=g).to(model.device)  # longer than the sliding window (8)
    tokens = torch.randint(3, 259, (tree.num_nodes,), generator=g).to(model.device)
    with torch.no_grad():
        cache = new_cache()
        model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): cache})
        state = DecodeState(cache=cache, prompt_ids=prompt, length=len(prompt), next_token=int(tokens[0]),
                            hidden=torch.empty(0))
        out = tree_forward(model, state, Draft(tokens=tokens, tree=tree))
        worst = 0.0
        for leaf_path in tree.leaf_paths:
            branch = leaf_path[leaf_path >= 0]
            ref = model(input_ids=torch.cat([prompt, tokens[branch]])[None]).logits[0, len(prompt):]
            worst = max(worst, float((out.logits[branch] - ref).abs().max()))
        # fp32 through 4 layers: the same sums in another order differ by ~1e-6 of logits of size ~10
        assert worst < 1e-4, f"{arch}: a tree node's logits differ from its own branch's by {worst}"
        if arch in SLIDING_ARCHS:  # the same tree under one full-attention mask reads keys outside the window
            crop = new_cache()
            model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): crop})
            allowed = torch.ones(tree.num_nodes, len(prompt) + tree.num_nodes, dtype=torch.bool, device=model.device)
            allowed[:, len(prompt):] = tree.ancestor_mask
            full = model(input_ids=tokens[None], attention_mask=additive_mask(allowed, torch.float32)[None, None],
                         position_ids=(tree.depth + len(prompt))[None], use_cache=True,
                         **{cache_kwarg(model): crop}).logits[0]
            assert (full - out.logits).abs().max() > 1e-2


@pytest.mark.parametrize("tree_name", ["default", "dynamic"])
def test_greedy_equals_hf_with_oracle_drafts(target, tree_name):
    arch, model = target
    tree = load_tree("mc_sim_7b_63") if tree_name == "default" else None
    oracle = OracleDrafter(tree, model.config.vocab_size, seed=11)
    run_greedy(model, oracle, f"archs-{arch}", oracle, num_prompts=6)
    assert oracle.longest_accept >= 3


def test_cache_equals_fresh_forward_after_every_commit(target):
    arch, model = target
    oracle = OracleDrafter(load_tree("mc_sim_7b_63"), model.config.vocab_size, seed=2)
    checker = CacheCheck(oracle, model)
    decoder = SpeculativeDecoder(model, checker)
    for i in range(3):
        ref, eos = reference(f"archs-{arch}", model, i)
        oracle.reset(ref, eos)
        decoder.eos_token_ids = frozenset([eos])
        assert decoder.generate(prompts()[i], max_new_tokens=20).tokens == ref
    assert checker.checks > 5 and oracle.longest_accept >= 2


class TopRanksDrafter(DrafterBase):
    """Drafts SAMPLE_TREE from the target itself: the node at rank path [a, b] holds the a-th most likely token
    after the root, then the b-th most likely after that. Under sampling such drafts are accepted often, whatever the
    architecture, so the sampling test compares distributions over steps that did accept drafts."""

    def __init__(self, model):
        self.model, self.tree = model, Tree.from_paths(SAMPLE_TREE)
        self.orders: dict[tuple[int, ...], torch.Tensor] = {}  # the seeds share their short contexts

    def order(self, context: torch.Tensor) -> torch.Tensor:
        key = tuple(context.tolist())
        if key not in self.orders:
            with torch.no_grad():
                self.orders[key] = self.model(input_ids=context[None]).logits[0, -1].argsort(descending=True)
        return self.orders[key]

    def propose(self, state, max_depth):
        device = state.prompt_ids.device
        context = torch.cat([state.prompt_ids,
                             torch.tensor(state.new_tokens + [state.next_token], dtype=torch.long, device=device)])
        tokens, ranked = [state.next_token], {(): context}
        for path in self.tree.rank_paths:  # nodes 1.. in order, parents before children
            parent = ranked[tuple(path[:-1])]
            token = int(self.order(parent)[path[-1]])
            ranked[tuple(path)] = torch.cat([parent, torch.tensor([token], device=device)])
            tokens.append(token)
        return Draft(tokens=torch.tensor(tokens), tree=self.tree)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_tokens_follow_the_target_distribution(arch):
    from test_verify import chi_square_pvalue

    model, _ = build_tiny(arch, vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    counts, accepted = sampled_first_three(model, TopRanksDrafter(model), seeds=300)
    assert accepted > 0.5  # drafts were accepted often enough for the test to mean something
    assert chi_square_pvalue(counts, exact) > 1e-3
