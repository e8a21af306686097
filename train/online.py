"""Drafters that learn from the traffic they decode (``learn=true``; docs/learning.md).

Every verify step already computes the target's hidden states at every committed position, and its tokens: what an
EAGLE-3, EAGLE-1 or DFlash drafter trains on. With ``learn=true`` a session keeps them and trains its heads between
requests, with the family's own training method (train/eagle_method.py, train/dflash_method.py: the same loss,
unrolled steps, block loss and draft vocabulary as offline training). Verification is untouched, so every answer stays
exactly the target's.

- :class:`Recorder` follows one request through the engine (``SpeculativeDecoder.generate(observer=...)``): the
  prompt's hidden states from the prefill, and at each commit the accepted branch's rows of the verify forward, at the
  layers the drafter reads and the last one. Nothing is recomputed. At the end it is one example in the feature
  store's own form (``input_ids``, ``labels`` on the answer, ``hidden``, ``aux``: train/feature_store.py).
- :class:`ReplayBuffer`: the examples, oldest dropped first past ``buffer_tokens`` positions. Every
  ``holdout_every``-th request (the first included) goes to a held-out buffer instead, never trained on.
- :class:`OnlineLearner`: after each request, ``steps`` optimizer steps on batches drawn from the buffer, on its own
  float32 copy of the heads. The guard then measures the chain acceptance the family's own evaluation reports on the
  held-out examples (``eval/accept_length_on_path`` for DFlash, ``eval/accept_length_chain`` for EAGLE) before and
  after: an update that lowers it is rolled back (weights and optimizer state), one that does not is copied into the
  session's heads in place, which the drafter reads from its next request on. Heads, optimizer state and both
  buffers are saved atomically every ``save_every`` requests and on close, into ``learner.dir``; a session started on
  the same ``learner.dir`` resumes from there.
"""

from __future__ import annotations

import copy
import random
import shutil
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from selfspec.core import folders
from selfspec.core.errors import SelfspecError, SettingError
from selfspec.core.families import FAMILIES
from selfspec.core.runtime import native_bf16
from selfspec.heads.io import load_heads
from selfspec.train.data.chat import IGNORE_INDEX
from selfspec.train.feature_store import collate_features


def learning_families() -> list[str]:
    """The families whose rows say ``learns_online`` (Medusa: Medusa-1's heads; Medusa-2's adapter is refused)."""
    return [name for name, family in FAMILIES.items() if family.learns_online]


class LearnSetupError(SelfspecError, ValueError):
    """Learning cannot start as asked (a family it does not train, a learner.dir that does not load); the message
    says what to do instead."""
STATE_FILE = "learner.pt"
HEADS_DIR = "heads"


@dataclass(frozen=True)
class LearnSettings:
    """``learner.*`` of conf/decode/decode.yaml (what each does is written there)."""

    dir: str
    resume: bool
    buffer_tokens: int
    holdout_every: int
    steps: int
    batch_size: int
    learning_rate: float
    min_tokens: int
    guard: bool
    guard_z: float
    save_every: int
    every_tokens: int
    max_length: int
    mixed_precision: str
    seed: int
    overwrite: bool = False  # a folder at dir that selfspec did not make: moved to a backup (else refused)

    @classmethod
    def from_dict(cls, values: dict) -> "LearnSettings":
        names = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(values) - set(names))
        optional = {"overwrite"}
        missing = [n for n in names if n not in values and n not in optional]
        if unknown or missing:
            raise SettingError(f"learner: {'unknown key ' + repr(unknown[0]) if unknown else 'missing ' + missing[0]}"
                               f"; it takes {', '.join(names)} (conf/decode/decode.yaml).")
        s = cls(dir=str(values["dir"]), resume=bool(values["resume"]), buffer_tokens=int(values["buffer_tokens"]),
                holdout_every=int(values["holdout_every"]), steps=int(values["steps"]),
                batch_size=int(values["batch_size"]), learning_rate=float(values["learning_rate"]),
                min_tokens=int(values["min_tokens"]), guard=bool(values["guard"]), guard_z=float(values["guard_z"]),
                save_every=int(values["save_every"]), every_tokens=int(values["every_tokens"]),
                max_length=int(values["max_length"]), mixed_precision=str(values["mixed_precision"]),
                seed=int(values["seed"]), overwrite=bool(values.get("overwrite", False)))
        problems = [f"learner.{k}={getattr(s, k)} must be >= {lo}" for k, lo in
                    (("buffer_tokens", 1), ("holdout_every", 2), ("steps", 0), ("batch_size", 1), ("min_tokens", 1),
                     ("save_every", 0), ("every_tokens", 0), ("max_length", 2)) if getattr(s, k) < lo]
        if s.learning_rate <= 0:
            problems.append(f"learner.learning_rate={s.learning_rate} must be > 0")
        if s.guard_z < 0:
            problems.append(f"learner.guard_z={s.guard_z} must be >= 0")
        if s.mixed_precision not in ("auto", "bf16", "no"):
            problems.append(f"learner.mixed_precision={s.mixed_precision!r}: use auto, bf16 or no")
        if problems:
            raise SettingError("; ".join(problems) + ".")
        return s


