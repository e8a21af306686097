"""DFlash training for :func:`selfspec.train.loop.train`: a block drafter (heads/dflash.py) on a frozen target.

Config (``cfg.heads``, conf/heads/dflash.yaml):

- ``num_layers``, ``block_size`` (the last emitted token and ``block_size - 1`` drafted positions),
  ``target_layer_ids`` (the target layers whose outputs are fused; null: selfspec.heads.dflash.default_target_layer_ids),
  ``mask_token_id`` (the id serving engines feed to the mask slots; ``auto``: :func:`choose_mask_token_id`);
- ``draft_vocab_size`` / ``draft_vocab_coverage``: the reduced draft vocabulary, counted on the training split as
  for EAGLE-3 (selfspec.train.data.count_draft_vocab);
- ``anchors_per_sequence``: blocks drafted per sequence in one training forward, at random answer positions;
- ``init_from_layer``: a target layer whose weights start every drafter layer (:func:`init_layers_from_target`;
  null: random, which measured best on the hour recipe);
- ``freeze_lm_head``: keep the draft LM head at the target's LM head rows it starts from (DFlash's reference drafters
  read the target's own LM head, frozen): the drafter learns to land where the target's last layer does, a step skips
  the head's weight gradient and its optimizer state, and a checkpoint leaves it out (it is rebuilt from the target);
- ``loss``: ``token_loss`` (kl: the target's distribution over the draft vocabulary | ce: the target's own greedy
  token), ``gamma`` (DFlash's per-position weight exp(-(k - 1) / gamma)), and ``retrieved_weight`` with
  ``retrieval_min_match``: a block position whose token copying from the text itself would have given
  (:func:`selfspec.heads.dflash.retrieval_hits`: what the suffix drafter proposes in the hybrid) weighs ``retrieved_weight``
  times its position's weight (1: every position alike), so the drafter's capacity goes where retrieval misses;
  ``off_path_weight``: a block position k whose text before it in the block leaves the target's greedy path
  (:func:`selfspec.heads.dflash.on_greedy_path`; in training the teacher's top draft id stands for the greedy token) weighs
  ``off_path_weight`` times its weight. Decoding verifies position k only after the target's own tokens, while the
  teacher there is the target's prediction after the text's tokens, which the mask slots never see. The step's
  normaliser (``count_items``) is the weights' sum before this factor, so an off-path position's share is dropped,
  not handed to the others.

A step samples each sequence's anchors with the global torch RNG (``count_items``, so a checkpoint's RNG state
resumes them exactly) and keeps them in the batch (``batch["anchors"]``) for ``compute_loss``. The drafter reads
the target layers' outputs at every real position, fuses them into one context, and drafts all the blocks of a
sequence in one forward under :func:`selfspec.heads.dflash.block_mask`. The loss is a sum over the scored block positions
weighted by position, divided by the step's total weight (``count_items``), so a step's gradient does not depend on
how it is split over micro-batches and processes. The teacher at block position k of anchor p is the target's
prediction at p + k - 1, its LM head applied to the scored rows only.

Hidden states come from the target as training runs (``features: online``) or from the feature store EAGLE-3
writes (``features: store``): the last hidden state and ``hidden_states[i + 1]`` for each target layer i. DFlash's
default layers are EAGLE-3's default minus one, so a store of the EAGLE-3 recipe with the same data and target has
the same identity and is reused (``feature_store.dir=<its run>/features``).

Evaluation drafts at anchors from a fixed generator (the same every evaluation) and reports, per block position k,
top-1 agreement with the target's greedy token (``eval/acc_pos{k}``), the loss, and the expected accepted length of
the block as a chain (``eval/accept_length_chain``), and the same as decoding verifies it, on the greedy path
(``eval/acc_on_path_pos{k}``, ``eval/accept_length_on_path``; :meth:`DFlashMethod.evaluate`). Saved through selfspec.heads.io
as head type ``dflash``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from selfspec.heads.dflash import (
    DFlashConfig,
    DFlashHeads,
    block_mask,
    block_targets,
    chain_on_path,
    dflash_block_loss,
    on_greedy_path,
    position_weights,
    retrieval_hits,
    sample_anchors,
)
from selfspec.core.archs import output_logits
from selfspec.core.layers import decoder_of
from selfspec.core.errors import SettingError
from selfspec.heads.medusa import expected_accept_length
from selfspec.core.runtime import rows_through
from selfspec.train.config import settings_from_cfg
from selfspec.train.data import count_draft_vocab, draft_vocab_problems
from selfspec.train.feature_store import FeatureSource, hidden_states_extract, hidden_states_fields, target_hidden_states
from selfspec.train.method import TrainMethod, save_run_heads, state_under, unwrap

TOKEN_LOSSES = ("kl", "ce")
LOSS_KEYS = ("token_loss", "gamma", "retrieved_weight", "retrieval_min_match", "off_path_weight")
RETRIEVAL_MAX_MATCH = 8  # longer earlier matches count as this long when choosing which occurrence to copy
EVAL_SEED = 1234  # evaluation's anchors: the same positions at every evaluation of a run
ARGMAX_ROWS = 1024  # rows of the target's full-vocabulary logits computed at once (its greedy tokens)


@dataclass
class DFlashSettings:
    """``cfg.heads``; the defaults are in conf/heads/dflash.yaml only."""

    type: str  # dflash
    num_layers: int
    block_size: int
    target_layer_ids: list[int] | None  # null: selfspec.heads.dflash.default_target_layer_ids
    mask_token_id: int | str  # a token id, or auto (choose_mask_token_id)
    draft_vocab_size: int | str | None  # a number, auto (by draft_vocab_coverage), or null (the full vocab)
    draft_vocab_coverage: float | None
    anchors_per_sequence: int
    freeze_lm_head: bool  # the draft LM head stays the target's LM head rows it starts from
    loss: dict  # token_loss (kl | ce), gamma
    init_from_layer: int | None = None  # a target layer whose weights start every drafter layer; None: random

    @classmethod
    def from_cfg(cls, cfg: Any) -> "DFlashSettings":
        out = settings_from_cfg(cls, cfg)
        problems = []
        if out.type != "dflash":
            problems.append(f"heads.type={out.type!r}: train/dflash.py trains dflash heads (heads=dflash)")
        if out.anchors_per_sequence < 1:
            problems.append(f"heads.anchors_per_sequence={out.anchors_per_sequence} must be >= 1")
        if out.mask_token_id != "auto" and (not isinstance(out.mask_token_id, int) or out.mask_token_id < 0):
            problems.append(f"heads.mask_token_id={out.mask_token_id!r}: use a token id or auto")
        unknown = sorted(set(out.loss) - set(LOSS_KEYS))
        missing = sorted(set(LOSS_KEYS) - set(out.loss))
        if unknown or missing:
            problems.append(f"heads.loss: unknown {unknown}, missing {missing}; known: {list(LOSS_KEYS)}")
        elif out.loss["token_loss"] not in TOKEN_LOSSES:
            problems.append(f"heads.loss.token_loss={out.loss['token_loss']!r}: use kl or ce")
        elif float(out.loss["gamma"]) < 0:
            problems.append(f"heads.loss.gamma={out.loss['gamma']} must be >= 0 (0: every position weighs 1)")
        elif not 0 <= float(out.loss["retrieved_weight"]) <= 1:
            problems.append(f"heads.loss.retrieved_weight={out.loss['retrieved_weight']} must be in [0, 1] "
                            "(1: retrieved positions weigh as much as the others)")
        elif not 0 <= float(out.loss["off_path_weight"]) <= 1:
            problems.append(f"heads.loss.off_path_weight={out.loss['off_path_weight']} must be in [0, 1] "
                            "(1: positions off the target's greedy path weigh as much as the others)")
        elif not 1 <= int(out.loss["retrieval_min_match"]) <= RETRIEVAL_MAX_MATCH:
            problems.append(f"heads.loss.retrieval_min_match={out.loss['retrieval_min_match']} must be in "
                            f"1..{RETRIEVAL_MAX_MATCH}")
        problems += draft_vocab_problems(out.draft_vocab_size, out.draft_vocab_coverage)
        if problems:
            raise SettingError("; ".join(problems) + ".")
        return out

    def dflash_config(self, target: Any) -> DFlashConfig:
        """The drafter's config for ``target`` (a selfspec.core.target.Target: its model and tokenizer)."""
        mask = self.mask_token_id
        if mask == "auto":
            mask = choose_mask_token_id(target.tokenizer, target.model.config.vocab_size)
        return DFlashConfig.from_target(
            target.model, num_layers=self.num_layers, block_size=self.block_size,
            target_layer_ids=self.target_layer_ids, mask_token_id=int(mask),
            draft_vocab_size=None if self.draft_vocab_size == "auto" else self.draft_vocab_size,  # auto: until counted
        )


