"""Training-data pipeline: streaming reader, record conversion, assistant-only labels, cached dataset, collate."""

from __future__ import annotations

import json

import pytest
import torch

import selfspec.train.data as data
import selfspec.train.data.dataset
import selfspec.core.records
from selfspec.train.data import (
    IGNORE_INDEX, ChatTemplateError, DataError, build_dataset, collate, load_conversations, read_records, to_messages,
    tokenize_conversation,
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another, in French?"},
    {"role": "assistant", "content": "Rouge, café-au-lait ☕."},
    {"role": "user", "content": "And one more."},
    {"role": "assistant", "content": "Green.\nThat is all."},
]


def sharegpt(i: int, turns: int = 2) -> dict:
    conv = [{"from": "human" if k % 2 == 0 else "gpt", "value": f"turn {k} of record {i} é"} for k in range(turns)]
    return {"id": f"r{i}", "conversations": conv}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def labelled_segments(tokenizer, example) -> list[str]:
    """The decoded text of each contiguous run of labelled tokens."""
    segments, run = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            segments.append(tokenizer.decode(run))
            run = []
    if run:
        segments.append(tokenizer.decode(run))
    return segments


@pytest.fixture
def tiny_tokenizer(tiny_llama):
    return tiny_llama[1]


@pytest.fixture(scope="module")
def llama3_tokenizer():
    from selfspec.core.target import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


# --- reading ---------------------------------------------------------------------------------------------------------


def test_truncated_json_array_gives_exactly_the_whole_records_at_every_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(selfspec.core.records, "CHUNK_BYTES", 7)  # refills and buffer compaction at every few bytes
    records = [sharegpt(i, turns=1 + i % 3) for i in range(6)]
    text = json.dumps(records, indent=2, ensure_ascii=False).encode()
    ends = []  # byte offset just after each record's closing brace
    for i in range(len(records)):
        prefix = json.dumps(records[: i + 1], indent=2, ensure_ascii=False).encode()
        ends.append(len(prefix.rstrip(b"]").rstrip()))
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) + 1):
        path.write_bytes(text[:cut])
        reader = read_records(path)
        got = list(reader)
        whole = sum(end <= cut for end in ends)
        assert got == records[:whole], cut
        assert reader.report.records_read == whole
        assert reader.report.truncated_tail == (cut < len(text)), cut


def test_truncated_jsonl_keeps_whole_lines_and_skips_bad_ones(tmp_path):
    lines = [json.dumps(sharegpt(i)) for i in range(4)]
    path = tmp_path / "d.jsonl"
    path.write_text(lines[0] + "\n" + "{not json}\n" + "\n".join(lines[1:]) + "\n" + lines[0][:25], encoding="utf-8")
    reader = read_records(path)
    assert [r["id"] for r in reader] == ["r0", "r1", "r2", "r3"]
    assert reader.report.truncated_tail
    assert reader.report.skipped == {data.INVALID_JSON_LINE: 1}
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    reader = read_records(path)
    assert len(list(reader)) == 4 and not reader.report.truncated_tail


def test_file_cut_inside_a_multibyte_character_is_a_truncation_not_an_encoding_error(tmp_path):
    text = json.dumps([sharegpt(0), {"id": "x", "conversations": [{"from": "human", "value": "☕☕"}]}],
                      ensure_ascii=False).encode()
    cut = text.index("☕".encode()) + 1
    path = tmp_path / "cut.json"
    path.write_bytes(text[:cut])
    reader = read_records(path)
    assert [r["id"] for r in reader] == ["r0"] and reader.report.truncated_tail
    path = tmp_path / "cut.jsonl"
    path.write_bytes(json.dumps(sharegpt(0)).encode() + b"\n" + "{\"a\": \"☕".encode()[:-1])
    reader = read_records(path)
    assert [r["id"] for r in reader] == ["r0"] and reader.report.truncated_tail


