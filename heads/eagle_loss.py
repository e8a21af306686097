"""The EAGLE drafters' training losses (heads/eagle.py's :class:`EagleHeads`), pure functions over the frozen
target's outputs: feature regression (EAGLE-1), KL to the target's distribution or cross-entropy on tokens, over
unrolled test-time steps in which the draft reads its own previous output feature."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
from torch.nn import functional as F

from selfspec.core.layers import shift_left
from selfspec.heads.eagle import EagleHeads
from selfspec.core.errors import SettingError
from selfspec.core.runtime import rows_through

def add_uniform_noise(x: torch.Tensor, scale: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """x + U(-scale, scale) noise (EAGLE's input-feature noise for robustness to its own errors)."""
    if scale <= 0:
        return x
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return x + ((noise * 2 - 1) * scale).to(x.dtype)


def feature_regression_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 between features [B, T, H], mean over H and over positions where mask [B, T] is true."""
    per_pos = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    mask = mask.to(per_pos.dtype)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def token_kl_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) per position [B, T] (logits [B, T, V]), averaged where mask is true."""
    kl = F.kl_div(
        F.log_softmax(logits.float(), -1), F.log_softmax(teacher_logits.float(), -1), log_target=True, reduction="none"
    ).sum(-1)
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def token_ce_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [B, T, V] against labels [B, T] (-100 ignored), averaged where mask is true."""
    valid = mask.bool() & (labels != -100)
    ce = F.cross_entropy(logits.float().transpose(1, 2), labels.clamp(min=0), reduction="none")  # [B, T]
    valid_f = valid.to(ce.dtype)
    return (ce * valid_f).sum() / valid_f.sum().clamp(min=1)


@dataclass
class EagleLossWeights:
    regression: float = 1.0  # smooth-L1 on features (EAGLE-1: 1.0; eagle3 has no feature target: 0)
    token: float = 0.1  # KL / CE on logits (EAGLE-1: 0.1; EAGLE-3: 1.0)
    step_decay: float = 0.8  # weight of unrolled step j is step_decay ** j
    token_loss: str = "kl"  # "kl" to the target's distribution, or "ce" on the data's tokens
    # eagle3's teacher with token_loss=kl: "full" runs the target's whole LM head on each trained row and also skips
    # rows whose target top token is outside the draft vocabulary; "draft" runs only the draft vocabulary's rows of
    # the LM head (the same softmax over the draft tokens, V / Vd times cheaper) and trains on every row whose data
    # token is a draft token
    teacher_vocab: str = "full"

    def __post_init__(self):
        if self.token_loss not in ("kl", "ce"):
            raise SettingError(f"token_loss must be 'kl' or 'ce', got {self.token_loss!r}")
        if self.teacher_vocab not in ("full", "draft"):
            raise SettingError(f"heads.loss.teacher_vocab must be 'full' or 'draft', got {self.teacher_vocab!r}")


TeacherLogits = Union[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _teacher_rows(teacher_logits: TeacherLogits, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Rows (b, p) of the target's logits: a [B, T, V] tensor indexed, or a function (b, p) -> [N, V] called."""
    return teacher_logits(b, p) if callable(teacher_logits) else teacher_logits[b, p]


def _scored_at(b: torch.Tensor, p: torch.Tensor, step: int, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """[N] bool: the teacher rows (b, p) unrolled step ``step`` is scored at: its feature index t = p - step - 1
    exists and, in a packed batch (``segment_ids``), lies in the example of the drafted token p + 1."""
    keep = p >= step + 1
    if segment_ids is not None:
        keep = keep & (segment_ids[b, (p - step - 1).clamp(min=0)] == segment_ids[b, p + 1])
    return keep


def step_counts(draft_labels: torch.Tensor, unroll_steps: int, segment_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Positions each unrolled step is trained at, [unroll_steps], from the labels alone (draft ids, -100 where not
    trained): the items a step's loss terms are normalised by over a whole optimizer step (``num_items`` of
    :func:`drafter_loss`). EAGLE-3's KL loss further skips the positions whose target top token is outside the draft
    vocabulary; they stay counted, as items with no loss."""
    b, p = (shift_left(draft_labels, 1, fill=-100) != -100).nonzero(as_tuple=True)
    return torch.stack([_scored_at(b, p, j, segment_ids).sum() for j in range(unroll_steps)])


def _loss_at(
    b: torch.Tensor,
    p: torch.Tensor,
    step_features: list[torch.Tensor],
    step_logits: list[torch.Tensor] | Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    weights: EagleLossWeights,
    target_features: torch.Tensor | None,
    teacher: torch.Tensor | None,
    num_items: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The unrolled loss over the positions it trains on, given as teacher rows (b, p) [N] (sample, position of the
    feature / teacher row a draft step predicts; its drafted token is labels[b, p + 1]) with ``teacher`` [N, V'] the
    target's logits there. Step j reads index t = p - j - 1 of its features (where t >= 0), so each step's logits
    are computed only at the positions it is scored on. With ``segment_ids`` (a packed batch) step j is scored only
    where index t and the drafted token p + 1 lie in the same example. Each loss term of step j is a sum over its
    positions divided by ``num_items[j]`` ([steps]: :func:`step_counts` summed over an optimizer step; computed as
    the mean times count / num_items[j]). The metrics are means over this batch and stay on the device (scalar
    tensors; ``count_j``, a shape, is a float), so a training step does not wait for them."""
    total = step_features[0].new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor | float] = {}
    for j, feat in enumerate(step_features):
        keep = _scored_at(b, p, j, segment_ids)
        bj, pj = b[keep], p[keep]
        tj = pj - j - 1
        if callable(step_logits):
            logits = rows_through(step_logits, feat[bj, tj])  # [N_j, V']
        else:
            logits = step_logits[j][bj, tj]
        label_j = labels[bj, pj + 1]
        count = int(bj.numel())
        ones = torch.ones(count, dtype=torch.bool, device=feat.device)
        teacher_j = teacher[keep] if teacher is not None else None
        step_loss = total.new_zeros(())
        if weights.regression > 0:
            reg = feature_regression_loss(feat[bj, tj], target_features[bj, pj], ones)
            step_loss = step_loss + weights.regression * reg
            metrics[f"regression_{j}"] = reg.detach()
        if weights.token > 0:
            if weights.token_loss == "kl":
                tok = token_kl_loss(logits, teacher_j, ones)
            else:
                tok = token_ce_loss(logits.unsqueeze(0), label_j.unsqueeze(0), ones.unsqueeze(0))
            step_loss = step_loss + weights.token * tok
            metrics[f"token_{j}"] = tok.detach()
        reference = teacher_j.argmax(-1) if teacher_j is not None else label_j
        metrics[f"acc_{j}"] = (logits.argmax(-1) == reference).sum().double() / max(count, 1)
        metrics[f"count_{j}"] = float(count)
        if count == 0:  # nothing to learn in this batch: keep every parameter in the graph (DDP expects it)
            first = feat[:, :1]
            extra = step_logits(first).sum() if callable(step_logits) else step_logits[j].sum()
            step_loss = step_loss + (extra + first.sum()) * 0.0
        step_loss = step_loss * (count / num_items[j].clamp(min=1)).to(step_loss.dtype)  # the sum over the count
        total = total + (weights.step_decay**j) * step_loss
    metrics["loss"] = total.detach()
    return total, metrics


def eagle_loss(
    step_features: list[torch.Tensor],
    step_logits: list[torch.Tensor],
    labels: torch.Tensor,
    weights: EagleLossWeights,
    target_features: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    teacher_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Loss of an unrolled draft forward; returns (loss, metrics).

    step_features / step_logits: per step j, [B, T, H] / [B, T, V'] where index t predicts feature t+j+1 and token
    t+j+2. labels [B, T]: the data's tokens in the draft's id space (-100 = not trained on: not an assistant token,
    padding, or outside the draft vocabulary). target_features [B, T, H] (regression targets, feature t at index t)
    and teacher_logits [B, T, V'] (the target's logits, index t predicting token t+1) are optional;
    teacher_valid [B, T] marks teacher positions usable (eagle3: the target's top token is a draft token).
    Step j at index t is trained where labels[t+j+2] != -100 (the drafted token is an assistant token).
    Each loss term is a mean over the positions it is trained on (this batch is the whole step: its own counts are
    the ``num_items``); metrics hold per step the loss terms, ``acc_j`` (top-1 agreement with the teacher, or with
    the labels without one) and ``count_j`` (positions).
    """
    _check_loss_inputs(weights, target_features, teacher_logits)
    trained = shift_left(labels, 1, fill=-100) != -100  # teacher row p is used when token p + 1 is trained on
    if teacher_logits is not None and teacher_valid is not None:
        trained = trained & teacher_valid
    b, p = trained.nonzero(as_tuple=True)
    teacher = teacher_logits[b, p] if teacher_logits is not None else None
    counts = torch.stack([_scored_at(b, p, j, None).sum() for j in range(len(step_features))])  # [steps]
    return _loss_at(b, p, step_features, step_logits, labels, weights, target_features, teacher, counts)


def _check_loss_inputs(weights: EagleLossWeights, target_features, teacher_logits) -> None:
    if weights.regression > 0 and target_features is None:
        raise ValueError("regression weight > 0 needs target_features (eagle3 has none: set regression weight 0)")
    if weights.token_loss == "kl" and weights.token > 0 and teacher_logits is None:
        raise ValueError("token_loss='kl' needs teacher_logits (the target's logits); or use token_loss='ce'")


def drafter_loss(
    drafter: EagleHeads,
    hidden_states,
    target_logits: TeacherLogits | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    weights: EagleLossWeights,
    num_items: torch.Tensor,
    unroll_steps: int = 1,
    attention_mask: torch.Tensor | None = None,
    feature_noise: float = 0.0,
    generator: torch.Generator | None = None,
    segment_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The training loss of one batch, given the frozen target's forward over it (the same as :func:`eagle_loss`
    over the drafter's full logits, but the draft's and the target's vocabulary projections, the costliest part of a
    step, run only at the positions the loss is trained on: assistant tokens, no padding).

    hidden_states: the target's ``out.hidden_states`` (L + 1 tensors [B, T, H]); target_logits (needed for
    token_loss='kl'): the target's logits [B, T, V], or a function (b, p) -> [N, V] computing rows (b, p) only
    (e.g. the target's LM head over stored last hidden states); input_ids / labels / attention_mask [B, T] as
    collated (labels -100 off the assistant's tokens). Noise goes on the step-0 input features only; regression
    targets stay clean. A packed batch (selfspec.train.data.collate_packed) passes its ``segment_ids`` and ``position_ids``:
    the loss then equals the padded batch's over the same examples. ``num_items`` [unroll_steps]: the step's global
    :func:`step_counts` (summed over the optimizer step's micro-batches and ranks), which each step's loss terms are
    normalised by; a batch that is a whole step passes its own :func:`step_counts`.
    """
    use_teacher = target_logits is not None and weights.token_loss == "kl"
    _check_loss_inputs(weights, hidden_states[-1] if weights.regression > 0 else None,
                       target_logits if use_teacher else None)
    features = add_uniform_noise(drafter.target_features(hidden_states), feature_noise, generator)
    steps = drafter.unrolled_forward(features, input_ids, unroll_steps, key_padding=attention_mask,
                                     segment_ids=segment_ids, position_ids=position_ids)
    draft_labels = drafter.target_to_draft(labels)
    b, p = (shift_left(draft_labels, 1, fill=-100) != -100).nonzero(as_tuple=True)
    teacher = None
    if use_teacher:
        with torch.no_grad():
            teacher, in_vocab = drafter.teacher_logits(_teacher_rows(target_logits, b, p))
        if drafter.has_draft_vocab:
            b, p, teacher = b[in_vocab], p[in_vocab], teacher[in_vocab]
    regression_target = None
    if weights.regression > 0:
        if drafter.variant != "eagle":
            raise SettingError("eagle3 has no feature regression target: set heads.loss.regression=0.")
        regression_target = hidden_states[-1].to(steps[0].dtype)
    return _loss_at(b, p, steps, drafter.logits, draft_labels, weights, regression_target, teacher, num_items,
                    segment_ids)


