"""Check exported heads in a real serving engine (vLLM's CPU build), beside selfspec's own engine.

``scripts/serve_check.py`` and ``scripts/bench.py``'s vLLM rows call this. vLLM pins its own torch and transformers, so
it lives in a virtualenv of its own (``scripts/make_vllm_venv.sh`` makes it; ``.ci/run`` too; core/vllm_env.py finds
it): this module writes a job, runs ``serve/serving_worker.py`` with that venv's Python and reads its answer. Both
engines decode the same prompt token ids greedily. A check's vLLM engines (plain decoding, then each format) start one
after another in one worker process; :func:`serve_checks` runs several checks' engines so, on one target or several.

What :func:`serve_check` compares, per format and prompt:

- that vLLM loaded the exported folder;
- vLLM's tokens with its drafter against vLLM's plain decoding and Hugging Face ``generate`` (greedy: equal or lost);
- vLLM's acceptance counters per draft position against selfspec's engine drafting the same thing: the same heads
  as a chain of ``k`` (vLLM verifies chains), adaptive depth off, suffix drafter off;
- tokens/s of both engines, and the speedup the heads give inside vLLM.

The acceptance comparison counts the same steps in both engines. vLLM drafts ``k`` tokens every step, even when fewer
are left to emit; selfspec's engine drafts at most what is left. So selfspec's run gets ``k`` more tokens of budget and
only its steps until it has emitted the answer's length are counted: those are the steps vLLM ran.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.core import folders
from selfspec.core.families import FAMILIES
from selfspec.core.archs import context_limit
from selfspec.core.vllm_env import (  # noqa: F401 - the venv's names, used from here by the bench, the CLI and the tests
    ENGINE_DEFAULTS,
    REPO,
    ServingError,
    selfspec_pythonpath,
    served_target_dir,
    vllm_available,
    vllm_python,
    worker_env,
)
from selfspec.decode.adaptive import measured_cost_curve
from selfspec.decode.families import DRAFTERS
from selfspec.decode.prompts import prompt_ids
from selfspec.decode.session import hf_generate, load_session
from selfspec.decode.settings import decode_config, required
from selfspec.heads.export import (FORMATS as EXPORT_FORMATS, VLLM_TOKEN_MAP_FLAG, export_heads, medusa_vocab,
                                   served_exports)
from selfspec.heads.io import heads_dir, read_heads_config
from selfspec.serve.vllm_hybrid import COUNTS_RPC, HOOK, TRAINED_TOKENS_ENV
from selfspec.serve.vllm_suffix import COST_CURVE_ENV

WORKER = Path(__file__).resolve().parent / "serving_worker.py"


# --- the formats, and how vLLM is told to draft with each -------------------------------------------------------------


@dataclass(frozen=True)
class ServedFormat:
    export: str  # heads/export.py's format
    method: str | None  # vLLM's speculative method; None: the folder is served itself (``vllm serve <folder>``)
    hybrid: bool = False  # selfspec's hybrid proposer around vLLM's own (serve/vllm_hybrid.py)

    def run(self, folder: str | Path, k: int, name: str | None = None) -> dict:
        """The worker's run: the target with ``--speculative-config``, or (speculators) the exported folder alone,
        which names its verifier and its speculative settings itself. A hybrid run names selfspec's hook as vLLM's
        ``worker_extension_cls`` (selfspec on the worker's ``PYTHONPATH``: :func:`needs_selfspec`) and reports
        how many chains each drafter sent."""
        name = name or self.export
        if self.method is None:
            return {"name": name, "model": str(folder), "speculative_config": None}
        run = {"name": name,
               "speculative_config": {"method": self.method, "model": str(folder), "num_speculative_tokens": int(k)}}
        if self.hybrid:
            run["engine"] = {"worker_extension_cls": HOOK}
            run["rpc"] = COUNTS_RPC
        return run


def _served_formats() -> dict[str, ServedFormat]:
    """Every export vLLM serves, with the method that serves it, as the families' rows declare them (``exports``), in
    heads/export.py's order of formats."""
    served = {fmt: ServedFormat(fmt, method) for f in FAMILIES.values() for fmt, method in f.exports.items()}
    return {fmt: served[fmt] for fmt in EXPORT_FORMATS if fmt in served}


FORMATS = _served_formats()
HYBRID = "hybrid"  # the format name of selfspec's hybrid proposer: the family's own export, served through the hook


def served_format(fmt: str, head_type: str) -> ServedFormat:
    """How vLLM serves ``fmt`` for ``head_type`` heads: hybrid is the family's own export (its row's
    ``hybrid_export``: eagle3 or dflash) with selfspec's hybrid proposer around vLLM's."""
    if fmt == HYBRID:
        return replace(FORMATS[FAMILIES[head_type].hybrid_export], hybrid=True)
    return FORMATS[fmt]


def formats_for(head_type: str, head_config: dict) -> list[str]:
    """Every format these heads (their type and saved ``head_config``) export to that vLLM serves (the hybrid too,
    for the families it extends): heads/export.py's ``served_exports``, and the hybrid where the family joins it."""
    exports = served_exports(head_type, head_config)
    return [*exports, *([HYBRID] if exports and FAMILIES[head_type].vllm_hybrid else [])]


def default_formats(head_type: str, head_config: dict) -> list[str]:
    """What a serve check checks when not told: every format but the hybrid (one more vLLM engine; ask for it with
    formats=[hybrid])."""
    return [f for f in formats_for(head_type, head_config) if f != HYBRID]


def needs_selfspec(runs: list[dict]) -> bool:
    """Whether any of ``runs`` imports selfspec inside vLLM's venv: a selfspec ``custom_class`` proposer, or a
    ``worker_extension_cls`` (the hybrid's hook)."""
    def imports_selfspec(run: dict) -> bool:
        spec = run.get("speculative_config") or {}
        own_proposer = spec.get("method") == "custom_class" and str(spec.get("model", "")).startswith("selfspec.")
        return own_proposer or "worker_extension_cls" in (run.get("engine") or {})

    return any(imports_selfspec(r) for r in runs)


def proposer_env(model: torch.nn.Module, linear_kernel: str, longest: int, trained: int) -> dict[str, str]:
    """The environment selfspec's proposers read inside vLLM's worker: the target's verify cost curve as selfspec
    measured it on this machine, for chains up to ``longest`` tokens (the proposers' prior until they have measured
    vLLM's own: serve/vllm_suffix.py's MeasuredCurve), and the hybrid's EAGLE-3 chain length ``trained``
    (serve/vllm_hybrid.py)."""
    curve = measured_cost_curve(model, linear_kernel if model.device.type == "cpu" else "torch")
    return {COST_CURVE_ENV: json.dumps({n: curve.cost(n) for n in range(1, longest + 2)}),
            TRAINED_TOKENS_ENV: str(trained)}


def chain_settings(head_type: str, k: int) -> dict:
    """selfspec's draft settings that propose what vLLM proposes: a chain of k (the family's ``chain``,
    decode/families.py), no adaptive depth, no suffix."""
    drafting = DRAFTERS.get(head_type)
    if drafting is None or drafting.chain is None:
        raise ServingError(f"{head_type} heads have no vLLM format.")
    return {**drafting.chain(k), "adaptive": False, "suffix": False}


# --- running vLLM -----------------------------------------------------------------------------------------------------


def run_vllm(job: dict, venv: str | Path | None = None, timeout: float | None = None, quiet: bool = True,
             log_path: str | Path | None = None, one_process: bool = False) -> dict:
    """Run ``job`` (see serve/serving_worker.py) in vLLM's venv, each of its runs in a worker process of its own
    (``one_process``: all in one); returns their results in order. ``timeout``: seconds for all the runs together.
    vLLM's log (every run's, in order) is copied to ``log_path`` when given; the lines that name each failed run's
    cause are kept in that run's ``log_errors``.

    One process per run by default: with the engine in the worker's process (ENGINE_ENV_DEFAULTS), vLLM 0.32 does not
    start every kind of engine reliably after another in the same process (a suffix engine after an ngram one, or an
    ngram one after engines of other models, fails in its executor with ``AttributeError: '_lib_fn_wrapper' object
    has no attribute 'get'``); a fresh process pays vLLM's imports again (slow on a small CPU) and leaves each run as
    a user's own script would run it. Plain, ``medusa``, ``eagle``, ``eagle3``, ``dflash`` and speculators engines do
    start one after another in one process (the worker tears each one's distributed state down), also after one that
    failed, on one target or several: :func:`serve_checks` runs them so."""
    python = vllm_python(venv)
    job = {**job, "engine": {**ENGINE_DEFAULTS, **job.get("engine", {})}}
    result: dict = {"vllm_version": None, "runs": []}
    texts = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for runs in [job["runs"]] if one_process else [[run] for run in job["runs"]]:
            left = None if deadline is None else max(1.0, deadline - time.monotonic())
            one, text = _run_worker(python, {**job, "runs": runs}, left)
            texts.append(text)
            if not quiet:
                sys.stderr.write(text)
            result["vllm_version"] = one.get("vllm_version")
            result["runs"] += one["runs"]
    finally:
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(log_path).write_text("".join(texts))
    return result


def _run_worker(python: Path, job: dict, timeout: float | None) -> tuple[dict, str]:
    """One worker process over ``job``: (its result, its log). Raises ServingError when it stops before reporting
    every run, with the log's tail."""
    with tempfile.TemporaryDirectory(prefix="selfspec-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        env = worker_env(job.get("pythonpath"), job.get("env"))
        log = Path(tmp) / "vllm.log"
        with open(log, "w") as out:
            proc = subprocess.run([str(python), "-P", str(WORKER), str(job_path), str(result_path)], cwd=tmp, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        text = log.read_text(errors="replace")
        tail = "\n".join(text.strip().splitlines()[-15:])
        if not result_path.exists():
            raise ServingError(f"vLLM's worker exited with status {proc.returncode} before reporting:\n{tail}")
        result = json.loads(result_path.read_text())
        errors = [line for line in text.splitlines() if "Error" in line and "Traceback" not in line]
        for run in result["runs"]:
            if run.get("error"):
                run["log_errors"] = list(dict.fromkeys(errors))[-6:]
        if proc.returncode != 0 or len(result["runs"]) < len(job["runs"]):
            raise ServingError(f"vLLM's worker stopped (status {proc.returncode}) after {len(result['runs'])} of "
                               f"{len(job['runs'])} runs:\n{tail}")
        return result, text


# --- acceptance, counted the way vLLM counts it -----------------------------------------------------------------------


def acceptance_per_position(depths: list[int], accepted: list[int], emitted: list[int], length: int,
                            k: int) -> dict:
    """vLLM's counters from selfspec's per-step record, over the steps until ``length`` tokens were emitted (the
    steps vLLM runs for an answer of that length; the prefill emitted the first): drafts, draft tokens, accepted,
    accepted per position."""
    per_pos = [0] * k
    drafts = draft_tokens = total = 0
    done = 1
    for depth, acc, out in zip(depths, accepted, emitted):
        if done >= length:
            break
        if depth > 0:
            drafts += 1
            draft_tokens += depth
            total += acc
            for i in range(min(acc, k)):
                per_pos[i] += 1
        done += out
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": total, "accepted_per_pos": per_pos}


def rates(counts: dict) -> list[float]:
    """Per-position acceptance rate: accepted at position i over drafts."""
    n = counts["drafts"]
    return [a / n if n else 0.0 for a in counts["accepted_per_pos"]]


def cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- the check --------------------------------------------------------------------------------------------------------


@dataclass
class CheckSettings:
    """The serving check's settings: conf/decode/serve_check.yaml describes them and writes their defaults, the only
    place they are written (:meth:`from_config`)."""

    k: int | str  # tokens vLLM drafts per step (num_speculative_tokens); auto: :func:`requested_depth`
    max_new_tokens: int
    venv: str | None  # vLLM's venv (None: $SELFSPEC_VLLM_VENV, else .venv-vllm)
    model: Any  # the target (a name in conf/model/, a folder); None: the one the heads record
    target: dict  # settings over its model config (model.KEY=VALUE)
    out: str | None  # where the exports go (None: a temporary folder)
    warmup: bool  # decode one prompt first in every engine, not reported
    timeout: float | None  # seconds vLLM may take for all its runs
    tolerance: float  # per-position acceptance rates may differ by this much (serve_check.py's aim)
    vocab: str  # Medusa exports: full | draft | auto (heads/export.py:medusa_vocab)
    suffix_tokens: int  # the hybrid's num_speculative_tokens: the longest chain it sends (its trained drafter: k)

    @classmethod
    def from_config(cls, cfg: Any) -> "CheckSettings":
        """The settings of a composed conf/decode/serve_check.yaml."""
        c = required(cfg, ("k", "max_new_tokens", "model", "target", "out", "warmup", "tolerance", "vocab",
                           "suffix_tokens", "serving"))
        serving = required(c["serving"], ("vllm_venv", "timeout"))
        return cls(k=c["k"], max_new_tokens=int(c["max_new_tokens"]), venv=serving["vllm_venv"], model=c["model"],
                   target=dict(c["target"] or {}),
                   out=None if c["out"] is None else str(c["out"]), warmup=bool(c["warmup"]),
                   timeout=None if serving["timeout"] is None else float(serving["timeout"]),
                   tolerance=float(c["tolerance"]), vocab=str(c["vocab"]),
                   suffix_tokens=int(c["suffix_tokens"]))


def our_sessions(heads_path: str | Path, head_type: str, settings: CheckSettings):
    """(selfspec's chain-of-k session with the heads, plain decoding in the same engine on the same target, the
    Medusa export's vocabulary). Medusa heads exported over the full vocabulary draft over it here too."""
    base = {"heads": str(heads_path), "model": settings.model, "target": settings.target, "acceptance": "greedy",
            "max_new_tokens": settings.max_new_tokens + settings.k, "draft": chain_settings(head_type, settings.k)}
    chain = load_session(decode_config(base))
    vocab = None
    if "vllm" in FAMILIES[head_type].exports:  # the vLLM Medusa format's vocabulary option
        vocab = medusa_vocab(chain.heads, settings.vocab)
        if vocab == "full" and chain.heads.token_map is not None:
            chain.heads.token_map = None  # as vLLM will draft: argmax over the target's whole LM head
            chain.decoder = chain.decoder_for()
    return chain, chain.decoder_for("vanilla"), vocab


AUTO_DEPTH = 3  # what k=auto asks of heads that draft any depth (EAGLE-3); scripts/bench.py's vLLM proposers draft 3


def requested_depth(meta: dict, k: int | str) -> int:
    """``k`` as asked, or for ``auto`` what the heads draft in vLLM at :data:`AUTO_DEPTH` (:func:`served_depth`: fewer
    where a Medusa model has fewer heads; a DFlash drafter's own block less its first slot)."""
    if k == "auto":
        return served_depth(meta, AUTO_DEPTH)
    if isinstance(k, bool) or not str(k).isdigit() or int(k) < 1:
        raise ServingError(f"k={k!r}: give the tokens vLLM drafts a step, a whole number >= 1, or k=auto.")
    return int(k)


def checked_formats(meta: dict, formats: list[str] | None, k: int) -> list[str]:
    """``formats`` (default: every vLLM format these heads export to), each checked against the heads, and ``k``
    (resolved: :func:`requested_depth`) against what the heads draft in vLLM (:func:`served_depth`)."""
    head_type = meta["head_type"]
    layout = (meta.get("head_config") or {}).get("layout")
    available = formats_for(head_type, meta.get("head_config") or {})
    formats = list(formats or default_formats(head_type, meta.get("head_config") or {}))
    if not formats:
        served = "; ".join(f"{f.name} heads" + (" trained with " + " ".join(f"heads.{k}={str(v).lower()}" for k, v
                                                                          in f.export_needs.items())
                                                 if f.export_needs else "")
                           + f" to {' and '.join(f.exports)}" for f in FAMILIES.values() if f.exports)
        raise ServingError(f"{head_type} heads (layout={layout}) have no format vLLM serves. These do: {served}.")
    for fmt in formats:
        if fmt not in FORMATS and fmt != HYBRID:
            raise ServingError(f"format {fmt!r}: vLLM serves {', '.join([*FORMATS, HYBRID])}.")
        if fmt not in available:
            raise ServingError(f"{head_type} heads (layout={layout}) do not export to {fmt}; they export to "
                               f"{', '.join(available) or 'no vLLM format'}.")
    depth = served_depth(meta, k)
    if depth != k:  # Medusa's heads, or a DFlash drafter's own block
        raise ServingError(f"k={k}: these {head_type} heads draft {depth} tokens a step in vLLM when asked for {k}; "
                           f"check them with k={depth}.")
    return formats


def served_depth(meta: dict, k: int) -> int:
    """Tokens vLLM drafts a step with these heads (``meta``: their heads config) when asked for ``k``: what their
    family's ``served_depth`` says (decode/families.py: at most a Medusa model's heads; a DFlash drafter's own block
    less its first slot, whatever ``k``), ``k`` otherwise."""
    drafting = DRAFTERS.get(meta.get("head_type"))
    return drafting.served_depth(meta, k) if drafting is not None and drafting.served_depth is not None else k


@dataclass
class CheckPlan:
    """One serving check made ready to run: the heads exported, selfspec's sessions loaded, vLLM's job written."""

    heads: Path
    head_type: str
    settings: CheckSettings  # ``k`` resolved
    formats: list[str]
    exports: dict[str, Path]
    vocab: str | None  # a Medusa export's vocabulary
    chain: Any  # selfspec's chain-of-k session
    plain: Any  # selfspec's plain decoding on the same target
    eos: set[int]
    job: dict  # vLLM's job: plain decoding, then each format (serve/serving_worker.py)
    out_root: Path


def plan_check(heads_path: str | Path, prompts: list[list[int]] | list[str], formats: list[str] | None = None, *,
               settings: CheckSettings) -> CheckPlan:
    """Export the heads in every vLLM format (or ``formats``) and write the vLLM job that decodes ``prompts`` (token
    ids, or texts put through the target's chat template) plain and with each export."""
    heads_path = heads_dir(str(heads_path))
    meta = read_heads_config(heads_path)
    head_type = meta["head_type"]
    settings = replace(settings, k=requested_depth(meta, settings.k))
    formats = checked_formats(meta, formats, settings.k)
    chain, plain, vocab = our_sessions(heads_path, head_type, settings)
    target = chain.target
    if prompts and isinstance(prompts[0], str):
        prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    prompts = [list(map(int, p)) for p in prompts]
    eos = set(chain.decoder.eos_token_ids)
    limit = context_limit(target.model.config)
    drafted = max(settings.k, settings.suffix_tokens if HYBRID in formats else 0)  # the longest chain vLLM verifies
    longest = max(len(p) for p in prompts) + settings.max_new_tokens + drafted + 1
    if longest > limit:
        raise ServingError(f"The longest prompt plus max_new_tokens ({longest} tokens) exceeds the target's context "
                           f"({limit}); shorten the prompts or lower max_new_tokens.")
    # absolute: vLLM's worker runs in a folder of its own
    out_root = (Path(settings.out) if settings.out else Path(tempfile.mkdtemp(prefix="selfspec-serve-"))).resolve()
    folders.claim(out_root, "serve-check", setting="out")  # a folder of the user's is refused, untouched
    served = served_target_dir(target)
    exports, by_export = {}, {}  # per checked format; per export format (the hybrid runs the family's own export)
    for fmt in formats:
        export = served_format(fmt, head_type).export
        if export not in by_export:
            by_export[export], _ = export_heads(heads_path, out_root / export, target, fmt=export,
                                                vocab=vocab or "auto", verifier=str(served),
                                                speculative_tokens=settings.k)
        exports[fmt] = by_export[export]
    job = {
        "model": str(served),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "max_model_len": min(limit, longest + 8),
        "max_new_tokens": settings.max_new_tokens,
        "prompts": prompts,
        "stop_token_ids": sorted(eos),
        "warmup": [prompts[0][: max(1, len(prompts[0]) // 2)]] if settings.warmup else [],
        # vLLM <= 0.32 loads a Medusa token_map only without its strict weight check (heads/export.py:medusa_vocab)
        "engine": VLLM_TOKEN_MAP_FLAG if vocab == "draft" else {},
        "runs": [{"name": "plain", "speculative_config": None}]
        + [served_format(fmt, head_type).run(exports[fmt], settings.suffix_tokens if fmt == HYBRID else settings.k,
                                             name=fmt) for fmt in formats],
    }
    if needs_selfspec(job["runs"]):
        job["pythonpath"] = [selfspec_pythonpath()]
        job["env"] = proposer_env(target.model, chain.decoder.linear_kernel, drafted, settings.k)
    return CheckPlan(heads=heads_path, head_type=head_type, settings=settings, formats=formats, exports=exports,
                     vocab=vocab, chain=chain, plain=plain, eos=eos, job=job, out_root=out_root)


def finish_check(plan: CheckPlan, vllm: dict, plain_runs: dict | None = None) -> dict:
    """The report of ``plan`` (see :func:`format_report`) from vLLM's results for its job's runs (by name), with
    selfspec's engine run on the same prompts now (``plain_runs``: see :func:`run_ours`). Raises ServingError when
    vLLM could not decode the target itself."""
    plain = next(r for r in vllm["runs"] if r["name"] == "plain")
    if not plain["loaded"] or plain.get("error"):
        raise ServingError(f"vLLM could not decode the target itself: {plain.get('error')}")
    same_target = None if plain_runs is None else plain_runs.setdefault((plan.job["model"], plan.job["dtype"]), {})
    ours = run_ours(plan.chain, plan.plain, plan.job["prompts"], plan.settings, warmup=plan.job["warmup"],
                    plain_runs=same_target)
    return compare(vllm, ours, plan.formats, plan.eos, plan.settings, head_type=plan.head_type, heads=str(plan.heads),
                   vocab=plan.vocab, exports={f: str(p) for f, p in plan.exports.items()})


def serve_check(heads_path: str | Path, prompts: list[list[int]] | list[str], formats: list[str] | None = None, *,
                settings: CheckSettings, progress: bool = True) -> dict:
    """Export the heads in every vLLM format (or ``formats``), decode ``prompts`` (token ids, or texts put through
    the target's chat template) in vLLM plain and with each export, and in selfspec's engine; returns the report
    (see :func:`format_report`)."""
    plan = plan_check(heads_path, prompts, formats, settings=settings)
    if progress:
        print(f"[selfspec] vLLM: plain decoding and {', '.join(plan.formats)} on {len(plan.job['prompts'])} prompts, "
              "then selfspec's engine and HF generate on the same prompts", file=sys.stderr)
    [report] = serve_checks([plan], settings.venv, settings.timeout, log_path=plan.out_root / "vllm.log")
    if isinstance(report, ServingError):
        raise report
    return report


def serve_checks(plans: list[CheckPlan], venv: str | Path | None = None, timeout: float | None = None,
                 log_path: str | Path | None = None) -> list[dict | ServingError]:
    """The reports of several planned checks (:func:`plan_check`; heads of any family, on one target or several),
    their vLLM runs all in one worker process: vLLM's imports (slow on a small CPU) are paid once. A plain
    run that two plans share (the same target, prompts and engine settings) runs once. A plan whose target vLLM could
    not decode gets the ServingError :func:`serve_check` would raise in place of its report, so one such target
    leaves the others' reports."""
    shared = ("model", "dtype", "max_model_len", "max_new_tokens", "prompts", "stop_token_ids", "warmup", "engine")
    runs: dict[str, dict] = {}  # by the run's whole spec (its name aside)
    names: list[dict[str, str]] = []  # per plan: its run's name -> the name in the merged job
    for i, plan in enumerate(plans):
        names.append({})
        for run in plan.job["runs"]:
            spec = {**{k: plan.job[k] for k in shared}, **run}
            key = json.dumps({k: v for k, v in spec.items() if k != "name"}, sort_keys=True)
            runs.setdefault(key, {**spec, "name": f"{i}/{run['name']}"})
            names[i][run["name"]] = runs[key]["name"]
    job = {"runs": list(runs.values())}
    paths = [p for plan in plans for p in plan.job.get("pythonpath") or []]
    if paths:
        job["pythonpath"] = list(dict.fromkeys(paths))
    vllm = run_vllm(job, venv, timeout, log_path=log_path, one_process=True)
    by_name = {r["name"]: r for r in vllm["runs"]}
    reports: list[dict | ServingError] = []
    plain_runs: dict = {}  # HF generate's and selfspec's plain answers, once per target (and dtype) and prompt
    for plan, renamed in zip(plans, names):
        own = [{**by_name[merged], "name": name} for name, merged in renamed.items()]
        try:
            reports.append(finish_check(plan, {"vllm_version": vllm["vllm_version"], "runs": own}, plain_runs))
        except ServingError as err:
            reports.append(err)
    return reports


def run_ours(chain, plain, prompts: list[list[int]], settings: CheckSettings, warmup: list[list[int]],
             plain_runs: dict | None = None) -> list[dict]:
    """Per prompt: HF generate's tokens and time, selfspec's plain decoding, selfspec's chain of k (the steps vLLM
    runs counted as vLLM counts them). ``plain_runs``: a dict shared by the checks of one target (the folder vLLM
    loads, in one dtype) with several heads, where the first keeps HF generate's and plain decoding's answers and
    times for the others."""
    n, k = settings.max_new_tokens, settings.k
    answer_settings = dataclasses.replace(chain.settings, max_new_tokens=n)
    with torch.no_grad():
        for ids in warmup:
            plain.generate(ids, max_new_tokens=n)
            chain.decoder.generate(ids, max_new_tokens=n + k)
        rows = []
        plain_runs = {} if plain_runs is None else plain_runs
        for ids in prompts:
            key = (tuple(ids), n)
            if key not in plain_runs:
                hf_tokens, hf_s = hf_generate(chain, ids, answer_settings)
                p = plain.generate(ids, max_new_tokens=n)
                plain_runs[key] = (hf_tokens, hf_s, p.tokens, p.stats.total_s)
            hf_tokens, hf_s, plain_tokens, plain_s = plain_runs[key]
            c = chain.decoder.generate(ids, max_new_tokens=n + k)
            st = c.stats
            answer = cut_at_eos(c.tokens, set(chain.decoder.eos_token_ids))[:n]
            counts = acceptance_per_position(st.drafted_per_step, st.accepted_per_step, st.accept_lengths,
                                             len(answer), k)
            # the chain's time for the answer's length: its steps until then, in proportion
            rows.append({"hf": hf_tokens, "hf_s": hf_s, "plain": plain_tokens, "plain_s": plain_s,
                         "chain": answer, "chain_s": c.stats.total_s * len(answer) / max(1, len(c.tokens)),
                         **counts})
    return rows


def _mismatch(report: dict, i: int, engine: str, tokens: list[int], hf: list[int]) -> bool:
    """Record where ``tokens`` leave HF generate's (if they do); True when they equal it."""
    where = first_difference(tokens, hf)
    if where is not None:
        report["mismatches"].append({"prompt": i, "engine": engine, "position": where,
                                     "got": tokens[where: where + 3], "hf": hf[where: where + 3]})
    return where is None


def _add_counts(total: dict, counts: dict) -> None:
    for key in ("drafts", "draft_tokens", "accepted"):
        total[key] += counts[key]
    total["accepted_per_pos"] = [a + b for a, b in zip(total["accepted_per_pos"], counts["accepted_per_pos"])]


def format_entry(run: dict, ours: list[dict], fmt: str, eos: set[int], settings: CheckSettings,
                 report: dict) -> dict:
    """One format's figures: per prompt and summed, vLLM's counters beside selfspec's, tokens/s, lossless."""
    entry: dict[str, Any] = {"loaded": bool(run["loaded"]), "error": run.get("error"), "prompts": [],
                             "log_errors": run.get("log_errors", [])}
    if not run["loaded"] or run.get("error"):
        return entry
    k, n = settings.k, settings.max_new_tokens
    totals = {side: {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}
              for side in ("vllm", "selfspec")}
    seconds = {"vllm": [0, 0.0], "selfspec": [0, 0.0]}  # tokens, seconds
    for i, (vp, r) in enumerate(zip(run["prompts"], ours)):
        tokens = cut_at_eos(vp["tokens"], eos)
        lossless = _mismatch(report, i, f"vLLM {fmt}", tokens, cut_at_eos(r["hf"], eos)[:n])
        theirs = {**{key: vp[key] for key in ("drafts", "draft_tokens", "accepted")},
                  "accepted_per_pos": (vp["accepted_per_pos"] + [0] * k)[:k]}
        mine = {key: r[key] for key in ("drafts", "draft_tokens", "accepted", "accepted_per_pos")}
        _add_counts(totals["vllm"], theirs)
        _add_counts(totals["selfspec"], mine)
        seconds["vllm"] = [seconds["vllm"][0] + len(tokens), seconds["vllm"][1] + vp["seconds"]]
        seconds["selfspec"] = [seconds["selfspec"][0] + len(r["chain"]), seconds["selfspec"][1] + r["chain_s"]]
        entry["prompts"].append({
            "lossless": lossless, "vllm": {**theirs, "tokens_per_s": len(tokens) / vp["seconds"]},
            "selfspec": {**mine, "tokens_per_s": len(r["chain"]) / r["chain_s"] if r["chain_s"] else 0.0}})
    for side in ("vllm", "selfspec"):
        tokens, secs = seconds[side]
        entry[side] = {**totals[side], "rates": rates(totals[side]), "tokens_per_s": tokens / secs if secs else 0.0}
    entry["speedup_in_vllm"] = entry["vllm"]["tokens_per_s"] / report["vllm_plain_tokens_per_s"]
    entry["lossless"] = all(p["lossless"] for p in entry["prompts"])
    entry["max_rate_difference"] = max(
        (abs(a - b) for a, b in zip(entry["vllm"]["rates"], entry["selfspec"]["rates"])), default=0.0)
    entry["acceptance_equal"] = entry["max_rate_difference"] <= settings.tolerance
    if fmt == HYBRID:  # its chains are its own choice each step: nothing of selfspec's engine drafts the same
        entry["acceptance_equal"] = None
        entry["sent"] = run.get("rpc_result")  # chains sent per drafter, as the proposer counted them
    return entry


def compare(vllm: dict, ours: list[dict], formats: list[str], eos: set[int], settings: CheckSettings,
            **info: Any) -> dict:
    """The report: per format and prompt, loaded / tokens equal / acceptance per position in both engines."""
    runs = {r["name"]: r for r in vllm["runs"]}
    plain = runs["plain"]
    report = {"vllm_version": vllm.get("vllm_version"), "k": settings.k, "max_new_tokens": settings.max_new_tokens,
              "tolerance": settings.tolerance, **info, "formats": {}, "mismatches": []}
    n = settings.max_new_tokens
    vllm_plain_s = sum(p["seconds"] for p in plain["prompts"])
    report["vllm_plain_tokens_per_s"] = sum(len(p["tokens"]) for p in plain["prompts"]) / vllm_plain_s
    report["hf_tokens_per_s"] = sum(len(cut_at_eos(r["hf"], eos)[:n]) for r in ours) / sum(r["hf_s"] for r in ours)
    report["ours_plain_tokens_per_s"] = sum(len(r["plain"]) for r in ours) / sum(r["plain_s"] for r in ours)
    for i, (vp, r) in enumerate(zip(plain["prompts"], ours)):
        hf = cut_at_eos(r["hf"], eos)[:n]
        for name, tokens in (("vLLM plain", cut_at_eos(vp["tokens"], eos)), ("selfspec plain", r["plain"]),
                             ("selfspec chain", r["chain"])):
            _mismatch(report, i, name, tokens, hf)
    for fmt in formats:
        run = runs.get(fmt, {"loaded": False, "error": "not run", "prompts": []})
        report["formats"][fmt] = format_entry(run, ours, fmt, eos, settings, report)
    report["ok"] = not report["mismatches"] and all(
        f["loaded"] and not f["error"] and f["acceptance_equal"] is not False for f in report["formats"].values())
    return report


def format_report(report: dict) -> str:
    """The report as a few Markdown tables (overall, then per prompt)."""
    k = report["k"]
    lines = [
        f"vLLM {report['vllm_version']}, {report['head_type']} heads {report['heads']}, chains of k={k}, "
        f"{report['max_new_tokens']} new tokens, greedy",
        "",
        f"plain decoding: vLLM {report['vllm_plain_tokens_per_s']:.1f} tokens/s, selfspec "
        f"{report['ours_plain_tokens_per_s']:.1f}, HF generate {report['hf_tokens_per_s']:.1f}",
        "",
        "| format | loads | lossless | acceptance per position: vLLM | selfspec | equal | tokens/s vLLM | selfspec | "
        "speedup in vLLM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt, e in report["formats"].items():
        if not e["loaded"] or e["error"]:
            error = " ".join(str(e["error"]).split())[:300]
            lines.append(f"| {fmt} | {'no' if not e['loaded'] else 'yes, but decoding failed'}: {error} | | | | | | | |")
            continue
        fmt_rates = " ".join(f"{r:.3f}" for r in e["vllm"]["rates"])
        our_rates = " ".join(f"{r:.3f}" for r in e["selfspec"]["rates"])
        equal = ("not compared (chains sent: " + ", ".join(f"{k or 'none'} {v}" for k, v in (e.get("sent") or {})
                                                     .items()) + ")" if e["acceptance_equal"] is None else
                 f"{'yes' if e['acceptance_equal'] else 'NO'} (max diff {e['max_rate_difference']:.3f})")
        lines.append(
            f"| {fmt} | yes | {'yes' if e['lossless'] else 'NO'} | {fmt_rates} | {our_rates} | {equal} | "
            f"{e['vllm']['tokens_per_s']:.1f} | {e['selfspec']['tokens_per_s']:.1f} | {e['speedup_in_vllm']:.2f}x |")
    for fmt, e in report["formats"].items():
        if not e.get("prompts"):
            continue
        lines += ["", f"{fmt}, per prompt:", "", "| prompt | lossless | vLLM accepted per position / drafts | "
                  "selfspec | vLLM tokens/s |", "|---|---|---|---|---|"]
        for i, p in enumerate(e["prompts"]):
            v, o = p["vllm"], p["selfspec"]
            lines.append(f"| {i} | {'yes' if p['lossless'] else 'NO'} | {v['accepted_per_pos']} / {v['drafts']} | "
                         f"{o['accepted_per_pos']} / {o['drafts']} | {v['tokens_per_s']:.1f} |")
    for m in report["mismatches"]:
        lines.append(f"MISMATCH: prompt {m['prompt']}, {m['engine']}, position {m['position']}: {m['got']} where HF "
                     f"generate has {m['hf']}")
    return "\n".join(lines)
