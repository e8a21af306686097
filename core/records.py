"""Reading records: a tolerant streaming reader of JSON-array and JSONL files, and what reading gave.

    reader = read_records(path)        # a RecordReader: iterate it for dicts, then look at reader.report
    for record in reader: ...
    reader.report                      # ReadReport(records_read, skipped, truncated_tail, path)

The embedded ShareGPT V3 file is cut off at 125.5 MB in the middle of a record, so ``json.load`` fails on it;
:class:`RecordReader` streams it record by record and keeps every whole record, and the report says the tail was cut.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.core.errors import SelfspecError

CHUNK_BYTES = 1 << 20
INVALID_JSON_LINE = "invalid JSON line"  # a skip reason (a key of ReadReport.skipped)


class DataError(SelfspecError, ValueError):
    """The training data cannot be used; the message names the problem and how to fix it."""


@dataclass
class ReadReport:
    """What reading a source gave: whole records read, records skipped by reason, whether the file was cut off."""

    path: str
    records_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated_tail: bool = False
    conversations: int = 0  # usable conversations kept (set by load_conversations)
    stopped_early: bool = False  # max_records reached before the end of the source

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def summary(self) -> str:
        parts = [f"{self.records_read:,} records read from {self.path}", f"{self.conversations:,} conversations kept"]
        if self.skipped:
            parts.append("skipped: " + ", ".join(f"{r} {n:,}" for r, n in sorted(self.skipped.items())))
        if self.stopped_early:
            parts.append("stopped at max_records")
        if self.truncated_tail:
            parts.append(f"file was cut off after record {self.records_read:,}: tail ignored")
        return "; ".join(parts)


class RecordReader:
    """Streams the records (dicts) of a JSON array file or a JSONL file; ``.report`` fills in as it goes.

    A JSON array is decoded record by record (``json.JSONDecoder.raw_decode`` over a buffer refilled in 1 MB chunks),
    so the first records arrive at once, memory holds the file's text at most once, and a file cut off in the middle
    of a record yields every whole record before the cut (``report.truncated_tail``). A JSONL file is read line by
    line; a bad line is skipped and counted, and a bad last line without a newline is a cut-off tail.

    Raises :class:`DataError` for a missing, empty, non-UTF-8 or corrupt file (with the byte offset of the problem).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise DataError(f"Data file {self.path} does not exist: check data.path (relative paths are taken from "
                            f"the folder you run in, {Path.cwd()}).")
        if self.path.is_dir():
            raise DataError(f"Data path {self.path} is a folder: point data.path at a .json or .jsonl file.")
        self.report = ReadReport(path=str(self.path))
        self._records = self._read()

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        return next(self._records)

    def _read(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            head = f.read(4096)
            start = 3 if head.startswith(codecs.BOM_UTF8) else 0
            text = head[start:].lstrip()
            while not text and len(head) > start:  # leading whitespace longer than one read
                more = f.read(4096)
                if not more:
                    break
                text = more.lstrip()
            if not text:
                what = "is empty" if len(head) <= start else "holds only whitespace"
                raise DataError(f"Data file {self.path} {what}: write conversations into it (a JSON array or one "
                                "JSON object per line), or choose another data.path.")
            f.seek(start)
            if text[:1] == b"[":
                yield from self._read_array(f, start)
            elif text[:1] == b"{":
                yield from self._read_lines(f, start)
            else:
                raise DataError(
                    f"Data file {self.path} is not JSON or JSONL (it starts with {text[:20]!r}): give a JSON array "
                    "of conversations, or one JSON object per line."
                )

    def _not_utf8(self, err: UnicodeDecodeError, offset: int) -> DataError:
        bad = err.object[err.start:err.start + 1]
        return DataError(
            f"Data file {self.path} is not UTF-8: byte {bad!r} at byte offset {offset:,} cannot be decoded. "
            "Re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.json > out.json`)."
        )

    def _read_lines(self, f, start: int) -> Iterator[Any]:
        offset, line_no, first_bad = start, 0, None
        lines = iter(f)
        line = next(lines, b"")
        while line:
            following = next(lines, b"")
            line_no += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                if following or line.endswith(b"\n") or err.end < len(line):
                    raise self._not_utf8(err, offset + err.start) from None
                self.report.truncated_tail = True  # the last line ends inside a character: cut off
                break
            offset += len(line)
            if not text.strip():
                line = following
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                if not following and not line.endswith(b"\n"):
                    self.report.truncated_tail = True  # a partial last line, e.g. from an interrupted writer
                    break
                first_bad = first_bad or line_no
                self.report.skip(INVALID_JSON_LINE)
                line = following
                continue
            self.report.records_read += 1
            yield record
            line = following
        if self.report.records_read == 0 and first_bad:
            raise DataError(
                f"Data file {self.path} has no valid JSON line (line {first_bad} is the first bad one): for JSONL, "
                "write one whole JSON object per line; for a JSON array, start the file with '['."
            )

    def _read_array(self, f, start: int) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        text = _TextWindow(f, start, self._not_utf8)
        text.skip_space()
        text.pos += 1  # the opening '['
        expect_comma = False
        while True:
            if not text.skip_space():
                self.report.truncated_tail = True  # no closing ']'
                return
            if text.buf[text.pos] == "]":
                return
            if expect_comma:
                if text.buf[text.pos] != ",":
                    found = text.buf[text.pos]
                    raise self._corrupt(text, text.pos, f"expected ',' or ']' between records, found {found!r}")
                text.pos, expect_comma = text.pos + 1, False
                if not text.skip_space():
                    self.report.truncated_tail = True
                    return
            try:
                record, end = decoder.raw_decode(text.buf, text.pos)
                complete = end < len(text.buf) or text.eof
            except json.JSONDecodeError as err:
                # A cut at the buffer's end reads as an unterminated string or an error at (or near) the end.
                complete = not (err.msg.startswith("Unterminated string") or err.pos >= len(text.buf) - 6)
                if complete:
                    raise self._corrupt(text, err.pos, err.msg) from None
            if not complete:
                if text.eof:
                    self.report.truncated_tail = True
                    return
                text.fill()
                continue
            self.report.records_read += 1
            yield record
            text.pos, expect_comma = end, True
            text.drop_decoded()

    def _corrupt(self, text: "_TextWindow", where: int, what: str) -> DataError:
        n = self.report.records_read
        return DataError(
            f"Data file {self.path} is not valid JSON at byte offset {text.byte_offset(where):,} (record {n + 1}): "
            f"{what}. The {n:,} whole record(s) before it are fine; fix or delete that record, or convert the "
            "file to JSONL (one object per line) so bad lines can be skipped."
        )


class _TextWindow:
    """The UTF-8 text of a binary file from byte ``start`` on, decoded ``CHUNK_BYTES`` at a time: ``buf`` (which
    begins at byte ``offset`` of the file), a read position ``pos`` in it, and ``eof`` once the file is exhausted."""

    def __init__(self, f, start: int, not_utf8: Callable[[UnicodeDecodeError, int], Exception]):
        self.f, self.not_utf8 = f, not_utf8
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.eof = "", 0, False
        self.offset = start  # byte offset of buf[0] in the file
        self.bytes_read = start

    def fill(self) -> None:
        chunk = self.f.read(CHUNK_BYTES)
        pending = len(self.utf8.getstate()[0])
        try:
            self.buf += self.utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError as err:
            if chunk or err.end < len(err.object):  # not merely a character cut off by the file's end
                raise self.not_utf8(err, self.bytes_read - pending + err.start) from None
        self.bytes_read += len(chunk)
        self.eof = not chunk

    def byte_offset(self, p: int) -> int:
        return self.offset + len(self.buf[:p].encode("utf-8"))

    def skip_space(self) -> bool:
        """Advance pos past whitespace; False at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if self.eof:
                return False
            self.fill()

    def drop_decoded(self) -> None:
        """Forget the text before pos once it is longer than a chunk, so the file's text is held at most once."""
        if self.pos > CHUNK_BYTES:
            self.offset += len(self.buf[:self.pos].encode("utf-8"))
            self.buf, self.pos = self.buf[self.pos:], 0


def read_records(path: str | os.PathLike) -> RecordReader:
    """Stream the records of a JSON array or JSONL file; see :class:`RecordReader` (``.report`` after iterating)."""
    return RecordReader(path)


# --- turns of a record ---------------------------------------------------------------------------------------------


ROLE_NAMES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


# Skip reasons (the keys of ReadReport.skipped).
NOT_AN_OBJECT = "not a JSON object"
NO_TURNS = "no turns (conversations, messages, data, or instruction and response)"
EMPTY_CONVERSATION = "empty conversation"
UNKNOWN_ROLE = "unknown role"
INVALID_TURN = "invalid turn"
EMPTY_TURN = "empty turn"
NO_ASSISTANT = "no assistant turn"


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) for p in value):  # OpenAI content parts
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # an answer's reasoning, as records name it


