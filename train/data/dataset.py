"""The tokenized dataset of a ``data`` config: conversations read, tokenized, split into train / eval and cached.

    ds = build_dataset(cfg.data, tokenizer)      # DatasetDict: train / eval, cached on disk
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from selfspec.core.config import cfg_get, to_dict
from selfspec.train.data.chat import (
    FORMATS,
    IGNORE_INDEX,
    ChatTemplateError,
    _require_chat_template,
    conversation_examples,
    text_example,
)
from selfspec.train.data.conversations import load_conversations, sharegpt_path
from selfspec.core.records import DataError, ReadReport
from selfspec.core.folders import cache_dir

CACHE_FORMAT = 2  # bump when the tokenized layout or labelling rule changes: old caches are then ignored
# 2: an example per answer for templates that rewrite earlier answers (they were skipped); splits by conversation

# Skip reasons (the keys of ReadReport.skipped) of tokenizing.
TOO_LONG = "longer than max_length (overflow=drop)"
NO_LABELS = "no assistant tokens within max_length"
TEMPLATE_UNSTABLE = "chat template does not start the answer with its generation prompt"
TEMPLATE_FAILED = "chat template raised an error"


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
    # deferred: datasets (slow to import) only for a dataset of the Hub or a saved one
    import datasets

    fmt = str(cfg_get(data_cfg, "format", "chat"))
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r}: chat (conversations under the chat template) or text (plain text, for "
                        "a base model: an opening and its continuation, as scripts/regenerate.py format=text writes).")
    if fmt == "chat":
        _require_chat_template(tokenizer)
    root = Path(cache_dir).expanduser() if cache_dir is not None else data_cache_root()
    folder = root / dataset_cache_key(data_cfg, tokenizer)
    if (folder / "dataset_dict.json").exists():
        return _load_cached(folder, verbose)

    conversations, report = load_conversations(data_cfg, verbose=verbose)
    max_length = int(cfg_get(data_cfg, "max_length", 1024))
    template_kwargs = to_dict(cfg_get(data_cfg, "chat_template_kwargs"))
    examples, groups = _tokenize_all(conversations, tokenizer, max_length,
                                     str(cfg_get(data_cfg, "overflow", "truncate")), report, verbose, template_kwargs,
                                     text=fmt == "text")
    n = len(examples["input_ids"])
    eval_fraction, seed = float(cfg_get(data_cfg, "eval_fraction", 0.0)), int(cfg_get(data_cfg, "seed", 0))
    # Split conversations, not examples: the examples of one conversation (one per answer for some templates) share
    # their opening turns, so they all go to one side.
    train_conv, eval_conv = split_indices(groups[-1] + 1, eval_fraction, seed)
    eval_set = set(eval_conv)
    train_idx = [j for j, g in enumerate(groups) if g not in eval_set]
    eval_idx = [j for j, g in enumerate(groups) if g in eval_set]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int32"))})

    def subset(idx: list[int]):
        return datasets.Dataset.from_dict({k: [v[j] for j in idx] for k, v in examples.items()}, features=features)

    ds = datasets.DatasetDict({"train": subset(train_idx), "eval": subset(eval_idx)})
    per_answer = f" of {groups[-1] + 1:,} conversations" if n != groups[-1] + 1 else ""
    summary = (f"{n:,} examples{per_answer} ({len(train_idx):,} train / {len(eval_idx):,} eval) from "
               f"{report.summary()}")
    if verbose:
        print(f"[selfspec] data: {summary}", file=sys.stderr)
    _save_atomically(ds, folder, {"summary": summary, "skipped": report.skipped, "records_read": report.records_read,
                                  "truncated_tail": report.truncated_tail})
    return datasets.load_from_disk(str(folder))


def _load_cached(folder: Path, verbose: bool):
    # deferred: datasets (slow to import) only for a dataset of the Hub or a saved one
    import datasets

    ds = datasets.load_from_disk(str(folder))
    if verbose:
        info = json.loads((folder / "report.json").read_text()) if (folder / "report.json").exists() else {}
        print(f"[selfspec] data: tokenized cache {folder} ({len(ds['train']):,} train / {len(ds['eval']):,} "
              f"eval examples){'; ' + info['summary'] if 'summary' in info else ''}", file=sys.stderr)
    return ds


def _tokenize_all(conversations: list, tokenizer, max_length: int, overflow: str, report: ReadReport,
                  verbose: bool, template_kwargs: dict | None = None,
                  text: bool = False) -> tuple[dict[str, list[list[int]]], list[int]]:
    """``{"input_ids": [...], "labels": [...]}`` of the conversations that give examples, and each example's
    conversation (0, 1, ... over those conversations, ascending); the others are counted in ``report``. Raises when
    the chat template fails on most conversations or no example is left. ``text``: each conversation as plain text
    (:func:`~selfspec.train.data.chat.text_example`), no template."""
    examples: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    groups: list[int] = []
    first_template_error = None
    unstable = 0
    for i, messages in enumerate(tqdm(conversations, desc="tokenizing", unit="conv", disable=not verbose)):
        try:
            conversation = (text_example(tokenizer, messages, max_length, overflow) if text else
                            conversation_examples(tokenizer, messages, max_length, overflow, template_kwargs))
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
        conversation = [e for e in conversation if any(label != IGNORE_INDEX for label in e["labels"])]
        if not conversation:
            report.skip(TOO_LONG if overflow == "drop" else NO_LABELS)
            continue
        group = groups[-1] + 1 if groups else 0
        for example in conversation:
            examples["input_ids"].append(example["input_ids"])
            examples["labels"].append(example["labels"])
            groups.append(group)
    if not examples["input_ids"]:
        hint = f" First template error: {first_template_error}" if first_template_error else ""
        raise DataError(
            f"No training example left after tokenizing {len(conversations):,} conversations (skipped: "
            f"{report.skipped}).{hint} Raise data.max_length (now {max_length}) or use data.overflow=truncate."
        )
    return examples, groups


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