def test_load_conversations_reports_the_cut_tail(tmp_path, capsys):
    text = json.dumps([sharegpt(i) for i in range(3)]).encode()
    path = tmp_path / "cut.json"
    path.write_bytes(text[: len(text) - 20])
    conversations, report = load_conversations({"source": "file", "path": str(path)})
    assert len(conversations) == 2 and report.truncated_tail and report.conversations == 2
    assert "file was cut off after record 2: tail ignored" in capsys.readouterr().err


# --- bad inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, words", [
    (b"", "is empty"),
    (b"  \n\n ", "only whitespace"),
    (b"this is not json at all", "not JSON or JSONL"),
    (b"<html><body>404</body></html>", "not JSON or JSONL"),
    (b"{not json\n{also not}\n", "no valid JSON line"),
    (b'[{"id": 1, "conversations": []}, nonsense, {"id": 2}]', r"byte offset 33 \(record 2\)"),
])
def test_unreadable_files_raise_data_error(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=words):
        load_conversations({"source": "file", "path": str(path)}, verbose=False)


@pytest.mark.parametrize("suffix", ["json", "jsonl"])
def test_non_utf8_file_names_the_byte_offset(tmp_path, suffix):
    record = b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}'
    content = b"[" + record + b"]" if suffix == "json" else b'{"a": 1}\n' + record + b"\n"
    offset = content.index(b"\xe9")
    path = tmp_path / f"latin1.{suffix}"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"not UTF-8: byte b'\\xe9' at byte offset {offset} .*iconv"):
        load_conversations({"source": "file", "path": str(path)}, verbose=False)


def test_missing_file_and_missing_path_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_conversations({"source": "file", "path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(DataError, match="data.path"):
        load_conversations({"source": "file", "path": None})
    with pytest.raises(DataError, match="Unknown data.source"):
        load_conversations({"source": "ftp"})


def test_composed_data_configs_are_read(tmp_path):
    from conftest import compose

    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(3)])
    cfg = compose("regenerate", ["data=file", f"data.path={path}", "data.max_records=2"])
    conversations, _ = load_conversations(cfg.data, verbose=False)
    assert len(conversations) == 2
    with pytest.raises(DataError, match="data=file needs data.path"):
        load_conversations(compose("regenerate", ["data=file"]).data)
    with pytest.raises(DataError, match="data=hf needs data.name"):
        load_conversations(compose("regenerate", ["data=hf"]).data)


def test_records_without_assistant_turn_are_skipped_and_counted(tmp_path):
    records = [
        sharegpt(0),
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "gpt", "value": "an answer before any question"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "   "}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "wizard", "value": "a"}]},
        {"conversations": []},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["no parts"]}]},
        {"text": "plain text"},
        ["not", "an", "object"],
        {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
    ]
    conversations, report = load_conversations({"source": "file", "path": str(write_jsonl(tmp_path / "d.jsonl",
                                                                                          records))}, verbose=False)
    assert conversations[1] == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert len(conversations) == 2 and report.records_read == 10
    assert report.skipped == {data.NO_ASSISTANT: 2, data.EMPTY_TURN: 1, data.UNKNOWN_ROLE: 1,
                              data.EMPTY_CONVERSATION: 1, data.INVALID_TURN: 1, data.NO_TURNS: 1,
                              data.NOT_AN_OBJECT: 1}


def test_all_records_invalid_raises_data_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": "q"}]}] * 3)
    with pytest.raises(DataError, match=r"No usable conversation .*3 records read; no assistant turn: 3"):
        load_conversations({"source": "file", "path": str(path)}, verbose=False)
    path.write_text("[]")
    with pytest.raises(DataError, match="No usable conversation"):
        load_conversations({"source": "file", "path": str(path)}, verbose=False)


def test_to_messages_maps_roles_and_trims_unlearnable_turns():
    record = {"conversations": [
        {"from": "system", "value": "sys"}, {"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q1"},
        {"from": "chatgpt", "value": "a1"}, {"from": "user", "value": "q2"}, {"from": "bard", "value": "a2"},
        {"from": "human", "value": "unanswered"}]}
    assert to_messages(record) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}]}
    assert to_messages(parts)[0] == {"role": "user", "content": "ab"}


