"""Drafters: what proposes the tree each step. One protocol serves every family.

- :class:`MedusaDrafter`: a static tree of top-k ranks from Medusa heads at the last accepted hidden state.
- :class:`VanillaDrafter`: no draft; the tree is the root alone, so the engine does plain autoregressive decoding.
- :class:`OracleDrafter`: a known answer's next tokens, always accepted (measurements and tests).
- EAGLE-style drafters (decode/eagle_drafter.py) grow a dynamic tree (``Tree.from_parents`` each step), keep their
  own KV cache, and follow the target's commits through :meth:`~selfspec.decode.types.Drafter.on_commit`.

The protocol and the types a step passes around are in decode/types.py; decode/registry.py says which drafter each
heads folder (or a training-free name) becomes.

Batch size 1.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfspec.decode.tree import Tree, chain_tree, load_tree
from selfspec.decode.types import DecodeState, Draft, DrafterBase, ForwardOutput, root_only
from selfspec.heads.medusa import MedusaConfig, MedusaHeads


class VanillaDrafter(DrafterBase):
    """No draft: one token per target forward (tau = 1), through the same engine as every other drafter."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.device = prefill.logits.device

    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        return root_only(state, self.device or torch.device("cpu"))


class OracleDrafter(DrafterBase):
    """Proposes the next ``depth`` tokens of a known greedy ``answer`` (the target's own, decoded before) as a chain,
    so that every draft is accepted: the engine's ceiling at depth ``depth`` (scripts/engine_ceiling.py), and tests
    whose drafts must be accepted for the output to show a broken verify path."""

    def __init__(self, answer: Sequence[int], depth: int):
        self.answer, self.depth = list(answer), depth
        self.calls = 0  # drafts proposed

    @property
    def max_draft_depth(self) -> int:
        return self.depth

    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        self.calls += 1
        done = len(state.new_tokens)  # emitted so far, next_token (the root) last
        ahead = self.answer[done:done + min(self.depth, max_depth)]
        tokens = torch.tensor([state.next_token] + ahead, device=state.prompt_ids.device)
        return Draft(tokens=tokens, tree=chain_tree(len(ahead)).to(tokens.device))


MEDUSA_TREES = {"cpu": "small_16", "other": "mc_sim_7b_63"}  # tree=auto, by the heads' device (docs/journal/)


def medusa_tree(tree: "str | Tree | Sequence[Sequence[int]]",
                device: torch.device | str) -> "str | Tree | Sequence[Sequence[int]]":
    """The Medusa tree ``tree`` names: ``auto`` is ``small_16`` on a CPU (it ran faster there than Medusa's own tree,
    whose larger cuts cost several one-token forwards: docs/journal/2026-11-benchmarks.md) and Medusa's own
    ``mc_sim_7b_63`` on an accelerator; anything else is itself."""
    if not (isinstance(tree, str) and tree == "auto"):
        return tree
    return MEDUSA_TREES["cpu" if torch.device(device).type == "cpu" else "other"]


