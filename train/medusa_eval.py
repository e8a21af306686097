"""Medusa heads' evaluation: per-head top-1/top-5 accuracy and loss over labelled positions, the accepted lengths
they imply, and their summary in a heads folder's config.json.

    metrics = medusa_eval_metrics(batches, head_logits_of, num_heads)   # e.g. selfspec.train.medusa_method.evaluate_heads
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from selfspec.heads.medusa import expected_accept_length, medusa_positions, medusa_topk_hits, to_draft_ids, weighted_head_loss
from selfspec.train.data import IGNORE_INDEX


def medusa_eval_metrics(batches, head_logits_of, num_heads: int, decay: float = 0.8, gather=None,
                        token_map: torch.Tensor | None = None) -> dict[str, float]:
    """Per-head top-1/top-5 accuracy and mean loss over the labelled positions of ``batches``, and the expected
    accepted lengths they imply (chain from top-1, full top-5 tree from top-5).

    ``head_logits_of(batch, head_index [N]) -> [K, N, V]``, or [K, N, V'] over the draft vocabulary ``token_map``:
    then a token outside it is a miss for the accuracies and left out of the loss. ``gather`` collects per-example
    sums from all processes (``accelerator.gather_for_metrics``, which also drops the duplicates even sharding adds),
    None in one process.
    """
    K = num_heads
    totals = None  # [5, K]: correct@1, correct@5, positions, loss sum, positions the loss reads
    for batch in batches:
        labels = batch["labels"]
        head_index, head_targets = medusa_positions(labels, K)  # [N], [K, N]
        targets = head_targets if token_map is None else to_draft_ids(head_targets, token_map)
        with torch.no_grad():
            head_logits = head_logits_of(batch, head_index)  # [K, N, V or V']
        loss = F.cross_entropy(head_logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="none").view(targets.shape)  # [K, N], 0 where ignored
        row = head_index // labels.shape[1]  # example of each position
        valid = (head_targets != IGNORE_INDEX).double()
        scored = (targets != IGNORE_INDEX).double()
        per_example = torch.zeros(labels.shape[0], 5, K, dtype=torch.float64, device=labels.device)
        hits1 = medusa_topk_hits(head_logits, targets, 1).double()
        hits5 = medusa_topk_hits(head_logits, targets, 5).double()
        for j, value in enumerate((hits1, hits5, valid, loss.double() * scored, scored)):
            per_example[:, j].index_add_(0, row, value.T)
        if gather is not None:
            per_example = gather(per_example)
        totals = per_example.sum(0) if totals is None else totals + per_example.sum(0)
    if totals is None:
        totals = torch.zeros(5, K, dtype=torch.float64)
    count = totals[2].clamp(min=1)
    acc1, acc5 = (totals[0] / count).tolist(), (totals[1] / count).tolist()
    losses = (totals[3] / totals[4].clamp(min=1)).tolist()
    metrics = {}
    for k in range(K):
        metrics[f"eval/acc1_head{k}"] = acc1[k]
        metrics[f"eval/acc5_head{k}"] = acc5[k]
        metrics[f"eval/loss_head{k}"] = losses[k]
    metrics["eval/loss"] = float(weighted_head_loss(torch.tensor(losses), decay))
    metrics["eval/accept_length_chain"] = expected_accept_length(acc1)
    metrics["eval/accept_length_top5_tree"] = expected_accept_length(acc5)
    metrics["eval/positions"] = float(totals[2, 0])
    return metrics


def eval_summary(metrics: dict[str, float], num_heads: int) -> dict[str, Any]:
    """Flat eval metrics -> the structured form written into the heads' config.json."""
    if not metrics:
        return {}
    get = lambda name: [metrics.get(f"eval/{name}_head{k}") for k in range(num_heads)]  # noqa: E731
    return {
        "acc1": get("acc1"),
        "acc5": get("acc5"),
        "loss": get("loss"),
        "expected_accept_length_chain": metrics.get("eval/accept_length_chain"),
        "expected_accept_length_top5_tree": metrics.get("eval/accept_length_top5_tree"),
        "positions": metrics.get("eval/positions"),
    }
