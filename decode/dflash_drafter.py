"""The DFlash drafter for the decode engine: one forward of a DFlash block drafter (heads/dflash.py) drafts a chain.

The drafter keeps its own context: every layer's keys and values of the fused target features, one row per position
whose token the target has read, so after each commit it covers positions 0 .. ``state.length - 1``:

- ``start``: the prompt's features (from the prefill forward) at positions 0 .. T-1;
- ``on_commit``: the accepted branch's features (the root and the accepted drafted nodes, which the verify forward
  returned) at the positions they were committed to; rejected nodes never enter it;
- ``propose``: one drafter forward over the block ``[state.next_token, mask x (block_size - 1)]`` at positions
  ``state.length ..``, which sees the whole context and the whole block (no mask), and position k's argmax drafts
  the token k ahead.

As EAGLE's draft cache (decode/eagle_drafter.py), the context is caught up lazily: ``start`` and ``on_commit`` keep
the features, and the next ``propose`` projects everything kept since the last one in one batch, so steps on which
adaptive depth has drafting off cost nothing.

With ``top_k`` > 1 the draft is a small tree: the chain, plus the first position's next ``top_k - 1`` tokens as the
chain head's siblings (leaves). Drafts are deterministic (argmax / top-k), so the engine verifies them with
point-mass draft probabilities (``probs=None``), lossless for sampling as well as greedy decoding.
"""

from __future__ import annotations

import torch

from decode.cache import Backlog, CacheError
from decode.tree import Tree
from decode.types import DecodeState, Draft, DrafterBase, ForwardOutput, root_only
from decode.verify import Verdict
from heads.dflash import DFlashDrafter
from heads.errors import SettingError

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: keys, values [1, kv_heads, C, head_dim]


def fresh_context_kv(drafter: DFlashDrafter, features: torch.Tensor, start: int = 0) -> ContextKV:
    """Every layer's context keys and values of ``features`` [n, n_layers * H] at positions start .. start + n - 1."""
    positions = torch.arange(start, start + features.shape[0], device=features.device)[None]  # [1, n]
    return drafter.context_kv(drafter.context(features[None]), positions)


def chain_with_siblings(root: int, chain: torch.Tensor, siblings: torch.Tensor) -> Draft:
    """The chain [d] under the root, then ``siblings`` [s] of its first node (the root's later children)."""
    d = int(chain.numel())
    parents = [-1, *range(d), *([0] * int(siblings.numel()))]
    tokens = torch.cat([torch.tensor([root], device=chain.device), chain, siblings])
    return Draft(tokens=tokens, tree=Tree.from_parents(parents).to(chain.device))


class DFlashBlockDrafter(DrafterBase):
    """DFlash block drafts (module docstring): a chain of up to ``block_size - 1`` tokens from one drafter forward,
    with the first position's ``top_k - 1`` next tokens as siblings of the chain's first node."""

    def __init__(self, heads: DFlashDrafter, top_k: int = 1):
        if not isinstance(heads, DFlashDrafter):
            raise TypeError(f"DFlashBlockDrafter drafts with DFlash heads (heads.dflash.DFlashDrafter), got "
                            f"{type(heads).__name__}.")
        if top_k < 1:
            raise SettingError(f"DFlash top_k={top_k}: 1 drafts a chain, more adds the first position's next tokens.")
        self.drafter = heads.eval()
        self.top_k = int(top_k)
        self.kv: ContextKV | None = None  # the context read so far
        self._backlog = Backlog()  # committed features [n, n_layers * H] the context has not read

    def modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.drafter,)

    @property
    def max_draft_depth(self) -> int:
        return self.drafter.block_size - 1

    def draft_nodes(self, depth: int) -> int:
        """The root, the chain cut to ``depth`` and the first position's ``top_k - 1`` siblings."""
        depth = min(max(depth, 0), self.max_draft_depth)
        return 1 + depth + (self.top_k - 1 if depth > 0 else 0)

    @property
    def context_length(self) -> int:
        """Positions the context covers, read or kept to be read."""
        return self._backlog.end

    def _catch_up(self) -> None:
        """Project every feature kept since the last propose and append it to the context, in one batch."""
        taken = self._backlog.take()
        if taken is None:
            return
        start, (features,) = taken
        new = fresh_context_kv(self.drafter, features, start)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.kv, new)]

    @torch.no_grad()
    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.kv = None
        self._backlog = Backlog()
        self._backlog.add(self.drafter.target_features(prefill.hidden_states))

    @torch.no_grad()
    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        path = torch.tensor(verdict.path, device=out.hidden.device)  # accepted node ids, root first
        self._backlog.add(self.drafter.target_features(out.hidden_states, path), at=state.length - len(path))

    def _block_logits(self, state: DecodeState, depth: int) -> torch.Tensor:
        """Draft-vocabulary logits [depth, Vd] of block positions 1 .. depth after the context's state.length rows."""
        self._catch_up()
        if self.context_length != state.length:
            raise CacheError(f"the DFlash context covers {self.context_length} positions, the target's cache "
                             f"{state.length}: the drafter missed a start or a commit.")
        device = self.kv[0][0].device
        block = self.drafter.block_inputs(torch.tensor([[state.next_token]], device=device))  # [1, bs, H]
        positions = torch.arange(state.length, state.length + self.drafter.block_size, device=device)[None]
        hidden = self.drafter(block, positions, self.kv, None)  # [1, bs, H]
        return self.drafter.logits(hidden[0, 1 : 1 + depth])

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        depth = min(self.max_draft_depth, max_depth)
        device = state.hidden.device
        if depth <= 0:
            return root_only(state, device)
        logits = self._block_logits(state, depth)  # [depth, Vd]
        chain = logits.argmax(dim=-1)  # [depth] draft ids
        siblings = chain[:0]
        if self.top_k > 1:  # the first position's top-k: its best heads the chain (one tie-break for both)
            top = logits[0].topk(min(self.top_k, logits.shape[-1])).indices  # [k]
            chain[0], siblings = top[0], top[1:]
        to_target = self.drafter.draft_to_target
        return chain_with_siblings(state.next_token, to_target(chain).to(device), to_target(siblings).to(device))
