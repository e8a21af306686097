"""Layer-skip exit training for :func:`selfspec.train.loop.train`: early exits on a frozen target (heads/layerskip.py).

Config (conf/layerskip.yaml): ``exit_layer`` (a layer 1..L-1, or ``auto``) and ``exit``:

- ``form``: ``head`` (a final norm and an LM head) or ``adapter`` (one decoder block of the target's class before
  them, as in Kangaroo); ``tune_lm_head``: train the LM head rows too (else frozen);
- ``draft_vocab_size`` / ``draft_vocab_coverage``: the exit's reduced vocabulary (selfspec.train.data.choose_draft_vocab);
- ``candidates``: the layers ``exit_layer=auto`` trains (null: five from shallow to half way, :func:`default_candidates`);
- ``thresholds``, ``max_depth``: what the end-of-run estimate searches for the confidence threshold and the chain
  length that decoding will use (saved with the exit).

**Loss.** At every labelled position (whose next token is an answer token), the exit reads the target's layer-E hidden
state and is fitted to the target's own next-token distribution, the final layer's, by KL(target || exit) over the
exit's vocabulary (the teacher renormalised over it; over the whole vocabulary without a reduced one). The teacher's
logits are computed at those positions only and over those rows only. Losses are sums over positions divided by the
global count (``count_items``), one term per exit; exits do not interact, so training several is training each.

**Hidden states** come from one target forward per batch (``features: online``, ``output_hidden_states``) or from a
feature store holding the candidate layers' states and the final normed state (``features: store``). Either way one
target forward feeds every candidate exit.

**Choosing the exit** (``exit_layer=auto``). The evaluation measures, per exit: top-1 agreement with the target's
greedy token (over the whole vocabulary), and per threshold t the share of positions where the exit's top probability
reaches t, and where it does and is right. At the end, the measured costs of the first E layers, the exit and a
one-token forward (decode/layerskip.py:measure_layer_costs) and this machine's verify cost curve turn these into
expected tokens/s against plain decoding for each (E, t, chain length) (decode/layerskip.py:expected_speedup). The run
prints the table, writes it to ``<run_dir>/exit_layers.json`` and saves the best exit with its threshold in
``heads/``; the others go to ``exits/layer-E/``, heads folders too (``scripts/sweep_trees.py --layerskip`` compares
them).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from selfspec.core.archs import output_logits
from selfspec.core.errors import SettingError
from selfspec.core.layers import causal_mask
from selfspec.core.target import TargetSettings, resolve_dtype
from selfspec.heads.layerskip import FORMS, ExitConfig, ExitSet, LayerSkipExit, other_exit_dir
from selfspec.core.runtime import rows_through
from selfspec.decode.layerskip import best_chain, measure_layer_costs
from selfspec.decode.session import depth_policy
from selfspec.train.data import IGNORE_INDEX, count_draft_vocab, draft_vocab_problems, position_ids_from_mask, target_inputs
from selfspec.train.feature_store import FeatureSource, hidden_states_extract, stored_hidden_states
from selfspec.train.config import settings_from_cfg
from selfspec.train.method import TrainMethod, save_run_heads, state_under, unwrap


@dataclass
class ExitSettings:
    """``cfg.exit`` (defaults in conf/layerskip.yaml only) and ``cfg.exit_layer``."""

    form: str
    tune_lm_head: bool
    draft_vocab_size: Any  # a number, auto (by coverage), or null (the whole vocabulary)
    draft_vocab_coverage: float | None
    candidates: Any  # exit_layer=auto: list of layers, or null
    thresholds: Any  # list of floats
    max_depth: int

    @classmethod
    def from_cfg(cls, cfg: Any) -> "ExitSettings":
        out = settings_from_cfg(cls, cfg.exit, group="exit")
        problems = []
        if out.form not in FORMS:
            problems.append(f"exit.form={out.form!r}: use head or adapter")
        if out.max_depth < 1:
            problems.append(f"exit.max_depth={out.max_depth} must be >= 1")
        thresholds = list(out.thresholds or [])
        if not thresholds or any(not 0.0 <= float(t) <= 1.0 for t in thresholds):
            problems.append(f"exit.thresholds={thresholds}: give one or more numbers in [0, 1]")
        out.thresholds = sorted(float(t) for t in thresholds)
        problems += draft_vocab_problems(out.draft_vocab_size, out.draft_vocab_coverage)
        if problems:
            raise SettingError("; ".join(problems) + ".")
        return out


SHALLOW_TO_MIDDLE = (1 / 15, 1 / 8, 1 / 4, 3 / 8, 1 / 2)  # the default exit layers, as shares of the depth


def default_candidates(num_layers: int) -> list[int]:
    """Five exit layers from shallow to half way (2, 4, 8, 11, 15 of 30). Shallow exits draft cheaply: on SmolLM2 an
    adapter exit after layer 2 costs a small share of a forward and decoded faster than plain decoding, while exits
    past a third of the stack cost more than their agreement gains (docs/journal/2026-12-01-figures-from-code.md)."""
    return sorted({min(num_layers - 1, max(1, int(num_layers * f + 0.5))) for f in SHALLOW_TO_MIDDLE})


def exit_layers(exit_layer: Any, candidates: Any, num_layers: int) -> list[int]:
    """The layers to train exits at: ``exit_layer`` alone, or with ``auto`` the candidates; clear errors otherwise."""
    if exit_layer in ("auto", None):
        layers = sorted({int(e) for e in candidates}) if candidates else default_candidates(num_layers)
    elif isinstance(exit_layer, int) and not isinstance(exit_layer, bool):
        layers = [exit_layer]
    else:
        raise SettingError(f"exit_layer={exit_layer!r}: give a layer number, or auto to try several.")
    bad = [e for e in layers if not 1 <= e < num_layers]
    if bad:
        raise SettingError(f"exit_layer {bad}: an exit goes after a layer in 1..{num_layers - 1} (this target has "
                           f"{num_layers} layers).")
    return layers


def exit_positions(labels: torch.Tensor) -> torch.Tensor:
    """labels [B, T] -> bool [B, T]: positions t whose next token t + 1 is a labelled (answer) token."""
    out = torch.zeros_like(labels, dtype=torch.bool)
    out[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return out


def kl_to_teacher(exit_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Sum over rows of KL(softmax(teacher) || softmax(exit)), both [N, K]."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    student = F.log_softmax(exit_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum()


class ExitTrainModule(nn.Module):
    """The exits and their loss in one forward (the module the loop prepares, so DDP syncs it)."""

    def __init__(self, exits: ExitSet):
        super().__init__()
        self.exits = exits

    def forward(self, layer_states: dict[int, torch.Tensor], teacher_logits: torch.Tensor, where: torch.Tensor,
                attention_mask: torch.Tensor):
        """-> ({layer: exit logits [N, K]}, {layer: KL sum}); ``where`` [B, T] bool the trained positions."""
        logits, losses = {}, {}
        for e in self.exits.layers:
            exit_module = self.exits[e]
            hidden = layer_states[e].to(exit_module.norm.weight.dtype)
            if exit_module.adapter is None:  # per position: only the trained rows
                features = exit_module.features(hidden[where])
            else:  # the block attends over the sequence: causal, padding hidden
                mask = causal_mask(hidden.shape[1], 0, hidden.dtype, hidden.device, key_padding=attention_mask)
                features = exit_module.features(hidden, position_ids_from_mask(attention_mask), mask)[where]
            logits[e] = rows_through(exit_module.logits, features)
            losses[e] = kl_to_teacher(logits[e], teacher_logits)
        return logits, losses


def decode_copy(model: nn.Module, dtype: str) -> nn.Module:
    """The target as decoding runs it (``model.dtype``): itself, or a copy in that dtype when training ran it in
    another (trainer.target_dtype), so that costs measured on it are those decoding pays."""
    param = next(model.parameters())
    wanted = resolve_dtype(dtype, param.device)
    return model if param.dtype == wanted else copy.deepcopy(model).to(wanted)


class LayerSkipMethod(TrainMethod):
    """Layer-skip exits for the shared loop (see selfspec.train.method.TrainMethod)."""

    name = "layerskip"

    def __init__(self, cfg: Any):
        self.settings = ExitSettings.from_cfg(cfg)
        self.exit_layer = cfg.get("exit_layer", "auto")
        if isinstance(self.exit_layer, str) and self.exit_layer.isdigit():
            self.exit_layer = int(self.exit_layer)
        self.features = FeatureSource.from_cfg(cfg)
        self.run_dir = Path(str(cfg.run_dir))
        # what decoding runs the target in (model.dtype)
        self.decode_dtype = str(TargetSettings.from_config(cfg.get("model") or {}).dtype)
        self.layers: list[int] = []
        self.token_map: torch.Tensor | None = None
        self.vocab_coverage: float | None = None
        self.last_eval: dict[str, float] = {}
        self._stats: dict[int, dict] = {}  # per layer: agreement and per-threshold counts, from the last evaluation

    # --- setup --------------------------------------------------------------------------------------------------

    def _layers_of(self, model: nn.Module) -> list[int]:
        if not self.layers:
            num_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
            self.layers = exit_layers(self.exit_layer, self.settings.candidates, num_layers)
        return self.layers

    def prepare_data(self, datasets, target, accelerator, collate_fn):
        model = target.model
        self._layers_of(model)
        if self.settings.draft_vocab_size is not None:
            vocab = count_draft_vocab(datasets["train"], int(model.config.get_text_config(decoder=True).vocab_size),
                                      self.settings, "layer-skip exit", accelerator)
            self.token_map, self.vocab_coverage = vocab.token_map, vocab.coverage
        if self.features.online:
            return datasets["train"], datasets.get("eval"), collate_fn
        extract = hidden_states_extract(model, self.layers, self.features.dtype)
        return self.features.open_store(datasets, target, accelerator, collate_fn, extract,
                                        {"fields": f"layerskip-last-hidden+layers{self.layers}"})

    def exit_config(self, model: nn.Module, layer: int) -> ExitConfig:
        size = self.settings.draft_vocab_size  # counted by prepare_data; before it, a number or the whole vocabulary
        size = int(self.token_map.numel()) if self.token_map is not None else (size if isinstance(size, int) else None)
        return ExitConfig.from_target(model, exit_layer=layer, form=self.settings.form, draft_vocab_size=size,
                                      tune_lm_head=self.settings.tune_lm_head)

    def build_module(self, target) -> nn.Module:
        model = target.model
        exits = {e: LayerSkipExit(self.exit_config(model, e), model, token_map=self.token_map)
                 for e in self._layers_of(model)}
        module = ExitTrainModule(ExitSet(exits))
        return module.to(device=model.get_input_embeddings().weight.device, dtype=torch.float32)

    # --- loss ---------------------------------------------------------------------------------------------------

    def _teacher(self, batch: dict, target, where: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor,
                                                                              torch.Tensor]:
        """({layer: hidden [B, T, H]}, the teacher's logits [N, K] over the exit vocabulary at the positions
        ``where`` (soft-capped as the target's own), and the target's final normed hidden states [N, H] there)."""
        model = target.model
        with torch.no_grad():
            if "hidden" in batch:
                states = stored_hidden_states(batch, self.layers)
                final = states[-1]
            else:
                out = model(input_ids=batch["input_ids"], **target_inputs(batch), output_hidden_states=True,
                            use_cache=False, logits_to_keep=1)
                final = out.hidden_states[-1]
                states = {e: out.hidden_states[e] for e in self.layers}
            head = model.get_output_embeddings().weight
            rows = final[where].to(head.dtype)  # [N, H]
            weight = head if self.token_map is None else head[self.token_map.to(head.device)]
            teacher = rows_through(lambda x: output_logits(model.config, x @ weight.t()), rows)
            return states, teacher.float(), rows

    def count_items(self, batch: dict) -> torch.Tensor:
        return exit_positions(batch["labels"]).sum().reshape(1)

    def compute_loss(self, batch: dict, target, drafter: nn.Module, num_items: torch.Tensor):
        """num_items [1]: the step's trained positions (:meth:`count_items`); every exit's KL sum is divided by it."""
        where = exit_positions(batch["labels"])
        states, teacher, _ = self._teacher(batch, target, where)
        logits, losses = drafter(states, teacher, where, batch["attention_mask"])
        loss = sum(losses.values()) / num_items.sum()
        best = teacher.argmax(-1)
        metrics = {f"acc_exit{e}": (logits[e].argmax(-1) == best).float().mean().detach() if best.numel() else
                   torch.tensor(0.0) for e in logits}
        return loss, metrics

    # --- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, loader, target, drafter: nn.Module, accelerator) -> dict[str, float]:
        """Per exit, over the eval split: KL to the target, top-1 agreement with the target's greedy token (the whole
        vocabulary), and per threshold the share of positions where the exit is that sure, and sure and right."""
        core = unwrap(drafter)
        layers, thresholds = core.exits.layers, self.settings.thresholds
        # per layer: [positions, kl sum, agree, confident per t..., confident & right per t...]
        totals = torch.zeros(len(layers), 3 + 2 * len(thresholds), dtype=torch.float64, device=accelerator.device)
        head = target.model.get_output_embeddings()
        for batch in loader:
            where = exit_positions(batch["labels"])
            states, teacher, final_rows = self._teacher(batch, target, where)
            with torch.no_grad():
                logits, losses = drafter(states, teacher, where, batch["attention_mask"])
                greedy = head(final_rows).argmax(-1)  # the target's own next token
                for i, e in enumerate(layers):
                    probs = torch.softmax(logits[e].float(), dim=-1)
                    p, top = probs.max(-1)
                    right = core.exits[e].to_target_ids(top) == greedy
                    row = [float(where.sum()), float(losses[e]), float(right.sum())]
                    row += [float((p >= t).sum()) for t in thresholds]
                    row += [float(((p >= t) & right).sum()) for t in thresholds]
                    totals[i] += torch.tensor(row, dtype=torch.float64, device=accelerator.device)
        totals = accelerator.reduce(totals, reduction="sum")
        out, self._stats = {}, {}
        for i, e in enumerate(layers):
            n = max(float(totals[i, 0]), 1.0)
            k = len(thresholds)
            stats = {"positions": float(totals[i, 0]), "kl": float(totals[i, 1]) / n,
                     "agreement": float(totals[i, 2]) / n,
                     "share": [float(totals[i, 3 + j]) / n for j in range(k)],
                     "right": [float(totals[i, 3 + k + j]) / n for j in range(k)]}
            self._stats[e] = stats
            out[f"eval/kl_exit{e}"] = stats["kl"]
            out[f"eval/agreement_exit{e}"] = stats["agreement"]
        out["eval/loss"] = sum(s["kl"] for s in self._stats.values())
        out["eval/positions"] = float(totals[0, 0]) if layers else 0.0
        self.last_eval = out
        return out

    # --- choosing and saving ------------------------------------------------------------------------------------

    def choose(self, target, core: ExitSet) -> list[dict]:
        """Per trained exit: agreement, and the threshold and chain length with the best expected tokens/s against
        plain decoding under this machine's measured costs; best first."""
        if not self._stats:
            raise SettingError("layer-skip exits are chosen from an evaluation: give the run an eval split "
                               "(data.eval_fraction > 0).")
        model = decode_copy(target.model, self.decode_dtype)  # costs as decoding will pay them
        costs = measure_layer_costs(model, {e: core[e] for e in core.layers})
        curve = depth_policy(model, "auto").curve
        rows = []
        for e in core.layers:
            stats = self._stats[e]
            best = best_chain(stats["share"], stats["right"], self.settings.thresholds, self.settings.max_depth,
                              draft_cost=costs["draft"][e], layer_share=costs["layers"][e], curve=curve)
            rows.append({"exit_layer": e, "agreement": stats["agreement"], "kl": stats["kl"],
                         "draft_cost": costs["draft"][e], **best})
        rows.sort(key=lambda r: -r["speedup"])
        return rows

    def save(self, path: Path, drafter: nn.Module, target, meta: dict, state_dict: dict | None = None) -> Path:
        """The best exit into ``path`` (heads/), every other into ``exits/layer-E/`` beside it."""
        core = drafter.exits if isinstance(drafter, ExitTrainModule) else drafter
        rows = self.choose(target, core)
        report_table(rows, sys.stderr)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "exit_layers.json").write_text(json.dumps(rows, indent=1))
        for row in rows[1:]:  # the others too, each a heads folder of its own (sweeps over E decode with them)
            self._save_exit(other_exit_dir(path, row["exit_layer"]), core, row, rows, target, meta, state_dict)
        if len(rows) > 1:
            print(f"[selfspec] kept the exit after layer {rows[0]['exit_layer']} in {path}; the others are in "
                  f"{other_exit_dir(path, 0).parent}/layer-E", file=sys.stderr)
        return self._save_exit(path, core, rows[0], rows, target, meta, state_dict)

    def _save_exit(self, path: Path, core: ExitSet, row: dict, rows: list[dict], target, meta: dict,
                   state_dict: dict | None) -> Path:
        """The exit of ``row`` as head type ``layerskip``, with the ranking of every exit and its chosen threshold."""
        e = row["exit_layer"]
        return save_run_heads(path, core[e], "layerskip", target, meta, settings=self.settings, settings_key="exit",
                            features=self.features.kind, draft_vocab_coverage=self.vocab_coverage,
                            extra={"exit_layers": rows},
                            decode={"threshold": row["threshold"], "max_depth": self.settings.max_depth},
                            state_dict=state_under(state_dict, f"exits.exits.{e}."))


def report_table(rows: list[dict], stream) -> None:
    """The per-layer table ``exit_layer=auto`` ends with (best first)."""
    print("[selfspec] layer-skip exits (expected tokens/s against plain decoding, from this machine's measured costs):",
          file=stream)
    print(f"  {'exit':>4} {'agree':>6} {'draft':>6} {'thresh':>6} {'depth':>5} {'tokens/step':>11} {'speedup':>7}",
          file=stream)
    for i, r in enumerate(rows):
        mark = "  <- kept" if i == 0 else ""
        print(f"  {r['exit_layer']:>4} {r['agreement']:>6.3f} {r['draft_cost']:>6.3f} {r['threshold']:>6.2f} "
              f"{r['depth']:>5} {r['tokens_per_step']:>11.2f} {r['speedup']:>6.2f}x{mark}", file=stream)
