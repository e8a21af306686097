"""Regenerating conversations with the target: its own greedy answers, resumable output, valid training input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import MT_BENCH, REPO, compose
from train.data import DataError, chat_ids, load_conversations, read_records
from train.regenerate import Answering, HFEngine, iter_prompts, regenerate, run

PROMPTS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "old answer"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Why?"},
                                  {"from": "gpt", "value": "old"}, {"from": "human", "value": "And then?"},
                                  {"from": "gpt", "value": "old"}]},
    {"id": "c", "messages": [{"role": "user", "content": "A question that is somewhat longer than others"}]},
    {"id": "d", "conversations": [{"from": "gpt", "value": "no question here"}]},  # skipped: no user turn
    {"question_id": 7, "category": "math", "turns": ["1 + 1?", "Times three?"]},
    {"id": "e", "conversations": [{"from": "human", "value": "Last"}, {"from": "gpt", "value": "x"}]},
]
MAX_NEW = 6


def greedy_reference(model, tokenizer, messages) -> str:
    """The target's own greedy answer: plain HF generate at batch 1, no padding."""
    ids = torch.tensor([chat_ids(tokenizer, messages, add_generation_prompt=True)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    if 2 in out:
        out = out[: out.index(2)]
    return tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def regen(model, tok, prompts_file, out, n, batch_size=4):
    skipped = {}
    report = regenerate(HFEngine(model, tok, batch_size), tok, iter_prompts(read_records(prompts_file), skipped), out,
                        n=n, answering=Answering(max_new_tokens=MAX_NEW), progress=False)
    return report, skipped


def test_assistant_turns_are_the_targets_own_greedy_answers(tiny_llama, prompts_file, tmp_path):
    model, tok = tiny_llama
    out = tmp_path / "out.jsonl"
    report, skipped = regen(model, tok, prompts_file, out, n=5, batch_size=3)  # batches of mixed lengths
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    records = [by_id[i] for i in ["a", "b", "c", "7", "e"]]
    assert len(by_id) == 5 and report.written == 5
    assert skipped == {"no user turn": 1} and records[3]["category"] == "math"
    for record, source in zip(records, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4], PROMPTS[5]]):
        messages = record["messages"]
        assert "old" not in json.dumps(messages)
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users == (source.get("turns") or [t["value"] for t in source.get("conversations", [])
                                                 if t["from"] == "human"] or [source["messages"][0]["content"]])
        for k, message in enumerate(messages):
            if message["role"] == "assistant":  # answered from the conversation so far, with its own answers
                assert message["content"] == greedy_reference(model, tok, messages[:k])
    assert records[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in records[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]


def test_output_is_valid_training_input(tiny_llama, prompts_file, tmp_path):
    model, tok = tiny_llama
    out = tmp_path / "out.jsonl"
    regen(model, tok, prompts_file, out, n=5)
    conversations, report = load_conversations({"source": "file", "path": str(out)}, verbose=False)
    assert report.records_read == 5 and not report.skipped
    assert [m["role"] for m in conversations[4]] == ["user", "assistant"]


def test_kill_and_resume_writes_each_id_once_and_keeps_what_was_done(tiny_llama, prompts_file, tmp_path):
    model, tok = tiny_llama
    out = tmp_path / "out.jsonl"
    regen(model, tok, prompts_file, out, n=3)
    first = out.read_text().splitlines()
    assert len(first) == 3
    with open(out, "a") as f:
        f.write('{"id": "7", "messages": [{"role": "us')  # a record cut by a kill
    report, _ = regen(model, tok, prompts_file, out, n=5)
    lines = out.read_text().splitlines()
    assert lines[:3] == first
    assert sorted(json.loads(line)["id"] for line in lines) == ["7", "a", "b", "c", "e"]
    assert report.dropped_partial_line and report.already_done == 3 and report.written == 2
    report, _ = regen(model, tok, prompts_file, out, n=5)  # nothing left to do
    assert report.written == 0 and out.read_text().splitlines() == lines


def test_foreign_output_file_is_refused(tiny_llama, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("not a record\n")
    with pytest.raises(DataError, match="line 1 is not a regenerated record"):
        regen(*tiny_llama, prompts_file, out, n=1)


@pytest.mark.parametrize("batch_size", [1, 5])
def test_prompts_are_answered_shortest_first_and_answers_end_at_max_length(tiny_llama, prompts_file, tmp_path,
                                                                            batch_size):
    model, tok = tiny_llama
    out = tmp_path / "out.jsonl"
    prompts = list(iter_prompts(read_records(prompts_file), {}, max_turns=1))
    openings = [chat_ids(tok, ([{"role": "system", "content": p.system}] if p.system else [])
                         + [{"role": "user", "content": p.turns[0]}], add_generation_prompt=True) for p in prompts]
    max_length = max(len(ids) for ids in openings) + 3  # every prompt fits; the longest has room for 3 tokens
    regenerate(HFEngine(model, tok, batch_size), tok, iter(prompts), out, n=5,
               answering=Answering(max_new_tokens=MAX_NEW, max_length=max_length), progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [len(chat_ids(tok, r["messages"][:-1], add_generation_prompt=True)) for r in records]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1  # written shortest first
    rooms = [min(MAX_NEW, max_length - length) for length in lengths]  # each answer ends where its conversation is full
    assert rooms[-1] == 3 and rooms[0] == MAX_NEW
    for record, room in zip(records, rooms):
        ids = torch.tensor([chat_ids(tok, record["messages"][:-1], add_generation_prompt=True)])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=room, do_sample=False,
                                  pad_token_id=0)[0, ids.shape[1]:].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2)]
        assert record["messages"][-1]["content"] == tok.decode(expected, skip_special_tokens=True)


