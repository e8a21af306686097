"""What a drafter family supplies to the shared training loop (:func:`selfspec.train.loop.train`): one :class:`TrainMethod`.

The whole contract is this class. Five methods are required (``build_module``, ``count_items``, ``compute_loss``,
``evaluate``, ``save``; a subclass that lacks one cannot be instantiated) plus a ``name``; every optional capability
is declared here with its default, so a family overrides only what it offers and the loop calls each member directly:

=======================  ==================================================================================
capability               default
=======================  ==================================================================================
``trains_target``        False: the target is frozen, and may run in bfloat16 where that is native
``supports_packing``     False: ``trainer.packing=true`` is refused
``prepare_data``         the splits and the collate function unchanged
``param_groups``         one group: every trainable parameter of the module ``build_module`` built
``wrap_module``          refused: the module around a drafter built elsewhere (learning while decoding)
``store_target_layers``  None: the loop loads the whole target (a store-fed method says what it reads of it)
=======================  ==================================================================================

One normalisation rule: a loss is a sum over the items a micro-batch trains on divided by ``num_items``, their count
over the whole optimizer step (``count_items`` summed over the step's micro-batches and every rank), so how a step is
split into micro-batches and processes does not change its gradient. Every family's loss function takes ``num_items``
as a required argument; none falls back to a micro-batch's own count.

One save path: a family's ``save`` hands its module and what it chose to :func:`save_run_heads`, which builds the
metadata every heads folder carries and calls selfspec.heads.io.save_heads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from selfspec.core.families import FAMILIES
from selfspec.heads.io import save_heads


class TrainMethod(ABC):
    """A drafter family's training: what is trained and how its loss, evaluation and save go.

    ``name`` (e.g. "medusa") names the method in logs and in the saved heads' metadata; a subclass sets it as a class
    attribute or in ``__init__``.
    """

    name: str

    #: Whether the method trains weights inside the target (e.g. Medusa-2's LoRA). The target then keeps the model
    #: config's dtype under ``trainer.target_dtype=auto`` instead of bfloat16 (selfspec.train.config.training_dtype).
    trains_target: bool = False

    #: Whether ``compute_loss`` reads packed batches (selfspec.train.data.collate_packed: ``segment_ids`` and restarting
    #: ``position_ids``), keeping its masks and look-ahead targets within an example. Evaluation reads padded batches.
    supports_packing: bool = False

    # --- required -------------------------------------------------------------------------------------------------

    @abstractmethod
    def build_module(self, target: Any) -> nn.Module:
        """The module whose trainable parameters are optimised (it may hold the target, e.g. with LoRA); its forward
        is what ``compute_loss`` calls, so that DDP syncs its gradients. Called after ``prepare_data``."""

    @abstractmethod
    def count_items(self, batch: dict) -> torch.Tensor:
        """The items this micro-batch's loss is a sum over, a tensor of any shape (e.g. label positions per head).

        The loop sums the counts over the step's micro-batches and ranks (elementwise, at least 1 each), passes them
        to ``compute_loss`` as ``num_items``, and undoes accelerate's averaging over micro-batches and ranks, so a
        step's gradient is that of the mean over every item of the global batch, whatever the split. Called on each
        micro-batch of a step before its ``compute_loss``."""

    @abstractmethod
    def compute_loss(self, batch: dict, target: Any, module: nn.Module, num_items: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) of one micro-batch on the device; metrics map a name to a scalar tensor, logged averaged
        over the step. ``num_items``: the step's global count (see ``count_items``); the loss is this micro-batch's
        ``loss_sum / num_items``."""

    @abstractmethod
    def evaluate(self, loader: Any, target: Any, module: nn.Module, accelerator: Any) -> dict[str, float]:
        """Metrics over the whole (sharded) eval loader, reduced over ranks; the keys are logged as they are. Runs
        under ``torch.no_grad`` and the accelerator's autocast, with ``module`` (``build_module``'s) in eval mode."""

    @abstractmethod
    def save(self, path: Path, module: nn.Module, target: Any, meta: dict, state_dict: dict | None = None) -> Path:
        """Write the trained heads to ``path`` (main process only) through :func:`save_run_heads` and return the
        folder. ``module`` (``build_module``'s) is unwrapped, ``state_dict`` its full state gathered from every rank, ``meta`` what the
        run was (run name, steps, data, trainer, eval metrics)."""

    # --- optional, with their defaults ----------------------------------------------------------------------------

    def prepare_data(self, datasets: dict, target: Any, accelerator: Any, collate_fn: Callable
                     ) -> tuple[Any, Any, Callable]:
        """(train split, eval split or None, collate_fn) from ``datasets`` ({"train", "eval"}; eval may be None),
        before the drafter is built: e.g. a draft vocabulary counted on the train split, or a feature store swapped
        in. By default the splits and ``collate_fn`` unchanged."""
        return datasets["train"], datasets.get("eval"), collate_fn

    def wrap_module(self, drafter: nn.Module, target: Any) -> nn.Module:
        """The module ``build_module`` would build, around a drafter that exists already (heads loaded for decoding,
        which train/online.py trains between requests). Families that learn while decoding implement it."""
        raise NotImplementedError(f"The {self.name} family does not train heads it did not build (no wrap_module).")

    def store_target_layers(self) -> list[int] | None:
        """The target's decoder layers this training reads besides its input embeddings, final norm and LM head,
        when it reads nothing else of the target (trained from a feature store): e.g. [] or the layer a drafter
        starts from; the loop then holds only those tensors (selfspec.core.target_parts). None (the default, and
        online training): the whole target."""
        return None

    def param_groups(self, module: nn.Module, lr: float) -> list[dict]:
        """The optimizer's parameter groups (e.g. a learning-rate multiplier for some of them); ``lr`` is
        ``trainer.learning_rate``. By default one group of every trainable parameter."""
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]


