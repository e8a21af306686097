"""Training data: read conversations, render them with the target's chat template, label the assistant's tokens,
and batch them. One module per stage; every name callers use is importable from ``selfspec.train.data``:

    conversations, report = load_conversations(cfg.data)             # list of [{"role", "content"}, ...]
    ds = build_dataset(cfg.data, tokenizer)                          # DatasetDict: train / eval, cached on disk
    batch = collate(ds["train"].select(range(8)), tokenizer.pad_token_id)
    batch = collate_packed(ds["train"].select(range(8)), tokenizer.pad_token_id, capacity=384)  # trainer.packing

- :mod:`selfspec.core.records` (shared with the suffix drafter's corpus): the tolerant streaming reader of JSON-array and
  JSONL files (cut-off files too), its :class:`ReadReport`, and a record's turns (:func:`parse_turns`);
- :mod:`selfspec.train.data.conversations`: records to conversations, and the sources (``data.source``: sharegpt, file, hf);
- :mod:`selfspec.train.data.chat`: a conversation tokenized with the chat template, labels on the assistant's tokens only;
- :mod:`selfspec.train.data.dataset`: the tokenized train / eval splits, cached on disk;
- :mod:`selfspec.train.data.batching`: padded and packed batches, and a target forward's attention inputs over them;
- :mod:`selfspec.train.data.draft_vocab`: draft vocabularies counted on a training split.
"""

from selfspec.train.data.batching import collate, collate_packed, pack_rows, position_ids_from_mask, target_inputs
from selfspec.train.data.chat import IGNORE_INDEX, ChatTemplateError, chat_ids, tokenize_conversation
from selfspec.core.records import (
    EMPTY_CONVERSATION,
    EMPTY_TURN,
    INVALID_JSON_LINE,
    INVALID_TURN,
    NO_ASSISTANT,
    NO_TURNS,
    NOT_AN_OBJECT,
    ROLE_NAMES,
    UNKNOWN_ROLE,
    DataError,
    ReadReport,
    RecordReader,
    parse_turns,
    read_records,
)
from selfspec.train.data.conversations import load_conversations, open_records, sharegpt_path, to_messages
from selfspec.train.data.dataset import (
    CACHE_FORMAT,
    NO_LABELS,
    TEMPLATE_FAILED,
    TEMPLATE_UNSTABLE,
    TOO_LONG,
    build_dataset,
    data_cache_root,
    dataset_cache_key,
    split_indices,
    tokenizer_identity,
)
from selfspec.train.data.draft_vocab import (
    DraftVocab,
    choose_draft_vocab,
    count_draft_vocab,
    draft_vocab_counts,
    draft_vocab_problems,
)

__all__ = [
    "CACHE_FORMAT", "ChatTemplateError", "DataError", "DraftVocab", "EMPTY_CONVERSATION", "EMPTY_TURN",
    "IGNORE_INDEX", "INVALID_JSON_LINE", "INVALID_TURN", "NOT_AN_OBJECT", "NO_ASSISTANT", "NO_LABELS", "NO_TURNS",
    "ROLE_NAMES", "ReadReport", "RecordReader", "TEMPLATE_FAILED", "TEMPLATE_UNSTABLE", "TOO_LONG", "UNKNOWN_ROLE",
    "build_dataset", "chat_ids", "choose_draft_vocab", "collate", "collate_packed", "count_draft_vocab",
    "data_cache_root", "dataset_cache_key", "draft_vocab_counts", "draft_vocab_problems", "load_conversations",
    "open_records", "pack_rows", "parse_turns", "position_ids_from_mask", "read_records", "sharegpt_path",
    "split_indices", "target_inputs", "to_messages", "tokenize_conversation", "tokenizer_identity",
]