def test_max_length_stops_a_conversation_before_it_overflows(tiny_llama, tmp_path):
    model, tok = tiny_llama
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["short", "y" * 200]}) + "\n"
                    + json.dumps({"question_id": 2, "turns": ["z" * 200]}) + "\n")
    out = tmp_path / "out.jsonl"
    report = regenerate(HFEngine(model, tok), tok, iter_prompts(read_records(path), {}), out,
                        answering=Answering(max_new_tokens=MAX_NEW, max_length=100), progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["messages"]) for r in records] == [2]  # the second turn would not fit; q2 never fits
    assert report.skipped == {"first prompt longer than max_length": 1}


@pytest.mark.skipif(not MT_BENCH.exists(), reason="MT-bench questions are not next to the project")
def test_run_composes_the_entry_config_and_reads_mt_bench_prompts(tmp_path):
    out = tmp_path / "mt.jsonl"
    cfg = compose("regenerate", ["model=tiny", f"prompts={MT_BENCH}", "n=2", "max_new_tokens=3", f"out={out}"])
    run(cfg)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["81", "82"] and records[0]["category"] == "writing"
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert (tmp_path / "mt.config.yaml").exists()


def test_script_runs_once_on_the_tiny_model(tmp_path, prompts_file):
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, str(REPO / "scripts" / "regenerate.py"), "model=tiny", "data=file",
           f"data.path={prompts_file}", "n=2", "max_new_tokens=2", f"out={out}", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert "2 written" in proc.stderr


def test_max_turns_keeps_only_the_first_user_turns():
    from train.regenerate import iter_prompts

    records = [{"id": "a", "conversations": [
        {"from": "human", "value": "one"}, {"from": "gpt", "value": "x"},
        {"from": "human", "value": "two"}, {"from": "gpt", "value": "y"}]}]
    assert [p.turns for p in iter_prompts(records, {})] == [["one", "two"]]
    assert [p.turns for p in iter_prompts(records, {}, max_turns=1)] == [["one"]]
