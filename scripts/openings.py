"""Document openings as completion prompts, for benchmarking a base model (Gemma 3 270M): the first sentences of
ShareGPT answers past the records training reads, written as MT-bench form questions (category ``document``) that
``scripts/bench.py prompts=FILE chat=false`` decodes as plain text.

    python scripts/openings.py --out outputs/prompts/openings.jsonl            # 80 openings past record 6,000
    python scripts/bench.py model=gemma3_270m chat=false prompts=[outputs/prompts/openings.jsonl,humaneval] ...

An opening is whole sentences of an answer's first paragraph, at least ``--min-chars`` and at most ``--max-chars``
characters (an answer whose first sentence is longer, or that has no sentence end in reach, is skipped), so the
prompt ends where a document would go on. Records are read in file order from ``--skip`` on: the hour recipes read
at most the first 6,000 (``data.max_records``), so the default prompts are unseen by training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from selfspec.core.records import parse_turns, read_records
from selfspec.train.data.conversations import sharegpt_path

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def opening(text: str, min_chars: int, max_chars: int) -> str | None:
    """Whole sentences from the start of ``text``'s first paragraph, ``min_chars`` to ``max_chars`` long; None when
    there are none such."""
    paragraph = text.strip().split("\n\n", 1)[0].strip()
    if "```" in paragraph or paragraph.startswith(("-", "*", "1.", "#", "|")):
        return None  # a list, table or code block, not prose that a document goes on from
    out = ""
    for sentence in SENTENCE_END.split(paragraph):
        if len(out) + len(sentence) + 1 > max_chars:
            break
        out = f"{out} {sentence}".strip()
        if len(out) >= min_chars and out[-1] in ".!?":
            return out
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the jsonl to write (MT-bench form)")
    parser.add_argument("--n", type=int, default=80, help="openings to write")
    parser.add_argument("--skip", type=int, default=6000, help="records to pass over first (those training reads)")
    parser.add_argument("--min-chars", type=int, default=120)
    parser.add_argument("--max-chars", type=int, default=400)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"error: {out} exists: choose another --out (nothing was written).", file=sys.stderr)
        return 2
    rows = []
    for index, record in enumerate(read_records(sharegpt_path())):
        if index < args.skip:
            continue
        messages, _ = parse_turns(record)
        answer = next((m["content"] for m in messages or () if m["role"] == "assistant"), None)
        text = opening(answer, args.min_chars, args.max_chars) if answer else None
        if text:
            rows.append({"question_id": f"sharegpt-{index}", "category": "document", "turns": [text]})
        if len(rows) == args.n:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"[selfspec] {len(rows)} openings of ShareGPT answers past record {args.skip:,} in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
