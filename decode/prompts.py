"""Prompts as the engine takes them: a conversation's token ids under the tokenizer's chat template
(:func:`prompt_ids`), and MT-bench style question files (:func:`read_questions`)."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.decode.types import DecodeSetupError


def prompt_ids(tokenizer, messages: list[dict], chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of a conversation ending with a user turn (chat template + generation prompt), or of the raw text
    of its last message when ``chat`` is off."""
    if any(not str(m.get("content", "")).strip() for m in messages if m["role"] == "user"):
        raise DecodeSetupError("The prompt is empty: give some text (prompt=\"...\").")
    if not chat:
        return tokenizer(messages[-1]["content"], add_special_tokens=True)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise DecodeSetupError("The tokenizer has no chat template: pass chat=false to decode raw text.")
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + messages
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def read_questions(path: str | Path, max_questions: int | None = None) -> list[dict]:
    """MT-bench style jsonl: {"question_id", "category", "turns": [str, ...]} per line."""
    path = Path(path)
    if not path.is_file():
        raise DecodeSetupError(f"prompts={path}: no such file. Give a jsonl of MT-bench form.")
    questions = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as err:
                raise DecodeSetupError(f"{path}:{n} is not valid JSON: {err}") from err
            if not isinstance(q.get("turns"), list) or not q["turns"]:
                raise DecodeSetupError(
                    f"{path}:{n} has no \"turns\" list (MT-bench form: question_id, category, turns)."
                )
            questions.append(q)
            if max_questions is not None and len(questions) >= max_questions:
                break
    return questions
