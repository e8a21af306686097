"""Medusa training for :func:`selfspec.train.loop.train`: Medusa-1 (frozen target) and Medusa-2 (LoRA on the target, joint),
one method each (:class:`Medusa1Method`, :class:`Medusa2Method`), chosen by ``heads.type`` (:func:`medusa_method`).

Config (``cfg.heads``, conf/heads/medusa.yaml and medusa2.yaml):

- ``num_heads`` K, ``num_layers`` residual blocks per head, ``shared_lm_head`` (use the frozen target LM head instead
  of one trainable copy per head), ``decay``: head k's loss weight is decay**k.
- ``loss``: ``ce`` trains head k at position t on the data token t + k + 2; ``kl`` on the target's own distribution
  for that token (KL(target || head), self-distillation), at the same labelled positions.
- ``loss_vocab``: ``draft`` (with a draft vocabulary) computes the heads' logits, losses and accuracies over the
  draft vocabulary only, the LM-head rows decoding projects onto; a position whose token is outside it is skipped by
  the loss (no draft could propose it) and counted as a miss by the accuracies; the KL teacher is the target's
  distribution renormalised over the same tokens. ``full``: the whole vocabulary.
- Medusa-2 (``type: medusa2``): a peft LoRA on the target (``lora``) trained with the heads; the target keeps its
  language-model objective (``target_loss: lm``, cross-entropy on the data) or stays close to the adapter-free model
  (``target_loss: kl``), weighted ``target_loss_weight``; the heads' loss is weighted ``heads_loss_weight`` and their
  learning rate is ``heads_lr_multiplier`` times the LoRA's. The adapter is saved in the heads folder.

Hidden states come from the target during training (``features: online``) or, for Medusa-1, from an offline feature
store (``features: store``, see selfspec.train.feature_store): both train the same thing. The store keeps the last hidden
states and, for ``loss: kl``, the target's top ``feature_store.teacher_topk`` logits per position (the teacher
distribution is renormalised over them; with topk = vocabulary size it is exact).

Losses are sums over label positions divided by the global count per head (``count_items``), so a step's gradient does
not depend on how the batch is split over processes and micro-batches. The evaluation's metrics are
selfspec.train.medusa_eval's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from selfspec.core.archs import attention_linear_names, output_logits
from selfspec.core.errors import SettingError
from selfspec.heads.medusa import (
    MedusaConfig,
    MedusaHeads,
    medusa_head_losses,
    medusa_positions,
    to_draft_ids,
    weighted_head_loss,
)
from selfspec.train.config import settings_from_cfg
from selfspec.train.data import (IGNORE_INDEX, collate, count_draft_vocab, draft_vocab_problems, position_ids_from_mask,
                                 target_inputs)
from selfspec.train.feature_store import FeatureSource, hidden_states_extract
from selfspec.train.medusa_eval import eval_summary, medusa_eval_metrics
from selfspec.train.method import TrainMethod, save_run_heads, state_under, unwrap

TEACHER_FILL = -1e30  # logit of the tokens outside a stored top-k: probability 0, and finite so KL stays finite


@dataclass
class MedusaSettings:
    """``cfg.heads``. The defaults are in conf/heads/medusa.yaml and medusa2.yaml only; the Medusa-2 fields are None
    under Medusa-1 (medusa.yaml does not set them)."""

    type: str  # medusa | medusa2
    num_heads: int
    num_layers: int
    shared_lm_head: bool
    decay: float
    loss: str  # ce | kl
    draft_vocab_size: int | str | None  # decoding drafts from these many most frequent tokens; auto: by coverage
    draft_vocab_coverage: float | None
    loss_vocab: str  # draft | full
    # Medusa-2 only
    lora: dict | None = None
    target_loss: str | None = None  # lm | kl
    target_loss_weight: float | None = None
    heads_loss_weight: float | None = None
    heads_lr_multiplier: float | None = None

    @classmethod
    def from_cfg(cls, cfg: Any) -> "MedusaSettings":
        out = settings_from_cfg(cls, cfg)
        problems = []
        if out.type not in METHODS:
            problems.append(f"heads.type={out.type!r}: use medusa or medusa2")
        if out.loss not in ("ce", "kl"):
            problems.append(f"heads.loss={out.loss!r}: use ce or kl")
        if out.loss_vocab not in ("draft", "full"):
            problems.append(f"heads.loss_vocab={out.loss_vocab!r}: use draft or full")
        if out.num_heads < 1 or out.num_layers < 1:
            problems.append("heads.num_heads and heads.num_layers must be >= 1")
        problems += draft_vocab_problems(out.draft_vocab_size, out.draft_vocab_coverage)
        if out.type == "medusa2":
            problems += out._medusa2_problems()
        if problems:
            raise SettingError("; ".join(problems) + ".")
        return out

    def _medusa2_problems(self) -> list[str]:
        problems = []
        if not self.lora:
            problems.append("heads=medusa2 needs heads.lora (r, alpha, dropout, target_modules)")
        if self.target_loss not in ("lm", "kl"):
            problems.append(f"heads.target_loss={self.target_loss!r}: use lm or kl")
        unset = [k for k in ("target_loss_weight", "heads_loss_weight", "heads_lr_multiplier")
                 if getattr(self, k) is None]
        if unset:
            problems.append(f"heads=medusa2 needs heads.{', heads.'.join(unset)} (conf/heads/medusa2.yaml)")
        return problems


# --- shared pieces: hidden states, teachers, the heads' loss ------------------------------------------------------


def _dtype(module: nn.Module, default: torch.Tensor) -> torch.dtype:
    param = next(module.parameters(), None)
    return param.dtype if param is not None else default.dtype


def last_hidden_state(causal_lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden state the LM head reads (after the final norm), [B, T, H], without computing logits. A padded
    batch gives its attention_mask (positions follow from it); a packed one no mask and its restarting position_ids
    (selfspec.train.data.target_inputs)."""
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.base_model
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def batch_hidden_state(causal_lm: nn.Module, batch: dict) -> torch.Tensor:
    """:func:`last_hidden_state` over a collated batch, padded or packed."""
    return last_hidden_state(causal_lm, batch["input_ids"], **target_inputs(batch))


