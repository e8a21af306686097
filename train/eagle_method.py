"""EAGLE training for :func:`selfspec.train.loop.train`: EAGLE-1 and EAGLE-3 drafters on a frozen target.

Config (``cfg.heads``, conf/heads/eagle.yaml and eagle3.yaml):

- ``type``: ``eagle`` (feature regression + token loss, the target's LM head) or ``eagle3`` (fused low/mid/high
  features, own LM head over a reduced draft vocabulary, token loss only).
- ``layout``: ``fc`` (EAGLE-1's input projection before an unmodified target layer) or ``midlayer`` (eagle3 only:
  EAGLE-3's widened q/k/v, exportable to SGLang and vLLM speculators, see selfspec.heads.export); see selfspec.heads.eagle;
- ``fc_bias``, ``input_norm`` (fc layout: the layer's own input norm; false with ``fc_bias: false`` is vLLM's
  EAGLE-1), ``init_layer_from`` (copy a Llama-shaped target layer into the draft layer), ``layer_ids`` (eagle3),
  ``draft_vocab_size`` (the most frequent assistant tokens of the training split, counted before training; eagle3's
  LM head is over them, and eagle's logits with one are the target LM head's rows of them: null, its default, keeps
  the whole head),
- ``unroll_steps``: test-time steps unrolled in training (the draft reads its own output features);
  ``feature_noise``: uniform noise on the step-0 input features (training only);
- ``loss``: ``regression``, ``token`` weights, ``token_loss`` (kl to the target | ce on the data), ``step_decay``,
  ``teacher_vocab`` (the kl teacher of a drafter with a draft vocabulary: the whole LM head, or its rows alone);
- ``tree``: the dynamic-tree settings decoding uses by default (saved with the heads).

Hidden states come from the target as training runs (``features: online``: one forward with
``output_hidden_states`` under no_grad) or from an offline feature store (``features: store``, see
selfspec.train.feature_store), which keeps the last hidden state (after the final norm) and, for eagle3, the three fused layers'
inputs. The teacher logits are the target's LM head on that last hidden state (soft-capped where the target's are),
so the store needs no top-k logits and trains the same drafter as online features (exactly, with
``feature_store.dtype=float32``).

Each loss term of an unrolled step is a sum over the positions it trains at divided by their global count over the
optimizer step (``count_items``: answer tokens inside the draft vocabulary), so a step's gradient does not depend on
how the batch is split over processes and micro-batches. EAGLE-3's KL loss skips the positions whose target top token
is outside the draft vocabulary (no draft could propose it); they stay counted, contributing no loss. With
``loss.teacher_vocab=draft`` the teacher is the draft vocabulary's rows of the LM head alone (the same softmax over
the draft tokens, without the whole head's cost: most of a step on a 262k vocabulary), and those positions train too.

Saved through selfspec.heads.io as head type ``eagle`` / ``eagle3``; a draft vocabulary's ``d2t`` / ``t2d`` are buffers of
the module and are saved with its weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.core.archs import output_logits
from selfspec.heads.eagle import EagleConfig, EagleHeads
from selfspec.heads.eagle_loss import EagleLossWeights, drafter_loss, step_counts
from selfspec.core.runtime import rows_through
from selfspec.train.data import count_draft_vocab, draft_vocab_problems
from selfspec.train.feature_store import FeatureSource, hidden_states_extract, hidden_states_fields, target_hidden_states
from selfspec.core.errors import SettingError
from selfspec.heads.medusa import expected_accept_length
from selfspec.train.config import settings_from_cfg
from selfspec.train.method import TrainMethod, save_run_heads, state_under, unwrap

HEAD_TYPES = ("eagle", "eagle3")


@dataclass
class EagleSettings:
    """``cfg.heads``; the defaults are in conf/heads/eagle.yaml and eagle3.yaml only."""

    type: str  # eagle | eagle3
    fc_bias: bool
    input_norm: bool
    init_layer_from: int | None
    layout: str
    layer_ids: list[int] | None
    draft_vocab_size: int | str | None  # a number, auto (by draft_vocab_coverage), or null (the full vocab)
    draft_vocab_coverage: float | None
    unroll_steps: int
    feature_noise: float
    loss: dict
    tree: dict

    @classmethod
    def from_cfg(cls, cfg: Any) -> "EagleSettings":
        out = settings_from_cfg(cls, cfg)
        problems = []
        if out.type not in HEAD_TYPES:
            problems.append(f"heads.type={out.type!r}: train/eagle.py trains eagle or eagle3 (heads=eagle|eagle3)")
        if out.unroll_steps < 1:
            problems.append(f"heads.unroll_steps={out.unroll_steps} must be >= 1")
        if out.feature_noise < 0:
            problems.append(f"heads.feature_noise={out.feature_noise} must be >= 0")
        if out.type == "eagle3" and float(out.loss.get("regression", 0.0)) > 0:
            problems.append("heads=eagle3 has no feature regression target: set heads.loss.regression=0")
        if out.layout not in ("fc", "midlayer"):
            problems.append(f"heads.layout={out.layout!r}: use fc or midlayer (eagle3 only)")
        elif out.layout == "midlayer" and out.type != "eagle3":
            problems.append("heads.layout=midlayer (EAGLE-3's widened q/k/v) is for heads=eagle3; EAGLE-1 uses fc")
        elif out.layout == "midlayer" and not out.input_norm:
            problems.append("heads.input_norm=false is for heads.layout=fc (midlayer has no input norm already)")
        problems += draft_vocab_problems(out.draft_vocab_size, out.draft_vocab_coverage)
        if problems:
            raise SettingError("; ".join(problems) + ".")
        out.loss_weights()  # validates token_loss
        return out

    def loss_weights(self) -> EagleLossWeights:
        try:
            return EagleLossWeights(**self.loss)
        except TypeError as err:
            raise SettingError(f"heads.loss: {err}; known: regression, token, token_loss, step_decay.") from err

    def eagle_config(self, target_model: nn.Module) -> EagleConfig:
        return EagleConfig.from_target(
            target_model, variant=self.type, fc_bias=self.fc_bias, init_layer_from=self.init_layer_from,
            layout=self.layout, input_norm=self.input_norm,
            layer_ids=self.layer_ids,
            draft_vocab_size=None if self.draft_vocab_size == "auto" else self.draft_vocab_size,  # auto: until counted
        )


class EagleTrainModule(nn.Module):
    """The drafter and its training loss in one forward (the module the loop prepares, so DDP syncs it)."""

    def __init__(self, drafter: EagleHeads, weights: EagleLossWeights, unroll_steps: int, feature_noise: float):
        super().__init__()
        self.drafter = drafter
        self.weights, self.unroll_steps, self.feature_noise = weights, unroll_steps, feature_noise

    def forward(self, hidden_states, target_logits, input_ids, labels, attention_mask, num_items, segment_ids=None,
                position_ids=None):
        """-> (loss, metrics); noise only in training mode; num_items [unroll_steps] the step's counts per unrolled
        step (selfspec.heads.eagle_loss.drafter_loss); segment_ids / position_ids of a packed batch."""
        return drafter_loss(
            self.drafter, hidden_states, target_logits, input_ids, labels, self.weights, num_items,
            unroll_steps=self.unroll_steps, attention_mask=attention_mask,
            feature_noise=self.feature_noise if self.training else 0.0,
            segment_ids=segment_ids, position_ids=position_ids,
        )


class EagleMethod(TrainMethod):
    """The EAGLE family for the shared loop (see selfspec.train.method.TrainMethod)."""

    supports_packing = True  # trainer.packing: the drafter's masks and losses read segment_ids

    def __init__(self, cfg: Any):
        self.settings = EagleSettings.from_cfg(cfg.heads)
        self.name = self.settings.type
        self.weights = self.settings.loss_weights()
        self.features = FeatureSource.from_cfg(cfg)
        self.d2t: torch.Tensor | None = None
        self.draft_vocab_coverage: float | None = None
        self._draft_vocab_of = None  # the built drafter's target -> draft id map, for count_items
        self._draft_head = None  # (the drafter's gathered rows, F.linear over them): _draft_rows_head

    # --- setup --------------------------------------------------------------------------------------------------

    def prepare_data(self, datasets, target, accelerator, collate_fn):
        if self.settings.type == "eagle3" or self.settings.draft_vocab_size is not None:
            model = target.model
            vocab = count_draft_vocab(datasets["train"], self.settings.eagle_config(model).vocab_size, self.settings,
                                      self.settings.type, accelerator)
            self.settings.draft_vocab_size = vocab.size
            self.d2t, self.draft_vocab_coverage = vocab.d2t, vocab.coverage
        if self.features.online:
            return datasets["train"], datasets.get("eval"), collate_fn
        layer_ids = self._layer_ids(target.model)
        extract = hidden_states_extract(target.model, layer_ids, self.features.dtype)
        return self.features.open_store(datasets, target, accelerator, collate_fn, extract,
                                        {"fields": hidden_states_fields(layer_ids)})

    def store_target_layers(self) -> list[int] | None:
        """From a store, the training reads the target's embeddings, final norm (the draft norms' start) and LM head
        (eagle's logits, the teacher's, eagle3's draft LM head rows), and the layer heads.init_layer_from copies."""
        if self.features.online:
            return None
        return [] if self.settings.init_layer_from is None else [int(self.settings.init_layer_from)]

    def _layer_ids(self, model: nn.Module) -> list[int] | None:
        """The target layers eagle3 fuses (None for eagle)."""
        return self.settings.eagle_config(model).layer_ids if self.settings.type == "eagle3" else None

    def build_module(self, target) -> nn.Module:
        """The EAGLE drafter (fp32, on the target's device) inside its training module. eagle3 without a counted
        draft vocabulary (prepare_data not run) starts with the first draft_vocab_size ids."""
        model = target.model
        drafter = EagleHeads(self.settings.eagle_config(model), model, d2t=self.d2t)
        drafter.to(device=model.get_input_embeddings().weight.device, dtype=torch.float32)
        return self.wrap_module(drafter, target)

    def wrap_module(self, drafter: nn.Module, target) -> nn.Module:
        """The training module around ``drafter`` (a built or loaded EagleHeads)."""
        self._draft_vocab_of = drafter.target_to_draft  # the labels count_items reads, in the drafter's vocabulary
        return EagleTrainModule(drafter, self.weights, self.settings.unroll_steps, self.settings.feature_noise)

    # --- loss ---------------------------------------------------------------------------------------------------

    def _target_outputs(self, batch: dict, target, layer_ids: list[int] | None, core: nn.Module):
        """(hidden states indexable by layer id and -1, the target's logits or None): the hidden states of an online
        forward of the decoder stack, or of the feature store; the logits a function (b, p) -> [N, V] (float32)
        applying the LM head (soft-capped as the target's logits are) to the rows the loss trains on only (not a
        [B, T, V] tensor over every position)."""
        model = target.model
        need_logits = self.weights.token > 0 and self.weights.token_loss == "kl"
        hidden_states = target_hidden_states(model, batch, layer_ids)  # the LM head runs below on trained rows alone
        lm_head, hidden = model.get_output_embeddings(), hidden_states[-1]
        head = lm_head
        if self.weights.teacher_vocab == "draft" and core.has_draft_vocab:  # the draft vocabulary's rows alone
            head = self._draft_rows_head(lm_head, core)

        def logits(b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:  # only the rows the loss trains on
            with torch.no_grad():
                return rows_through(lambda r: output_logits(model.config, head(r)),
                                    hidden[b, p].to(lm_head.weight.dtype)).float()

        return hidden_states, logits if need_logits else None

    def _draft_rows_head(self, lm_head: nn.Module, core: EagleHeads):
        """F.linear over the LM head's rows of the drafter's draft vocabulary, from the drafter's own gather
        (:meth:`EagleHeads.draft_rows`: once per run, again when the head or the map changes)."""
        weight, bias = core.draft_rows(lm_head)
        if self._draft_head is None or self._draft_head[0] is not weight:
            self._draft_head = (weight, functools.partial(F.linear, weight=weight, bias=bias))
        return self._draft_head[1]

    def count_items(self, batch: dict) -> torch.Tensor:
        """Positions each unrolled step trains at, [unroll_steps] (selfspec.heads.eagle_loss.step_counts)."""
        draft_labels = self._draft_vocab_of(batch["labels"])
        return step_counts(draft_labels, self.settings.unroll_steps, batch.get("segment_ids"))

    def compute_loss(self, batch: dict, target, drafter: nn.Module, num_items: torch.Tensor):
        core = unwrap(drafter).drafter
        layer_ids = core.config.layer_ids if core.variant == "eagle3" else None
        hidden_states, logits = self._target_outputs(batch, target, layer_ids, core)
        loss, metrics = drafter(hidden_states, logits, batch["input_ids"], batch["labels"], batch["attention_mask"],
                                num_items, batch.get("segment_ids"), batch.get("position_ids"))
        return loss, {k: v for k, v in metrics.items() if not k.startswith(("count_", "loss"))}

    # --- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, loader, target, drafter: nn.Module, accelerator) -> dict[str, float]:
        """Per unrolled step: top-1 agreement with the target (acc) and the token loss, over the eval split; and the
        accepted length of a chain that implies. Sums are reduced over ranks (padding duplicates included)."""
        steps = self.settings.unroll_steps
        totals = torch.zeros(3, steps, dtype=torch.float64, device=accelerator.device)  # hits, count, loss*count
        core = unwrap(drafter).drafter
        layer_ids = core.config.layer_ids if core.variant == "eagle3" else None
        for batch in loader:
            hidden_states, logits = self._target_outputs(batch, target, layer_ids, core)
            _, metrics = drafter(hidden_states, logits, batch["input_ids"], batch["labels"], batch["attention_mask"],
                                 self.count_items(batch), batch.get("segment_ids"), batch.get("position_ids"))
            for j in range(steps):
                n = metrics[f"count_{j}"]
                token = float(metrics.get(f"token_{j}", 0.0)) \
                    + self.weights.regression * float(metrics.get(f"regression_{j}", 0.0))
                totals[:, j] += torch.tensor([float(metrics[f"acc_{j}"]) * n, n, token * n], dtype=torch.float64,
                                             device=accelerator.device)
        totals = accelerator.reduce(totals, reduction="sum")
        acc = (totals[0] / totals[1].clamp(min=1)).tolist()
        losses = (totals[2] / totals[1].clamp(min=1)).tolist()

        metrics_out = {f"eval/acc_step{j}": acc[j] for j in range(steps)}
        metrics_out.update({f"eval/loss_step{j}": losses[j] for j in range(steps)})
        metrics_out["eval/loss"] = sum(self.weights.step_decay**j * losses[j] for j in range(steps))
        metrics_out["eval/accept_length_chain"] = expected_accept_length(acc)
        metrics_out["eval/positions"] = float(totals[1, 0])
        return metrics_out

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, path: Path, drafter: nn.Module, target, meta: dict, state_dict: dict | None = None) -> Path:
        """The drafter as head type ``eagle`` / ``eagle3``, with its tree settings as decoding's defaults."""
        core = drafter.drafter if isinstance(drafter, EagleTrainModule) else drafter
        return save_run_heads(path, core, core.variant, target, meta, settings=self.settings,
                            features=self.features.kind, draft_vocab_coverage=self.draft_vocab_coverage,
                            decode=self.settings.tree,
                            state_dict=state_under(state_dict, "drafter."))
