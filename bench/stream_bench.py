"""The learning stream benchmark (scripts/stream_bench.py's body): a stream of prompts from one domain, in order, each
decoded by every method in turn, its output checked token by token against HF generate's.

Methods (``methods=``; HF generate always runs, the reference):

- ``suffix``: the suffix drafter alone, one decoder over the whole stream (its memory of earlier answers: the
  training-free way to adapt);
- ``frozen``: the heads' default decoder (with the suffix drafter, adaptive depth), never trained;
- ``learn``: the same decoder from the same heads, learning from every request (train/online.py);
- ``learn_untrained``: that, from untrained heads of the same make (the heads' shape, layers and draft vocabulary,
  with the weights their family builds them with: heads/io.py:reinitialize).

For ``frozen`` and the learning methods the heads also decode each prompt alone at full depth (no suffix drafter,
no adaptive depth, nothing learned from it), before the request is decoded and learned from: the drafter's own tau
with the weights it meets the request with. Learning runs after each request (with ``learner.every_tokens``, also in
its middle); its seconds are reported apart, and counted into a second tokens/s. Learning in the middle of an answer
delays that answer: for it the second figure is the one a user sees.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from selfspec.core.folders import claim
from selfspec.bench.prompts import first_turn_ids, load_prompts
from selfspec.bench.report import machine_info
from selfspec.bench.run import first_difference
from selfspec.decode.session import Session, hf_generate, load_session
from selfspec.decode.settings import required
from selfspec.decode.types import DecodeSetupError
from selfspec.train.online import online_learner

METHODS = ("suffix", "frozen", "learn", "learn_untrained")
LEARNING = ("learn", "learn_untrained")
ALONE = {"suffix": False, "adaptive": False}  # the drafter alone at full depth
STREAM_KEYS = ("heads", "prompts", "limit", "methods", "window", "out", "alone")


def load_stream_sessions(cfg: Any, names: list[str], out: Path) -> dict[str, Session]:
    """The sessions the methods decode with: ``frozen`` (no learning; also HF generate's and the suffix drafter's),
    ``learn`` and ``learn_untrained`` (each learning into its own folder under ``out``)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    sessions = {"frozen": load_session(OmegaConf.create({**plain, "learn": False}))}
    learner = dict(plain["learner"], resume=False)
    if "learn" in names:
        sessions["learn"] = load_session(OmegaConf.create(
            {**plain, "learn": True, "learner": {**learner, "dir": str(out / "learned")}}), learner=online_learner)
    if "learn_untrained" in names:  # the same heads' make (shape, layers, draft vocabulary), none of their training
        sessions["learn_untrained"] = load_session(OmegaConf.create(
            {**plain, "learn": True, "learner": {**learner, "dir": str(out / "learned-untrained")}}), untrained=True,
            learner=online_learner)
    return sessions


def run_stream(cfg: Any, command: str = "") -> dict:
    c = required(cfg, STREAM_KEYS)
    names = list(c["methods"])
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise DecodeSetupError(f"methods: {unknown[0]!r} is not a stream method; choose from {', '.join(METHODS)}.")
    if c["heads"] in (None, "random"):
        raise DecodeSetupError("heads=FOLDER: the trained heads the stream starts from (e.g. the hour recipe's).")
    window = int(c["window"])
    out = claim(Path(str(c["out"])), "stream", bool(cfg.get("overwrite", False)), setting="out")  # a user's: refused
    questions = load_prompts(c["prompts"], c["limit"])
    sessions = load_stream_sessions(cfg, names, out)
    base = sessions["frozen"]  # (a family that cannot learn was refused by the learning sessions' loading)
    decoders = {"suffix": base.decoder_for("suffix")} if "suffix" in names else {}
    alone = {n: s.decoder_for(draft=ALONE) for n, s in sessions.items()
             if bool(c["alone"]) and (n in names or n == "frozen")}
    s = base.settings
    as_set = base.generate_kwargs
    runs, mismatches = [], []
    warm = first_turn_ids(base, {"turns": ["Hi"]})
    for session in sessions.values():  # one-time costs (kernels, allocator) out of the timings; nothing learned
        session.generate(warm, learn=False, max_new_tokens=4)
    for i, q in enumerate(tqdm(questions, desc="stream", unit="prompt")):
        ids = first_turn_ids(base, q)
        reference, hf_s = hf_generate(base, ids)
        row: dict[str, Any] = {"index": i, "question_id": q.get("question_id"), "hf": {"seconds": hf_s,
                                                                                       "new_tokens": len(reference)}}
        # each drafter alone first: with the weights the request is decoded with, before anything is learned from it
        alone_tau = {}
        for name, decoder in alone.items():
            result = decoder.generate(ids, **as_set)
            if first_difference(reference, result.tokens) is not None:
                mismatches.append({"method": f"{name} alone", "index": i})
            alone_tau[name] = result.stats.tau
        for name in names:
            t0 = time.perf_counter()
            if name == "suffix":
                result = decoders["suffix"].generate(ids, **as_set)
            else:
                result = sessions[name].generate(ids)
            wall = time.perf_counter() - t0
            learned = sessions[name].last_learned if name in LEARNING else None
            st = result.stats  # learning in the middle of a request (every_tokens) is in total_s, as learn_s
            record = {"new_tokens": len(result.tokens), "seconds": st.total_s - st.learn_s, "steps": st.steps,
                      "tau": st.tau, "accepted": st.accepted,
                      "learn_seconds": max(wall - st.total_s, 0.0) + st.learn_s if learned is not None else 0.0,
                      "learn_seconds_during": st.learn_s, "learned": learned}
            diff = first_difference(reference, result.tokens)
            if diff is not None:
                mismatches.append({"method": name, "index": i, "position": diff})
            row[name] = record
        for name, tau in alone_tau.items():
            row.setdefault(name, {})["alone_tau"] = tau
        runs.append(row)
    for session in sessions.values():
        session.close()
    param = next(base.target.model.parameters())
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command, "machine": machine_info(param.device), "heads": c["heads"],
              "family": base.family, "dtype": str(param.dtype).removeprefix("torch."),
              "prompts": str(c["prompts"]), "questions": len(questions), "window": window,
              "max_new_tokens": s.max_new_tokens, "methods": names, "runs": runs,
              "learner": {n: dataclasses.asdict(sessions[n].learner.settings) for n in LEARNING if n in sessions},
              "windows": windows(runs, names, window), "aims": aims(runs, names), "mismatches": mismatches,
              "learned": {n: sessions[n].learner.summary() for n in LEARNING if n in sessions}}
    (out / "stream.json").write_text(json.dumps(report, indent=1))
    (out / "stream.md").write_text(markdown(report))
    plot(report, out / "stream.png")
    return report