def lm_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, T] -> (flat index [M] of positions t whose next label t + 1 is valid, those labels [M])."""
    nxt = torch.full_like(labels, IGNORE_INDEX)
    nxt[:, :-1] = labels[:, 1:]
    nxt = nxt.flatten()
    index = (nxt != IGNORE_INDEX).nonzero().squeeze(-1)
    return index, nxt[index]


def head_rows(per_position: torch.Tensor, head_index: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [P, ...] of every flat position -> [K, N, ...] for the heads at ``head_index`` [N]: head k at position t
    reads row t + k + 1, the target's prediction of token t + k + 2 (clamped at the last row: no target there)."""
    last = per_position.shape[0] - 1
    return torch.stack([per_position[(head_index + k + 1).clamp(max=last)] for k in range(num_heads)])


def stored_teacher(batch: dict, head_index: torch.Tensor, num_heads: int, vocab_size: int,
                   token_map: torch.Tensor | None) -> torch.Tensor:
    """The heads' teacher logits [K, N, V] (V' over ``token_map``) from a feature store's top-k logits: the stored
    values at their ids, ``TEACHER_FILL`` elsewhere (stored ids outside the draft vocabulary are dropped)."""
    ids = batch["teacher_topk_ids"].flatten(0, 1).long()  # [B*T, k]
    vals = batch["teacher_topk_logits"].flatten(0, 1).float()
    if token_map is not None:  # stored ids outside the draft vocabulary go to one extra column, dropped
        vocab_size = int(token_map.numel())
        ids = to_draft_ids(ids, token_map)
        ids = torch.where(ids < 0, vocab_size, ids)
    ids, vals = head_rows(ids, head_index, num_heads), head_rows(vals, head_index, num_heads)  # [K, N, k]
    full = torch.full((*ids.shape[:2], vocab_size + 1), TEACHER_FILL, device=vals.device)
    return full.scatter_(2, ids, vals)[..., :vocab_size]


