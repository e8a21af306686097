"""Regenerate conversations with the target itself, so that drafters learn the target's own distribution.

Every user turn of every conversation is replayed through the target with its chat template; the conversation is
carried forward with the target's answers in place of the original assistant turns. Generation is batched with left
padding (Hugging Face ``generate``), shortest prompts first, greedy by default (``temperature: 0``) or sampled
(``temperature``, ``top_p``).

Output: JSONL in OpenAI-messages form, one ``{"id": ..., "messages": [...]}`` per line (plus ``category`` for
MT-bench prompts), appended and flushed record by record. A rerun reads what is already there, skips the ids it holds
(a partial last line left by a killed run is cut off and that record written again) and never writes an id twice.
The file is valid input for ``data=file data.path=OUT``.

Prompts come from the ``data`` config (ShareGPT / messages records; only their user and system turns are used), or
from ``prompts=PATH``: a JSONL of MT-bench questions ``{"question_id", "category", "turns": [str, ...]}`` or of any
record form above.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    """A Prompt from an MT-bench, ShareGPT or OpenAI-messages record (id from the record, else its index)."""
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


def _answer_texts(tokenizer, new_tokens: torch.Tensor, eos_ids: set[int]) -> list[str]:
    """Decode each row of generated ids [B, N] up to its first end-of-sequence token."""
    texts = []
    for row in new_tokens.tolist():
        end = next((k for k, t in enumerate(row) if t in eos_ids), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return texts


def generate_answers(model, tokenizer, conversations: list[list[dict[str, str]]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, max_length: int | None = None) -> list[str]:
    """The target's answer to each conversation (its chat template with a generation prompt), as one batch.

    With ``max_length``, the batch stops once its shortest conversation would pass ``max_length`` tokens: training
    cuts every conversation there, so later tokens would never be read.
    """
    prompts = [chat_ids(tokenizer, c, add_generation_prompt=True) for c in conversations]
    if max_length:
        max_new_tokens = max(1, min(max_new_tokens, max_length - min(len(p) for p in prompts)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # left padding: [B, T]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        attention_mask[row, width - len(p):] = 1
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=max_new_tokens,
            pad_token_id=pad_id, eos_token_id=sorted(eos_ids), **sampling,
        )
    return _answer_texts(tokenizer, out[:, width:].cpu(), eos_ids)


def regenerate(
    model, tokenizer, prompts: Iterable[Prompt], out_path: str | os.PathLike, n: int | None = None,
    batch_size: int = 16, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
    max_length: int | None = None, progress: bool = True,
) -> RegenerateReport:
    """Write the first ``n`` prompts' conversations, answered by the target, to ``out_path`` (skipping done ids).

    ``max_length`` stops a conversation once its prompt would leave no room for an answer within it (training cuts
    there anyway); a conversation whose first prompt is already that long is skipped and counted. Answers end where
    their conversation reaches ``max_length`` tokens (the batch's shortest conversation decides).

    Prompts are answered shortest first (by their first prompt's tokens), so that a batch's left padding and its
    answer budget fit all its rows alike; the records keep their ids, and a rerun resumes whatever is left.
    """
    from tqdm.auto import tqdm

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
        for start in range(0, len(todo), batch_size):
            for record in _answer_batch(model, tokenizer, todo[start:start + batch_size], max_new_tokens,
                                        temperature, top_p, max_length, report):
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                report.written += 1
            bar.update(len(todo[start:start + batch_size]))
    bar.close()
    return report


def _system_turn(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation before its first user turn: the system prompt, if any."""
    return [{"role": "system", "content": prompt.system}] if prompt.system else []


def _opening(prompt: Prompt) -> list[dict[str, str]]:
    """The conversation up to its first user turn (what the first answer is generated from)."""
    return _system_turn(prompt) + [{"role": "user", "content": prompt.turns[0]}]


def _answer_batch(model, tokenizer, batch: list[Prompt], max_new_tokens: int, temperature: float, top_p: float,
                  max_length: int | None, report: RegenerateReport) -> Iterator[dict[str, Any]]:
    """Replay a batch of prompts turn by turn; yields the finished records in prompt order."""
    conversations = [_system_turn(p) for p in batch]
    stopped = [False] * len(batch)
    for turn in range(max(len(p.turns) for p in batch)):
        active = [j for j, p in enumerate(batch) if turn < len(p.turns) and not stopped[j]]
        asking = []
        for j in active:
            candidate = conversations[j] + [{"role": "user", "content": batch[j].turns[turn]}]
            too_long = max_length and len(chat_ids(tokenizer, candidate, add_generation_prompt=True)) >= max_length
            if too_long:
                stopped[j] = True
                if turn == 0:
                    report.skip(PROMPT_TOO_LONG)
            else:
                conversations[j] = candidate
                asking.append(j)
        if not asking:
            continue
        answers = generate_answers(model, tokenizer, [conversations[j] for j in asking], max_new_tokens,
                                   temperature, top_p, max_length)
        for j, answer in zip(asking, answers):
            conversations[j].append({"role": "assistant", "content": answer})
    for prompt, messages in zip(batch, conversations):
        if any(m["role"] == "assistant" for m in messages):
            yield {"id": prompt.id, **prompt.extra, "messages": messages}


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


def run(cfg) -> RegenerateReport:
    """Load the target of ``cfg.model``, read prompts (``cfg.prompts`` or ``cfg.data``), regenerate into ``cfg.out``."""
    from omegaconf import OmegaConf

    from core.target import load_target

    if not cfg.out or cfg.out == "???":
        raise DataError("Give the output file: out=PATH.jsonl")
    out_path = Path(cfg.out)
    records = read_records(cfg.prompts) if cfg.get("prompts") else open_records(cfg.data)
    target = load_target(cfg.model)
    torch.manual_seed(int(cfg.get("seed", 0)))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config_path = out_path.with_name(out_path.stem + ".config.yaml")
    config_path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    skipped: dict[str, int] = {}
    max_length = cfg.data.get("max_length")
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    if max_positions:  # leave room for the answer within the model's positions
        room = max_positions - int(cfg.max_new_tokens)
        max_length = min(max_length, room) if max_length else room
    report = regenerate(
        target.model, target.tokenizer, iter_prompts(records, skipped, cfg.get("max_turns")), out_path, n=cfg.n,
        batch_size=int(cfg.batch_size), max_new_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
        top_p=float(cfg.top_p), max_length=max_length,
    )
    for reason, count in skipped.items():
        report.skipped[reason] = report.skipped.get(reason, 0) + count
    cut = "; the source file was cut off: tail ignored" if records.report.truncated_tail else ""
    print(f"[selfspec] regenerate: {report.written} written, {report.already_done} already in {out_path}, skipped "
          f"{report.skipped or 'none'} ({records.report.records_read:,} records read{cut})", file=sys.stderr)
    return report
