"""Loss masks under reasoning models' chat templates: Qwen3's (<think> blocks, dropped from earlier turns) and
gpt-oss's harmony format (analysis and final channels, <|return|> on the last answer only).

The real tokenizers and templates cannot be downloaded here: the templates are reproduced in tests/assets/chat_templates/
(their reasoning logic as the hub's tokenizer configs have it, tool calling left out) on the tiny byte-level tokenizer
with the models' added tokens (Qwen3's <think> and </think> are not special tokens, harmony's are). The harmony one is
checked against OpenAI's own harmony renderer (openai_harmony, in vLLM's venv) where that venv is installed.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
from transformers import AddedToken

from selfspec.core.target import build_tiny_tokenizer
from selfspec.train.data import IGNORE_INDEX, ChatTemplateError, build_dataset, chat_ids, parse_turns
from selfspec.core.records import DataError, ReadReport
from selfspec.train.data.chat import TemplateRewritesTurns, conversation_examples, tokenize_conversation
from selfspec.train.data.dataset import _tokenize_all

from conftest import REPO
from test_data import labelled_segments

TEMPLATES = REPO / "tests" / "assets" / "chat_templates"
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]


@pytest.fixture(scope="module")
def qwen3():
    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def harmony():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = (TEMPLATES / "gpt_oss.jinja").read_text()
    return tok


THINKING = [  # reasoning inside the content (as scripts/regenerate.py writes Qwen3's answers) and apart from it
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "<think>\nSomething common.\n</think>\n\nBlue."},
    {"role": "user", "content": "Another, in French?"},
    {"role": "assistant", "content": "Rouge.", "reasoning_content": "Translate red."},
    {"role": "user", "content": "One more."},
    {"role": "assistant", "content": "<think>\nA plant's.\n</think>\n\nGreen."},
]


def test_qwen3_answer_keeps_its_think_block_as_written(qwen3):
    messages = THINKING[:3]
    (example,) = conversation_examples(qwen3, messages, max_length=4096)
    assert example["input_ids"] == chat_ids(qwen3, messages)
    assert labelled_segments(qwen3, example) == ["<think>\nSomething common.\n</think>\n\nBlue.<|im_end|>"]
    think = qwen3.convert_tokens_to_ids("<think>")
    assert example["labels"].count(think) == 1  # the model's own token, not the characters of "<think>"


def test_qwen3_multi_turn_is_one_example_per_answer_in_the_context_it_was_written(qwen3):
    with pytest.raises(TemplateRewritesTurns):  # earlier answers lose their reasoning once a user turn follows
        tokenize_conversation(qwen3, THINKING, max_length=4096)
    examples = conversation_examples(qwen3, THINKING, max_length=4096)
    answers = [i for i, m in enumerate(THINKING) if m["role"] == "assistant"]
    assert len(examples) == len(answers)
    expected = ["<think>\nSomething common.\n</think>\n\nBlue.<|im_end|>",
                "<think>\nTranslate red.\n</think>\n\nRouge.<|im_end|>",
                "<think>\nA plant's.\n</think>\n\nGreen.<|im_end|>"]
    for i, example, text in zip(answers, examples, expected):
        prompt = chat_ids(qwen3, THINKING[:i], add_generation_prompt=True)  # what the target reads to answer turn i
        assert example["input_ids"][:len(prompt)] == prompt
        assert example["labels"][:len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert labelled_segments(qwen3, example) == [text]
    # the last example shows the earlier answers as history: without their reasoning
    history = qwen3.decode(examples[-1]["input_ids"])
    assert "assistant\nBlue.<|im_end|>" in history and "Something common" not in history


def test_qwen3_non_thinking_mode_leaves_the_empty_block_to_the_prompt(qwen3):
    plain = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]
    off = {"enable_thinking": False}
    examples = conversation_examples(qwen3, plain, max_length=4096, template_kwargs=off)
    assert [labelled_segments(qwen3, e) for e in examples] == [["Blue.<|im_end|>"], ["Red.<|im_end|>"]]
    last = qwen3.decode(examples[-1]["input_ids"])
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nRed.<|im_end|>\n")
    # thinking mode on the same answers: the (empty) block is the answer's, labelled
    (first, *_) = conversation_examples(qwen3, plain, max_length=4096)
    assert labelled_segments(qwen3, first) == ["<think>\n\n</think>\n\nBlue.<|im_end|>"]
    with pytest.raises(ChatTemplateError, match="generation prompt"):  # reasoning under the non-thinking prompt
        conversation_examples(qwen3, THINKING[:3], max_length=4096, template_kwargs=off)


HARMONY = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue.", "reasoning_content": "Something common."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Red.", "reasoning_content": "A warm one."},
]


def test_harmony_answer_is_its_analysis_and_final_channels(harmony):
    (example,) = conversation_examples(harmony, HARMONY[:2], max_length=4096)
    assert labelled_segments(harmony, example) == [
        "<|channel|>analysis<|message|>Something common.<|end|><|start|>assistant<|channel|>final<|message|>Blue."
        "<|return|>"]
    examples = conversation_examples(harmony, HARMONY, max_length=4096)
    assert len(examples) == 2
    assert labelled_segments(harmony, examples[1]) == [
        "<|channel|>analysis<|message|>A warm one.<|end|><|start|>assistant<|channel|>final<|message|>Red.<|return|>"]
    history = harmony.decode(examples[1]["input_ids"])
    assert "<|start|>assistant<|channel|>final<|message|>Blue.<|end|>" in history
    assert "Something common" not in history
    # reasoning_effort reaches the template's system message
    low = conversation_examples(harmony, HARMONY[:2], max_length=4096, template_kwargs={"reasoning_effort": "low"})
    assert "Reasoning: low" in harmony.decode(low[0]["input_ids"])


HARMONY_REFERENCE = """
import json, sys
from openai_harmony import (Conversation, HarmonyEncodingName, Message, ReasoningEffort, RenderConversationConfig,
                            Role, SystemContent, load_harmony_encoding)
enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
out = []
for conversation, completion in json.load(sys.stdin):
    system = SystemContent.new().with_conversation_start_date("DATE").with_reasoning_effort(ReasoningEffort.MEDIUM)
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    for k, m in enumerate(conversation):
        if m["role"] == "user":
            messages.append(Message.from_role_and_content(Role.USER, m["content"]))
            continue
        if "reasoning_content" in m and k == len(conversation) - 1:  # earlier answers' reasoning: dropped
            analysis = Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
            messages.append(analysis.with_channel("analysis"))
        messages.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
    c = Conversation.from_messages(messages)
    ids = (enc.render_conversation_for_completion(c, Role.ASSISTANT) if completion else
           enc.render_conversation_for_training(c, RenderConversationConfig(auto_drop_analysis=False)))
    out.append(enc.decode(ids))
print(json.dumps(out))
"""


def test_harmony_template_renders_as_openai_harmony_does(harmony):
    from selfspec.serve.serving import vllm_available, vllm_python

    if vllm_available():
        pytest.skip(f"no vLLM venv (openai_harmony lives there): {vllm_available()}")
    # the prompt of each answer (history in the final channel only), and each answer as trained (its analysis kept)
    cases = [(HARMONY[:i], True) for i in (1, 3)] + [(HARMONY[:i], False) for i in (2, 4)]
    proc = subprocess.run([str(vllm_python()), "-c", HARMONY_REFERENCE], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reference = json.loads(proc.stdout)
    # the template writes today's date; the reference a fixed one
    ours = [re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: DATE",
                   harmony.decode(chat_ids(harmony, conversation, add_generation_prompt=completion)))
            for conversation, completion in cases]
    assert ours == reference


def test_dataset_of_a_reasoning_template_keeps_each_conversation_on_one_side(qwen3, tmp_path):
    records = [{"messages": [{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"answer {i}", "reasoning": f"why {i}"},
                             {"role": "user", "content": "and then?"},
                             {"role": "assistant", "content": f"more {i}"}]} for i in range(8)]
    assert parse_turns(records[0])[0][1]["reasoning_content"] == "why 0"  # "reasoning" read as the answer's reasoning
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = {"source": "file", "path": str(path), "name": None, "split": "train", "max_records": None,
           "max_length": 200, "overflow": "truncate", "eval_fraction": 0.25, "seed": 0, "chat_template_kwargs": {}}
    ds = build_dataset(cfg, qwen3, cache_dir=tmp_path / "cache", verbose=False)
    sides, texts = {}, []
    for split in ("train", "eval"):
        for example in ds[split]:
            texts.append(qwen3.decode(example["input_ids"]))
            sides.setdefault(re.search(r"question (\d)", texts[-1]).group(1), set()).add(split)
            assert len(labelled_segments(qwen3, example)) == 1  # one answer labelled per example
    assert len(texts) == 16  # two answers of eight conversations
    assert len(ds["eval"]) == 4 and len(sides) == 8 and all(len(s) == 1 for s in sides.values())
    assert sum("<think>\nwhy 3\n</think>\n\nanswer 3" in t for t in texts) == 1  # in its own answer's example only


def test_a_transformers_without_control_tokens_is_refused_with_the_version_it_needs(qwen3, monkeypatch):
    """Before 5.20, transformers has no control-token list, and renders special tokens written in contents as tokens:
    labels would be wrong. Tokenizing stops with the version to install (a GPU image with 5.17 met this)."""
    def missing(self, name):
        raise AttributeError(f"{type(self).__name__} has no attribute {name}")

    monkeypatch.delattr(qwen3, "chat_control_tokens")
    monkeypatch.setattr(type(qwen3), "__getattr__", missing)
    with pytest.raises(DataError, match=r"transformers .* older than selfspec needs .*transformers>=5\.20"):
        chat_ids(qwen3, THINKING[:3])
    with pytest.raises(DataError, match=r"transformers>=5\.20"):  # at the first conversation, not skipped as one
        _tokenize_all([THINKING[:3]] * 20, qwen3, 256, "truncate", ReadReport("x"), verbose=False)
