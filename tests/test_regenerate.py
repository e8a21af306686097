"""Regenerating conversations with the target: its own greedy answers, resumable output, valid training input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MT_BENCH, REPO, compose
from selfspec.train.data import DataError, chat_ids, load_conversations, read_records
from selfspec.core.errors import SettingError
from selfspec.train.regenerate import EMPTY_ANSWER, AnswerEngine, Answering, HFEngine, iter_prompts, regenerate, run

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


def test_n_counts_conversations_written_not_prompts_read(tiny_llama, tmp_path):
    """n=2 with a first prompt too long to answer between them: that one is skipped and the next one taken."""
    model, tok = tiny_llama
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [text]}) + "\n"
                            for i, text in enumerate(["short", "z" * 200, "also short", "third"])))
    out = tmp_path / "out.jsonl"
    report = regenerate(HFEngine(model, tok), tok, iter_prompts(read_records(path), {}), out, n=2,
                        answering=Answering(max_new_tokens=MAX_NEW, max_length=100), progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert report.written == 2 and sorted(r["messages"][0]["content"] for r in records) == ["also short", "short"]
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
    from selfspec.train.regenerate import iter_prompts

    records = [{"id": "a", "conversations": [
        {"from": "human", "value": "one"}, {"from": "gpt", "value": "x"},
        {"from": "human", "value": "two"}, {"from": "gpt", "value": "y"}]}]
    assert [p.turns for p in iter_prompts(records, {})] == [["one", "two"]]
    assert [p.turns for p in iter_prompts(records, {}, max_turns=1)] == [["one"]]


# --- what every engine shares: thinking, writing conversations as they complete, the vLLM settings ------------------


def test_thinking_is_cut_out_wherever_its_markers_put_it():
    from selfspec.train.regenerate import drop_thinking

    assert drop_thinking("<think>\nsteps\n</think>\n\nAnswer", "<think>", "</think>") == "Answer"
    assert drop_thinking("opened by the template</think>Answer", "<think>", "</think>") == "Answer"
    assert drop_thinking("A<think>x</think>B<think>ran out of tokens", "<think>", "</think>") == "AB"
    assert drop_thinking("<r>x</r> kept </think>", "<r>", "</r>") == "kept </think>"
    assert drop_thinking("no thinking at all", "<think>", "</think>") == "no thinking at all"
    with pytest.raises(SettingError, match="thinking='hide': keep or drop"):
        Answering(thinking="hide")
    with pytest.raises(SettingError, match="give two non-empty strings"):
        Answering(thinking_markers=("<think>",))


class ScriptedEngine(AnswerEngine):
    """Answers each prompt with the reply its last user turn names (a test's script); stops (as a kill would) at
    call ``kill_at``. Records every prompt it was asked, as text."""

    def __init__(self, tokenizer, replies: dict[str, str], batch_size: int, kill_at: int | None = None):
        self.tok, self.replies, self.batch_size, self.kill_at = tokenizer, replies, batch_size, kill_at
        self.asked: list[str] = []
        self.calls = 0

    def answer(self, prompts, budgets, seeds, answering):
        self.calls += 1
        if self.calls == self.kill_at:
            raise KeyboardInterrupt
        texts = [self.tok.decode(p) for p in prompts]
        self.asked += texts
        last_user = [t.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0] for t in texts]
        return [self.tok.encode(self.replies[u], add_special_tokens=False) for u in last_user]


SCRIPT = {"q1": "<think>let me see</think>\n\nA1", "q2": "A2", "only": "<think>hmm</think>B",
          "cut": "<think>ran out of tokens"}
SCRIPTED = [{"id": "x", "turns": ["q1", "q2"]}, {"id": "y", "turns": ["only"]}, {"id": "z", "turns": ["cut"]}]


@pytest.mark.parametrize("thinking", ["keep", "drop"])
def test_thinking_is_kept_or_dropped_and_later_turns_see_what_was_kept(tiny_llama, tmp_path, thinking):
    _, tok = tiny_llama
    engine = ScriptedEngine(tok, SCRIPT, batch_size=3)
    out = tmp_path / "out.jsonl"
    report = regenerate(engine, tok, iter_prompts(SCRIPTED, {}), out, answering=Answering(thinking=thinking),
                        progress=False)
    records = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    second_prompt = next(t for t in engine.asked if "q2" in t)
    if thinking == "keep":
        assert records["x"][1]["content"] == SCRIPT["q1"] and "let me see" in second_prompt
        assert records["z"][1]["content"] == SCRIPT["cut"] and report.written == 3
    else:
        assert [m["content"] for m in records["x"]] == ["q1", "A1", "q2", "A2"] and records["y"][1]["content"] == "B"
        assert "let me see" not in second_prompt and "A1" in second_prompt
        assert "z" not in records and report.skipped == {EMPTY_ANSWER: 1}  # its answer was all thinking


def test_conversations_are_written_as_they_complete_and_a_kill_loses_only_those_in_flight(tiny_llama, tmp_path):
    _, tok = tiny_llama
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):  # killed while the group's second turn is asked
        regenerate(ScriptedEngine(tok, SCRIPT, batch_size=3, kill_at=2), tok, iter_prompts(SCRIPTED, {}), out,
                   progress=False)
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["y", "z"]  # one turn each
    again = ScriptedEngine(tok, SCRIPT, batch_size=3)
    report = regenerate(again, tok, iter_prompts(SCRIPTED, {}), out, progress=False)
    assert report.already_done == 2 and report.written == 1 and again.calls == 2  # x alone, both its turns
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["x", "y", "z"]


def test_vllm_settings_compose_into_the_llm_keywords_and_one_engine_per_data_parallel_replica():
    from selfspec.core.vllm_env import VllmSettings, llm_kwargs, replica_env

    cfg = compose("regenerate", ["engine=vllm", "vllm.tensor_parallel_size=2", "vllm.data_parallel_size=2",
                                 "vllm.max_num_seqs=64", "+vllm.engine_args.enable_expert_parallel=true"])
    settings = VllmSettings.from_config(cfg.vllm)
    assert llm_kwargs(settings, "/models/m", "bfloat16", 2048, 5) == {
        "model": "/models/m", "dtype": "bfloat16", "seed": 5, "max_model_len": 2048, "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1, "max_num_seqs": 64, "enable_expert_parallel": True}  # unset ones: vLLM's own
    assert replica_env(settings, ["0", "1", "2", "3"]) == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                           {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert replica_env(settings, ["4", "5", "6", "7", "8"]) == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                                {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(SettingError, match="= 4 GPUs, but 3 are visible"):
        replica_env(settings, ["0", "1", "2"])
    with pytest.raises(SettingError, match="none is visible here"):
        replica_env(settings, [])
    default = VllmSettings.from_config(compose("regenerate", ["engine=vllm"]).vllm)
    assert replica_env(default, []) == [{}]  # one engine keeps the devices as they are (CPU, or Ray's nodes)
    assert llm_kwargs(default, "m", "float32", None, 0) == {"model": "m", "dtype": "float32", "seed": 0,
                                                            "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    default.engine_args = {"data_parallel_size": 2}
    with pytest.raises(SettingError, match="engine_args sets data_parallel_size"):
        llm_kwargs(default, "m", "float32", None, 0)


def test_run_with_engine_vllm_starts_vllm_with_the_composed_settings(tmp_path, prompts_file, monkeypatch):
    """run() as scripts/regenerate.py engine=vllm calls it, with vLLM's session replaced by one that records what it
    was started with and answers every request with three fixed tokens."""
    import selfspec.train.regenerate

    started = []

    class RecordingSession:
        def __init__(self, engine, venv, replica_env, log_path=None, timeout=None):
            started.append({"engine": engine, "replicas": replica_env, "timeout": timeout})
            self.requests = []

        def generate(self, requests):
            started[-1].setdefault("requests", []).extend(requests)
            return [[70, 71, 72, 2, 73] for _ in requests]

        def close(self):
            started[-1]["closed"] = True

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    monkeypatch.setattr(selfspec.train.regenerate, "VllmSession", RecordingSession)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    out = tmp_path / "out.jsonl"
    cfg = compose("regenerate", ["model=tiny", "model.dtype=float32", "data=file", f"data.path={prompts_file}",
                                 "data.max_length=300", "n=3", "max_new_tokens=5", "temperature=0.7", "seed=3",
                                 f"out={out}", "engine=vllm", f"vllm.venv={venv}", "vllm.data_parallel_size=2",
                                 "vllm.timeout=50"])
    report = run(cfg)
    (call,) = started
    assert call["engine"]["dtype"] == "float32" and call["engine"]["max_model_len"] == 300 and call["closed"]
    assert call["engine"]["seed"] == 3 and "data_parallel_size" not in call["engine"] and call["timeout"] == 50
    assert (Path(call["engine"]["model"]) / "config.json").exists()  # the tiny target, saved for vLLM
    assert call["replicas"] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    requests = call["requests"]
    assert {r["stop_token_ids"] == [2] and r["temperature"] == 0.7 for r in requests} == {True}
    assert len({r["seed"] for r in requests}) == len(requests)  # every answer its own seed
    assert report.written == 3
    assert {m["content"] for r in map(json.loads, out.read_text().splitlines()) for m in r["messages"]
            if m["role"] == "assistant"} == {tok_text(70, 71, 72)}  # cut at the stop id


def tok_text(*ids: int) -> str:
    from selfspec.core.target import build_tiny_tokenizer

    return build_tiny_tokenizer().decode(list(ids))


def test_an_unknown_engine_and_a_missing_vllm_venv_are_refused_before_a_model_loads(tmp_path, prompts_file):
    from selfspec.core.vllm_env import ServingError

    common = ["model=tiny", "data=file", f"data.path={prompts_file}", f"out={tmp_path / 'out.jsonl'}"]
    with pytest.raises(SettingError, match="engine='tgi': hf .* or vllm"):
        run(compose("regenerate", common + ["engine=tgi"]))
    with pytest.raises(ServingError, match="No vLLM virtualenv at .*nowhere: make one with `bash scripts/make_vllm"):
        run(compose("regenerate", common + ["engine=vllm", f"vllm.venv={tmp_path / 'nowhere'}"]))
    assert not list(tmp_path.glob("out*"))  # nothing written: not the output, not its config


FAKE_VLLM = '''
import json, os
__version__ = "fake"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class LLM:
    def __init__(self, **kw):
        with open(os.environ["FAKE_KWARGS"], "w") as f:
            json.dump(kw, f)
    def generate(self, prompts, params, use_tqdm=False):
        out = []
        for p, s in zip(prompts, params):
            if not p["prompt_token_ids"]:
                raise ValueError("an empty prompt")
            ids = [int(os.environ["FAKE_REPLICA"])] + p["prompt_token_ids"][::-1] + [s.kw["max_tokens"]]
            out.append(type("Out", (), {"outputs": [type("Completion", (), {"token_ids": ids})()]})())
        return out
'''


def test_vllm_session_shares_each_call_among_its_replicas_and_answers_in_order(tmp_path):
    """selfspec.core.vllm_env.VllmSession with core/vllm_worker.py over a stand-in vllm package (this Python as the venv's):
    one worker per replica, each started once with the engine's keywords (and the CPU defaults it left out), every
    call shared among them and put back in request order; a failing call and a worker without vLLM are errors that
    say what failed."""
    import sys

    from selfspec.core.vllm_env import ServingError, VllmSession

    (tmp_path / "fake" / "vllm" / "platforms").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "fake" / "vllm" / "platforms" / "__init__.py").write_text(
        "current_platform = type('Platform', (), {'is_cpu': lambda self: True})()\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    replicas = [{"PYTHONPATH": str(tmp_path / "fake"), "FAKE_REPLICA": r, "FAKE_KWARGS": str(tmp_path / f"kw{r}")}
                for r in range(2)]
    requests = [{"prompt_token_ids": [10 + i, 20 + i], "max_tokens": 5 + i, "temperature": 0.0, "top_p": 1.0,
                 "seed": None, "stop_token_ids": [2]} for i in range(5)]
    with VllmSession({"model": "m", "enforce_eager": False}, tmp_path / "venv", replicas,
                     log_path=tmp_path / "vllm.log", timeout=120) as session:
        for _ in range(2):  # the engines stay up between calls
            assert session.generate(requests) == [[i % 2, 20 + i, 10 + i, 5 + i] for i in range(5)]
        with pytest.raises(ServingError, match="worker 0 failed: ValueError: an empty prompt"):
            session.generate([{**requests[0], "prompt_token_ids": []}])
    for r in range(2):  # the CPU default the engine set itself stays its own
        assert json.loads((tmp_path / f"kw{r}").read_text()) == {"model": "m", "enforce_eager": False,
                                                                 "gpu_memory_utilization": 0.3}
    with pytest.raises(ServingError, match="failed: ModuleNotFoundError: No module named 'vllm'"):
        VllmSession({"model": "m"}, tmp_path / "venv", timeout=120)


def test_resuming_reads_records_whose_text_holds_unicode_line_breaks(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+0085 and a form feed as they are; str.splitlines would cut a
    record there and call the file foreign (seen on ShareGPT's answers)."""
    from selfspec.train.regenerate import read_done

    out = tmp_path / "regenerated.jsonl"
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"a{sep}b"}]}
               for i, sep in enumerate(["\u2028", "\u0085", "\x0c", "\u2029"])]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert read_done(out) == ({"c0", "c1", "c2", "c3"}, False)
    with open(out, "a", encoding="utf-8") as f:
        f.write('{"id": "c4", "messages": [{"role": "user", "content": "cut\u2028 off')  # a killed run's last line
    assert read_done(out) == ({"c0", "c1", "c2", "c3"}, True)
    with open(out, "a", encoding="utf-8") as f:
        f.write("not a record\n")
    with pytest.raises(DataError, match="line 5 is not a regenerated record"):
        read_done(out)
