"""Batches of tokenized examples (or feature-store items): padded (:func:`collate`) or packed
(:func:`collate_packed`, ``trainer.packing``), and the attention inputs a target forward over either takes.

    batch = collate(ds["train"].select(range(8)), tokenizer.pad_token_id)
    batch = collate_packed(ds["train"].select(range(8)), tokenizer.pad_token_id, capacity=384)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from selfspec.train.data.chat import IGNORE_INDEX


def collate(examples: Iterable[Mapping[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids`` [B, T] long, ``attention_mask`` [B, T] long, ``labels`` [B, T] long with
    -100 on padding (an example without ``labels`` is labelled with its own ids)."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate got an empty list of examples.")
    if pad_token_id is None:
        raise ValueError("collate needs a pad_token_id: set tokenizer.pad_token (e.g. to its eos token).")
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.as_tensor(e.get("labels", e["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] positions counting only real tokens (right or left padding alike)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- packing ---------------------------------------------------------------------------------------------------------
#
# A packed batch holds the same examples as a padded one, laid end to end in as few rows as fit ``capacity`` tokens
# (first fit, longest first), so a step trains the same tokens with less padding. Its extra keys:
#   segment_ids [R, T]: 1, 2, ... the example a token belongs to within its row; 0 on padding;
#   position_ids [R, T]: positions restarting at 0 in every example (and in the row's padding tail).
# The first token of every example is labelled -100 (no position of its own example predicts it; the previous
# example's last token must not learn it). Attention stays within an example: the target reads packed rows through
# transformers' own packed-sequence masks (attention_mask=None with restarting position_ids, see target_inputs), the
# drafters build theirs from segment_ids, and every loss that looks k tokens ahead keeps within an example.


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens: first fit, longest first (each row's
    indices in their original order). A length over ``capacity`` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return [sorted(row) for row in rows]


def collate_packed(examples: Iterable[Mapping[str, Any]], pad_token_id: int, capacity: int) -> dict[str, torch.Tensor]:
    """Packed batch (see above) of tokenized examples or feature-store items: input_ids / attention_mask / labels /
    segment_ids / position_ids [R, T], and each further per-token field of the items [R, T, ...] (zeros on padding).
    R <= len(examples); T = the longest row, at most ``capacity`` unless one example alone is longer."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate_packed got an empty list of examples.")
    if pad_token_id is None:
        raise ValueError("collate_packed needs a pad_token_id: set tokenizer.pad_token (e.g. to its eos token).")
    items = []
    for e in examples:
        ids = torch.as_tensor(e["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(e.get("labels", e["input_ids"]), dtype=torch.long).clone()
        labels[:1] = IGNORE_INDEX
        item = {"input_ids": ids, "labels": labels}
        item.update({k: v for k, v in e.items()  # per-token features (a feature store's), as collate_features
                     if k not in item and isinstance(v, torch.Tensor) and v.dim() >= 1 and len(v) == len(ids)})
        items.append(item)
    rows = pack_rows([len(it["input_ids"]) for it in items], capacity)
    longest = max(sum(len(items[i]["input_ids"]) for i in row) for row in rows)
    out = {
        "input_ids": torch.full((len(rows), longest), int(pad_token_id), dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), longest), dtype=torch.long),
        "labels": torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long),
        "segment_ids": torch.zeros((len(rows), longest), dtype=torch.long),
        "position_ids": torch.zeros((len(rows), longest), dtype=torch.long),
    }
    for key, value in items[0].items():
        if key not in out:
            out[key] = torch.zeros((len(rows), longest, *value.shape[1:]), dtype=value.dtype)
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            n = len(items[i]["input_ids"])
            for key, value in items[i].items():
                out[key][r, start:start + n] = value
            out["attention_mask"][r, start:start + n] = 1
            out["segment_ids"][r, start:start + n] = seg
            out["position_ids"][r, start:start + n] = torch.arange(n)
            start += n
        out["position_ids"][r, start:] = torch.arange(longest - start)  # the tail: a sequence of its own
    return out


def target_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The attention inputs of a target forward over ``batch``: a padded batch's attention_mask and the positions
    it implies; for a packed batch no mask and its restarting position_ids, which transformers turns into a
    block-diagonal causal mask (its packed-sequence detection; use_cache=False and no cache, as training runs)."""
    if "segment_ids" in batch:  # packed
        return {"attention_mask": None, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"], "position_ids": position_ids_from_mask(batch["attention_mask"])}
