"""KV commit: accepted rows move down in place, the rest is cropped, and the result equals a fresh forward's cache
over the accepted prefix in every layer."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.cache import CacheError, commit_kv, layer_lengths, new_cache
from selfspec.decode.engine import tree_forward
from selfspec.decode.types import DecodeState, Draft
from selfspec.decode.tree import load_tree


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def numbered_cache(layers: int, length: int) -> "torch.nn.Module":
    cache = new_cache()
    for i in range(layers):
        k = torch.arange(length, dtype=torch.float32).reshape(1, 1, length, 1).expand(1, 2, length, 3) + 100 * i
        cache.update(k.clone(), -k.clone(), i)
    return cache


def test_commit_moves_accepted_rows_in_place():
    cache = numbered_cache(layers=3, length=10)  # 4 committed rows + a 6-node tree
    commit_kv(cache, past_length=4, keep=[0, 2, 5])
    assert layer_lengths(cache) == [7, 7, 7]
    for i, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [100 * i + r for r in [0, 1, 2, 3, 4, 6, 9]]
        assert torch.equal(layer.values, -layer.keys)


def test_commit_of_a_prefix_only_crops():
    cache = numbered_cache(layers=2, length=8)
    before = cache.layers[0].keys
    commit_kv(cache, past_length=5, keep=[0, 1])
    assert layer_lengths(cache) == [7, 7]
    assert cache.layers[0].keys.data_ptr() == before.data_ptr()  # a view: nothing copied
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == list(range(7))


def test_commit_rejects_unsorted_paths():
    with pytest.raises(CacheError, match="ascending"):
        commit_kv(numbered_cache(1, 6), 2, [0, 3, 1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_commit_equals_fresh_forward(attn):
    from selfspec.core.target import build_tiny, cache_kwarg

    model, _ = build_tiny("llama", attn_implementation=attn)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (9,), generator=g).to(model.device)
    tree = load_tree("mc_sim_7b_63").to(model.device)
    tokens = torch.randint(3, 259, (tree.num_nodes,), generator=g).to(model.device)
    with torch.no_grad():
        cache = new_cache()
        model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): cache})
        state = DecodeState(cache=cache, prompt_ids=prompt, length=9, next_token=int(tokens[0]), hidden=torch.empty(0))
        tree_forward(model, state, Draft(tokens=tokens, tree=tree))
        assert layer_lengths(cache) == [9 + tree.num_nodes] * 4
        leaf = int(tree.leaf_paths[7][tree.leaf_paths[7] >= 0][-1])
        path = tree.ancestor_mask[leaf].nonzero()[:, 0].tolist()  # a branch that is not a prefix of the node list
        assert path != list(range(len(path)))
        commit_kv(cache, 9, path)
        fresh = new_cache()
        model(input_ids=torch.cat([prompt, tokens[path]])[None], use_cache=True, **{cache_kwarg(model): fresh})
    assert layer_lengths(cache) == [9 + len(path)] * 4
    for mine, ref in zip(cache.layers, fresh.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5) and torch.allclose(mine.values, ref.values, atol=1e-5)


def test_the_growing_cache_holds_what_concatenation_holds():
    """The engine's cache (rows written in place into buffers with room) holds, after any sequence of appends,
    commits and crops that outgrows its buffers several times, exactly what transformers' concatenating
    DynamicCache holds after the same sequence; appends within the room move nothing."""
    from transformers import DynamicCache

    from selfspec.decode.cache import MIN_ROOM, GrowingCache

    g = torch.Generator().manual_seed(0)
    ours, theirs = new_cache(), DynamicCache()
    assert isinstance(ours, GrowingCache)
    length, grown = 0, 0
    for step in range(200):
        n = int(torch.randint(1, 17, (1,), generator=g)) if step else 40  # a prompt, then trees of 1-16 rows
        for layer in range(2):
            k, v = (torch.randn(1, 3, n, 4, generator=g) for _ in range(2))
            before = ours.layers[layer].keys.data_ptr() if step else None
            got = ours.update(k, v, layer)
            want = theirs.update(k.clone(), v.clone(), layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            if step and got[0].data_ptr() != before:
                grown += 1
        keep = sorted(torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))].tolist())
        for cache in (ours, theirs):
            commit_kv(cache, length, keep)
        length += len(keep)
        assert layer_lengths(ours) == layer_lengths(theirs) == [length, length]
    assert length > 3 * MIN_ROOM and 2 <= grown // 2 <= 8  # it grew a few times, not at every step
    for a, b in zip(ours.layers, theirs.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
