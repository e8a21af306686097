"""The loop's data: the splits as the method prepares them (:func:`prepare_splits`), the loaders over them
(:func:`train_loader`, with packing where the method reads it, and :func:`eval_loader`), and the endless,
resumable stream of training micro-batches (:func:`micro_batches`).

The data order of epoch e is a permutation seeded by (trainer.seed, e), the same on every rank (:class:`EpochSampler`);
accelerate shards each global batch over the ranks. A resumed run skips the micro-batches it consumed without loading
them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from selfspec.core.config import cfg_get, to_dict
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.train.config import TrainerConfig
from selfspec.train.data import build_dataset, collate, collate_packed
from selfspec.train.method import TrainMethod


class EmptyDatasetError(SelfspecError, ValueError):
    """The training split has no example."""



class EpochSampler(Sampler[int]):
    """Indices of one epoch: a permutation seeded by (seed, epoch), or in order. Touches no global RNG."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.num_samples, self.seed, self.shuffle, self.epoch = num_samples, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=gen).tolist())

    def __len__(self) -> int:
        return self.num_samples


def prepare_splits(cfg: Any, tc: TrainerConfig, method: TrainMethod, target: Any, datasets: Any, accelerator):
    """(train split, eval split or None, collate_fn): ``cfg.data`` tokenized unless ``datasets`` is given, then what
    the method makes of it (``prepare_data``, e.g. a feature store), the eval split capped at eval_max_examples."""
    if datasets is None:
        datasets = _load_datasets(cfg, target.tokenizer, accelerator)
    train_ds, eval_ds = _split(datasets, "train"), _split(datasets, "eval")
    _check_not_empty(train_ds, cfg)
    collate_fn = functools.partial(collate, pad_token_id=target.tokenizer.pad_token_id)
    train_ds, eval_ds, collate_fn = method.prepare_data({"train": train_ds, "eval": eval_ds}, target, accelerator,
                                                        collate_fn)
    if eval_ds is not None and tc.eval_max_examples is not None and len(eval_ds) > tc.eval_max_examples:
        eval_ds = torch.utils.data.Subset(eval_ds, range(tc.eval_max_examples))
    if eval_ds is not None and len(eval_ds) == 0:
        eval_ds = None
    return train_ds, eval_ds, collate_fn


def packing_collate(cfg: Any, tc: TrainerConfig, method: TrainMethod, target: Any) -> Callable:
    """trainer.packing: batches of the same examples, packed (selfspec.train.data.collate_packed) into rows of
    trainer.pack_length tokens (default data.max_length), whether the examples are tokenized data or feature-store
    items. Only for methods whose losses and masks read the packed layout (``supports_packing``). Evaluation keeps
    padded batches: its per-example sums (gather_for_metrics) count examples, and the metrics are the same."""
    if not method.supports_packing:
        raise SettingError(f"trainer.packing=true is not supported by {method.name} training: set "
                           "trainer.packing=false (medusa, medusa2, eagle and eagle3 support it).")
    capacity = tc.pack_length
    if capacity is None:
        capacity = cfg_get(cfg_get(cfg, "data"), "max_length")
    if capacity is None:
        raise SettingError("trainer.packing=true needs trainer.pack_length (or data.max_length) to size its rows.")
    return functools.partial(collate_packed, pad_token_id=target.tokenizer.pad_token_id, capacity=int(capacity))


def train_loader(train_ds: Any, tc: TrainerConfig, collate_fn: Callable) -> DataLoader:
    """Batches of ``trainer.batch_size`` in :class:`EpochSampler` order; the DataLoader seeds its workers from its own
    generator, not the global RNG."""
    return DataLoader(train_ds, batch_size=tc.batch_size, sampler=EpochSampler(len(train_ds), tc.seed),
                      collate_fn=collate_fn, num_workers=tc.num_workers,
                      generator=torch.Generator().manual_seed(tc.seed))


def eval_loader(eval_ds: Any, tc: TrainerConfig, collate_fn: Callable) -> DataLoader:
    """The eval split in order, padded batches of ``trainer.batch_size``."""
    return DataLoader(eval_ds, batch_size=tc.batch_size, shuffle=False, collate_fn=collate_fn,
                      num_workers=tc.num_workers)


def micro_batches(accelerator, loader, start: int) -> Iterator[dict]:
    """Endless micro-batches over epochs, beginning after the first ``start`` (skipped without loading them)."""
    per_epoch = len(loader)
    if per_epoch == 0:
        raise EmptyDatasetError("The training loader yields no batch on this process (fewer examples than processes?).")
    epoch, skip = divmod(start, per_epoch)
    while True:
        loader.set_epoch(epoch)
        source = accelerator.skip_first_batches(loader, skip) if skip else loader
        yield from source
        epoch, skip = epoch + 1, 0


def _load_datasets(cfg: Any, tokenizer, accelerator):
    with accelerator.main_process_first():  # the main process tokenizes and caches; the others load the cache
        return build_dataset(cfg.data, tokenizer, verbose=accelerator.is_main_process)


def _split(datasets: Any, name: str):
    try:
        return datasets[name]
    except (KeyError, IndexError):
        return None


def _check_not_empty(train_ds: Any, cfg: Any) -> None:
    if train_ds is None or len(train_ds) == 0:
        data = to_dict(cfg_get(cfg, "data", {}))
        hint = ", ".join(f"{k}={data[k]}" for k in ("source", "path", "max_records", "max_length", "overflow")
                         if k in data)
        raise EmptyDatasetError(
            f"The training split is empty ({hint or 'no data config'}): nothing to train on. Point data.path at "
            "conversations with assistant turns, raise data.max_records / data.max_length, or use "
            "data.overflow=truncate."
        )


__all__ = ["EmptyDatasetError", "EpochSampler", "eval_loader", "micro_batches", "packing_collate", "prepare_splits",
           "train_loader"]