def choose_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """A token chat never emits, for the mask slots: the highest-id special token of ``tokenizer`` that is not its
    bos / eos / pad / unk token and does not appear in its chat template; else the last embedding row
    (``vocab_size - 1``)."""
    named = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    unused = [i for i, tok in decoder.items()
              if getattr(tok, "special", False) and i not in named and i < vocab_size and str(tok) not in template]
    return max(unused) if unused else vocab_size - 1


def init_layers_from_target(drafter: DFlashHeads, model: nn.Module, layer: int) -> None:
    """Start every drafter layer from the target's decoder layer ``layer`` (-1: the last): its attention
    projections, MLP and the two norms, copied (the target is only read). The drafter's q/k norms keep their start
    (ones), and a target's projection biases (Qwen2) are not copied: the drafter's layers have none."""
    layers = decoder_of(model).layers
    if not -len(layers) <= layer < len(layers):
        raise SettingError(f"heads.init_from_layer={layer}: the target has layers 0..{len(layers) - 1} (-1: the last).")
    source = layers[layer]
    names = [f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    theirs = dict(source.named_parameters())
    with torch.no_grad():
        for drafter_layer in drafter.layers:
            mine = dict(drafter_layer.named_parameters())
            for name in names:
                if name not in theirs or theirs[name].shape != mine[name].shape:
                    raise SettingError(f"heads.init_from_layer={layer}: the target's layer has no {name} of shape "
                                       f"{tuple(mine[name].shape)}; use null (random).")
                mine[name].copy_(theirs[name].detach().to(mine[name].dtype))


class DFlashTrainModule(nn.Module):
    """The drafter and its block forward in one module (the module the loop prepares, so DDP syncs it)."""

    def __init__(self, drafter: DFlashHeads):
        super().__init__()
        self.drafter = drafter

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                anchors: torch.Tensor, scored: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """features [B, T, n*H] (the target layers' outputs), input_ids / attention_mask [B, T], anchors [B, A]
        (-1: none), ``scored`` the (b, a, k) indices of :func:`selfspec.heads.dflash.block_targets` -> draft logits [N, Vd]."""
        d = self.drafter
        bsz, t = input_ids.shape
        a, bs = anchors.shape[1], d.block_size
        context = d.context(features)  # [B, T, H]
        context_kv = d.context_kv(context, torch.arange(t, device=input_ids.device).expand(bsz, t))
        starts = anchors.clamp(min=0)
        block = d.block_inputs(input_ids.gather(1, starts))  # [B, A*bs, H]
        positions = (starts[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(bsz, a * bs)
        hidden = d(block, positions, context_kv, block_mask(anchors, attention_mask, bs))  # [B, A*bs, H]
        b, i, k = scored
        return rows_through(d.logits, hidden.view(bsz, a, bs, -1)[b, i, k])


@dataclass
class ScoredBlocks:
    """One batch's blocks at the positions they are scored at: the draft's logits [N, Vd], the teacher (kl: the
    target's logits over the draft vocabulary [N, Vd]; ce: its greedy token as a draft id [N], -100 outside), the
    positions' (b, a, k) indices (k: the block index) and the target's rows of their predictions (b, p + k - 1)."""

    logits: torch.Tensor
    teacher: torch.Tensor
    target_rows: torch.Tensor  # [N, H] the target's last hidden states the teacher reads
    scored: tuple[torch.Tensor, ...]  # the (b, a, k) indices of the positions (selfspec.heads.dflash.block_targets)


class DFlashMethod(TrainMethod):
    """The DFlash family for the shared loop (see selfspec.train.method.TrainMethod)."""

    name = "dflash"

    def __init__(self, cfg: Any):
        self.settings = DFlashSettings.from_cfg(cfg.heads)
        self.features = FeatureSource.from_cfg(cfg)
        self.token_loss = str(self.settings.loss["token_loss"])
        self.gamma = float(self.settings.loss["gamma"])
        self.retrieved_weight = float(self.settings.loss["retrieved_weight"])
        self.retrieval_min_match = int(self.settings.loss["retrieval_min_match"])
        self.off_path_weight = float(self.settings.loss["off_path_weight"])
        self.d2t: torch.Tensor | None = None
        self.draft_vocab_coverage: float | None = None
        self._teacher_head: tuple | None = None  # the target LM head's (weight, bias) rows of the draft vocabulary,
        # and the target's config (its soft-capping)

    # --- setup --------------------------------------------------------------------------------------------------

    def prepare_data(self, datasets, target, accelerator, collate_fn):
        vocab = count_draft_vocab(datasets["train"], int(target.model.config.vocab_size), self.settings, "dflash",
                                  accelerator)
        self.settings.draft_vocab_size = vocab.size
        self.d2t, self.draft_vocab_coverage = vocab.d2t, vocab.coverage
        if self.features.online:
            return datasets["train"], datasets.get("eval"), collate_fn
        layers = self.settings.dflash_config(target).feature_layers
        extract = hidden_states_extract(target.model, layers, self.features.dtype)
        return self.features.open_store(datasets, target, accelerator, collate_fn, extract,
                                        {"fields": hidden_states_fields(layers)})

    def store_target_layers(self) -> list[int] | None:
        """From a store, the training reads the target's embeddings (the block's tokens, the mask embedding) and LM
        head (the teacher, the draft LM head's rows, greedy tokens), and the layer heads.init_from_layer copies."""
        if self.features.online:
            return None
        return [] if self.settings.init_from_layer is None else [int(self.settings.init_from_layer)]

    def build_module(self, target) -> nn.Module:
        """The DFlash drafter (fp32, on the target's device) inside its training module. Without a counted draft
        vocabulary (prepare_data not run) it starts with the first draft_vocab_size ids."""
        model = target.model
        drafter = DFlashHeads(self.settings.dflash_config(target), model, d2t=self.d2t)
        if self.settings.init_from_layer is not None:
            init_layers_from_target(drafter, model, self.settings.init_from_layer)
        drafter.to(device=model.get_input_embeddings().weight.device, dtype=torch.float32)
        return self.wrap_module(drafter, target)

    def wrap_module(self, drafter: nn.Module, target) -> nn.Module:
        """The training module around ``drafter`` (a built or loaded DFlashHeads), with the teacher's rows of its
        draft vocabulary."""
        model = target.model
        if self.settings.freeze_lm_head:  # the target's rows of the draft vocabulary, copied by DFlashHeads
            drafter.lm_head.weight.requires_grad_(False)
        lm_head = model.get_output_embeddings()
        draft_ids = drafter.draft_to_target(torch.arange(drafter.d2t.numel(), device=drafter.d2t.device))
        draft_ids = draft_ids.to(lm_head.weight.device)
        bias = getattr(lm_head, "bias", None)
        # the teacher's own copy, frozen head or not: it stays in the target's dtype, and a drafter's parameters may
        # be sharded (DeepSpeed ZeRO-3) or cast by the accelerator, where reading them would not give these rows
        self._teacher_head = (lm_head.weight.detach()[draft_ids], None if bias is None else bias.detach()[draft_ids],
                              model.config)
        return DFlashTrainModule(drafter)

    # --- loss ---------------------------------------------------------------------------------------------------

    def count_items(self, batch: dict) -> torch.Tensor:
        """The step's weight of this micro-batch: the sum of position weights over its scored block positions. Draws
        the batch's anchors (global RNG) and keeps them in ``batch["anchors"]`` for compute_loss (and the positions
        copying would give in ``batch["retrieved"]``, when they are weighted)."""
        batch["anchors"] = sample_anchors(batch["labels"], self.settings.anchors_per_sequence)
        scored = block_targets(batch["anchors"], batch["labels"], self.settings.block_size)
        return self._weights(batch, batch["anchors"], scored).sum()

    def _weights(self, batch: dict, anchors: torch.Tensor, scored: tuple[torch.Tensor, ...],
                 retrieval: bool = True) -> torch.Tensor:
        """Each scored block position's weight [N]: DFlash's weight of its position k, times ``retrieved_weight``
        where copying from the text would have given its token (``retrieval``; skipped when the weight is 1)."""
        b, a, k = scored
        weights = position_weights(self.settings.block_size, self.gamma, k.device)[k]
        if retrieval and self.retrieved_weight != 1.0:
            if "retrieved" not in batch:
                batch["retrieved"] = self._retrieval_hits(batch)
            hits = batch["retrieved"][b, anchors[b, a] + k]
            weights = torch.where(hits, weights * self.retrieved_weight, weights)
        return weights

    def _retrieval_hits(self, batch: dict) -> torch.Tensor:
        """:func:`selfspec.heads.dflash.retrieval_hits` of the batch [B, T] (each row its own text; a packed row is not read
        here: DFlash does not pack)."""
        valid = batch["attention_mask"].bool() if batch.get("attention_mask") is not None \
            else torch.ones_like(batch["input_ids"], dtype=torch.bool)
        return retrieval_hits(batch["input_ids"], valid, self.retrieval_min_match, RETRIEVAL_MAX_MATCH)

    def compute_loss(self, batch: dict, target, drafter: nn.Module, num_items: torch.Tensor):
        if "anchors" not in batch:
            raise RuntimeError("DFlash draws a micro-batch's anchors in count_items (the step's normaliser): call "
                               "count_items(batch) before compute_loss(batch, ...), as selfspec.train.loop does.")
        blocks = self._scored_blocks(batch, target, drafter, batch["anchors"])
        weights = self._weights(batch, batch["anchors"], blocks.scored)
        top = self._teacher_top(blocks)
        if self.off_path_weight != 1.0:  # after count_items' sum: an off-path position's share is dropped, not moved
            on_path = self._on_path(unwrap(drafter).drafter, batch, batch["anchors"], blocks, top, draft_ids=True)
            weights = torch.where(on_path, weights, weights * self.off_path_weight)
        loss = dflash_block_loss(blocks.logits, blocks.teacher, weights, self.token_loss, num_items)
        with torch.no_grad():
            hits = (blocks.logits.argmax(-1) == top) & (top >= 0)
            acc = hits.float().sum() / max(hits.numel(), 1)
        return loss, {"acc": acc}

    def _scored_blocks(self, batch: dict, target, drafter: nn.Module, anchors: torch.Tensor) -> ScoredBlocks:
        """The draft's logits and the teacher at every scored block position of ``batch`` drafted at ``anchors``."""
        core: DFlashHeads = unwrap(drafter).drafter
        model = target.model
        states = target_hidden_states(model, batch, core.feature_layers)
        features = core.target_features(states)  # [B, T, n*H] in the drafter's dtype (stored float16 features do not
        # concatenate under CPU bf16 autocast)
        scored = block_targets(anchors, batch["labels"], core.block_size)
        logits = drafter(features, batch["input_ids"], batch["attention_mask"], anchors, scored)
        b, a, k = scored
        rows = states[-1][b, anchors[b, a] + k - 1]  # [N, H] the target's prediction of token p + k
        if self.token_loss == "kl":
            teacher = self._teacher_logits(rows)
        else:
            teacher = core.target_to_draft(target_greedy(model, rows))
        return ScoredBlocks(logits=logits, teacher=teacher, target_rows=rows, scored=scored)

    def _on_path(self, core: DFlashHeads, batch: dict, anchors: torch.Tensor, blocks: ScoredBlocks,
                 greedy: torch.Tensor, draft_ids: bool) -> torch.Tensor:
        """bool [N]: whether each scored position's block follows the target's greedy path before it in the text
        (:func:`selfspec.heads.dflash.on_greedy_path`). ``greedy`` [N]: the target's greedy token at each scored position, as
        a draft id (``draft_ids``; in training, the teacher's top draft id: a text token outside the draft
        vocabulary is off the path) or a target id."""
        b, a, k = blocks.scored
        data = batch["input_ids"][b, anchors[b, a] + k]
        if draft_ids:  # a text token outside the draft vocabulary (-100) matches nothing, not a -100 teacher
            data = core.target_to_draft(data)
            data = data.masked_fill(data < 0, -2)
        return on_greedy_path(blocks.scored, greedy, data, (*anchors.shape, self.settings.block_size))

    def _teacher_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary [N, Vd] (float32, soft-capped as the target's own) of its
        last hidden states [N, H]."""
        weight, bias, config = self._teacher_head
        with torch.no_grad():
            logits = rows_through(lambda r: output_logits(config, F.linear(r, weight, bias)), rows.to(weight.dtype))
            return logits.float()

    def _teacher_top(self, blocks: ScoredBlocks) -> torch.Tensor:
        """The teacher's top draft id per position [N] (ce: its greedy token, -100 outside the draft vocabulary)."""
        return blocks.teacher.argmax(-1) if blocks.teacher.dim() == 2 else blocks.teacher

    # --- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, loader, target, drafter: nn.Module, accelerator) -> dict[str, float]:
        """Per block position k = 1 .. bs-1: top-1 agreement of the draft with the target's greedy token over the
        eval split (anchors from a fixed generator); the loss (position weights only, so runs with another
        ``retrieved_weight`` compare); the expected accepted length of the block as a chain. The same agreement and
        chain over the positions copying would have missed (``eval/acc_unretrieved_pos{k}``,
        ``eval/accept_length_chain_unretrieved``: where a hybrid step needs the drafter) and the share of positions
        copying would have given (``eval/retrieved_share``). And as decoding would verify the block: the acceptance
        at k where the text before k in the block is the target's greedy path and the draft was right at every
        earlier position (``eval/acc_on_path_pos{k}``), and the chain of those conditional rates
        (``eval/accept_length_on_path``): the chain above multiplies each position's agreement with the target's
        prediction after the text's own tokens, which decoding never verifies where the text leaves the greedy path.
        On text that is not the target's own, the stretches on its path are the easier ones, so these read above
        what decoding measures (well above the decoded chain on the hour recipe,
        docs/journal/2026-12-01-figures-from-code.md).
        Sums are reduced over ranks (padding duplicates included)."""
        bs = self.settings.block_size
        core: DFlashHeads = unwrap(drafter).drafter
        generator = torch.Generator().manual_seed(EVAL_SEED)
        # per position k: hits, counts, unretrieved hits, unretrieved counts, on-path hits and counts; then the loss
        # and its weight
        totals = torch.zeros(6 * bs + 2, dtype=torch.float64, device=accelerator.device)
        for batch in loader:
            anchors = sample_anchors(batch["labels"], self.settings.anchors_per_sequence, generator)
            blocks = self._scored_blocks(batch, target, drafter, anchors)
            weights = self._weights(batch, anchors, blocks.scored, retrieval=False)
            loss_sum = dflash_block_loss(blocks.logits, blocks.teacher, weights, self.token_loss, num_items=1.0)
            greedy = target_greedy(target.model, blocks.target_rows)
            hits = (core.draft_to_target(blocks.logits.argmax(-1)) == greedy).double()
            b, a, k = blocks.scored
            novel = (~self._retrieval_hits(batch)[b, anchors[b, a] + k]).double()
            for i, value in enumerate((hits, torch.ones_like(hits), hits * novel, novel)):
                totals[i * bs:(i + 1) * bs] += torch.zeros(bs, dtype=torch.float64,
                                                           device=totals.device).index_add_(0, k, value)
            on_path = self._on_path(core, batch, anchors, blocks, greedy, draft_ids=False)
            totals[4 * bs:6 * bs] += torch.cat(chain_on_path(blocks.scored, hits.bool(), on_path,
                                                             (*anchors.shape, bs))).to(totals.device)
            totals[6 * bs:] += torch.stack([loss_sum.double(), weights.sum().double()])
        totals = accelerator.reduce(totals, reduction="sum")
        hits, counts, novel_hits, novel, path_hits, path_counts = (totals[i * bs + 1:(i + 1) * bs] for i in range(6))
        acc_path = path_hits / path_counts.clamp(min=1)
        acc, acc_novel = hits / counts.clamp(min=1), novel_hits / novel.clamp(min=1)
        out = {f"eval/acc_pos{k}": float(acc[k - 1]) for k in range(1, bs)}
        out.update({f"eval/acc_unretrieved_pos{k}": float(acc_novel[k - 1]) for k in range(1, bs)})
        out.update({f"eval/acc_on_path_pos{k}": float(acc_path[k - 1]) for k in range(1, bs)})
        out["eval/loss"] = float(totals[6 * bs] / totals[6 * bs + 1].clamp(min=1e-6))
        out["eval/accept_length_chain"] = expected_accept_length(acc)
        out["eval/accept_length_chain_unretrieved"] = expected_accept_length(acc_novel)
        out["eval/accept_length_on_path"] = expected_accept_length(acc_path)
        out["eval/retrieved_share"] = float(1 - novel.sum() / counts.sum().clamp(min=1))
        out["eval/positions"] = float(counts[0])
        return out

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, path: Path, drafter: nn.Module, target, meta: dict, state_dict: dict | None = None) -> Path:
        """The block drafter as head type ``dflash``."""
        core = drafter.drafter if isinstance(drafter, DFlashTrainModule) else drafter
        return save_run_heads(path, core, "dflash", target, meta, settings=self.settings, features=self.features.kind,
                            draft_vocab_coverage=self.draft_vocab_coverage,
                            state_dict=state_under(state_dict, "drafter."))


def target_greedy(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """The target's greedy token ids [N] of its last hidden states ``rows`` [N, H], through its whole LM head a
    block of rows at a time (a [N, V] float tensor of a large vocabulary would not fit)."""
    lm_head = model.get_output_embeddings()
    if rows.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    with torch.no_grad():
        return torch.cat([rows_through(lm_head, chunk.to(lm_head.weight.dtype)).argmax(-1)
                          for chunk in rows.split(ARGMAX_ROWS)])
