"""The EAGLE drafter for the decode engine: a dynamic tree (EAGLE-2) grown by an EAGLE / EAGLE-3 draft layer.

The draft keeps its own KV cache, one entry per committed target position: entry i read the target's feature of
position i and token i + 1, at position i. So after each commit it holds exactly ``state.length`` entries:

- ``start``: the prompt's features (from the prefill forward) and the prompt shifted by one, ending in the first new
  token, fill entries 0 .. T-1; the last output is the predicted feature the tree's depth-1 nodes read.
- ``propose``: the tree is grown over entries appended after the committed ones (:class:`DraftTreeExpander`), then
  those entries are dropped again.
- ``on_commit``: the accepted nodes are kept by re-reading them with the target's own features of the accepted
  branch (which the verify forward returned) and the tokens that followed them: one draft forward over the accepted
  length. Entries computed during drafting from the draft's guessed features are not reused, as in EAGLE: entries
  built on the target's true features are what the draft was trained on.

That catch-up is lazy: ``start`` and ``on_commit`` only keep the features and tokens, and the next ``propose`` runs
one draft forward over everything kept since the last one. While adaptive depth has drafting off (the engine then
calls no ``propose``), the drafter costs nothing; when it looks again, the steps it skipped are caught up in one
batched forward, giving the same cache as step-by-step catch-up.

Drafts are deterministic (top-k), so the engine verifies them with point-mass draft probabilities (``probs=None``),
which is lossless for sampling as well as greedy decoding.
"""

from __future__ import annotations

import torch

from selfspec.decode.cache import Backlog, new_cache
from selfspec.decode.dynamic_tree import DraftTreeExpander, dynamic_tree_nodes, grow_dynamic_tree, topk_children
from selfspec.decode.types import DecodeState, Draft, DrafterBase, ForwardOutput, root_only
from selfspec.decode.verify import Verdict
from selfspec.heads.eagle import EagleConfig, EagleHeads
from selfspec.core.errors import SettingError
from selfspec.core.kv import crop_cache


class EagleTreeDrafter(DrafterBase):
    """EAGLE-2 dynamic trees: ``depth`` levels, ``top_k`` children per expanded node and ``top_k`` nodes expanded
    per level, the ``total_tokens`` best drafted nodes verified (plus the root)."""

    def __init__(self, heads: EagleHeads, depth: int, top_k: int, total_tokens: int):
        if depth < 0 or top_k < 1 or total_tokens < 0:
            raise SettingError(f"EAGLE tree needs depth >= 0, top_k >= 1, total_tokens >= 0 "
                             f"(got depth={depth}, top_k={top_k}, total_tokens={total_tokens}).")
        if not isinstance(heads, EagleHeads):
            raise TypeError(f"EagleTreeDrafter drafts with EAGLE heads (selfspec.heads.eagle.EagleHeads), got "
                            f"{type(heads).__name__}; train some with train/eagle.py.")
        self.drafter = heads.eval()
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.cache = None
        self.root_feature: torch.Tensor | None = None  # [H] predicted feature of position state.length
        self.root_children: tuple[torch.Tensor, torch.Tensor] | None = None  # top-k (log-probs, tokens) after root
        self._backlog = Backlog(dims=(1, 0))  # committed (features [1, n, H], tokens [n]) the cache has not read

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.drafter,)

    @property
    def max_draft_depth(self) -> int:
        return int(self.depth)

    def draft_nodes(self, depth: int) -> int:
        return dynamic_tree_nodes(min(max(depth, 0), self.depth), self.top_k, self.total_tokens)

    def _features(self, hidden_states, rows=None) -> torch.Tensor:
        """Target hidden states (L + 1 tensors [N, H]) -> step-0 draft features [1, n, H] (rows picked)."""
        picked = [h if rows is None else h[rows] for h in hidden_states]
        return self.drafter.target_features([h[None] for h in picked])

    def _advance(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """Append committed entries (features [1, n, H], tokens [n]) at positions start.. and update the root."""
        positions = torch.arange(start, start + tokens.numel(), device=tokens.device)[None]
        out = self.drafter(features, tokens[None], positions, None, self.cache)  # [1, n, H]
        self.root_feature = out[0, -1]
        logprobs = torch.log_softmax(self.drafter.logits(out[0, -1]).float(), dim=-1)
        self.root_children = topk_children(logprobs, self.top_k, self.drafter.draft_to_target)

    def _catch_up(self) -> None:
        """One draft forward over every committed entry kept since the last one (see the module docstring)."""
        taken = self._backlog.take()
        if taken is not None:
            start, (features, tokens) = taken
            self._advance(features, tokens, start)

    @torch.no_grad()
    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        prompt = state.prompt_ids.reshape(-1)  # [T]
        tokens = torch.cat([prompt[1:], torch.tensor([state.next_token], device=prompt.device)])  # [T]
        self.cache = new_cache()
        self._backlog = Backlog(dims=(1, 0))
        self._backlog.add(self._features(prefill.hidden_states), tokens)

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        device = state.cache.layers[0].keys.device if state.cache.layers else self.root_feature.device
        depth = min(self.depth, max_depth)
        if depth <= 0 or self.total_tokens == 0:
            return root_only(state, device)
        self._catch_up()
        past = state.length
        expander = DraftTreeExpander(self.drafter, self.cache, past, self.root_feature, self.top_k)
        try:
            grown = grow_dynamic_tree(state.next_token, self.root_children, expander, depth, self.top_k,
                                      self.total_tokens)
        finally:
            crop_cache(self.cache, past)
        return Draft(tokens=grown.tokens.to(device), tree=grown.tree().to(device))

    @torch.no_grad()
    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        path = torch.tensor(verdict.path, device=draft.tokens.device)  # accepted node ids, root first
        following = torch.cat([draft.tokens[path[1:]], torch.tensor([verdict.next_token], device=path.device)])
        start = state.length - len(verdict.path)  # the root's position
        self._backlog.add(self._features(out.hidden_states, path), following, at=start)


# --- what decode/families.py registers for the eagle and eagle3 families --------------------------------------------


def eagle_from_settings(heads: EagleHeads, target, settings: dict) -> EagleTreeDrafter:
    return EagleTreeDrafter(heads, **{k: int(settings[k]) for k in ("depth", "top_k", "total_tokens")})


def eagle_chain(k: int) -> dict:
    """The draft settings that propose a chain of ``k``, as vLLM's EAGLE drafts (the serving check's)."""
    return {"depth": k, "top_k": 1, "total_tokens": k}


def random_eagle_heads(model: torch.nn.Module, seed: int = 0, variant: str = "eagle", **_) -> EagleHeads:
    """Untrained EAGLE heads for ``model`` (dry runs: their drafts are rarely accepted)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = EagleHeads(EagleConfig.from_target(model, variant=variant), model)
    param = next(model.parameters())
    return heads.to(device=param.device, dtype=param.dtype).eval()


def random_eagle3_heads(model: torch.nn.Module, seed: int = 0, **options) -> EagleHeads:
    """Untrained EAGLE-3 heads for ``model`` (dry runs)."""
    return random_eagle_heads(model, seed, **{**options, "variant": "eagle3"})
