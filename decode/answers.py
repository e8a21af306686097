"""decode/run.py's body (:func:`run`): one prompt streamed to the terminal, or every question of an MT-bench style
file answered turn by turn (:func:`answer_question`: each turn sees the earlier turns and answers), with the
summary decode/run.py prints (tau, tokens/s, the time split, and with ``baseline=hf`` the speedup over Hugging Face
``generate`` on the same prompts)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from omegaconf import OmegaConf

from selfspec.decode.engine import DecodeResult
from selfspec.decode.prompts import prompt_ids, read_questions
from selfspec.decode.session import LearnerFactory, Session, hf_generate, load_session
from selfspec.decode.settings import required
from selfspec.decode.types import DecodeSetupError


class TokenStream:
    """Prints text as tokens arrive (decoding the whole answer so multi-token characters come out whole)."""

    def __init__(self, tokenizer, out: TextIO | None = None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def decode_prompt(
    session: Session, ids: list[int], on_tokens: Callable[[list[int]], None] | None = None
) -> DecodeResult:
    return session.generate(ids, on_tokens=on_tokens, timings=True)


def warm_up(session: Session, baseline: bool) -> None:
    """One short run of each path, so one-time costs (kernels, allocator) stay out of the timings."""
    ids = prompt_ids(session.target.tokenizer, [{"role": "user", "content": "Hi"}], session.settings.chat)
    session.decoder.generate(ids, max_new_tokens=4, sampling=session.sampling)
    if baseline:
        hf_generate(session, ids, dataclasses.replace(session.settings, max_new_tokens=4, stop=[]))


def answer_question(session: Session, question: dict, baseline: bool = False, out: TextIO | None = None) -> dict:
    """Answer every turn of a question, each turn seeing the earlier turns and answers; returns a jsonl record."""
    tokenizer, s = session.target.tokenizer, session.settings
    messages: list[dict] = []
    answers, turns = [], []
    for turn in question["turns"]:
        messages.append({"role": "user", "content": turn})
        ids = prompt_ids(tokenizer, messages, s.chat, s.system_prompt)
        stream = TokenStream(tokenizer, out) if out is not None else None
        result = decode_prompt(session, ids, stream)
        if out is not None:
            out.write("\n")
        answer = tokenizer.decode(result.tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        stats = result.stats.to_dict()
        stats["finish_reason"] = result.finish_reason
        if session.learner is not None:  # learn=true: what this request's update did
            stats["learn"] = session.last_learned
        if baseline:
            hf_tokens, hf_s = hf_generate(session, ids)
            stats["hf"] = {"new_tokens": len(hf_tokens), "total_s": hf_s,
                           "tokens_per_s": len(hf_tokens) / hf_s if hf_s > 0 else 0.0,
                           "same_tokens": hf_tokens == result.tokens}
        turns.append(stats)
    return {"question_id": question.get("question_id"), "category": question.get("category"),
            "answers": answers, "turns": turns}


def summarize(turn_stats: list[dict]) -> dict:
    """Totals over turns: tau over all steps, tokens/s over all time, the drafting/verifying split, HF speedup."""
    steps = sum(t["steps"] for t in turn_stats)
    step_tokens = sum(t["new_tokens"] - 1 for t in turn_stats)  # the prefill's token is not a step's
    total_s = sum(t["total_s"] for t in turn_stats)
    new = sum(t["new_tokens"] for t in turn_stats)
    out = {
        "turns": len(turn_stats), "new_tokens": new, "steps": steps, "tau": step_tokens / steps if steps else 0.0,
        "tokens_per_s": new / total_s if total_s else 0.0, "total_s": total_s,
        "prefill_s": sum(t["prefill_s"] for t in turn_stats), "draft_s": sum(t["draft_s"] for t in turn_stats),
        "verify_s": sum(t["verify_s"] for t in turn_stats),
        "learn_s": sum(t.get("learn_s", 0.0) for t in turn_stats),
    }
    hf = [t["hf"] for t in turn_stats if "hf" in t]
    if hf:
        hf_s = sum(h["total_s"] for h in hf)
        out["hf_tokens_per_s"] = sum(h["new_tokens"] for h in hf) / hf_s if hf_s else 0.0
        out["speedup_vs_hf"] = out["tokens_per_s"] / out["hf_tokens_per_s"] if out["hf_tokens_per_s"] else 0.0
        out["same_tokens_as_hf"] = sum(h["same_tokens"] for h in hf)
    return out


def session_summary(session: Session, turn_stats: list[dict]) -> dict:
    """:func:`summarize` of a run's turns, with what its heads learned (learn=true)."""
    summary = summarize(turn_stats)
    if session.learner is not None:
        summary["learned"] = session.learner.summary()
    return summary


