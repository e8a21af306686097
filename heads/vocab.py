"""Reduced draft vocabularies: a draft LM head over the most frequent target tokens of the training data.

A draft step projects onto the vocabulary; on a small target that projection is most of the step (SmolLM2's LM head
is 21% of its weights). Keeping only the tokens that cover most of the training data's answers makes it several
times cheaper, and a token outside them is one the drafter rarely gets right anyway.

- :func:`count_tokens`: token frequencies of a split's answer tokens;
- :func:`size_for_coverage`: the fewest most-frequent tokens whose share of the counted tokens reaches a coverage;
- :func:`build_draft_vocab`: those tokens as SGLang's ``d2t`` / ``t2d`` maps (EAGLE-3; Medusa saves the kept ids,
  ``t2d``'s true positions, as vLLM's ``token_map``).
"""

from __future__ import annotations

import torch

from selfspec.core.errors import SettingError


def size_for_coverage(token_counts: torch.Tensor, coverage: float) -> int:
    """The fewest most-frequent tokens whose counts reach ``coverage`` (0 < coverage <= 1) of the total."""
    if not 0.0 < float(coverage) <= 1.0:
        raise SettingError(f"draft vocabulary coverage must be in (0, 1], got {coverage}.")
    counts = torch.sort(torch.as_tensor(token_counts).reshape(-1).double(), descending=True).values
    total = float(counts.sum())
    if total == 0:
        return counts.numel()
    reached = torch.cumsum(counts, 0) >= float(coverage) * total * (1 - 1e-12)
    return int(reached.nonzero()[0, 0]) + 1


def resolve_size(token_counts: torch.Tensor, size: int | str | None, coverage: float | None) -> int:
    """A draft vocabulary size from the settings: a number, or ``auto`` (by ``coverage``); None: the whole vocab."""
    vocab = torch.as_tensor(token_counts).numel()
    if size is None:
        return vocab
    if str(size) == "auto":
        if coverage is None:
            raise SettingError("draft_vocab_size=auto needs draft_vocab_coverage (e.g. 0.95).")
        return size_for_coverage(token_counts, coverage)
    return min(int(size), vocab)


def count_tokens(token_ids: torch.Tensor, vocab_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token frequencies [V] (long) of ``token_ids`` (any shape), counting only where ``mask`` is true."""
    ids = token_ids.reshape(-1)
    if mask is not None:
        ids = ids[mask.reshape(-1).bool()]
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids.long(), minlength=vocab_size)


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target ids (ties: lower id first) as SGLang's maps.

    Returns ``d2t`` [Vd] long with target id = draft id + d2t[draft id] (draft ids ordered by target id), and ``t2d``
    [V] bool, true for target ids in the draft vocabulary.
    """
    counts = torch.as_tensor(token_counts).reshape(-1)
    vocab_size = counts.numel()
    if draft_vocab_size <= 0:
        raise SettingError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    size = min(int(draft_vocab_size), vocab_size)
    order = torch.sort(counts.double(), descending=True, stable=True).indices  # stable: ties keep lower ids first
    kept = torch.sort(order[:size]).values  # [Vd] target ids, ascending
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t.long(), t2d


def install_draft_vocab(module: torch.nn.Module, d2t: torch.Tensor, init_lm_head_from: torch.nn.Module | None = None
                        ) -> None:
    """Set a drafter's ``d2t`` / ``t2d`` buffers to a draft vocabulary (``d2t`` as :func:`build_draft_vocab` gives
    it), checking it maps inside the target vocabulary, and optionally copy the matching rows of the target's LM head
    (``init_lm_head_from``) into the drafter's ``lm_head``."""
    d2t = d2t.to(module.d2t.device, torch.long)
    if d2t.shape != module.d2t.shape:
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}; expected {tuple(module.d2t.shape)} (the draft vocabulary "
                         "size).")
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if target_ids.min() < 0 or target_ids.max() >= module.t2d.numel():
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    module.d2t.copy_(d2t)
    module.t2d.zero_()
    module.t2d[target_ids] = True
    if init_lm_head_from is not None:
        with torch.no_grad():
            rows = init_lm_head_from.weight[target_ids.to(init_lm_head_from.weight.device)]
            module.lm_head.weight.copy_(rows.to(module.lm_head.weight))

