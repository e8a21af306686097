"""Attention masks and KV-cache crops: the small pieces that drafting, verifying and training all use.

Masks are additive floats (0 where a query may attend, the dtype's minimum elsewhere): eager attention misreads a
boolean 4D mask, while an additive one gives the same logits under eager and sdpa.
"""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = may attend), any shape -> additive float mask of the same shape (0 / dtype minimum)."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill(~allowed, torch.finfo(dtype).min)


def cache_length(cache) -> int:
    """Positions held by a transformers Cache (0 for None)."""
    return 0 if cache is None else int(cache.get_seq_length())


def crop_cache(cache, length: int) -> None:
    """Drop every cached position at or after ``length`` in every layer (transformers 5 crops by a negative count)."""
    extra = cache_length(cache) - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} entries to {length}")
    if extra:
        cache.crop(-extra)