def heads_step_loss(head_logits: torch.Tensor, head_targets: torch.Tensor, loss_targets: torch.Tensor,
                    teacher: torch.Tensor | None, num_items: torch.Tensor, decay: float
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The heads' loss of a micro-batch and its metrics. head_logits [K, N, V or V']; head_targets [K, N] target ids;
    loss_targets [K, N] the ids the loss reads (draft-vocabulary columns, -100 outside it); teacher [K, N, V'] or
    None (cross-entropy); num_items [K] the step's global counts (the heads' ``count_items`` over the step).
    The loss is sum_k decay**k * loss_sum_k / num_items_k."""
    num_heads = head_logits.shape[0]
    loss_sum, count = medusa_head_losses(head_logits, loss_targets, teacher)
    loss = weighted_head_loss(loss_sum / num_items.clamp(min=1).to(loss_sum.dtype), decay)
    metrics = {f"loss_head{k}": (loss_sum[k] / count[k].clamp(min=1)).detach() for k in range(num_heads)}
    labelled = (head_targets != IGNORE_INDEX).sum(-1)  # a token outside the draft vocabulary is a miss
    correct = ((head_logits.detach().argmax(-1) == loss_targets) & (loss_targets != IGNORE_INDEX)).sum(-1)
    metrics.update({f"acc1_head{k}": correct[k].float() / labelled[k].clamp(min=1) for k in range(num_heads)})
    return loss, metrics


# --- the methods --------------------------------------------------------------------------------------------------


class MedusaMethod(TrainMethod):
    """What Medusa-1 and Medusa-2 share: the heads, their draft vocabulary, the heads' loss, evaluation and save.
    A variant builds its drafter and says where the heads' inputs come from (:meth:`head_logits`)."""

    supports_packing = True  # targets stay within an example (segment_ids); the target reads packed rows through
    # transformers' packed-sequence masks

    def __init__(self, cfg: Any):
        self.settings = MedusaSettings.from_cfg(cfg.heads)
        if not isinstance(self, METHODS[self.settings.type]):
            raise ValueError(f"{type(self).__name__} does not train heads.type={self.settings.type}: build the method "
                             "with selfspec.train.medusa_method.medusa_method(cfg), which picks it by heads.type.")
        self.name = self.settings.type
        self.features = FeatureSource.from_cfg(cfg)
        if not self.features.online and self.settings.loss == "kl" and not self.features.settings.get("teacher_topk"):
            raise SettingError("heads.loss=kl with features=store needs the target's logits in the store: set "
                               "feature_store.teacher_topk (e.g. 64), or use features=online.")
        self.token_map: torch.Tensor | None = None  # the draft vocabulary, counted in prepare_data
        self.draft_vocab_coverage: float | None = None

    @property
    def reduced(self) -> bool:
        """Losses over the draft vocabulary (``loss_vocab: draft`` and a token map)."""
        return self.settings.loss_vocab == "draft" and self.token_map is not None

    def head_logits(self, batch: dict, target, drafter: nn.Module, head_index: torch.Tensor) -> torch.Tensor:
        """The heads' logits [K, N, V] (V' over the draft vocabulary when :attr:`reduced`) at ``head_index``."""
        raise NotImplementedError

    def _positions(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(head_index [N], head_targets [K, N] target ids, the ids the loss reads [K, N])."""
        head_index, head_targets = medusa_positions(batch["labels"], self.settings.num_heads,
                                                    batch.get("segment_ids"))
        loss_targets = to_draft_ids(head_targets, self.token_map) if self.reduced else head_targets
        return head_index, head_targets, loss_targets

    def _heads_forward(self, heads: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> the heads' logits [K, N, V or V']."""
        return heads(hidden.to(_dtype(heads, hidden)), draft_vocab=self.reduced)

    # --- setup --------------------------------------------------------------------------------------------------

    def build_heads(self, target) -> MedusaHeads:
        s = self.settings
        lm_head = target.model.get_output_embeddings()
        config = MedusaConfig(hidden_size=target.model.config.hidden_size, vocab_size=lm_head.weight.shape[0],
                              num_heads=s.num_heads, num_layers=s.num_layers, shared_lm_head=s.shared_lm_head,
                              draft_vocab_size=None if self.token_map is None else int(self.token_map.numel()))
        heads = MedusaHeads(config, lm_head).to(device=lm_head.weight.device, dtype=torch.float32)
        if self.token_map is not None:
            heads.set_token_map(self.token_map)
        return heads

    def prepare_data(self, datasets, target, accelerator, collate_fn):
        if self.settings.draft_vocab_size is not None:
            size = target.model.get_output_embeddings().weight.shape[0]
            vocab = count_draft_vocab(datasets["train"], size, self.settings, "medusa", accelerator)
            if vocab.size < size:  # none when it would be the whole vocabulary
                self.token_map, self.draft_vocab_coverage = vocab.token_map, vocab.coverage
        if self.features.online:
            return datasets["train"], datasets.get("eval"), collate_fn
        dtype, topk, model = self.features.dtype, int(self.features.settings.get("teacher_topk") or 0), target.model
        if not topk:  # the last hidden state alone: what any engine of the store computes
            return self.features.open_store(datasets, target, accelerator, collate_fn,
                                            hidden_states_extract(model, None, dtype),
                                            {"teacher_topk": topk, "fields": "medusa-last-hidden"})

        def extract(batch):
            hidden = last_hidden_state(model, batch["input_ids"], batch["attention_mask"])  # [B, T, H]
            out = {"hidden": hidden.to(dtype)}
            if topk:
                logits = output_logits(model.config, model.get_output_embeddings()(hidden))  # [B, T, V]
                top = logits.float().topk(min(topk, logits.shape[-1]), dim=-1)
                out["teacher_topk_ids"] = top.indices.to(torch.int32)
                out["teacher_topk_logits"] = top.values.to(dtype)
            return out

        return self.features.open_store(datasets, target, accelerator, collate_fn, extract,
                                        {"teacher_topk": topk, "fields": "medusa-last-hidden"})

    # --- loss ---------------------------------------------------------------------------------------------------

    def count_items(self, batch: dict) -> torch.Tensor:
        """Label positions per head [K] that the loss reads."""
        _, _, loss_targets = self._positions(batch)
        return (loss_targets != IGNORE_INDEX).sum(-1)

    # --- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, loader, target, drafter: nn.Module, accelerator) -> dict[str, float]:
        """Per-head top-1/top-5 accuracy and loss on the eval split, and the expected accepted length they imply."""
        return medusa_eval_metrics(loader, lambda batch, index: self.head_logits(batch, target, drafter, index),
                                   self.settings.num_heads, self.settings.decay, gather=accelerator.gather_for_metrics,
                                   token_map=self.token_map if self.reduced else None)

    # --- saving -------------------------------------------------------------------------------------------------

    def _save_heads(self, path: Path, heads: MedusaHeads, target, meta: dict, heads_state: dict | None,
                    adapter: nn.Module | None = None, adapter_state: dict | None = None) -> Path:
        """Medusa-1 and Medusa-2 heads (with Medusa-2's adapter) as head type ``medusa``."""
        return save_run_heads(path, heads, "medusa", target, meta, settings=self.settings, features=self.features.kind,
                            draft_vocab_coverage=self.draft_vocab_coverage,
                            eval_metrics=eval_summary(meta.get("eval", {}), self.settings.num_heads),
                            state_dict=heads_state, adapter=adapter, adapter_state_dict=adapter_state)


class Medusa1Method(MedusaMethod):
    """Medusa-1: the heads alone, on the frozen target's last hidden state (online, or from a feature store)."""

    def build_module(self, target) -> nn.Module:
        return self.build_heads(target)

    def store_target_layers(self) -> list[int] | None:
        """From a store, Medusa-1 reads the target's LM head (the heads' LM heads start from it, or share it) and
        its embeddings (the store's and the heads' fingerprint); no decoder layer."""
        return None if self.features.online else []

    def wrap_module(self, drafter: nn.Module, target) -> nn.Module:
        """Loaded heads as they are (Medusa-1 trains the heads module itself), with their draft vocabulary."""
        self.token_map = drafter.token_map
        return drafter

    def head_logits(self, batch: dict, target, drafter: nn.Module, head_index: torch.Tensor) -> torch.Tensor:
        return self._heads_forward(drafter, self._hidden(batch, target).flatten(0, 1)[head_index])

    def compute_loss(self, batch: dict, target, drafter: nn.Module, num_items: torch.Tensor):
        head_index, head_targets, loss_targets = self._positions(batch)
        hidden = self._hidden(batch, target)  # [B, T, H]
        head_logits = self._heads_forward(drafter, hidden.flatten(0, 1)[head_index])
        teacher = self._teacher(batch, target, hidden, head_index) if self.settings.loss == "kl" else None
        return heads_step_loss(head_logits, head_targets, loss_targets, teacher, num_items, self.settings.decay)

    def _hidden(self, batch: dict, target) -> torch.Tensor:
        if "hidden" in batch:  # from the feature store
            return batch["hidden"]
        with torch.no_grad():
            return batch_hidden_state(target.model, batch)

    def _teacher(self, batch: dict, target, hidden: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
        """The target's logits for each head's token at each position: [K, N, V] (head k at t: logits at t+k+1);
        over the draft vocabulary, [K, N, V'], when the losses are (a softmax over them renormalises)."""
        token_map = self.token_map if self.reduced else None
        lm_head = target.model.get_output_embeddings()
        with torch.no_grad():
            if "teacher_topk_ids" in batch:
                return stored_teacher(batch, head_index, self.settings.num_heads, lm_head.weight.shape[0], token_map)
            flat = hidden.flatten(0, 1).to(lm_head.weight.dtype)
            if token_map is not None:
                logits = F.linear(flat, lm_head.weight[token_map.to(flat.device)])
            else:
                logits = lm_head(flat)
            return head_rows(output_logits(target.model.config, logits), head_index, self.settings.num_heads)

    def save(self, path: Path, drafter: nn.Module, target, meta: dict, state_dict: dict | None = None) -> Path:
        return self._save_heads(path, drafter, target, meta, state_dict)


class Medusa2Model(nn.Module):
    """The target with LoRA (a peft model) and the heads, trained together; one forward for DDP."""

    def __init__(self, target: nn.Module, heads: MedusaHeads):
        super().__init__()
        self.target = target
        self.heads = heads

    def base_causal_lm(self) -> nn.Module:
        return self.target.get_base_model()

    def forward(self, input_ids, attention_mask, head_index, lm_index, draft_vocab: bool = False, position_ids=None):
        """input_ids, attention_mask [B, T]; head_index [N], lm_index [M] flat positions; position_ids [B, T] of a
        packed batch (attention_mask None). Returns (head_logits [K, N, V] (V' with ``draft_vocab``),
        lm_logits [M, V])."""
        causal_lm = self.base_causal_lm()
        hidden = last_hidden_state(causal_lm, input_ids, attention_mask, position_ids).flatten(0, 1)  # LoRA active
        head_logits = self.heads(hidden[head_index].to(_dtype(self.heads, hidden)), draft_vocab=draft_vocab)
        lm_logits = output_logits(causal_lm.config, causal_lm.get_output_embeddings()(hidden[lm_index]))
        return head_logits, lm_logits


class Medusa2Method(MedusaMethod):
    """Medusa-2: the heads and a LoRA on the target, trained jointly; the target keeps its own objective."""

    trains_target = True  # its LoRA: the target keeps its own dtype (trainer.target_dtype=auto)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        if not self.features.online:
            raise SettingError("heads=medusa2 trains LoRA inside the target, so its hidden states change every step "
                               "and cannot come from a feature store: use features=online.")

    def build_module(self, target) -> nn.Module:
        # deferred: peft (slow to import) only for Medusa-2's LoRA
        from peft import LoraConfig, get_peft_model

        heads = self.build_heads(target)
        lora = dict(self.settings.lora or {})
        peft_config = LoraConfig(
            r=int(lora.get("r", 8)), lora_alpha=float(lora.get("alpha", 16)),
            lora_dropout=float(lora.get("dropout", 0.0)),
            target_modules=lora_target_modules(target.model, lora.get("target_modules")),
            bias="none", task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(target.model, peft_config)
        peft_model.train()
        return Medusa2Model(peft_model, heads)

    def param_groups(self, drafter: nn.Module, lr: float) -> list[dict]:
        heads = [p for p in drafter.heads.parameters() if p.requires_grad]
        head_ids = {id(p) for p in heads}
        lora = [p for p in drafter.target.parameters() if p.requires_grad and id(p) not in head_ids]
        return [{"params": lora, "lr": lr}, {"params": heads, "lr": lr * self.settings.heads_lr_multiplier}]

    def count_items(self, batch: dict) -> torch.Tensor:
        """Label positions per head, then those of the target's own loss: [K + 1]."""
        lm_count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().reshape(1)
        return torch.cat([super().count_items(batch), lm_count])

    def head_logits(self, batch: dict, target, drafter: nn.Module, head_index: torch.Tensor) -> torch.Tensor:
        return self._forward(batch, drafter, head_index)[0]

    def compute_loss(self, batch: dict, target, drafter: nn.Module, num_items: torch.Tensor):
        """num_items [K + 1]: the heads' counts, then the target loss's (:meth:`count_items`)."""
        s = self.settings
        head_index, head_targets, loss_targets = self._positions(batch)
        head_logits, lm_logits = self._forward(batch, drafter, head_index)
        base = self._adapter_free_logits(batch, drafter) if "kl" in (s.loss, s.target_loss) else None  # [B*T, V]
        teacher = None
        if s.loss == "kl":
            columns = base[:, self.token_map.to(base.device)] if self.reduced else base
            teacher = head_rows(columns, head_index, s.num_heads)
        heads_loss, metrics = heads_step_loss(head_logits, head_targets, loss_targets, teacher,
                                              num_items[: s.num_heads], s.decay)
        lm_index, lm_targets = lm_positions(batch["labels"])
        if s.target_loss == "lm":
            lm_sum = F.cross_entropy(lm_logits.float(), lm_targets, reduction="sum")
        else:
            lm_sum = F.kl_div(F.log_softmax(lm_logits.float(), -1), F.log_softmax(base[lm_index].float(), -1),
                              log_target=True, reduction="sum")
        lm_count = torch.as_tensor(lm_targets.numel(), device=lm_logits.device)
        lm_denom = num_items[-1].clamp(min=1).to(lm_sum.dtype)
        metrics["loss_target"] = (lm_sum / lm_count.clamp(min=1)).detach()
        metrics["loss_heads"] = heads_loss.detach()
        return s.target_loss_weight * lm_sum / lm_denom + s.heads_loss_weight * heads_loss, metrics

    def _forward(self, batch: dict, drafter: nn.Module, head_index: torch.Tensor):
        """(head_logits [K, N, V or V'], lm_logits [M, V]): one forward of the adapted target and the heads."""
        lm_index, _ = lm_positions(batch["labels"])
        inputs = target_inputs(batch)
        return drafter(batch["input_ids"], inputs["attention_mask"], head_index, lm_index, draft_vocab=self.reduced,
                       position_ids=inputs["position_ids"])

    @staticmethod
    def _adapter_free_logits(batch: dict, drafter: nn.Module) -> torch.Tensor:
        """The target's logits without its adapter at every position, [B*T, V]: the teachers of the KL losses."""
        base = unwrap(drafter)
        with torch.no_grad(), base.target.disable_adapter():
            causal_lm = base.base_causal_lm()
            hidden = batch_hidden_state(causal_lm, batch).flatten(0, 1)
            return output_logits(causal_lm.config, causal_lm.get_output_embeddings()(hidden))

    def save(self, path: Path, drafter: nn.Module, target, meta: dict, state_dict: dict | None = None) -> Path:
        return self._save_heads(path, drafter.heads, target, meta, state_under(state_dict, "heads."), drafter.target,
                                state_under(state_dict, "target."))


def lora_target_modules(model: nn.Module, setting: Any) -> list[str]:
    """``heads.lora.target_modules``: ``auto``, every linear layer of the target's attention (selfspec.core.archs:
    q/k/v/o, Phi-3's fused qkv_proj, DeepSeek-V3's low-rank MLA projections), or a list of module names, each of
    which must name linear layers of the target (peft would silently adapt only those of a list that exist)."""
    attention = attention_linear_names(model)
    if setting in (None, "auto"):
        if not attention:
            raise SettingError(f"heads.lora.target_modules=auto adapts the linear layers of the target's attention, "
                               f"but {type(model).__name__}'s decoder layers have no attention module with linear "
                               "layers: name the modules to adapt (heads.lora.target_modules=[...]).")
        return attention
    names = [setting] if isinstance(setting, str) else [str(n) for n in setting]
    linears = {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [n for n in names if n not in linears]
    if missing or not names:
        raise SettingError(f"heads.lora.target_modules={names}: {missing or 'nothing'} is not a linear layer of this "
                           f"target ({model.config.model_type}, whose attention has {attention}); use auto or names "
                           "from those.")
    return names


METHODS: dict[str, type[MedusaMethod]] = {"medusa": Medusa1Method, "medusa2": Medusa2Method}


def medusa_method(cfg: Any) -> MedusaMethod:
    """The method ``cfg.heads.type`` names: Medusa-1 (``medusa``) or Medusa-2 (``medusa2``)."""
    kind = cfg.heads.type
    if kind not in METHODS:
        raise SettingError(f"heads.type={kind!r}: train/medusa.py trains medusa or medusa2 (heads=medusa|medusa2).")
    return METHODS[kind](cfg)


def evaluate_heads(heads: nn.Module, target_model: nn.Module, dataset, pad_token_id: int, batch_size: int = 8,
                   decay: float = 0.8) -> dict[str, float]:
    """Accuracy metrics of Medusa heads (e.g. ``heads.load(path, target).module``) on a tokenized dataset split,
    in one process; hidden states come from ``target_model`` (with a Medusa-2 adapter merged, if any)."""
    device = next(target_model.parameters()).device
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        collate_fn=lambda examples: collate(examples, pad_token_id))

    def head_logits_of(batch, head_index):
        hidden = last_hidden_state(target_model, batch["input_ids"], batch["attention_mask"])
        return heads(hidden.flatten(0, 1)[head_index].to(_dtype(heads, hidden)))

    batches = ({k: v.to(device) for k, v in b.items()} for b in loader)
    return medusa_eval_metrics(batches, head_logits_of, heads.config.num_heads, decay)