def test_max_records_caps_conversations(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(10)])
    conversations, report = load_conversations({"source": "file", "path": str(path), "max_records": 4}, verbose=False)
    assert len(conversations) == 4 and report.stopped_early


def test_hf_source_reads_a_local_dataset_folder_and_explains_an_unreachable_one(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", [sharegpt(i) for i in range(3)])
    conversations, report = load_conversations({"source": "hf", "name": str(tmp_path), "split": "train"},
                                               verbose=False)
    assert len(conversations) == 3 and report.records_read == 3

    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/chats' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError, match=r"(?s)someone/chats.*data=file data.path="):
        load_conversations({"source": "hf", "name": "someone/chats", "split": "train"})



# --- the record forms people have -----------------------------------------------------------------------------------

TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
             {"role": "assistant", "content": "Bye."}]
FORMS = {  # a record of each form, and the conversation it holds
    "sharegpt": ({"id": "s", "conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[
        m["role"]], "value": m["content"]} for m in TWO_TURNS]}, TWO_TURNS),
    "openai": ({"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]} if m["role"] == "user" else m
                             for m in TWO_TURNS]}, TWO_TURNS),
    "ultrachat": ({"id": "u", "data": ["Hi?", "Hello.", "Bye?", "Bye."]}, TWO_TURNS[1:]),
    "magpie": ({"uuid": "m", "instruction": "Hi?", "response": "Hello.", "gen_input_configs": {"temperature": 1.0},
                "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
               TWO_TURNS[1:3]),
    "magpie_columns": ({"instruction": "Hi?", "response": "Hello.", "system": "Be brief."}, TWO_TURNS[:3]),
    "alpaca": ({"instruction": "Translate to French.", "input": "cat", "output": "chat"},
               [{"role": "user", "content": "Translate to French.\n\ncat"}, {"role": "assistant", "content": "chat"}]),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_record_form_reads_through_one_reader_and_labels_its_answers(tiny_tokenizer, tmp_path, form):
    record, conversation = FORMS[form]
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    (read,), _ = load_conversations({"source": "file", "path": str(path)}, verbose=False)
    assert read == conversation
    example = tokenize_conversation(tiny_tokenizer, read, max_length=4096)  # labels from the target's template
    assert labelled_segments(tiny_tokenizer, example) == [m["content"] + "<|im_end|>" for m in conversation
                                                          if m["role"] == "assistant"]


def test_hf_datasets_of_the_new_forms_read_by_name(tmp_path):
    for form in ("ultrachat", "magpie_columns", "alpaca"):  # sharegpt: test_hf_source_reads_a_local_dataset_folder
        folder = tmp_path / form
        folder.mkdir()
        write_jsonl(folder / "train.jsonl", [FORMS[form][0]] * 2)
        conversations, report = load_conversations({"source": "hf", "name": str(folder), "split": "train"},
                                                    verbose=False)
        assert conversations == [FORMS[form][1]] * 2 and not report.skipped, form


def test_malformed_records_of_the_new_forms_are_skipped_with_their_reason(tmp_path):
    records = [{"data": ["q", 3]}, {"data": ["q", " "]}, {"data": []}, {"instruction": "q", "response": ""},
               {"instruction": "q"}, {"instruction": ["q"], "output": "a"}, {"data": ["only a question"]}]
    path = write_jsonl(tmp_path / "d.jsonl", records + [FORMS["alpaca"][0]])
    conversations, report = load_conversations({"source": "file", "path": str(path)}, verbose=False)
    assert conversations == [FORMS["alpaca"][1]]
    assert report.skipped == {data.INVALID_TURN: 2, data.EMPTY_TURN: 2, data.EMPTY_CONVERSATION: 1,
                              data.NO_TURNS: 1, data.NO_ASSISTANT: 1}

# --- labels ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_labels_cover_exactly_each_assistant_content_and_its_end_of_turn(tiny_tokenizer, llama3_tokenizer, template):
    tok, eot = (tiny_tokenizer, "<|im_end|>") if template == "chatml" else (llama3_tokenizer, "<|eot_id|>")
    example = tokenize_conversation(tok, CONVERSATION, max_length=4096)
    ids = tok.apply_chat_template(CONVERSATION, return_dict=False)
    assert example["input_ids"] == ids
    expected = [m["content"] + eot for m in CONVERSATION if m["role"] == "assistant"]
    assert labelled_segments(tok, example) == expected
    # token by token: a label is set exactly on the tokens of an assistant content and the end-of-turn after it
    eot_id = tok.convert_tokens_to_ids(eot)
    n_labelled = sum(label != IGNORE_INDEX for label in example["labels"])
    assert n_labelled == sum(len(tok.encode(m["content"], add_special_tokens=False)) + 1
                             for m in CONVERSATION if m["role"] == "assistant")
    assert [t for t, lab in zip(example["input_ids"], example["labels"]) if t == eot_id and lab != IGNORE_INDEX] \
        == [eot_id] * 3
    assert example["labels"].count(eot_id) == 3 and example["input_ids"].count(eot_id) == len(CONVERSATION)


def test_control_tokens_written_in_content_are_text_not_turn_boundaries(tiny_tokenizer):
    messages = [{"role": "user", "content": "What does <|im_end|> mean?"},
                {"role": "assistant", "content": "It ends a turn: <|im_end|> is the marker."}]
    example = tokenize_conversation(tiny_tokenizer, messages, max_length=4096)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert example["input_ids"].count(im_end) == 2  # the template's own two, not the ones in the text
    assert labelled_segments(tiny_tokenizer, example) == [messages[1]["content"] + "<|im_end|>"]


def test_truncate_cuts_at_max_length_and_drop_returns_none(tiny_tokenizer):
    full = tokenize_conversation(tiny_tokenizer, CONVERSATION, max_length=4096)
    n = len(full["input_ids"])
    for max_length in (n - 1, n - 30, 40):
        cut = tokenize_conversation(tiny_tokenizer, CONVERSATION, max_length=max_length)
        assert cut == {"input_ids": full["input_ids"][:max_length], "labels": full["labels"][:max_length]}
        assert tokenize_conversation(tiny_tokenizer, CONVERSATION, max_length, overflow="drop") is None
    assert tokenize_conversation(tiny_tokenizer, CONVERSATION, n, overflow="drop") == full
    with pytest.raises(DataError, match="overflow"):
        tokenize_conversation(tiny_tokenizer, CONVERSATION, n, overflow="wrap")


def test_template_that_rewrites_earlier_turns_is_a_clear_error(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    # Shows only the last assistant answer in full (like templates that strip earlier reasoning).
    tok.chat_template = (
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n'}}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{'...'}}{% else %}{{m['content']}}{% endif %}"
        "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        tokenize_conversation(tok, CONVERSATION, max_length=4096)


@pytest.mark.real_model
def test_smollm2_labels_every_assistant_turn(smollm2):
    tok = smollm2.tokenizer
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with a system message, and with SmolLM2's default one
        example = tokenize_conversation(tok, messages, max_length=4096)
        assert example["input_ids"] == tok.apply_chat_template(messages, return_dict=False)
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert labelled_segments(tok, example) == expected
        # the role header and the newline after <|im_end|> are not labelled
        header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        ids, labels = example["input_ids"], example["labels"]
        starts = [k for k in range(len(ids)) if ids[k:k + len(header)] == header]
        assert len(starts) == 3
        for k in starts:
            assert labels[k:k + len(header)] == [IGNORE_INDEX] * len(header)
            assert labels[k + len(header)] != IGNORE_INDEX
        assert labels[-1] == IGNORE_INDEX and tok.decode(ids[-1]) == "\n"


# --- the dataset -----------------------------------------------------------------------------------------------------


def data_cfg(path, **overrides):
    cfg = {"source": "file", "path": str(path), "name": None, "split": "train", "max_records": None,
           "max_length": 200, "overflow": "truncate", "eval_fraction": 0.25, "seed": 0}
    cfg.update(overrides)
    return cfg


def test_build_dataset_splits_caches_and_rebuilds_on_config_change(tmp_path, tiny_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i, turns=4) for i in range(8)])
    calls = []
    real = selfspec.train.data.dataset.conversation_examples
    monkeypatch.setattr(selfspec.train.data.dataset, "conversation_examples", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "cache"

    ds = build_dataset(data_cfg(path), tiny_tokenizer, cache_dir=cache, verbose=False)
    assert (len(ds["train"]), len(ds["eval"])) == (6, 2) and len(calls) == 8
    assert ds["train"].column_names == ["input_ids", "labels"]
    conversations, _ = load_conversations(data_cfg(path), verbose=False)
    expected = [tokenize_conversation(tiny_tokenizer, c, 200) for c in conversations]
    calls.clear()
    assert sorted(map(tuple, list(ds["train"]["input_ids"]) + list(ds["eval"]["input_ids"]))) \
        == sorted(tuple(e["input_ids"]) for e in expected)

    again = build_dataset(data_cfg(path), tiny_tokenizer, cache_dir=cache, verbose=False)
    assert calls == [] and list(again["eval"]["labels"]) == list(ds["eval"]["labels"])
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no temporary folder left

    build_dataset(data_cfg(path, max_length=100), tiny_tokenizer, cache_dir=cache, verbose=False)
    assert len(calls) == 8 and len(list(cache.iterdir())) == 2
    write_jsonl(path, [sharegpt(i, turns=4) for i in range(9)])  # the data file changed
    assert len(build_dataset(data_cfg(path), tiny_tokenizer, cache_dir=cache, verbose=False)["train"]) == 7


def test_build_dataset_uses_the_cache_root_from_the_environment(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("SELFSPEC_DATA_CACHE", str(tmp_path / "envcache"))
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(3)])
    build_dataset(data_cfg(path, eval_fraction=0.0), tiny_tokenizer, verbose=False)
    assert [p for p in (tmp_path / "envcache").iterdir() if (p / "dataset_dict.json").exists()]


def test_build_dataset_drops_and_counts_examples_without_labels(tmp_path, tiny_tokenizer, capsys):
    long_question = {"conversations": [{"from": "human", "value": "x" * 300}, {"from": "gpt", "value": "y"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(0), long_question, sharegpt(1, turns=6)])
    ds = build_dataset(data_cfg(path, eval_fraction=0.0), tiny_tokenizer, cache_dir=tmp_path / "c")
    assert len(ds["train"]) == 2 and len(ds["eval"]) == 0
    assert f"{data.NO_LABELS} 1" in capsys.readouterr().err
    ds = build_dataset(data_cfg(path, eval_fraction=0.0, overflow="drop", max_length=90), tiny_tokenizer,
                       cache_dir=tmp_path / "c")
    assert len(ds["train"]) == 1 and f"{data.TOO_LONG} 2" in capsys.readouterr().err
    with pytest.raises(DataError, match="No training example left"):
        build_dataset(data_cfg(path, max_length=20), tiny_tokenizer, cache_dir=tmp_path / "c", verbose=False)


def test_collate_right_pads_and_masks_padding():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}],
                    pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long


# --- the embedded ShareGPT file --------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_sharegpt_first_records_stream_without_reading_the_file():
    reader = read_records(data.sharegpt_path())
    first = [next(reader) for _ in range(20)]
    assert first[0]["id"] == "QWJhYvA_0" and all("conversations" in r for r in first)
    assert to_messages(first[0])[0]["role"] == "user"
    assert reader.report.records_read == 20 and not reader.report.truncated_tail


@pytest.mark.real_model
def test_sharegpt_whole_file_gives_17671_records_and_says_the_tail_was_cut(capsys):
    conversations, report = load_conversations({"source": "sharegpt"})
    assert report.records_read == 17671 and report.truncated_tail
    assert 17000 < len(conversations) < 17671
    assert "file was cut off after record 17,671: tail ignored" in capsys.readouterr().err
