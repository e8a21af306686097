"""scripts/regenerate.py's engine=vllm in real vLLM (the CPU build, in its own venv), against engine=hf: greedy
answers equal, or differ first at a float near-tie; a sampled run resumed after a kill writes what an uninterrupted
one writes. One vLLM engine serves the whole module (it takes tens of seconds to start on a small machine).

The target is test_serving's tiny random Llama (heads of 32: vLLM's CPU attention has no kernel for 16), saved for
vLLM as regenerate's run saves it. Without vLLM's venv these tests skip; under CI they fail instead.

Tolerance. Both engines compute the target in float32, in different kernels, so where the two best next tokens are
nearly tied, rounding may pick either. Float32's unit roundoff is u = 2**-24; a dot product of K terms computed in
any order is off by at most K * u * sum(|terms|). A logit goes through at most PRODUCTS such products in a row (per
layer q/k/v, attention, output, gate/up and down projections, then the head), each of at most K = 128 terms (the
hidden and intermediate sizes), so an answer may differ where the top-2 logits (HF's, at the first differing
position) are within PRODUCTS * K * u times the larger of their sums of |terms| in the head's product. Any other
difference fails.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import compose
from test_regenerate import PROMPTS
from test_serving import HIDDEN, LAYERS, tiny_target, vllm_or_skip
from selfspec.train.data import chat_ids, load_conversations
from selfspec.core.vllm_env import VllmSettings
from selfspec.train.regenerate import Answering, HFEngine, iter_prompts, open_vllm_engine, regenerate

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.vllm]

MAX_NEW = 24
PRODUCTS = 6 * LAYERS + 1
TERMS = HIDDEN  # the tiny Llama's intermediate size is its hidden size
TOLERANCE = PRODUCTS * TERMS * 2.0 ** -24  # relative to the head's sum of |terms|: about 3.8e-4
MORE = [{"id": f"m{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(
    ["Tell me a story about a fox.", "2 + 2 = ?", "Why is the sky blue? Explain it simply, in a few words.",
     "List three colours.", "x", "What is the capital of France, and why did it become the capital?",
     "Write a haiku.", "Translate 'good morning' to German."])]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(the target, engine=hf on it, engine=vllm on its saved copy): vLLM started once, as run() starts it."""
    from selfspec.core.vllm_env import served_model

    vllm_or_skip()
    target = tiny_target()
    cfg = compose("regenerate", ["engine=vllm", "model=tiny", f"model.tiny.hidden_size={HIDDEN}",
                                 f"model.tiny.num_hidden_layers={LAYERS}", "model.dtype=float32"])
    path, tokenizer = served_model(cfg.model)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    vllm = open_vllm_engine(path, tokenizer, cfg.model, VllmSettings.from_config(cfg.vllm), Answering(), log_path=log)
    yield target, HFEngine(target.model, target.tokenizer, batch_size=4), vllm
    vllm.close()


def regen(engine, tokenizer, out, records, n=None, **answering):
    return regenerate(engine, tokenizer, iter_prompts(records, {}), out, n=n,
                      answering=Answering(max_new_tokens=MAX_NEW, **answering), progress=False)


def near_tie(model, prompt: list[int], a: list[int], b: list[int], stop: int) -> tuple[bool, str]:
    """Whether answers ``a`` and ``b`` to ``prompt`` (each cut before its ``stop``) first differ between the target's
    two best tokens, with their logits within the tolerance (module docstring); and what was measured."""
    k = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    chosen = {a[k] if k < len(a) else stop, b[k] if k < len(b) else stop}  # an answer that ended chose its stop
    with torch.no_grad():
        out = model(torch.tensor([prompt + a[:k]]), output_hidden_states=True)
    logits, hidden = out.logits[0, -1].double(), out.hidden_states[-1][0, -1].double()  # [V], [H] (after the norm)
    top = logits.topk(2)
    head = model.lm_head.weight.double()[top.indices]  # [2, H]
    scale = (head * hidden).abs().sum(-1).max().item()
    gap = (top.values[0] - top.values[1]).item()
    measured = f"position {k}: tokens {sorted(chosen)}, top-2 {top.indices.tolist()}, gap {gap:.2e}, tolerance " \
               f"{TOLERANCE * scale:.2e}"
    return chosen == set(top.indices.tolist()) and gap <= TOLERANCE * scale, measured


