"""Regenerate conversations with the target itself, so that drafters learn the target's own distribution.

Every user turn of every conversation is replayed through the target with its chat template; the conversation is
carried forward with the target's answers in place of the original assistant turns, so each turn sees the
regenerated earlier ones. Greedy by default (``temperature: 0``) or sampled (``temperature``, ``top_p``, ``seed``).
Two engines answer (``engine``):

- ``hf``: Hugging Face ``generate`` in selfspec's venv, in batches of ``batch_size`` conversations with left padding,
  shortest prompts first; each batch is replayed turn by turn. Sampling draws from torch's generator, seeded once.
- ``vllm``: vLLM's offline ``LLM`` in its own venv (core/vllm_env.py), kept open for the whole run. Groups of
  ``vllm.batch_size`` conversations are replayed turn by turn, each turn of a whole group one call, which vLLM
  batches continuously. ``vllm.tensor_parallel_size``, ``pipeline_parallel_size`` and the rest pass through to
  ``LLM(...)`` (:func:`llm_kwargs`); ``vllm.data_parallel_size`` starts that many engines, each on its own devices,
  sharing every call (:func:`replica_env`). Each sampled answer has its own seed, from ``seed``, the conversation's
  id and the turn, so a resumed run writes what an uninterrupted one would.

Both engines get the same token ids (the template is applied here), stop at the same end-of-turn ids and give at
most ``max_new_tokens`` per answer, fewer where the conversation would pass ``max_length`` (training cuts it there).
Answers are decoded here, without special tokens. A reasoning model's thinking (between ``thinking_markers``,
``<think>`` and ``</think>`` by default) stays in the answer or is cut out (``thinking: drop``), in both engines. An
answer left empty ends its conversation before that turn; a conversation with no answer is skipped and counted.

Output: JSONL in OpenAI-messages form, one ``{"id": ..., "messages": [...]}`` per line (plus ``category`` for
MT-bench prompts), appended and flushed as each conversation is complete. A rerun reads what is already there, skips
the ids it holds (a partial last line left by a killed run is cut off and that record written again) and never
writes an id twice. The file is valid input for ``data=file data.path=OUT``.

Prompts come from the ``data`` config (any record form core.records.parse_turns reads: ShareGPT, OpenAI messages,
UltraChat, instruction records; only their user and system turns are used), or from ``prompts=PATH``: a JSONL of
MT-bench questions ``{"question_id", "category", "turns": [str, ...]}`` or of any record form above.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from core.errors import SettingError
from train.data import (
    EMPTY_TURN,
    INVALID_TURN,
    NOT_AN_OBJECT,
    DataError,
    chat_ids,
    open_records,
    parse_turns,
    read_records,
)

NO_USER_TURN = "no user turn"
DUPLICATE_ID = "duplicate id"
PROMPT_TOO_LONG = "first prompt longer than max_length"
EMPTY_ANSWER = "empty first answer (end of turn at once, or thinking only: raise max_new_tokens)"
ENGINES = ("hf", "vllm")
THINKING = ("keep", "drop")


@dataclass
class Prompt:
    """The user side of one conversation: what the target is asked, turn by turn."""

    id: str
    turns: list[str]
    system: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # kept in the output record (e.g. MT-bench category)


@dataclass
class RegenerateReport:
    written: int = 0
    already_done: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    dropped_partial_line: bool = False

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def to_prompt(record: Any, index: int) -> tuple[Prompt | None, str | None]:
    """A Prompt from an MT-bench question or any record parse_turns reads (id from the record, else its index)."""
    if not isinstance(record, Mapping):
        return None, NOT_AN_OBJECT
    if isinstance(record.get("turns"), list):  # MT-bench question
        turns = record["turns"]
        if not all(isinstance(t, str) for t in turns):
            return None, INVALID_TURN
        if not turns or not all(t.strip() for t in turns):
            return None, EMPTY_TURN if turns else NO_USER_TURN
        rid = record.get("question_id", record.get("id", index))
        extra = {k: record[k] for k in ("category",) if k in record}
        return Prompt(id=str(rid), turns=list(turns), extra=extra), None
    messages, reason = parse_turns(record)
    if messages is None:
        return None, reason
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        return None, NO_USER_TURN
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    return Prompt(id=str(record.get("id", index)), turns=turns, system=system), None


def read_done(out_path: Path) -> tuple[set[str], bool]:
    """Ids already in ``out_path``; cuts off a partial last line (from a killed run). Returns (ids, cut_off)."""
    if not out_path.exists():
        return set(), False
    data = out_path.read_bytes()
    cut = False
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(out_path, "r+b") as f:
            f.truncate(keep)
        data, cut = data[:keep], True
    done = set()
    for line_no, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{out_path} line {line_no} is not a regenerated record ({err}): it is not this "
                            "script's output. Choose another out=PATH, or delete the file to start over.") from None
    return done, cut


# --- how answers are made -------------------------------------------------------------------------------------------


@dataclass
class Answering:
    """How every answer is made, whatever the engine."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    max_length: int | None = None  # an answer ends where its conversation reaches this many tokens
    thinking: str = "keep"  # keep | drop: the text between thinking_markers
    thinking_markers: tuple[str, str] = ("<think>", "</think>")

    def __post_init__(self) -> None:
        if self.thinking not in THINKING:
            raise SettingError(f"thinking={self.thinking!r}: keep or drop (a reasoning model's thinking, between "
                               "thinking_markers, stays in the answer or is cut out).")
        markers = list(self.thinking_markers)
        if len(markers) != 2 or not all(isinstance(m, str) and m for m in markers):
            raise SettingError(f"thinking_markers={markers!r}: give two non-empty strings, where the thinking "
                               "starts and where it ends (e.g. ['<think>', '</think>']).")
        self.thinking_markers = (markers[0], markers[1])

    def budget(self, prompt_length: int) -> int:
        """New tokens for an answer to a prompt of this many tokens."""
        if self.max_length is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.max_length - prompt_length))

    def answer_seed(self, conversation_id: str, turn: int) -> int:
        """The seed of one sampled answer: the same for a conversation's turn in every run, however it is batched."""
        digest = hashlib.sha256(f"{self.seed}/{conversation_id}/{turn}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def text(self, tokenizer, answer_ids: list[int]) -> str:
        """An answer's text: decoded without special tokens, its thinking cut out under ``thinking: drop``."""
        text = tokenizer.decode(answer_ids, skip_special_tokens=True)
        return drop_thinking(text, *self.thinking_markers) if self.thinking == "drop" else text


def drop_thinking(text: str, start: str, end: str) -> str:
    """``text`` without its thinking: every ``start ... end`` span; what comes before an ``end`` whose ``start`` the
    chat template wrote into the prompt (DeepSeek-R1's opens the thinking in its generation prompt); an unclosed
    ``start`` to the end (the answer ran out of tokens while thinking). Leading whitespace goes too."""
    while True:
        i, j = text.find(start), text.find(end)
        if j >= 0 and (i < 0 or j < i):  # an end before any start: the thinking began in the prompt
            text = text[j + len(end):]
        elif i >= 0:
            k = text.find(end, i + len(start))
            text = text[:i] if k < 0 else text[:i] + text[k + len(end):]
        else:
            return text.lstrip()


def stop_token_ids(generation_eos: int | list[int] | None, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's end-of-sequence ids and the tokenizer's."""
    ids = set(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos is not None
              else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def cut_answer(tokens: list[int], stop_ids: Iterable[int], budget: int) -> list[int]:
    """An answer's ids up to its first stop id (not included), at most ``budget`` of them."""
    stop = set(stop_ids)
    end = next((k for k, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:min(end, budget)]


# --- the engines ----------------------------------------------------------------------------------------------------


class AnswerEngine(ABC):
    """Answers prompts given as token ids. ``batch_size`` conversations are replayed together, turn by turn, each
    turn of them one :meth:`answer` call."""

    batch_size: int

    @abstractmethod
    def answer(self, prompts: list[list[int]], budgets: list[int], seeds: list[int],
               answering: Answering) -> list[list[int]]:
        """Each prompt's answer: the generated ids up to the first stop id (not included), at most its budget long.
        ``prompts``: the chat template's ids with its generation prompt; ``seeds``: each answer's, for sampling."""

    def close(self) -> None:
        """Release what the engine holds (vLLM's processes)."""


class HFEngine(AnswerEngine):
    """Hugging Face ``generate`` on the loaded target: a left-padded batch per call, as long as its longest budget
    (each answer is then cut to its own); sampling draws from torch's generator, so ``seeds`` are not used."""

    def __init__(self, model, tokenizer, batch_size: int = 16):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, int(batch_size)
        self.stop_ids = stop_token_ids(model.generation_config.eos_token_id, tokenizer)

    def answer(self, prompts, budgets, seeds, answering):
        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # left padding: [B, T]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention_mask[row, width - len(p):] = 1
        if answering.temperature > 0:
            sampling = {"do_sample": True, "temperature": answering.temperature, "top_p": answering.top_p}
        else:
            sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        device = next(self.model.parameters()).device
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=max(budgets), pad_token_id=pad_id, eos_token_id=self.stop_ids, **sampling,
            )
        rows = out[:, width:].cpu().tolist()  # [B, N]
        return [cut_answer(row, self.stop_ids, budget) for row, budget in zip(rows, budgets)]


@dataclass
class VllmSettings:
    """engine=vllm's settings: conf/regenerate.yaml's ``vllm:`` block describes them and writes their defaults, the
    only place they are written (:meth:`from_config`)."""

    venv: str | None  # vLLM's venv (None: $SELFSPEC_VLLM_VENV, else .venv-vllm)
    batch_size: int  # conversations replayed together; each turn of them is one call
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int  # engines, each on its own tensor x pipeline devices
    distributed_executor_backend: str | None  # None: vLLM's choice (mp on one node, ray across nodes)
    gpu_memory_utilization: float | None  # None: vLLM's default (0.3 on its CPU build: core.vllm_env)
    enforce_eager: bool | None  # None: vLLM's default (CUDA graphs on GPUs; eager on its CPU build)
    max_num_seqs: int | None  # sequences vLLM runs at once (None: its default)
    engine_args: dict  # any other LLM(...) keyword
    timeout: float | None  # seconds vLLM may take to start, and for each call

    @classmethod
    def from_config(cls, vllm_cfg: Any) -> "VllmSettings":
        from core.config import to_plain

        values = to_plain(vllm_cfg) or {}
        missing = [f.name for f in fields(cls) if f.name not in values]
        if missing:
            raise SettingError(f"vllm.{missing[0]} is not set: compose conf/regenerate.yaml, which writes every "
                               "vllm.* default, rather than a config of your own.")
        settings = cls(**{f.name: values[f.name] for f in fields(cls)})
        settings.engine_args = dict(settings.engine_args or {})
        return settings


# LLM(...) keywords that have a setting of their own (or are the target's): engine_args may not set them
OWN_ARGS = ("model", "dtype", "seed", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
            "data_parallel_size", "distributed_executor_backend", "gpu_memory_utilization", "enforce_eager",
            "max_num_seqs")


def llm_kwargs(settings: VllmSettings, model: str, dtype: str, max_model_len: int | None, seed: int) -> dict:
    """The keywords of each engine's ``LLM(...)``: the target, its dtype, the longest conversation, the seed, and the
    settings that pass through (a None one is left to vLLM). ``data_parallel_size`` is not among them: vLLM 0.32
    refuses it in one process, so each replica is an engine of its own (:func:`replica_env`)."""
    taken = sorted(set(settings.engine_args) & set(OWN_ARGS))
    if taken:
        raise SettingError(f"vllm.engine_args sets {', '.join(taken)}: the target and its dtype come from model=, "
                           "the seed from seed=, max_model_len from data.max_length, the rest are vllm.* settings "
                           "of their own.")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(settings, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingError(f"vllm.{key}={value!r}: a whole number >= 1.")
    kwargs = {
        "model": model, "dtype": dtype, "seed": int(seed), "max_model_len": max_model_len,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "distributed_executor_backend": settings.distributed_executor_backend,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enforce_eager": settings.enforce_eager,
        "max_num_seqs": settings.max_num_seqs, **settings.engine_args,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


def replica_env(settings: VllmSettings, visible: list[str]) -> list[dict[str, str]]:
    """Per data-parallel replica, the variables that give it its own devices: replica ``r`` sees the ``r``-th run of
    tensor x pipeline devices among ``visible`` (``$CUDA_VISIBLE_DEVICES``, else every GPU). One replica keeps the
    devices as they are (a multi-node engine finds its GPUs through Ray)."""
    replicas, per = settings.data_parallel_size, settings.tensor_parallel_size * settings.pipeline_parallel_size
    if replicas == 1:
        return [{}]
    if not visible:
        raise SettingError(f"vllm.data_parallel_size={replicas}: each replica is an engine on its own GPUs, and none "
                           "is visible here (on a CPU one vLLM engine already uses every core: keep 1).")
    if replicas * per > len(visible):
        raise SettingError(f"vllm.data_parallel_size={replicas} x tensor_parallel_size x pipeline_parallel_size "
                           f"= {replicas * per} GPUs, but {len(visible)} are visible ({','.join(visible)}): lower "
                           "one of them, or for several nodes run one regenerate per node (docs/usage.md).")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[r * per:(r + 1) * per])} for r in range(replicas)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``$CUDA_VISIBLE_DEVICES``, else every one torch sees."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


class VllmEngine(AnswerEngine):
    """vLLM's offline ``LLM`` in its venv (core/vllm_env.py's :class:`VllmSession`): every call one batch of
    requests, each with its own budget and, sampled, its own seed."""

    def __init__(self, session, stop_ids: list[int], batch_size: int):
        self.session, self.stop_ids, self.batch_size = session, list(stop_ids), int(batch_size)

    def answer(self, prompts, budgets, seeds, answering):
        sampled = answering.temperature > 0
        requests = [{"prompt_token_ids": p, "max_tokens": b, "temperature": answering.temperature if sampled else 0.0,
                     "top_p": answering.top_p if sampled else 1.0, "seed": s if sampled else None,
                     "stop_token_ids": self.stop_ids} for p, b, s in zip(prompts, budgets, seeds)]
        return [cut_answer(t, self.stop_ids, b) for t, b in zip(self.session.generate(requests), budgets)]

    def close(self) -> None:
        self.session.close()


def open_vllm_engine(path: str, tokenizer, model_cfg: Any, settings: VllmSettings, answering: Answering,
                     log_path: Path | None = None) -> VllmEngine:
    """Start vLLM on ``path`` (core.vllm_env.served_model's folder or hub id for ``model_cfg``) in ``model.dtype``,
    for conversations of at most ``answering.max_length`` tokens."""
    from transformers import GenerationConfig

    from core.config import cfg_get
    from core.target import resolve_device, resolve_dtype
    from core.vllm_env import VllmSession

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's end of sequence alone
        eos = None
    dtype = resolve_dtype(cfg_get(model_cfg, "dtype", "auto"), resolve_device(cfg_get(model_cfg, "device", "auto")))
    kwargs = llm_kwargs(settings, path, str(dtype).removeprefix("torch."), answering.max_length, answering.seed)
    session = VllmSession(kwargs, settings.venv, replica_env(settings, visible_gpus()), log_path=log_path,
                          timeout=settings.timeout)
    return VllmEngine(session, stop_token_ids(eos, tokenizer), settings.batch_size)


# --- the run --------------------------------------------------------------------------------------------------------


def regenerate(engine: AnswerEngine, tokenizer, prompts: Iterable[Prompt], out_path: str | os.PathLike,
               n: int | None = None, answering: Answering | None = None, progress: bool = True) -> RegenerateReport:
    """Write the first ``n`` prompts' conversations, answered by ``engine``, to ``out_path`` (skipping done ids).

    ``answering.max_length`` stops a conversation once its prompt would leave no room for an answer within it
    (training cuts there anyway); a conversation whose first prompt is already that long is skipped and counted.

    Prompts are answered shortest first (by their first prompt's tokens), so that a batch pads little; the records
    keep their ids, and a rerun resumes whatever is left.
    """
    from tqdm.auto import tqdm

    answering = answering or Answering()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = RegenerateReport()
    done, report.dropped_partial_line = read_done(out_path)
    if report.dropped_partial_line:
        print(f"[selfspec] regenerate: dropped a partial last line of {out_path} (an interrupted run); "
              "that record is written again", file=sys.stderr)
    todo, seen = [], set()
    for prompt in prompts if n is None or n > 0 else ():
        if prompt.id in seen:
            report.skip(DUPLICATE_ID)
            continue
        seen.add(prompt.id)
        if prompt.id in done:
            report.already_done += 1
        else:
            todo.append(prompt)
        if n is not None and len(seen) >= n:
            break
    todo.sort(key=lambda p: len(chat_ids(tokenizer, _opening(p), add_generation_prompt=True)))  # stable
    bar = tqdm(total=len(todo), desc="regenerating", unit="conv", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), engine.batch_size):
            for record in _answer_batch(engine, tokenizer, todo[start:start + engine.batch_size], answering, report):
                if record is not None:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                    report.written += 1
                bar.update(1)
    bar.close()
    return report


def _system_turn(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation before its first user turn: the system prompt, if any."""
    return [{"role": "system", "content": prompt.system}] if prompt.system else []


def _opening(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation up to its first user turn (what the first answer is generated from)."""
    return _system_turn(prompt) + [{"role": "user", "content": prompt.turns[0]}]


def _answer_batch(engine: AnswerEngine, tokenizer, batch: list[Prompt], answering: Answering,
                  report: RegenerateReport) -> Iterator[dict[str, Any] | None]:
    """Replay a batch of prompts turn by turn, all of a turn in one call. Yields each conversation once it is
    complete, in prompt order within a turn: its record, or None when it has no answer (skipped and counted)."""
    conversations = [_system_turn(p) for p in batch]
    live = list(range(len(batch)))
    for turn in range(max(len(p.turns) for p in batch)):
        asking, prompts, ended = [], [], []
        for j in live:
            candidate = conversations[j] + [{"role": "user", "content": batch[j].turns[turn]}]
            ids = chat_ids(tokenizer, candidate, add_generation_prompt=True)
            if answering.max_length and len(ids) >= answering.max_length:
                ended.append(j)
                if turn == 0:
                    report.skip(PROMPT_TOO_LONG)
            else:
                asking.append(j)
                prompts.append(ids)
        answers = engine.answer(prompts, [answering.budget(len(p)) for p in prompts],
                                [answering.answer_seed(batch[j].id, turn) for j in asking], answering) if asking else []
        for j, ids in zip(asking, answers):
            text = answering.text(tokenizer, ids)
            if not text.strip():  # an empty turn is no training data (core.records refuses it): the conversation ends
                ended.append(j)
                if turn == 0:
                    report.skip(EMPTY_ANSWER)
                continue
            conversations[j] += [{"role": "user", "content": batch[j].turns[turn]},
                                 {"role": "assistant", "content": text}]
            if turn + 1 == len(batch[j].turns):
                ended.append(j)
        for j in sorted(ended):
            has_answer = any(m["role"] == "assistant" for m in conversations[j])
            yield {"id": batch[j].id, **batch[j].extra, "messages": conversations[j]} if has_answer else None
        live = [j for j in live if j not in set(ended)]
        if not live:
            break


def iter_prompts(records: Iterable[Any], skipped: dict[str, int], max_turns: int | None = None) -> Iterator[Prompt]:
    """Prompts of ``records``; ``max_turns`` keeps only each conversation's first user turns."""
    for index, record in enumerate(records):
        prompt, reason = to_prompt(record, index)
        if prompt is None:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            if max_turns:
                prompt.turns = prompt.turns[:max_turns]
            yield prompt


def answering_of(cfg: Any, max_length: int | None) -> Answering:
    """The answer settings of a composed conf/regenerate.yaml."""
    from core.config import to_plain

    return Answering(max_new_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
                     top_p=float(cfg.top_p), seed=int(cfg.seed), max_length=max_length, thinking=str(cfg.thinking),
                     thinking_markers=tuple(to_plain(cfg.thinking_markers)))


def usable_length(data_max_length: int | None, max_positions: int | None, max_new_tokens: int) -> int | None:
    """The longest a conversation may grow: ``data.max_length`` (training cuts there), and room for an answer within
    the model's positions."""
    if not max_positions:
        return data_max_length
    room = max_positions - max_new_tokens
    return min(data_max_length, room) if data_max_length else room


def run(cfg) -> RegenerateReport:
    """Read prompts (``cfg.prompts`` or ``cfg.data``), start ``cfg.engine`` on the target of ``cfg.model``,
    regenerate into ``cfg.out``."""
    from omegaconf import OmegaConf

    if not cfg.out or cfg.out == "???":
        raise DataError("Give the output file: out=PATH.jsonl")
    if cfg.engine not in ENGINES:
        raise SettingError(f"engine={cfg.engine!r}: hf (transformers generate) or vllm (vLLM's offline LLM, in its "
                           "own venv).")
    answering = answering_of(cfg, None)  # the settings are checked before a model loads
    if cfg.engine == "vllm":
        from core.vllm_env import vllm_python

        settings = VllmSettings.from_config(cfg.vllm)
        vllm_python(settings.venv)  # say at once when vLLM's venv is missing
    out_path = Path(cfg.out)
    records = read_records(cfg.prompts) if cfg.get("prompts") else open_records(cfg.data)
    torch.manual_seed(answering.seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config_path = out_path.with_name(out_path.stem + ".config.yaml")
    config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.engine == "vllm":
        from transformers import AutoConfig

        from core.vllm_env import served_model

        path, tokenizer = served_model(cfg.model)
        max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        answering.max_length = usable_length(cfg.data.get("max_length"), max_positions, answering.max_new_tokens)
        engine = open_vllm_engine(path, tokenizer, cfg.model, settings, answering,
                                  log_path=out_path.with_name(out_path.stem + ".vllm.log"))
    else:
        from core.target import load_target

        target = load_target(cfg.model)
        tokenizer = target.tokenizer
        max_positions = getattr(target.model.config, "max_position_embeddings", None)
        answering.max_length = usable_length(cfg.data.get("max_length"), max_positions, answering.max_new_tokens)
        engine = HFEngine(target.model, tokenizer, int(cfg.batch_size))
    skipped: dict[str, int] = {}
    try:
        report = regenerate(engine, tokenizer, iter_prompts(records, skipped, cfg.get("max_turns")), out_path,
                            n=cfg.n, answering=answering)
    finally:
        engine.close()
    for reason, count in skipped.items():
        report.skipped[reason] = report.skipped.get(reason, 0) + count
    cut = "; the source file was cut off: tail ignored" if records.report.truncated_tail else ""
    print(f"[selfspec] regenerate: {report.written} written, {report.already_done} already in {out_path}, skipped "
          f"{report.skipped or 'none'} ({records.report.records_read:,} records read{cut})", file=sys.stderr)
    return report