def parse_turns(record: Any) -> tuple[list[dict[str, str]] | None, str | None]:
    """All turns of a record as ``[{"role", "content"}]``, or ``(None, skip reason)``. The forms, first match first:

    - ShareGPT, ``{"conversations": [{"from": "human", "value": ...}, ...]}`` (Magpie's datasets too, whose rows also
      carry ``instruction`` and ``response``);
    - OpenAI messages, ``{"messages": [{"role": "user", "content": ...}, ...]}`` (UltraChat 200k, most chat sets);
    - UltraChat's original rows, ``{"data": [question, answer, question, ...]}``: user and assistant in turn;
    - one instruction and its answer: ``{"instruction", "response"}`` (Magpie) or ``{"instruction", "input",
      "output"}`` (Alpaca; a non-empty ``input`` follows the instruction after a blank line), with a ``system``
      string if the record has one.

    Roles are normalized to system/user/assistant; nothing is dropped (see :func:`to_messages` for that). An
    assistant turn's reasoning, where the record gives it apart from the content (``reasoning_content``: vLLM's
    reasoning parsers, DeepSeek's API; ``reasoning``; ``thinking``: gpt-oss), is kept as ``reasoning_content``; the
    chat template decides how to render it (selfspec.train.data.chat).
    """
    if not isinstance(record, Mapping):
        return None, NOT_AN_OBJECT
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    elif isinstance(record.get("data"), list):  # UltraChat: the turns alone, the user's first
        turns, role_key, text_key = [{"role": ("user", "assistant")[k % 2], "content": text}
                                     for k, text in enumerate(record["data"])], "role", "content"
    elif "instruction" in record and ("response" in record or "output" in record):
        turns, role_key, text_key = _instruction_turns(record), "role", "content"
    else:
        return None, NO_TURNS
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            return None, INVALID_TURN
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        if not isinstance(role, str):
            return None, INVALID_TURN
        role = ROLE_NAMES.get(role.lower())
        if role is None:
            return None, UNKNOWN_ROLE
        content = _content(turn.get(text_key, turn.get("content", turn.get("value"))))
        if content is None:
            return None, INVALID_TURN
        if not content.strip():
            return None, EMPTY_TURN
        message = {"role": role, "content": content}
        reasoning = next((turn[k] for k in REASONING_KEYS if isinstance(turn.get(k), str) and turn[k].strip()), None)
        if role == "assistant" and reasoning is not None:
            message["reasoning_content"] = reasoning
        messages.append(message)
    if not messages:
        return None, EMPTY_CONVERSATION
    return messages, None


def _instruction_turns(record: Mapping) -> list[dict[str, Any]]:
    """An instruction record's turns: its ``system`` (if a string), the instruction (with Alpaca's ``input``), the
    answer (``response``, else ``output``). A field of the wrong type stays as it is, for parse_turns to refuse."""
    question, extra = record["instruction"], record.get("input")
    if isinstance(question, str) and isinstance(extra, str) and extra.strip():
        question = f"{question}\n\n{extra}"
    answer = record["response"] if "response" in record else record["output"]
    system = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) \
        and record["system"].strip() else []
    return system + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