def _totals(rows: list[dict], name: str) -> dict:
    tokens = sum(r[name]["new_tokens"] for r in rows)
    seconds = sum(r[name]["seconds"] for r in rows)
    learn = sum(r[name].get("learn_seconds", 0.0) for r in rows)
    steps = sum(r[name]["steps"] for r in rows)
    alone = [r[name]["alone_tau"] for r in rows if "alone_tau" in r[name]]
    return {"tau": tokens / steps if steps else None, "tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_s_with_learning": tokens / (seconds + learn) if seconds + learn else None,
            "learn_seconds_per_request": learn / len(rows), "alone_tau": sum(alone) / len(alone) if alone else None}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def windows(runs: list[dict], names: list[str], window: int) -> list[dict]:
    """Per window of ``window`` consecutive requests: each method's tau, tokens/s (decoding alone, and with its
    learning counted in), learning seconds per request, and its drafter's own tau (the mean over the requests)."""
    out = []
    for start in range(0, len(runs), window):
        rows = runs[start:start + window]
        out.append({"start": start, "end": start + len(rows),
                    "methods": {n: _totals(rows, n) for n in names if "seconds" in rows[0].get(n, {})},
                    "frozen_alone_tau": _mean([r["frozen"]["alone_tau"] for r in rows
                                               if "alone_tau" in r.get("frozen", {})])})
    return out


def aims(runs: list[dict], names: list[str], edge: int = 20) -> dict:
    """What the stream is judged by: the learning default decoder against the suffix drafter alone on the stream's
    second half (tokens/s, learning between requests and counted in), and the learning drafter's own tau over its
    first and last ``edge`` requests."""
    half = runs[len(runs) // 2:]
    out: dict[str, Any] = {}
    if "suffix" in names:
        suffix = _totals(half, "suffix")["tokens_per_s"]
        for n in (m for m in names if m in LEARNING):
            t = _totals(half, n)
            out[f"{n}_vs_suffix_second_half"] = t["tokens_per_s"] / suffix if suffix else None
            out[f"{n}_vs_suffix_second_half_learning_counted"] = (t["tokens_per_s_with_learning"] / suffix
                                                                  if suffix else None)
    for n in (m for m in names if m in LEARNING):
        first, last = _totals(runs[:edge], n)["alone_tau"], _totals(runs[-edge:], n)["alone_tau"]
        if first is not None and last is not None:
            out[f"{n}_alone_tau_first_{edge}"], out[f"{n}_alone_tau_last_{edge}"] = first, last
    return out


def markdown(report: dict) -> str:
    names = report["methods"]
    head = "| requests | " + " | ".join(f"{n} tau | {n} tok/s" + (f" | {n} tok/s, learning counted | {n} learn s/req"
                                                                     if n in LEARNING else "")
                                         + (f" | {n} alone tau" if n in (*LEARNING, "frozen") else "")
                                         for n in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for w in report["windows"]:
        cells = []
        for n in names:
            t = w["methods"][n]
            cells += [fmt(t["tau"]), fmt(t["tokens_per_s"])]
            if n in LEARNING:
                cells += [fmt(t["tokens_per_s_with_learning"]), fmt(t["learn_seconds_per_request"])]
            if n in (*LEARNING, "frozen"):
                cells.append(fmt(t["alone_tau"]))
        lines.append(f"| {w['start'] + 1}-{w['end']} | " + " | ".join(cells) + " |")
    lines += ["", "| aim | value |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in report["aims"].items()]
    lines += ["", f"Lossless: {'every method on every request' if not report['mismatches'] else report['mismatches']}",
              "", f"`{report['command']}`"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    # deferred: matplotlib (slow to import) only when the plot is written
    import matplotlib

    matplotlib.use("Agg")
    # deferred: matplotlib (slow to import) only when the plot is written
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [w["end"] for w in report["windows"]]
    for n in report["methods"]:
        ax1.plot(xs, [w["methods"][n]["tokens_per_s"] for w in report["windows"]], marker="o", label=n)
        if n in (*LEARNING, "frozen"):
            ax2.plot(xs, [w["methods"][n]["alone_tau"] for w in report["windows"]], marker="o", label=f"{n} alone")
    ax1.set(xlabel="requests", ylabel="tokens/s (decoding)", title="speed over the stream")
    ax2.set(xlabel="requests", ylabel="tau, the drafter alone", title="the drafter's own tau")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