# --- what one request leaves ----------------------------------------------------------------------------------------


class Recorder:
    """One request's committed positions as the engine computed them: its tokens, and per position the hidden states
    at ``layers`` (indices into ``out.hidden_states``: the input of decoder layer i) and the last one (after the final
    norm), in ``dtype`` on the CPU. The engine calls :meth:`start` after the prefill and :meth:`commit` after each
    commit; :meth:`example` makes the feature-store example of the finished answer."""

    def __init__(self, layers: Iterable[int], dtype: torch.dtype, max_length: int):
        self.layers, self.dtype, self.max_length = list(layers), dtype, int(max_length)
        self.tokens: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []  # [n, len(layers) + 1, H]: the layers', then the last
        self.prompt_length = 0
        self.length = 0

    def _keep(self, tokens: torch.Tensor, hidden_states, index) -> None:
        if self.length >= self.max_length:
            return
        rows = torch.stack([hidden_states[i][index] for i in (*self.layers, -1)], dim=1)
        self.tokens.append(tokens.detach().to("cpu"))
        self.rows.append(rows.detach().to("cpu", self.dtype))
        self.length += int(tokens.shape[0])

    def start(self, prompt_ids: torch.Tensor, out) -> None:
        """``out``: the prefill's selfspec.decode.types.ForwardOutput."""
        self.prompt_length = int(prompt_ids.shape[0])
        self._keep(prompt_ids, out.hidden_states, slice(None))

    def commit(self, draft, verdict, out) -> None:
        """The engine's selfspec.decode.types Draft, selfspec.decode.verify Verdict and ForwardOutput of one step."""
        path = torch.tensor(verdict.path, device=draft.tokens.device)
        self._keep(draft.tokens[path], out.hidden_states, path.to(out.hidden.device))

    @property
    def answer_length(self) -> int:
        """Answer positions kept so far: each committed token but the newest (its hidden states come with the next
        forward)."""
        return self.length - self.prompt_length

    def partial(self) -> dict[str, torch.Tensor] | None:
        """The answer so far as an example (:meth:`example` of a request that ended here): every kept position."""
        return self._example(self.length)

    def example(self, new_tokens: list[int]) -> dict[str, torch.Tensor] | None:
        """The answer as a feature-store example: the positions whose hidden states the target computed (the prompt
        and every answer token but the last, which no forward read), at most ``max_length``; labels on the answer
        tokens only (-100 on the prompt). None when no position has a label (an answer of one token)."""
        return self._example(self.prompt_length + len(new_tokens) - 1)

    def _example(self, n: int) -> dict[str, torch.Tensor] | None:
        n = min(n, self.length, self.max_length)
        if n <= self.prompt_length:
            return None
        ids = torch.cat(self.tokens)[:n].long()
        rows = torch.cat(self.rows)[:n]
        labels = ids.clone()
        labels[: self.prompt_length] = IGNORE_INDEX
        example = {"input_ids": ids, "labels": labels, "hidden": rows[:, -1].contiguous()}
        if self.layers:
            example["aux"] = rows[:, :-1].contiguous()
        return example


