"""A decode session: the target, a drafter family's heads and settings, and the engine they decode with, loaded once
from a composed conf/decode/decode.yaml (:func:`load_session`). Batch size 1.

:meth:`Session.decoder_for` is the one way to get an engine on the session's target under other settings: another
family (``"vanilla"``: plain decoding), other ``draft.*`` settings (adaptive depth or the suffix drafter off, another
tree), another heads module of the family. decode/run.py, the benchmark, the serving check, the tree sweep and a
training run's speed check all decode through it.

:func:`hf_generate` is Hugging Face ``generate`` on the session's target under its settings: the reference of
speedup and losslessness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from selfspec.core.target import Target, load_target
from selfspec.decode import registry
from selfspec.decode.adaptive import AdaptiveDepth, measured_cost_curve
from selfspec.decode.engine import DecodeResult, Observer, SpeculativeDecoder
from selfspec.cpu_kernels.linear_kernels import use_small_batch
from selfspec.decode.hybrid import build_hybrid
from selfspec.decode.registry import DrafterEntry
from selfspec.decode.settings import DecodeSettings
from selfspec.decode.step import synchronize
from selfspec.decode.types import DecodeSetupError, Drafter
from selfspec.decode.verify import Sampling
from selfspec.heads.io import load_heads, read_heads_config, reinitialize


class Learner(Protocol):
    """What a session learns with under ``learn=true``: it trains the session's heads in place between requests.
    decode builds none: the command that asks for ``learn=true`` hands :func:`load_session` a :data:`LearnerFactory`
    (decode/run.py and the learning benchmarks hand train/online.py's ``OnlineLearner``)."""

    def recorder(self) -> Observer:
        """A fresh observer of one request: what the engine shows it becomes the example :meth:`learn` takes."""
        ...

    def learn(self, example: dict[str, torch.Tensor]) -> dict:
        """Learn from one request's example; what the update did."""
        ...

    def save(self) -> None: ...

    def summary(self) -> dict: ...


LearnerFactory = Callable[["Session"], Learner]  # the session (its heads, target, family, settings) -> its learner


@dataclass
class Session:
    """What :func:`load_session` loads; ``decoder`` is :meth:`decoder_for` under the session's own settings."""

    settings: DecodeSettings
    target: Target  # the model to decode with (a Medusa-2 adapter already merged in)
    family: str  # the registry entry the drafter came from (decode/registry.py)
    draft_settings: dict  # its settings: defaults < saved with the heads < draft.*
    heads: torch.nn.Module | None  # the module the family's drafter runs (None: a training-free family)
    heads_config: dict | None  # the heads folder's config.json (None: random heads or none)
    decoder: SpeculativeDecoder = field(init=False)
    learner: Learner | None = field(default=None, init=False)  # learn=true: what trains ``heads`` between requests
    last_learned: dict | None = field(default=None, init=False)  # what the last request's update did

    def __post_init__(self) -> None:
        self.decoder = self.decoder_for()

    def generate(self, ids: list[int], learn: bool = True, on_tokens: Callable[[list[int]], None] | None = None,
                 **overrides: Any) -> DecodeResult:
        """Decode ``ids`` with the session's decoder under its settings (``overrides``: other ``generate`` keyword
        arguments, e.g. ``max_new_tokens``). With ``learn=true`` in the settings, the heads then learn from this
        request, unless ``learn=False`` here (a request that must not be stored: nothing of it is kept)."""
        if self.learner is None or not learn:
            return self.decoder.generate(ids, on_tokens=on_tokens, **{**self.generate_kwargs, **overrides})
        result, example = self.record(ids, on_tokens=on_tokens, **overrides)
        self.last_learned = self.learner.learn(example)
        return result

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        """The session's settings as ``SpeculativeDecoder.generate`` keyword arguments (any of its decoders)."""
        s = self.settings
        return {"max_new_tokens": s.max_new_tokens, "sampling": s.sampling, "stop": s.stop, "seed": s.seed}

    def record(self, ids: list[int], on_tokens: Callable[[list[int]], None] | None = None,
               **overrides: Any) -> tuple[DecodeResult, dict[str, torch.Tensor]]:
        """Decode ``ids`` as :meth:`generate` does and return the answer with the example ``learn=true`` keeps of
        it (train/online.py's Recorder), learning nothing from it yet. Needs the session's learner."""
        recorder = self.learner.recorder()
        result = self.decoder.generate(ids, on_tokens=on_tokens, observer=recorder,
                                       **{**self.generate_kwargs, **overrides})
        return result, recorder.example(result.tokens)

    def close(self) -> None:
        """Save what the heads learned (learn=true); nothing otherwise."""
        if self.learner is not None:
            self.learner.save()

    @property
    def sampling(self) -> Sampling:
        return self.settings.sampling

    def settings_for(self, family: str | None = None, draft: dict | None = None) -> tuple[DrafterEntry, dict]:
        """The registry entry and the settings :meth:`decoder_for` builds its drafter from."""
        entry = registry.entry(family or self.family)
        if entry.name == self.family:
            return entry, entry.settings(self.heads_config, {**self.settings.draft, **(draft or {})})
        return entry, entry.settings(None, draft)

    def decoder_for(self, family: str | None = None, draft: dict | None = None,
                    heads: torch.nn.Module | None = None) -> SpeculativeDecoder:
        """An engine on this session's target, with its linear kernels, under other settings:

        - ``family``: another registry entry, with its defaults and no heads (``"vanilla"``: plain decoding); None:
          the session's own family, with its heads and settings (defaults < saved with the heads < draft.*);
        - ``draft``: ``draft.*`` settings over those (e.g. ``{"suffix": False}``: the heads alone, without the suffix
          drafter's proposals; ``{"adaptive": False}``: the whole tree every step); a setting the family does not
          take is refused;
        - ``heads``: another module of the session's family instead of its own (another layer-skip exit).

        As the session's own decoder, it is a hybrid with the suffix drafter under ``suffix`` and has an adaptive
        depth policy under ``adaptive``: ``decoder_for()`` builds a decoder equal to ``self.decoder``, with nothing
        learned yet."""
        entry, settings = self.settings_for(family, draft)
        if heads is None and entry.name == self.family:
            heads = self.heads
        if entry.needs_heads and heads is None:
            raise DecodeSetupError(f"The {entry.name} drafter needs heads of its own; this session has "
                                   f"{self.family} heads or none. Load a session with heads of that family.")
        drafter = entry.build(heads, self.target, settings)
        return _engine(self.target, drafter, settings, self.settings.linear_kernel)


def _engine(target: Target, drafter: Drafter, settings: dict, kernel: str) -> SpeculativeDecoder:
    """The engine for ``drafter`` under its settings (a family without a setting has it off): adaptive depth if
    ``adaptive``; with ``suffix``, the drafter and the suffix drafter merged into one tree per step
    (decode/hybrid.py:build_hybrid), the engine's depth policy then applied to the drafter's part."""
    policy = (depth_policy(target.model, kernel, drafter.max_draft_depth, drafter.verify_share, drafter)
              if settings.get("adaptive") else None)
    if settings.get("suffix"):
        drafter = build_hybrid(target, drafter, settings)
    return SpeculativeDecoder(target.model, drafter, decode=target.tokenizer.decode, linear_kernel=kernel,
                              depth_policy=policy)


def depth_policy(model: torch.nn.Module, linear_kernel: str, full_depth: int | None = None,
                 verify_share: float = 1.0, drafter: Drafter | None = None) -> AdaptiveDepth:
    """Adaptive draft depth under this machine's verify cost curve, measured with the kernels the engine will run;
    ``full_depth``: the deepest draft the drafter proposes (None: the first step shows it); ``verify_share``: the
    share of a forward its verify pass runs (a layer-skip drafter's ``verify_share``; 1 for the others);
    ``drafter``: the drafter whose ``draft_nodes`` give each depth's tree size from the first step (a static tree's
    first levels can cost several forwards: guessed as a chain, they were drafted whole at the start)."""
    device = next(model.parameters()).device
    curve = measured_cost_curve(model, "small_batch" if use_small_batch(linear_kernel, device) else "torch")
    nodes = {}
    if drafter is not None and full_depth is not None:
        nodes = {d: n for d in range(1, full_depth + 1) if (n := drafter.draft_nodes(d)) is not None}
    return AdaptiveDepth(curve, full_depth=full_depth, verify_share=verify_share, nodes=nodes)


def choose_family(name: str | None, heads: str | None, heads_config: dict | None) -> DrafterEntry:
    """The registry entry for ``drafter=`` and ``heads=``: by default the family the heads were trained as."""
    if name is None:
        name = heads_config["head_type"] if heads_config else ("medusa" if heads == "random" else "vanilla")
    chosen = registry.entry(str(name))
    if heads_config and chosen.takes_heads and chosen.name != heads_config["head_type"]:
        raise DecodeSetupError(
            f"{heads} holds {heads_config['head_type']!r} heads; drafter={chosen.name} drafts with {chosen.name} "
            f"heads. Leave drafter unset to use the heads' own drafter."
        )
    if chosen.needs_heads and heads is None:
        raise DecodeSetupError(f"The {chosen.name} drafter needs heads: give heads=FOLDER (or heads=random).")
    return chosen


def load_drafter_heads(chosen: DrafterEntry, heads: str | None, heads_config: dict | None, target: Target,
                       random_options: dict, heads_check: str = "full") -> tuple[Target, torch.nn.Module | None]:
    """The heads module the drafter runs (loaded and checked against the target, or random), and the target to
    decode with (a Medusa-2 adapter merged in). ``heads_check``: ``full`` or ``shape`` (core/target.py)."""
    if not chosen.takes_heads or (heads_config is None and not chosen.needs_heads):
        return target, None
    if heads_config is None:
        return target, chosen.random_heads(target.model, **random_options)
    loaded = load_heads(heads, target=target, heads_check=heads_check)  # refuses heads trained for another target
    return Target(model=loaded.target, tokenizer=target.tokenizer, name=target.name), loaded.module


def load_session(cfg: Any, untrained: bool = False, learner: LearnerFactory | None = None) -> Session:
    """The session of a composed ``conf/decode/decode.yaml`` (its settings read once: :class:`DecodeSettings`).
    ``untrained``: its heads re-initialised as their family builds them before training, their make kept
    (heads/io.py:reinitialize, under ``random_heads.seed``): the stream benchmark's untrained control. ``learner``:
    what ``learn=true`` learns with, built from the session (decode itself trains nothing)."""
    settings = DecodeSettings.from_config(cfg)
    heads_config = None
    if settings.heads not in (None, "random"):
        heads_config = read_heads_config(settings.heads)
    chosen = choose_family(settings.family, settings.heads, heads_config)
    draft_settings = chosen.settings(heads_config, settings.draft)
    target = load_target(settings.target_settings(heads_config))
    target, module = load_drafter_heads(chosen, settings.heads, heads_config, target, settings.random_heads,
                                        settings.heads_check)
    if untrained and module is not None and heads_config is not None:
        reinitialize(module, heads_config, target.model, seed=int(settings.random_heads.get("seed", 0)))
        heads_config = {**heads_config, "learned_from": f"untrained (the make of {settings.heads})"}
    session = Session(settings=settings, target=target, family=chosen.name, draft_settings=draft_settings,
                      heads=module, heads_config=heads_config)
    if settings.learn:
        if learner is None:
            raise DecodeSetupError("learn=true trains the heads while decoding, which this command does not do: run "
                                   "it with decode/run.py (selfspec-decode), or give learn=false.")
        session.learner = learner(session)
    return session


def hf_generate(session: Session, ids: list[int], settings: DecodeSettings | None = None) -> tuple[list[int], float]:
    """Hugging Face ``generate`` on the session's target and the same ids, under ``settings`` (None: the session's):
    (new tokens, seconds)."""
    model, tokenizer = session.target.model, session.target.tokenizer
    s = settings or session.settings
    sampling = s.sampling
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens,
        "eos_token_id": sorted(session.decoder.eos_token_ids) or None,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if sampling.acceptance == "greedy":
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if s.stop:
        kwargs.update(stop_strings=s.stop, tokenizer=tokenizer)
    torch.manual_seed(s.seed)
    input_ids = torch.tensor([ids], device=device)
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    synchronize(device)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0
