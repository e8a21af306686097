"""KV-cache commit: after a verify forward appended N tree rows to every layer, keep only the accepted ones.

Works on ``transformers.DynamicCache``, whose layers hold ``keys``/``values`` [B, kv_heads, T, head_dim]; the
accepted rows are moved down in place and the tail is cropped, so every layer ends at the committed length.
Batch size 1.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class CacheError(RuntimeError):
    """The cache is not in the state a commit expects."""


def new_cache() -> DynamicCache:
    """A full-attention DynamicCache (one plain layer per decoder layer, created on first use)."""
    return DynamicCache()


def layer_lengths(cache: DynamicCache) -> list[int]:
    """Number of cached positions in every layer."""
    return [int(layer.keys.shape[-2]) if layer.is_initialized and layer.keys is not None else 0 for layer in cache.layers]


def commit_kv(cache: DynamicCache, past_length: int, keep: list[int]) -> None:
    """Keep tree rows ``keep`` (node ids, ascending) after ``past_length`` committed rows and drop the rest, in place.

    Before: every layer has past_length + N rows. After: past_length + len(keep) rows, the kept ones in order.
    """
    if list(keep) != sorted(keep):
        raise CacheError(f"commit_kv needs accepted node ids in ascending order, got {keep}.")
    contiguous = list(keep) == list(range(len(keep)))  # chains and a rejected first child: a crop is enough
    end = past_length + len(keep)
    index = None
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise CacheError("commit_kv needs full-attention cache layers; create the cache with new_cache().")
        if index is None and not contiguous:
            index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + past_length  # [A]
        if not contiguous:
            # Advanced indexing copies first, so the overlapping write is safe.
            layer.keys[:, :, past_length:end] = layer.keys[:, :, index]  # [B, kv_heads, A, head_dim]
            layer.values[:, :, past_length:end] = layer.values[:, :, index]
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]