def format_summary(summary: dict) -> str:
    timed = summary["prefill_s"] + summary["draft_s"] + summary["verify_s"]
    share = (lambda x: 100 * x / timed) if timed else (lambda x: 0.0)
    lines = [
        f"steps {summary['steps']}  tau {summary['tau']:.2f} tokens/step  {summary['new_tokens']} tokens  "
        f"{summary['tokens_per_s']:.1f} tokens/s",
        f"time: prefill {summary['prefill_s']:.2f}s ({share(summary['prefill_s']):.0f}%)  drafting "
        f"{summary['draft_s']:.2f}s ({share(summary['draft_s']):.0f}%)  verifying {summary['verify_s']:.2f}s "
        f"({share(summary['verify_s']):.0f}%)"
        + (f"  learning mid-answer {summary['learn_s']:.2f}s" if summary.get("learn_s") else ""),
    ]
    if "hf_tokens_per_s" in summary:
        lines.append(
            f"HF generate {summary['hf_tokens_per_s']:.1f} tokens/s -> speedup {summary['speedup_vs_hf']:.2f}x; "
            f"same tokens as HF in {summary['same_tokens_as_hf']}/{summary['turns']} turns"
        )
    if "learned" in summary:
        ln = summary["learned"]
        lines.append(f"learned from {ln['requests']} requests: {ln['updates']} updates kept, {ln['rollbacks']} rolled "
                     f"back, {ln['steps']} steps; buffers {ln['buffer_bytes'] / 2**20:.1f} MiB (bound "
                     f"{ln['memory_bound'] / 2**20:.0f} MiB with the heads and optimizer)")
    return "\n".join(lines)


RUN_KEYS = ("prompt", "prompts", "max_questions", "out", "stream", "baseline")


def run(cfg: Any, out: TextIO | None = None, learner: LearnerFactory | None = None) -> dict:
    """decode/run.py's body: one streamed prompt, or every question of a prompts file written to ``out=``.
    Returns the summary (tau, tokens/s, time split, HF speedup with baseline=hf). ``learner``: what ``learn=true``
    learns with (decode/run.py hands train/online.py's)."""
    out = out or sys.stdout
    c = required(cfg, RUN_KEYS)
    prompt, prompts, baseline = c["prompt"], c["prompts"], c["baseline"]
    if (prompt is None) == (prompts is None):
        raise DecodeSetupError('Give one of prompt="..." (one prompt) or prompts=FILE.jsonl (MT-bench form).')
    if baseline not in (None, "hf"):
        raise DecodeSetupError(f"baseline={baseline!r}: use baseline=hf (or leave it unset).")
    session = load_session(cfg, learner=learner)
    try:
        return _answer(session, c, cfg, out)
    finally:
        session.close()  # learn=true: the adapted heads saved


def _answer(session: Session, c: dict, cfg: Any, out: TextIO) -> dict:
    prompt, prompts, baseline = c["prompt"], c["prompts"], c["baseline"]
    stream = bool(c["stream"])
    if prompt is not None:
        if baseline:
            warm_up(session, baseline=True)
        record = answer_question(session, {"question_id": None, "turns": [str(prompt)]}, baseline == "hf",
                                 out if stream else None)
        if not stream:
            out.write(record["answers"][0] + "\n")
        summary = session_summary(session, record["turns"])
        out.write(format_summary(summary) + "\n")
        return summary

    questions = read_questions(prompts, c["max_questions"])
    answers_path = Path(str(c["out"]))
    answers_path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(cfg, dict):
        OmegaConf.save(cfg, answers_path.parent / "config.yaml", resolve=True)
    warm_up(session, baseline == "hf")
    turn_stats = []
    with open(answers_path, "w") as f:
        for q in questions:
            out.write(f"\n=== question {q.get('question_id')} ({q.get('category')}) ===\n")
            record = answer_question(session, q, baseline == "hf", out if stream else None)
            record["summary"] = summarize(record["turns"])
            f.write(json.dumps(record) + "\n")
            f.flush()
            turn_stats.extend(record["turns"])
    summary = session_summary(session, turn_stats)
    (answers_path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    out.write(f"\n{len(questions)} questions -> {answers_path}\n" + format_summary(summary) + "\n")
    return summary