class LearningRecorder(Recorder):
    """A :class:`Recorder` that also has its learner train in the middle of the request (``learner.every_tokens``):
    once every ``every`` answer positions, between the engine's steps, on the buffer and this answer so far
    (:meth:`OnlineLearner.learn_partial`). The next draft reads the new weights; verification is untouched."""

    def __init__(self, learner: "OnlineLearner", every: int):
        super().__init__(learner.layers, learner.dtype, learner.settings.max_length)
        self.learner, self.every, self.mark = learner, int(every), int(every)

    def between_steps(self) -> None:
        if self.answer_length < self.mark:
            return
        # past max_length nothing more is kept: the answer so far would not change
        self.mark = self.answer_length + self.every if self.length < self.max_length else float("inf")
        self.learner.learn_partial(self.partial())


def prefixes(example: dict[str, torch.Tensor], every: int) -> list[dict[str, torch.Tensor]]:
    """What a :class:`LearningRecorder` hands its learner during the request that made ``example``: the example cut
    after every ``every``-th answer position, shorter than the whole (the engine's steps can pass a mark by a few
    positions; here each cut is exact). :meth:`OnlineLearner.prefixes` under its ``every_tokens``."""
    prompt = int((example["labels"] < 0).sum())
    return [{k: v[: prompt + n] for k, v in example.items()}
            for n in range(every, len(example["input_ids"]) - prompt, every)]


class ReplayBuffer:
    """Examples, the oldest dropped first once they hold more than ``max_tokens`` positions (the newest is kept even
    alone past it)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.examples: deque[dict[str, torch.Tensor]] = deque()
        self.tokens = 0
        self.added = 0  # examples ever added

    def add(self, example: dict[str, torch.Tensor]) -> None:
        self.added += 1
        self.examples.append(example)
        self.tokens += len(example["input_ids"])
        while self.tokens > self.max_tokens and len(self.examples) > 1:
            self.tokens -= len(self.examples.popleft()["input_ids"])

    @property
    def answer_tokens(self) -> int:
        return sum(int((e["labels"] >= 0).sum()) for e in self.examples)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.examples for t in e.values())

    def state(self) -> list[dict[str, torch.Tensor]]:
        return list(self.examples)

    def load(self, examples: list[dict[str, torch.Tensor]]) -> None:
        self.examples, self.tokens = deque(), 0
        for e in examples:
            self.add(e)


def bytes_per_position(hidden_size: int, layers: int, dtype: torch.dtype) -> int:
    """What one buffered position costs: the hidden states of ``layers`` layers and the last one, plus two int64."""
    return (layers + 1) * hidden_size * torch.tensor([], dtype=dtype).element_size() + 16


# --- the learner ----------------------------------------------------------------------------------------------------


class _OneProcess:
    """What a family's ``evaluate`` asks of its accelerator, for one process: the device and a reduce that is the
    identity."""

    def __init__(self, device: torch.device):
        self.device = device

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _mean(values: list[float] | None) -> float | None:
    return None if values is None else sum(values) / max(len(values), 1)


def significantly_lower(before: list[float], after: list[float], z: float) -> bool:
    """Whether the held-out acceptance fell by more than ``z`` standard errors: the per-example differences
    ``after - before`` (the same examples, so paired) have a mean below ``-z`` times its standard error. With one
    example, or all differences equal, any fall counts; ``z=0``: any fall of the mean."""
    d = [a - b for a, b in zip(after, before, strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean < 0
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5
    return mean < -z * se


def training_method(head_type: str, heads_config: dict):
    """The family's training method, configured as these heads were trained (their saved ``heads`` settings over the
    family's entry config)."""
    from omegaconf import OmegaConf, open_dict

    from selfspec.core.config import compose
    from selfspec.train.families import METHODS  # every family's method and its imports: only once one learns

    family = FAMILIES[head_type]
    cfg = compose(family.train_conf, family.train_overrides(), config_dir=family.conf.parent)
    saved = heads_config.get("heads")
    if saved:
        with open_dict(cfg):
            cfg.heads = OmegaConf.merge(cfg.heads, {k: v for k, v in saved.items() if k in cfg.heads})
    return METHODS[head_type](cfg)


