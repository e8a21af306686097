"""Learner settings measured offline on a recorded stream (scripts/learn_replay.py's body).

The stream benchmark (bench/stream_bench.py) decodes every request with every method: an hour of target forwards
for a hundred requests on a CPU. What the learner's settings change (learning rate, steps, the guard) needs none of
them again: the learner sees only the recorded examples. So the stream is decoded once, its examples (what
``learn=true`` records: the target's answer and the hidden states the drafter reads) saved to ``record=``, and each
setting then replays them in order through :class:`selfspec.train.online.OnlineLearner`:

- before the learner takes request ``i``, the drafter's chain acceptance on it, with the weights it would have decoded
  that request with (the family's own evaluation: DFlash's ``eval/accept_length_on_path``, EAGLE's
  ``eval/accept_length_chain``; the request is not trained on yet);
- the same for the frozen heads, on the same examples, so each window's gain is paired.

With ``learner.every_tokens`` the learner also gets each request's answer cut after every N answer positions, before
the whole, as a live decode hands it over (there a step can pass the mark by a few positions). A request's
acceptance is measured before all of them: what the later part of an answer gains from its own first part is not
counted.

Per window: both acceptances, the gain, updates and rollbacks, and the learner's seconds per request.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from selfspec.core.folders import claim
from selfspec.bench.prompts import first_turn_ids, load_prompts
from selfspec.bench.report import machine_info
from selfspec.decode.session import load_session
from selfspec.decode.settings import required
from selfspec.decode.types import DecodeSetupError
from selfspec.train.online import online_learner

REPLAY_KEYS = ("heads", "prompts", "limit", "record", "window", "out")
RECORD_FORMAT = 1


def record_identity(session, prompts: Any, limit: Any) -> dict:
    """What a recording depends on: the target, the layers the drafter reads, the stream and how its answers were
    decoded (greedy: the target's own, whatever the heads). Heads of the same family reading the same layers replay
    the same recording."""
    s = session.settings
    return {"format": RECORD_FORMAT, "target": str(session.target.name), "family": session.family,
            "layers": list(session.learner.layers), "dtype": str(session.learner.dtype), "prompts": str(prompts),
            "limit": limit, "max_new_tokens": s.max_new_tokens, "chat": s.chat, "system_prompt": s.system_prompt,
            "max_length": session.learner.settings.max_length}


def record_stream(session, questions: list[dict], path: Path, identity: dict) -> list[dict[str, torch.Tensor]]:
    """Decode each question with ``session`` (greedy: the answers are the target's) and keep the example
    ``learn=true`` would record from it; saved to ``path`` atomically with ``identity``."""
    examples = [session.record(first_turn_ids(session, q))[1] for q in tqdm(questions, desc="record", unit="prompt")]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save({"identity": identity, "examples": examples}, f)
    os.replace(tmp, path)
    return examples


def load_record(path: Path, identity: dict) -> list[dict[str, torch.Tensor]]:
    try:
        saved = torch.load(path, weights_only=True)  # tensors and plain containers only: nothing is executed
        examples, theirs = saved["examples"], saved["identity"]
    except Exception as err:  # noqa: BLE001 - named with the fix
        raise DecodeSetupError(f"record={path} does not load as a recorded stream ({type(err).__name__}: {err}). "
                               "Delete it (it is made again) or give another record=.") from err
    differ = sorted(k for k in identity if theirs.get(k) != identity[k])
    if differ:
        raise DecodeSetupError(f"record={path} was recorded with other settings ({', '.join(differ)}: "
                               f"{', '.join(repr(theirs.get(k)) for k in differ)}; now "
                               f"{', '.join(repr(identity[k]) for k in differ)}). Give another record= (each "
                               "heads folder and stream records its own), or delete it to record it again.")
    return examples


def run_replay(cfg: Any, command: str = "") -> dict:
    c = required(cfg, REPLAY_KEYS)
    if c["heads"] in (None, "random"):
        raise DecodeSetupError("heads=FOLDER: the trained heads the replay starts from (e.g. the hour recipe's).")
    plain = OmegaConf.to_container(cfg, resolve=True)
    out = claim(Path(str(c["out"])), "replay", bool(cfg.get("overwrite", False)), setting="out")  # a user's: refused
    # the learner as configured, never resumed and never saved: the replay leaves no state behind
    learner = dict(plain["learner"], resume=False, save_every=0, dir=str(out / "unused"))
    session = load_session(OmegaConf.create({**plain, "learn": True, "learner": learner}), learner=online_learner)
    record = Path(str(c["record"]))
    identity = record_identity(session, c["prompts"], c["limit"])
    if record.is_file():
        examples = load_record(record, identity)
    else:
        examples = record_stream(session, load_prompts(c["prompts"], c["limit"]), record, identity)
    learner = session.learner
    frozen = learner.acceptance(examples)  # the heads as loaded, before anything is learned
    rows, start = [], time.perf_counter()
    for i, example in enumerate(tqdm(examples, desc="replay", unit="request")):
        [before] = learner.acceptance([example])
        t0 = time.perf_counter()
        for part in learner.prefixes(example):  # what learning every N tokens hands the learner mid-answer
            learner.learn_partial(part)
        report = learner.learn(example)
        updates = [*report.get("during", ()), *([report] if "rolled_back" in report else [])]
        rows.append({"index": i, "frozen": frozen[i], "learning": before, "seconds": time.perf_counter() - t0,
                     "held_out": bool(report.get("held_out")), "rolled_back": report.get("rolled_back"),
                     "updates": sum(not u["rolled_back"] for u in updates),
                     "rollbacks": sum(bool(u["rolled_back"]) for u in updates)})
    window = int(c["window"])
    device = next(session.target.model.parameters()).device
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command, "machine": machine_info(device), "heads": c["heads"],
              "family": session.family, "prompts": str(c["prompts"]), "requests": len(rows), "window": window,
              "learner": dataclasses.asdict(learner.settings), "seconds": time.perf_counter() - start,
              "windows": replay_windows(rows, window), "summary": learner.summary(), "rows": rows}
    (out / "replay.json").write_text(json.dumps(report, indent=1))
    (out / "replay.md").write_text(replay_markdown(report))
    return report


def replay_windows(rows: list[dict], window: int) -> list[dict]:
    """Per window of ``window`` requests: the mean acceptance of the frozen and the learning heads (each request
    measured before it is learned from), their difference, updates kept and rolled back, learner seconds a request."""
    out = []
    for a in range(0, len(rows), window):
        w = rows[a:a + window]
        frozen, learning = (sum(r[k] for r in w) / len(w) for k in ("frozen", "learning"))
        out.append({"start": a, "end": a + len(w), "frozen": frozen, "learning": learning, "gain": learning - frozen,
                    "updates": sum(r["updates"] for r in w), "rollbacks": sum(r["rollbacks"] for r in w),
                    "seconds_per_request": sum(r["seconds"] for r in w) / len(w)})
    return out


def replay_markdown(report: dict) -> str:
    lines = ["| requests | frozen | learning | gain | updates kept | rolled back | learner s/request |",
             "|---|---|---|---|---|---|---|"]
    for w in report["windows"]:
        lines.append(f"| {w['start'] + 1}-{w['end']} | {w['frozen']:.3f} | {w['learning']:.3f} | {w['gain']:+.3f} | "
                     f"{w['updates']} | {w['rollbacks']} | {w['seconds_per_request']:.2f} |")
    rows = report["rows"]
    gain = sum(r["learning"] - r["frozen"] for r in rows[len(rows) // 2:]) / max(len(rows) - len(rows) // 2, 1)
    lines += ["", f"Chain acceptance of each request before it is learned from; second half's gain {gain:+.3f}.",
              "", f"`{report['command']}`"]
    return "\n".join(lines) + "\n"