class MedusaDrafter(DrafterBase):
    """Medusa: head k reads the target's last hidden state (after the final norm) of the last accepted token and
    proposes the token k + 2 ahead; a static tree picks which top-k ranks of which heads to verify.

    ``tree``: ``auto`` (:func:`medusa_tree`: by the heads' device), a :class:`Tree`, rank paths, a tree YAML file, a
    name in conf/trees/, ``chain``, ``chain-K`` or ``single``. Its depth must not exceed the number of heads.
    """

    def __init__(self, heads: MedusaHeads, tree: "str | Tree | Sequence[Sequence[int]]"):
        self.heads = heads.eval()
        device = next(heads.parameters()).device
        self.tree = load_tree(medusa_tree(tree, device), num_heads=heads.config.num_heads)
        if self.tree.rank_paths is None:
            raise ValueError("MedusaDrafter needs a static tree of rank paths (Tree.from_paths or a tree file).")
        self.top_k = self.tree.max_rank + 1
        self._by_depth: dict[tuple[int, str], tuple[Tree, torch.Tensor]] = {}
        # decode-time LM heads over the heads' draft vocabulary (the token_map rows; the full heads without one)
        self.draft_heads = heads.draft_lm_heads()
        self.token_map = heads.token_map

    def modules(self) -> Sequence[torch.nn.Module]:
        return (self.heads, *self.draft_heads)

    @property
    def max_draft_depth(self) -> int:
        return int(self.tree.max_depth)

    def draft_nodes(self, depth: int) -> int:
        """The static tree's nodes down to ``depth``, the root included."""
        return int((self.tree.depth <= max(depth, 0)).sum())

    def _logits(self, depth: int, features: list[torch.Tensor]) -> torch.Tensor:
        """Logits [depth, V'] of heads 0..depth-1 over the draft vocabulary; a shared LM head takes them as one
        batch of rows (one pass over its weight)."""
        if len(self.draft_heads) == 1:
            head = self.draft_heads[0]
            return head(torch.stack(features[:depth]).to(head.weight.dtype))
        return torch.stack([self.draft_heads[k](features[k]) for k in range(depth)])

    def _layout(self, max_depth: int, device: torch.device) -> tuple[Tree, torch.Tensor]:
        """The tree cut to max_depth on ``device`` and its candidate gather index [N - 1] (built once each)."""
        depth = max(0, min(max_depth, self.tree.max_depth))
        key = (depth, str(device))
        if key not in self._by_depth:
            tree = self.tree.truncate(depth).to(device)
            self._by_depth[key] = (tree, tree.candidate_index(self.top_k))
        return self._by_depth[key]

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        device = state.hidden.device
        tree, index = self._layout(max_depth, device)
        root = torch.tensor([state.next_token], device=device)
        if tree.num_nodes == 1:
            return Draft(tokens=root, tree=tree)
        hidden = state.hidden.to(next(self.heads.parameters()).dtype)  # [H]
        features = self.heads.features(hidden)  # K x [H]
        logits = self._logits(tree.max_depth, features)  # [D, V']
        candidates = logits.topk(self.top_k, dim=-1).indices.reshape(-1)  # [D * top_k] draft ids
        if self.token_map is not None:
            candidates = self.token_map[candidates]  # target ids
        return Draft(tokens=torch.cat([root, candidates[index]]), tree=tree)


# --- what decode/families.py registers for the vanilla and medusa families ------------------------------------------


def vanilla_from_settings(heads, target, settings: dict) -> VanillaDrafter:
    return VanillaDrafter()


def medusa_from_settings(heads: MedusaHeads, target, settings: dict) -> MedusaDrafter:
    return MedusaDrafter(heads, tree=settings["tree"])


def medusa_chain(k: int) -> dict:
    """The draft settings that propose a chain of ``k``, as vLLM's Medusa drafts (the serving check's)."""
    return {"tree": f"chain-{k}"}


def medusa_served_depth(meta: dict, k: int) -> int:
    """Tokens vLLM's Medusa drafts a step when asked for ``k``: at most one per head (``meta``: the heads config)."""
    config = meta.get("head_config") or {}
    return min(k, int(config.get("num_heads") or meta.get("num_heads") or k))


def random_medusa_heads(model: torch.nn.Module, seed: int = 0, num_heads: int = 4) -> MedusaHeads:
    """Untrained Medusa heads for ``model`` as training starts them (blocks zero, LM heads copied from the target's),
    with the blocks jittered by ``seed`` so that heads differ. For dry runs; their drafts are rarely accepted."""
    config = model.config.get_text_config(decoder=True)
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=num_heads, num_layers=1,
                                     shared_lm_head=False, draft_vocab_size=None),
                        model.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    param = next(model.parameters())
    return heads.to(device=param.device, dtype=param.dtype).eval()