class OnlineLearner:
    """Trains a session's heads between its requests (module docstring). ``heads``: the module the session's drafter
    reads, updated in place after every accepted update; ``target``: the session's ``selfspec.core.target.Target``."""

    def __init__(self, heads: torch.nn.Module, head_type: str, heads_config: dict, target: Any,
                 settings: LearnSettings):
        learning = learning_families()
        if head_type not in learning:
            raise LearnSetupError(f"learn=true trains {', '.join(learning)} heads; the session's drafter is "
                                  f"{head_type}. Give heads=FOLDER of one of those families (heads=random with "
                                  "drafter=eagle3 or dflash: untrained heads), or decode with learn=false.")
        self.heads, self.head_type, self.target, self.settings = heads, head_type, target, settings
        self.heads_config = heads_config
        model = target.model
        self.device = next(model.parameters()).device
        self.method = training_method(head_type, heads_config)
        # the float32 copy trained here; the target and its parts it refers to stay the same objects (not copied)
        memo = {id(x): x for x in (model, *model.modules(), *model.parameters())}
        drafter = copy.deepcopy(heads, memo=memo).to(device=self.device, dtype=torch.float32)
        drafter.requires_grad_(True)
        try:
            self.module = self.method.wrap_module(drafter, target)
        except NotImplementedError as err:
            raise LearnSetupError(f"learn=true cannot train these {head_type} heads: {err} (Medusa-2's heads fit "
                                  "the target with its adapter). Decode with learn=false.") from err
        self.core = drafter  # the heads inside the training module (wrap_module trains them in place)
        groups = self.method.param_groups(self.module, settings.learning_rate)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, weight_decay=0.0)
        self.layers = self._store_layers()
        self.dtype = next(model.parameters()).dtype
        self.buffer = ReplayBuffer(settings.buffer_tokens)
        self.holdout = ReplayBuffer(max(settings.buffer_tokens // settings.holdout_every, 1))
        self.rng = random.Random(settings.seed)  # which buffered examples each step draws
        # the CPU RNG a family's loss draws from (DFlash's anchors), kept apart from decoding's and saved with the rest
        self.torch_rng = torch.Generator().manual_seed(settings.seed).get_state()
        self.requests = 0  # requests learned from (held out ones included)
        self._during: list[dict] = []  # the current request's updates in its middle (every_tokens)
        self.updates = self.rollbacks = self.steps = 0
        # the held-out acceptance (per example) of the weights the session has, and the held-out set it was measured
        # on: the next update's "before" while that set is unchanged
        self._guarded: tuple[int, list[float]] | None = None
        self.dir = Path(settings.dir)
        # before any request: a folder at learner.dir that selfspec did not write is refused (or backed up)
        folders.make_way(self.dir, "learner", settings.overwrite, key="learner.overwrite", setting="learner.dir")
        if settings.resume and (self.dir / STATE_FILE).is_file():
            self._resume()

    def _store_layers(self) -> list[int]:
        """The layers the family's feature store keeps beside the last: the heads' own ``feature_layers`` where its
        row ``reads_layers`` (EAGLE-3's fused inputs, DFlash's context), none where they read the last alone."""
        return list(self.core.feature_layers) if FAMILIES[self.head_type].reads_layers else []

    def bytes_per_position(self) -> int:
        return bytes_per_position(self.core.config.hidden_size, len(self.layers), self.dtype)

    def memory_bound(self) -> int:
        """Bytes the learner can hold at most: both buffers full, and the float32 heads with AdamW's two moments."""
        params = sum(p.numel() for p in self.module.parameters()) * 4
        trainable = sum(p.numel() for p in self.params) * 4
        positions = self.buffer.max_tokens + self.holdout.max_tokens + 2 * self.settings.max_length
        return positions * self.bytes_per_position() + params + 2 * trainable

    def recorder(self) -> Recorder:
        """What follows the next request: a :class:`LearningRecorder` with ``every_tokens``, else a plain one."""
        self._during = []
        if self.settings.every_tokens:
            return LearningRecorder(self, self.settings.every_tokens)
        return Recorder(self.layers, self.dtype, self.settings.max_length)

    # --- after a request ----------------------------------------------------------------------------------------

    def learn(self, example: dict[str, torch.Tensor] | None) -> dict:
        """Take one finished request's example: held out or buffered, then (if the buffer holds ``min_tokens`` answer
        tokens and there is a held-out example) ``steps`` optimizer steps, guarded; saved every ``save_every``.
        Returns what happened."""
        report: dict[str, Any] = {"request": self.requests}
        if self._during:
            report["during"], self._during = self._during, []
        if example is None:
            return report
        held_out = self.requests % self.settings.holdout_every == 0
        (self.holdout if held_out else self.buffer).add(example)
        self.requests += 1
        report["held_out"] = held_out
        if (not held_out and self.settings.steps and self.buffer.answer_tokens >= self.settings.min_tokens
                and (self.holdout.examples or not self.settings.guard)):
            report.update(self.update())
        if self.settings.save_every and self.requests % self.settings.save_every == 0:
            self.save()
        return report

    def prefixes(self, example: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """:func:`prefixes` of ``example`` under ``every_tokens`` (none when it is 0): what learning every N tokens
        hands :meth:`learn_partial` during the request that made it."""
        every = self.settings.every_tokens
        return prefixes(example, every) if every else []

    def learn_partial(self, example: dict[str, torch.Tensor] | None) -> dict | None:
        """In the middle of a request (``every_tokens``): :meth:`update` on the buffer and ``example``, this answer
        so far, which is not buffered (the finished request's :meth:`learn` buffers the whole). Nothing when the
        request is one to hold out, or :meth:`learn` would not update yet. Returns what happened, or None."""
        s = self.settings
        if (example is None or not s.steps or self.requests % s.holdout_every == 0
                or (s.guard and not self.holdout.examples)
                or self.buffer.answer_tokens + int((example["labels"] >= 0).sum()) < s.min_tokens):
            return None
        report = self.update(extra=example)
        self._during.append(report)
        return report

    def update(self, extra: dict[str, torch.Tensor] | None = None) -> dict:
        """``steps`` optimizer steps on the buffer (and ``extra``, drawn as one more example of it); kept (and
        copied into the session's heads) unless the guard sees the held-out acceptance fall, else rolled back."""
        snapshot = (copy.deepcopy(self.module.state_dict()), copy.deepcopy(self.optimizer.state_dict()))
        guard = self.settings.guard
        held_out = self._held_out_key()
        before = (self._guarded[1] if self._guarded and self._guarded[0] == held_out  # these weights, measured
                  else self.held_out_scores()) if guard else None
        losses = [self.train_step(extra) for _ in range(self.settings.steps)]
        after = self.held_out_scores() if guard else None
        out = {"loss": sum(losses) / len(losses), "before": _mean(before), "after": _mean(after)}
        if before is not None and significantly_lower(before, after, self.settings.guard_z):
            self.module.load_state_dict(snapshot[0])
            self.optimizer.load_state_dict(snapshot[1])
            self.rollbacks += 1
            self._guarded = (held_out, before)
            out["rolled_back"] = True
            return out
        self._guarded = (held_out, after) if guard else None
        self.updates += 1
        self.steps += len(losses)
        with torch.no_grad():
            self.heads.load_state_dict(self.core.state_dict())
        out["rolled_back"] = False
        return out

    def _held_out_key(self) -> int:
        """What identifies the held-out set: it changes only when an example is added (and the oldest dropped)."""
        return self.holdout.added

    def _autocast(self):
        mp = self.settings.mixed_precision
        if mp == "no":
            return nullcontext()

        if mp == "bf16" or native_bf16(self.device):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _batch(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        pad = self.target.tokenizer.pad_token_id
        batch = collate_features(examples, 0 if pad is None else int(pad))
        return {k: v.to(self.device) for k, v in batch.items()}

    def train_step(self, extra: dict[str, torch.Tensor] | None = None) -> float:
        """One optimizer step on ``batch_size`` examples drawn from the buffer (and ``extra``), with replacement."""
        examples = list(self.buffer.examples) + ([extra] if extra is not None else [])
        picks = [examples[self.rng.randrange(len(examples))] for _ in range(self.settings.batch_size)]
        batch = self._batch(picks)
        self.module.train()
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), self._autocast():
            torch.set_rng_state(self.torch_rng)
            num_items = self.method.count_items(batch).clamp(min=1)
            loss, _ = self.method.compute_loss(batch, self.target, self.module, num_items)
            loss.backward()
            self.torch_rng = torch.get_rng_state()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.eval()
        return float(loss.detach())

    def held_out_scores(self) -> list[float]:
        """:meth:`acceptance` of each held-out example."""
        return self.acceptance(self.holdout.examples)

    @torch.no_grad()
    def acceptance(self, examples: Iterable[dict[str, torch.Tensor]]) -> list[float]:
        """Per example, the chain acceptance of the weights being trained, as the family's evaluation reports it
        (DFlash's ``eval/accept_length_on_path``, EAGLE's ``eval/accept_length_chain``), each under a fixed seed:
        DFlash draws its evaluation anchors the same way for every call."""
        scores = []
        for example in examples:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.settings.seed)
                metrics = self.method.evaluate([self._batch([example])], self.target, self.module,
                                               _OneProcess(self.device))
            scores.append(float(metrics.get("eval/accept_length_on_path", metrics["eval/accept_length_chain"])))
        return scores

    def held_out_acceptance(self) -> float:
        """The mean of :meth:`held_out_scores`."""
        return _mean(self.held_out_scores())

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self) -> Path:
        """The adapted heads (a heads folder: decode, export and serve it like any other) and the learner's state
        (optimizer, buffers, counters), written together into ``learner.dir`` atomically."""
        tmp = folders.temp_dir(self.dir, "learner")
        try:
            meta = {k: v for k, v in self.heads_config.items()
                    if k not in ("format_version", "head_type", "base_model", "target_fingerprint", "hidden_size",
                                 "vocab_size", "num_heads", "num_layers", "head_config", "adapter", "weights_sha256",
                                 "model")}
            meta["learned"] = {"requests": self.requests, "updates": self.updates, "rollbacks": self.rollbacks,
                               "steps": self.steps, "from": self.heads_config.get("learned_from")
                               or self.heads_config.get("run_name")}
            self.method.save(tmp / HEADS_DIR, self.module, self.target, meta)
            state = {"optimizer": self.optimizer.state_dict(), "buffer": self.buffer.state(),
                     "holdout": self.holdout.state(), "rng": self.rng.getstate(), "torch_rng": self.torch_rng,
                     "counters": {"requests": self.requests, "updates": self.updates, "rollbacks": self.rollbacks,
                                  "steps": self.steps}}
            torch.save(state, tmp / STATE_FILE)
            folders.replace_dir(tmp, self.dir, self.settings.overwrite, kind="learner", key="learner.overwrite",
                                setting="learner.dir")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.dir

    def _resume(self) -> None:
        """The state :meth:`save` left in ``learner.dir``: the heads (into the training copy and the session's
        heads), optimizer, buffers and counters."""
        try:
            loaded = load_heads(self.dir / HEADS_DIR, target=self.target)
            state = torch.load(self.dir / STATE_FILE, weights_only=True)  # tensors and plain containers
            self.core.load_state_dict(loaded.module.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
            buffer, holdout, rng, torch_rng, c = (state[k] for k in ("buffer", "holdout", "rng", "torch_rng",
                                                                     "counters"))
        except Exception as err:  # noqa: BLE001 - named with the fix
            raise LearnSetupError(f"learner.dir={self.dir} holds no learner state that loads ({type(err).__name__}: "
                                   f"{err}). Point learner.dir elsewhere, or give learner.resume=false to start over "
                                   "from heads= (the next save replaces that folder).") from err
        with torch.no_grad():
            self.heads.load_state_dict(loaded.module.state_dict())
        self.buffer.load(buffer)
        self.holdout.load(holdout)
        self.rng.setstate(rng)
        self.torch_rng = torch_rng
        self.requests, self.updates, self.rollbacks, self.steps = c["requests"], c["updates"], c["rollbacks"], c["steps"]

    def summary(self) -> dict:
        return {"requests": self.requests, "updates": self.updates, "rollbacks": self.rollbacks, "steps": self.steps,
                "buffer_tokens": self.buffer.tokens, "holdout_tokens": self.holdout.tokens,
                "buffer_bytes": self.buffer.nbytes() + self.holdout.nbytes(), "memory_bound": self.memory_bound()}


def online_learner(session: Any) -> OnlineLearner:
    """The learner ``learn=true`` decodes with (a ``selfspec.decode.session.LearnerFactory``): trains the session's
    heads in place, as its ``learner.*`` settings say. The commands that decode with learning hand it to
    ``load_session``."""
    return OnlineLearner(session.heads, session.family, session.heads_config or {}, session.target,
                         LearnSettings.from_dict(session.settings.learner))


__all__ = ["LearnSettings", "LearnSetupError", "LearningRecorder", "OnlineLearner", "Recorder", "ReplayBuffer",
           "online_learner", "training_method", "bytes_per_position", "prefixes"]