def unwrap(module: nn.Module) -> nn.Module:
    """The module itself, out of the wrappers ``accelerator.prepare`` put around it (DDP, DeepSpeed, compile)."""
    return extract_model_from_parallel(module)


def state_under(state_dict: dict | None, prefix: str) -> dict | None:
    """The entries of a gathered ``state_dict`` under ``prefix`` (e.g. "drafter."), renamed without it (None: None):
    the state of one submodule of the module the loop trained."""
    if state_dict is None:
        return None
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def save_run_heads(path: Path, module: nn.Module, head_type: str, target: Any, meta: dict, *, settings: Any,
                 features: str, draft_vocab_coverage: float | None, settings_key: str = "heads",
                 eval_metrics: dict | None = None, extra: dict | None = None, decode: dict | None = None,
                 state_dict: dict | None = None, adapter: nn.Module | None = None,
                 adapter_state_dict: dict | None = None) -> Path:
    """Every family's save: ``module`` into the heads folder ``path`` through selfspec.heads.io.save_heads, as head type
    ``head_type`` with its ``module.config.to_dict()``, and the metadata of the run in config.json:

    - ``meta`` (run name, method, steps, tokens, data, trainer; from the loop), its ``eval`` replaced by
      ``eval_metrics`` when the family summarises them (Medusa);
    - ``settings`` (the family's settings dataclass) under ``settings_key`` ("heads"; layer-skip's "exit");
    - ``features`` (the feature source: online | store), and ``draft_vocab_coverage`` when a draft vocabulary was
      counted;
    - ``extra``: the family's own keys (layer-skip's exit ranking);
    - ``decode``: the decode settings training chose for these heads, under the family's ``saved_key``
      (core/families.py), the key decoding reads them from ("decode", EAGLE's "tree").

    ``state_dict`` / ``adapter`` / ``adapter_state_dict`` go to save_heads as they are (gathered weights, Medusa-2's
    LoRA)."""
    saved = dict(meta)
    if eval_metrics is not None:
        saved["eval"] = eval_metrics
    saved[settings_key] = asdict(settings)
    saved["features"] = features
    if draft_vocab_coverage is not None:
        saved["draft_vocab_coverage"] = draft_vocab_coverage
    saved.update(extra or {})
    if decode is not None:
        saved[FAMILIES[head_type].saved_key] = dict(decode)
    return save_heads(path, module, head_type, module.config.to_dict(), target, saved, adapter=adapter,
                      state_dict=state_dict, adapter_state_dict=adapter_state_dict)


__all__ = ["TrainMethod", "save_run_heads", "state_under", "unwrap"]
