"""The decode engine's KV cache, and its commit: after a verify forward appended N tree rows to every layer, keep
only the accepted ones.

The cache is a ``transformers.DynamicCache`` whose layers (:class:`GrowingLayer`) hold ``keys``/``values``
[B, kv_heads, T, head_dim] as views of buffers with room to grow: a forward writes its new rows after the last ones
in place, where transformers' own ``DynamicLayer`` concatenates, copying the whole cache of every layer on every
step (at 400 positions of SmolLM2, 18 MB copied a step; at 2,000, 92 MB, a fifth of the weights' bytes). A buffer
that is full is replaced by one half as large again, its rows copied once. Everything that reads ``keys`` and
``values`` (attention, masks, the lengths) sees the same tensors as with concatenation.

The commit moves the accepted rows down in place and crops the tail, so every layer ends at the committed length.
Batch size 1.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

MIN_ROOM = 256  # rows a new buffer holds at least


class CacheError(RuntimeError):
    """The cache is not in the state a commit expects."""


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys``/``values`` are views of buffers with room to grow (module doc):
    ``update`` writes the new rows in place after the current ones and returns the views, as ``DynamicLayer``
    returns its concatenation."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = length + key_states.shape[-2]
        if self._room is None or end > self._room[0].shape[-2]:
            rows = max(end, length + max(MIN_ROOM, length // 2))
            room = tuple(new.new_empty(*new.shape[:-2], rows, new.shape[-1]) for new in (key_states, value_states))
            if length:
                room[0][..., :length, :] = self.keys
                room[1][..., :length, :] = self.values
            self._room = room
        keys, values = self._room
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A DynamicCache of :class:`GrowingLayer` (one per decoder layer, created on first use)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def new_cache() -> DynamicCache:
    """The engine's cache: a :class:`GrowingCache` (full attention)."""
    return GrowingCache()


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
