"""Draft vocabularies counted on a training split: the most frequent answer tokens (heads/vocab.py's maps)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.heads.vocab import build_draft_vocab, count_tokens, resolve_size
from selfspec.train.data.chat import IGNORE_INDEX


def draft_vocab_counts(dataset: Any, vocab_size: int) -> torch.Tensor:
    """Token counts [V] over the assistant tokens (labels != -100) of a tokenized split."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for example in dataset:
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(example["labels"], dtype=torch.long)
        counts += count_tokens(ids, vocab_size, labels != IGNORE_INDEX)
    return counts


@dataclass
class DraftVocab:
    """A draft vocabulary counted on a training split (heads/vocab.py's maps)."""

    d2t: torch.Tensor  # [Vd] SGLang's draft -> target offsets
    t2d: torch.Tensor  # [V] bool: target ids in the draft vocabulary
    coverage: float  # their share of the split's answer tokens

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    @property
    def token_map(self) -> torch.Tensor:
        """The kept target ids, ascending (vLLM Medusa's token_map)."""
        return self.t2d.nonzero().squeeze(-1)


def choose_draft_vocab(dataset: Any, vocab_size: int, size: Any, coverage: float | None, family: str,
                       verbose: bool = True) -> DraftVocab:
    """The most frequent answer tokens of ``dataset``: ``size`` of them, or with ``size=auto`` the fewest that cover
    ``coverage`` of the answers (heads/vocab.py:resolve_size); says what it kept on stderr when ``verbose``."""
    counts = draft_vocab_counts(dataset, vocab_size)
    d2t, t2d = build_draft_vocab(counts, resolve_size(counts, size, coverage))
    total = int(counts.sum())
    vocab = DraftVocab(d2t, t2d, float(counts[t2d].sum()) / total if total else 0.0)
    if verbose:
        print(f"[selfspec] {family} draft vocabulary: {vocab.size:,} of {vocab_size:,} tokens cover "
              f"{vocab.coverage:.1%} of {total:,} assistant tokens in the training split", file=sys.stderr)
    return vocab


def draft_vocab_problems(size: Any, coverage: Any) -> list[str]:
    """What is wrong with ``heads.draft_vocab_size`` / ``heads.draft_vocab_coverage`` (empty: nothing)."""
    problems = []
    if size is not None and str(size) != "auto" and (not isinstance(size, int) or size < 1):
        problems.append(f"heads.draft_vocab_size={size!r}: use a number >= 1, auto (by heads.draft_vocab_coverage) "
                        "or null (the full vocabulary)")
    if str(size) == "auto" and (coverage is None or not 0 < float(coverage) <= 1):
        problems.append(f"heads.draft_vocab_size=auto needs heads.draft_vocab_coverage in (0, 1], got {coverage!r}")
    return problems


def count_draft_vocab(dataset: Any, vocab_size: int, settings: Any, family: str, accelerator: Any = None) -> DraftVocab:
    """:func:`choose_draft_vocab` on a training split with a family's settings (``settings.draft_vocab_size`` and
    ``settings.draft_vocab_coverage``), said on the main process only (``accelerator``: None in one process)."""
    return choose_draft_vocab(dataset, vocab_size, settings.draft_vocab_size, settings.draft_vocab_coverage, family,
                              verbose=accelerator is None or accelerator.is_main_process)
