"""Data for a base model (``data.format=text``): scripts/regenerate.py has the target continue the opening of each
record's text, and training tokenizes such records as plain text, labelled on the continuation, so an example is
the sequence the target generated (its opening special tokens, the opening, its greedy continuation, kept as text)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import compose
from selfspec.train.data.chat import IGNORE_INDEX, text_example
from selfspec.train.regenerate import run


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "records.jsonl"
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me about rivers."},
                                      {"from": "gpt", "value": "Rivers carry water from high ground to the sea, " * 3}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Write code. " * 20}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_regenerate_continues_openings_and_training_reads_them_as_the_sequence_generated(records, tmp_path):
    from selfspec.core.target import load_target
    from selfspec.train.data.dataset import build_dataset

    out = tmp_path / "text.jsonl"
    cfg = compose("regenerate", ["model=tiny", "data=file", f"data.path={records}", "data.format=text",
                                 "opening_tokens=24", "max_new_tokens=10", f"out={out}", "n=null"])
    report = run(cfg)
    assert report.written == 2 and report.skipped == {"text shorter than opening_tokens": 1}  # "Hello!" is short
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["a", "c"]  # a's answer, c's user turn (it has no answer)

    target = load_target({"source": "tiny"})
    tok, model = target.tokenizer, target.model
    opening = written[0]["messages"][0]["content"]
    assert opening == "Rivers carry water from high ground to the sea, "[:24]  # 24 byte tokens of its answer
    ids = tok(opening, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, pad_token_id=0)
    continuation = greedy[0, len(ids):].tolist()
    stop = model.generation_config.eos_token_id
    continuation = continuation[:continuation.index(stop)] if stop in continuation else continuation
    assert written[0]["messages"][1]["content"] == tok.decode(continuation, skip_special_tokens=True)

    data = build_dataset(compose("medusa", ["model=tiny", "data=file", f"data.path={out}", "data.format=text",
                                            "data.eval_fraction=0"]).data, tok, cache_dir=tmp_path / "cache")
    first = data["train"][0]
    # the continuation is kept as text (the random tiny model's bytes need not decode and encode back to themselves;
    # a real tokenizer's text does): the opening's ids as generated, then the continuation's text tokenized
    written_ids = tok(written[0]["messages"][1]["content"], add_special_tokens=False)["input_ids"]
    assert first["input_ids"] == ids + written_ids
    assert first["labels"] == [IGNORE_INDEX] * len(ids) + written_ids  # labelled on the continuation only


def test_a_text_example_keeps_the_tokenizer_s_opening_tokens_and_cuts_or_drops_at_max_length(tiny_llama):
    _, tok = tiny_llama
    messages = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "abc"},
                {"role": "assistant", "content": "defg"}]
    opening = tok("", add_special_tokens=True)["input_ids"]
    (example,) = text_example(tok, messages, max_length=64)
    body = tok("abc", add_special_tokens=False)["input_ids"] + tok("defg", add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == opening + body
    assert example["labels"][-4:] == tok("defg", add_special_tokens=False)["input_ids"]
    assert len(text_example(tok, messages, max_length=5)[0]["input_ids"]) == 5
    assert text_example(tok, messages, max_length=5, overflow="drop") == []


def test_an_unknown_format_is_refused_by_name(tmp_path):
    from selfspec.core.records import DataError
    from selfspec.core.target import load_target
    from selfspec.train.data.dataset import build_dataset

    cfg = compose("medusa", ["model=tiny", "data.format=prose"])
    with pytest.raises(DataError, match="data.format='prose': chat .* or text"):
        build_dataset(cfg.data, load_target({"source": "tiny"}).tokenizer, cache_dir=tmp_path)


def test_document_openings_are_whole_prose_sentences_in_their_length_range(tmp_path):
    from conftest import load_script

    openings = load_script("openings")
    text = "First sentence here. Second one is longer than that! Third? Fourth.\n\nNext paragraph."
    assert openings.opening(text, 20, 60) == "First sentence here."  # whole sentences, from min_chars on
    assert openings.opening(text, 25, 60) == "First sentence here. Second one is longer than that!"
    assert openings.opening(text, 10, 15) is None  # no whole sentence in reach
    assert openings.opening("- a list item. Another.", 5, 100) is None  # a list is not prose
    assert openings.opening("```python\nx = 1\n```", 1, 100) is None
    out = tmp_path / "openings.jsonl"
    assert openings.main(["--out", str(out), "--n", "3", "--skip", "10"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["category"] == "document" and 120 <= len(r["turns"][0]) <= 400 for r in rows)
    assert all(int(r["question_id"].split("-")[1]) >= 10 for r in rows)
    assert openings.main(["--out", str(out)]) == 2  # an existing file is never overwritten
