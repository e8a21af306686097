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


class Backlog:
    """Committed positions a drafter's own cache has not read yet (EAGLE's draft cache, a layer-skip adapter's): the
    commits add their rows, and the next draft reads them all in one batched forward (:meth:`take`), so a drafter
    whose drafting is switched off costs nothing. Each entry is a tuple of tensors whose ``dim``-th axis runs over
    positions (the first tensor's ``dim`` counts them); ``start`` is the first position not yet read."""

    def __init__(self, start: int = 0, dims: tuple[int, ...] = (0,)):
        self.start, self.dims = start, dims
        self.parts: list[tuple[torch.Tensor, ...]] = []

    @property
    def end(self) -> int:
        """The position after the last row added."""
        return self.start + sum(int(p[0].shape[self.dims[0]]) for p in self.parts)

    def add(self, *tensors: torch.Tensor, at: int | None = None) -> None:
        """Rows for the positions after :attr:`end` (``at``: the position the caller expects them at, checked)."""
        if at is not None and at != self.end:
            raise CacheError(f"rows for position {at} added to a backlog that ends at {self.end}; a drafter's own "
                             "cache follows its own commits only.")
        self.parts.append(tensors)

    def take(self) -> tuple[int, tuple[torch.Tensor, ...]] | None:
        """(the first position, each field concatenated over every row added), emptying the backlog; None if empty."""
        if not self.parts:
            return None
        start = self.start
        fields = tuple(torch.cat(list(column), dim=d) for column, d in zip(zip(*self.parts), self.dims))
        self.start, self.parts = self.end, []
        return start, fields