def test_greedy_answers_equal_hf_or_differ_first_at_a_float_near_tie(engines, tmp_path):
    target, hf, vllm = engines
    tok = target.tokenizer
    records = PROMPTS + MORE
    regen(hf, tok, tmp_path / "hf.jsonl", records)
    regen(vllm, tok, tmp_path / "vllm.jsonl", records)
    ours = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "hf.jsonl").read_text().splitlines())}
    theirs = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "vllm.jsonl").read_text().splitlines())}
    assert set(ours) == set(theirs) and len(ours) == len(records) - 1  # PROMPTS has one record without a question
    differing, answers = [], 0
    for cid, messages in ours.items():
        for turn, (m, v) in enumerate(zip(messages, theirs[cid])):
            if m == v:
                answers += m["role"] == "assistant"
                continue
            # the first differing answer: both engines answer its conversation so far again, as token ids
            prompt = chat_ids(tok, messages[:turn], add_generation_prompt=True)
            a, b = (e.answer([prompt], [MAX_NEW], [0], Answering())[0] for e in (hf, vllm))
            tied, measured = near_tie(target.model, prompt, a, b, stop=hf.stop_ids[0])
            assert tied, f"{cid}, message {turn}: HF and vLLM differ beyond a near-tie ({measured})"
            differing.append((cid, measured))
            break
        else:
            assert len(messages) == len(theirs[cid])
    print(f"greedy: {answers} answers equal, {len(differing)} conversations differ at a near-tie: {differing}")
    prompt = chat_ids(tok, ours["m0"][:1], add_generation_prompt=True)  # a check on the check: the target's least
    answer = hf.answer([prompt], [MAX_NEW], [0], Answering())[0]  # likely token in place of its 4th is no near-tie
    with torch.no_grad():
        worst = target.model(torch.tensor([prompt + answer[:3]])).logits[0, -1].argmin().item()
    assert not near_tie(target.model, prompt, answer, answer[:3] + [worst], stop=hf.stop_ids[0])[0]
    assert answers >= 10 and len(differing) <= 2  # mostly equal; a near-tie is rare
    multi_turn = theirs["b"]
    assert [m["role"] for m in multi_turn] == ["system", "user", "assistant", "user", "assistant"]


def test_sampled_run_resumed_after_a_kill_writes_what_an_uninterrupted_one_writes(engines, tmp_path):
    target, _, vllm = engines
    tok = target.tokenizer
    records = PROMPTS + MORE
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    regen(vllm, tok, tmp_path / "whole.jsonl", records, **sampling)
    regen(vllm, tok, tmp_path / "resumed.jsonl", records, n=3, **sampling)  # killed after three
    with open(tmp_path / "resumed.jsonl", "a") as f:
        f.write('{"id": "m1", "messages": [{"role": "us')  # a record cut by the kill
    report = regen(vllm, tok, tmp_path / "resumed.jsonl", records, **sampling)
    assert report.dropped_partial_line and report.already_done == 3
    whole, resumed = ({r["id"]: r for r in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}
                      for name in ("whole", "resumed"))
    lines = (tmp_path / "resumed.jsonl").read_text().splitlines()
    assert len(lines) == len(resumed) == len(whole) and resumed == whole  # each id once, the same answers
    regen(vllm, tok, tmp_path / "greedy.jsonl", records)
    regen(vllm, tok, tmp_path / "seed4.jsonl", records, **{**sampling, "seed": 4})
    for name in ("greedy", "seed4"):  # sampling did sample, and the seed matters
        other = {r["id"]: r for r in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())}
        assert sum(other[i] != whole[i] for i in whole) >= len(whole) // 2, name
    conversations, read = load_conversations({"source": "file", "path": str(tmp_path / "resumed.jsonl")},
                                             verbose=False)
    assert read.records_read == len(whole) and not read.skipped  # valid training input
