"""Medusa heads: K parallel heads on the target's last hidden state.

Head k (0-based) reads the hidden state at position t and predicts the token at t + k + 2 (the target's own LM head
predicts t + 1). Each head is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` with W zero-initialised (so an
untrained head starts as the target's LM head), followed by an LM head initialised from the target's, or the frozen
target LM head itself when ``shared_lm_head`` is set (saves memory and the full-vocabulary gradient).

A reduced draft vocabulary (``draft_vocab_size``; heads/vocab.py) is a ``token_map`` buffer of the target ids the
heads draft from, chosen by coverage of the training data and saved with them: decoding projects onto those rows of
the LM head only (:meth:`MedusaHeads.draft_lm_heads`), which makes a draft step several times cheaper on a small
target. Training projects onto the same rows (``forward(..., draft_vocab=True)``, targets through
:func:`to_draft_ids`): what decoding can propose is what the heads learn, at a fraction of the cost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class MedusaConfig:
    """The shape of a set of heads, as saved with them. Every field is given: training passes them from
    ``cfg.heads`` (conf/heads/medusa.yaml holds the training defaults, and only there)."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    shared_lm_head: bool
    draft_vocab_size: int | None  # None: draft over the whole vocabulary; else the size of ``token_map``

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, target_lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        if config.shared_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if target_lm_head is not None:
                self.init_lm_heads_from(target_lm_head)
        # The frozen target head is used, never owned: kept out of state_dict and parameters().
        self._target_lm_head = [target_lm_head]
        self._draft_rows: list = [None]  # (key, the frozen head's token_map rows), built once per head and map
        if config.draft_vocab_size is not None:
            if not 0 < config.draft_vocab_size <= config.vocab_size:
                raise ValueError(f"draft_vocab_size={config.draft_vocab_size} must be in 1..{config.vocab_size}.")
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))  # set_token_map sets the real one
        else:
            self.token_map = None

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """The target ids the heads draft from (ascending, ``draft_vocab_size`` of them; selfspec.train.data.DraftVocab.token_map)."""
        token_map = torch.as_tensor(token_map, dtype=torch.long).reshape(-1)
        if self.token_map is None or token_map.shape != self.token_map.shape:
            raise ValueError(f"token_map has {token_map.numel()} ids; these heads take draft_vocab_size="
                             f"{self.config.draft_vocab_size}.")
        if token_map.numel() and (token_map.min() < 0 or token_map.max() >= self.config.vocab_size
                                  or bool((token_map[1:] <= token_map[:-1]).any())):
            raise ValueError("token_map must hold distinct target ids in ascending order.")
        self.token_map.copy_(token_map.to(self.token_map.device))

    def draft_lm_heads(self) -> list[nn.Linear]:
        """Decode-time LM heads over the draft vocabulary (the ``token_map`` rows; the full heads without a map):
        one per head, or one shared. New modules holding copies of those rows, built once by the drafter."""
        full = list(self.lm_heads) if self.lm_heads is not None else [self._target_lm_head[0]]
        if full[0] is None:
            raise RuntimeError("shared_lm_head heads need the target's LM head: call attach_target_lm_head(...).")
        if self.token_map is None:
            return full
        out = []
        for head in full:
            rows = head.weight.detach()[self.token_map.to(head.weight.device)]
            small = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            small.weight.data.copy_(rows)
            small.requires_grad_(False)
            out.append(small)
        return out

    def init_lm_heads_from(self, target_lm_head: nn.Linear) -> None:
        if self.lm_heads is None:
            return
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(target_lm_head.weight.to(head.weight.dtype))

    def attach_target_lm_head(self, target_lm_head: nn.Linear) -> None:
        self._target_lm_head = [target_lm_head]

    def draft_weights(self) -> list[torch.Tensor]:
        """The LM-head rows of the draft vocabulary [V', H]: one per head (indexed from each trainable head, so the
        gradient reaches those rows), or one for the frozen shared head (copied once, while the map and the head
        stay the same)."""
        if self.token_map is None:
            raise ValueError("These heads have no draft vocabulary (token_map); project onto the whole vocabulary.")
        if self.lm_heads is not None:
            return [head.weight[self.token_map] for head in self.lm_heads]
        lm_head = self._target_lm_head[0]
        if lm_head is None:
            raise RuntimeError("shared_lm_head heads need the target's LM head: call attach_target_lm_head(...).")
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.token_map._version,
               self.token_map.data_ptr())
        if self._draft_rows[0] is None or self._draft_rows[0][0] != key:
            self._draft_rows[0] = (key, weight.detach()[self.token_map.to(weight.device)])
        return [self._draft_rows[0][1]]

    def features(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [..., H] -> K tensors [..., H], the input of each head's LM projection."""
        return [block(hidden) for block in self.blocks]

    def project(self, k: int, feature: torch.Tensor) -> torch.Tensor:
        """feature [..., H] -> logits [..., V] of head k."""
        if self.lm_heads is not None:
            return self.lm_heads[k](feature)
        lm_head = self._target_lm_head[0]
        if lm_head is None:
            raise RuntimeError("shared_lm_head heads need the target's LM head: call attach_target_lm_head(...).")
        return lm_head(feature.to(lm_head.weight.dtype))

    def forward(self, hidden: torch.Tensor, draft_vocab: bool = False) -> torch.Tensor:
        """hidden [..., H] -> logits [K, ..., V]; with ``draft_vocab`` (and a token_map), [K, ..., V'] over the draft
        vocabulary, column i being token ``token_map[i]``."""
        features = self.features(hidden)
        if not draft_vocab or self.token_map is None:
            return torch.stack([self.project(k, f) for k, f in enumerate(features)])
        weights = self.draft_weights()
        if len(weights) == 1:  # one shared head: all K heads' rows in one matrix product
            return F.linear(torch.stack(features).to(weights[0].dtype), weights[0])
        return torch.stack([F.linear(f, w) for f, w in zip(features, weights)])


def medusa_targets(labels: torch.Tensor, num_heads: int,
                   segment_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-head label tensors [B, T]: head k at position t is trained on labels[t + k + 2] (-100 where none, and,
    with ``segment_ids`` [B, T] of a packed batch, where t + k + 2 lies in another example)."""
    out = []
    for k in range(num_heads):
        shift = k + 2
        target = torch.full_like(labels, -100)
        if shift < labels.shape[1]:
            target[:, :-shift] = labels[:, shift:]
            if segment_ids is not None:
                apart = segment_ids[:, :-shift] != segment_ids[:, shift:]
                target[:, :-shift] = target[:, :-shift].masked_fill(apart, -100)
        out.append(target)
    return out


def to_draft_ids(ids: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    """Target ids -> their columns in the draft vocabulary (``token_map``: ascending target ids); -100 where an id is
    not in it (no draft could propose it) or was -100 already."""
    token_map = token_map.to(ids.device)
    if token_map.numel() == 0:
        return torch.full_like(ids, -100)
    pos = torch.searchsorted(token_map, ids.clamp(min=0)).clamp(max=token_map.numel() - 1)
    return torch.where((token_map[pos] == ids) & (ids >= 0), pos, torch.full_like(ids, -100))


def weighted_head_loss(per_head: torch.Tensor, decay: float) -> torch.Tensor:
    """per_head [K] -> sum_k decay**k * per_head[k]."""
    weights = decay ** torch.arange(per_head.shape[0], device=per_head.device, dtype=per_head.dtype)
    return (weights * per_head).sum()


def medusa_head_losses(
    head_logits: torch.Tensor,
    head_targets: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head summed losses and their counts over flat positions; returns (loss_sum [K], count [K]).

    head_logits [K, N, V]; head_targets [K, N] token ids (-100 = no target here). With ``teacher_logits`` [K, N, V]
    (the target's logits for the same tokens) the loss is KL(teacher || head) instead of cross-entropy with the ids,
    still only where the target id is valid. Sums, not means, so callers can normalise over a whole global batch.
    """
    valid = head_targets != -100  # [K, N]
    count = valid.sum(-1)  # [K]
    if teacher_logits is None:
        num_heads, num_positions, vocab = head_logits.shape
        loss = F.cross_entropy(  # rows over the vocabulary: several times faster than a class dim in the middle
            head_logits.float().reshape(-1, vocab), head_targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(num_heads, num_positions)  # [K, N]
    else:
        loss = F.kl_div(
            F.log_softmax(head_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1), log_target=True,
            reduction="none",
        ).sum(-1)  # [K, N]
        loss = loss * valid
    return loss.sum(-1), count


def medusa_positions(labels: torch.Tensor, num_heads: int,
                     segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions where at least one head has a target, and each head's target there.

    labels [B, T] (-100 = no label); segment_ids [B, T] of a packed batch (targets stay within an example). Returns
    (flat_index [N] into the B*T positions, head_targets [K, N]). Training on these positions only skips the
    full-vocabulary projection where no head has anything to learn.
    """
    head_targets = torch.stack(medusa_targets(labels, num_heads, segment_ids)).flatten(1)  # [K, B*T]
    flat_index = (head_targets != -100).any(0).nonzero().squeeze(-1)  # [N]
    return flat_index, head_targets[:, flat_index]


def medusa_topk_hits(head_logits: torch.Tensor, head_targets: torch.Tensor, k: int) -> torch.Tensor:
    """[K, N] bool: position has a target and it is among the head's top-k tokens. head_logits [K, N, V]."""
    top = head_logits.topk(min(k, head_logits.shape[-1]), dim=-1).indices  # [K, N, k]
    return (top == head_targets.unsqueeze(-1)).any(-1) & (head_targets != -100)


def expected_accept_length(accuracy: list[float] | torch.Tensor) -> float:
    """Expected accepted draft tokens of a chain whose head k is right with probability accuracy[k]:
    sum_k prod_{j<=k} accuracy[j] (a head's token is only used when all earlier ones were accepted).

    With top-1 accuracies this is the chain; with top-w accuracies it is a full w-ary tree of the same depth.
    Independence across heads is assumed, so this estimates; decoding measures. Tokens per step = 1 + this.
    """
    total, running = 0.0, 1.0
    for acc in [float(a) for a in accuracy]:
        running *= acc
        total += running
    return total


def build_medusa_heads(config: dict, target_model: nn.Module | None = None) -> MedusaHeads:
    """Build heads from a saved config dict (``MedusaConfig`` fields); the head-type builder used by selfspec.heads.io."""
    fields = {k: config[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_layers")}
    fields["shared_lm_head"] = bool(config.get("shared_lm_head", False))  # heads saved before the option had their own
    fields["draft_vocab_size"] = config.get("draft_vocab_size")  # heads saved before reduced vocabularies: None
    lm_head = target_model.get_output_embeddings() if target_model is not None else None
    return MedusaHeads(MedusaConfig(**fields), lm_head)
