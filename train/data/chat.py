"""Tokenizing a conversation with the target's chat template, labelling the assistant's tokens.

Labels are ``-100`` everywhere except the tokens the assistant writes: its content and the end-of-turn token that
closes each of its turns (``<|im_end|>``, ``<|eot_id|>``, ``<|return|>``, ...), in every assistant turn. The spans
come from the chat template itself (the token ids of the conversation rendered up to each assistant turn, with and
without that turn), so no template-specific parsing is needed, and what the template writes for an answer is
labelled as written: a reasoning block (Qwen3's ``<think>...</think>``, gpt-oss's analysis channel) included.

Reasoning models' templates render an answer one way while it is the last turn (as the model writes it, reasoning
and all) and another once a later turn follows (Qwen3, gpt-oss and DeepSeek-R1 drop earlier turns' reasoning). Such a
conversation is not one sequence the model would ever see, so :func:`conversation_examples` makes one example per
answer: the conversation up to and including it, rendered as the target sees it when it answers (earlier answers as
history), labelled on that answer only. A template whose renders do not start each answer with its generation
prompt cannot be labelled, and is reported with :class:`ChatTemplateError`.

An answer's reasoning given apart from its content (``reasoning_content``, from the records: selfspec.core.records) reaches the
template under the names templates read: ``reasoning_content`` (Qwen3) and ``thinking`` (gpt-oss); reasoning written
inside the content (``<think>...</think>``, as scripts/regenerate.py writes Qwen3's answers) is the template's to
split. ``template_kwargs`` (``data.chat_template_kwargs``) go to the template: ``{enable_thinking: false}`` renders
Qwen3's non-thinking mode, ``{reasoning_effort: low}`` gpt-oss's system prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from selfspec.core.records import DataError

IGNORE_INDEX = -100


class ChatTemplateError(DataError):
    """The tokenizer's chat template cannot give assistant-token labels for a conversation."""


class TemplateRewritesTurns(ChatTemplateError):
    """Later turns change how the template renders an earlier answer (reasoning dropped from history): the whole
    conversation is no one sequence to label; :func:`conversation_examples` labels each answer in its own example."""


def chat_ids(tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
             template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (``template_kwargs`` passed to it).

    Special tokens written inside contents (a literal "<|im_end|>" in a chat about chat formats) are encoded as
    text, so only the template's own special tokens delimit turns. Added tokens that are not special (Qwen3's
    ``<think>``, ``</think>``) stay tokens: the model writes them itself, and templates split contents on them.
    """
    # transformers' sanitizing also takes the non-special added tokens the template mentions for control tokens
    # unless the tokenizer lists its own; wrapped in markers inside a content, Qwen3's template splits its reasoning
    # around the markers and renders stray newlines. An empty list keeps the special tokens alone.
    try:
        listed = tokenizer.chat_control_tokens
    except AttributeError:  # transformers before 5.20 has no control-token list, and would render contents unsanitized
        import transformers  # deferred: only its version, for this message
        raise DataError(f"transformers {transformers.__version__} is older than selfspec needs (5.20: chat templates' "
                        "control tokens): pip install 'transformers>=5.20'") from None
    if listed is None:
        tokenizer.chat_control_tokens = []
    try:
        return list(tokenizer.apply_chat_template(
            [_for_template(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False, sanitize_control_tokens=True, **dict(template_kwargs or {}),
        ))
    finally:
        tokenizer.chat_control_tokens = listed


def _for_template(message: Mapping[str, str]) -> dict[str, str]:
    """A message as templates read it: its reasoning also under gpt-oss's name for it (``thinking``)."""
    message = dict(message)
    if "reasoning_content" in message:
        message["thinking"] = message["reasoning_content"]
    return message


def _special_ids(tokenizer) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def _require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
                                "tokenizer.chat_template, or train from a chat (instruct) model.")


def tokenize_conversation(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int, overflow: str = "truncate",
    template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, list[int]] | None:
    """``{"input_ids", "labels"}`` for one conversation; labels are -100 except on the assistant's tokens.

    For each assistant turn i the labelled span is the tokens that ``messages[:i+1]`` adds to
    ``messages[:i]`` + generation prompt, up to and including its last special token (the end-of-turn token;
    a newline the template writes after it is not labelled). ``overflow``: ``truncate`` cuts at ``max_length``,
    ``drop`` returns None for a longer conversation. Raises :class:`TemplateRewritesTurns` when a prefix does not
    render to a prefix of the whole conversation's ids, :class:`ChatTemplateError` when an answer's render does not
    start with its generation prompt.
    """
    if overflow not in ("truncate", "drop"):
        raise DataError(f"data.overflow={overflow!r} is not known: use truncate or drop.")
    _require_chat_template(tokenizer)
    if overflow == "drop" and len(chat_ids(tokenizer, messages, template_kwargs=template_kwargs)) > max_length:
        return None
    specials = _special_ids(tokenizer)
    spans = []  # (start, stop) of each assistant turn's labelled tokens
    renders = []  # (before, after) ids of each assistant turn: both must be prefixes of the whole
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after, span = _answer(tokenizer, messages, i, specials, template_kwargs)
        renders.append(after)
        spans.append(span)
        if len(after) >= max_length or i + 1 == len(messages):
            # Only the first max_length tokens are kept, and this render is a prefix of the whole conversation
            # that reaches them: a long conversation costs no more than its first max_length tokens plus one turn.
            full = after
            break
    else:
        full = chat_ids(tokenizer, messages, template_kwargs=template_kwargs)
    for k, after in enumerate(renders):
        if full[: len(after)] != after:
            raise TemplateRewritesTurns(
                f"The chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} is not prefix-stable "
                f"at assistant turn {k + 1}: rendering the conversation up to an assistant turn does not give a "
                "prefix of the whole conversation's tokens (the template rewrites earlier turns, as reasoning models' "
                "templates drop earlier reasoning, or tokens merge across turn boundaries). conversation_examples() "
                "labels each answer in an example of its own."
            )
    labels = [IGNORE_INDEX] * len(full)
    for start, stop in spans:
        labels[start:stop] = full[start:stop]
    return {"input_ids": full[:max_length], "labels": labels[:max_length]}


def conversation_examples(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int, overflow: str = "truncate",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, list[int]]]:
    """The training examples of one conversation: one (:func:`tokenize_conversation`: every answer labelled) where
    the template renders the conversation as one sequence; else, for a template that rewrites earlier answers, one per
    answer: ``messages`` up to and including it, as the target sees them when it answers, labelled on that answer
    alone (and cut at ``max_length``; an answer whose prompt alone fills ``max_length``, and all after it, give none).
    ``overflow=drop`` leaves out examples longer than ``max_length``."""
    try:
        example = tokenize_conversation(tokenizer, messages, max_length, overflow, template_kwargs)
        return [] if example is None else [example]
    except TemplateRewritesTurns:
        pass
    specials = _special_ids(tokenizer)
    examples = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after, (start, stop) = _answer(tokenizer, messages, i, specials, template_kwargs)
        if len(before) >= max_length:
            break
        if overflow == "drop" and len(after) > max_length:
            continue
        labels = [IGNORE_INDEX] * start + after[start:stop] + [IGNORE_INDEX] * (len(after) - stop)
        examples.append({"input_ids": after[:max_length], "labels": labels[:max_length]})
    return examples


def _answer(tokenizer, messages: Sequence[Mapping[str, str]], i: int, specials: frozenset[int],
            template_kwargs: Mapping[str, Any] | None) -> tuple[list[int], list[int], tuple[int, int]]:
    """Assistant turn ``i`` rendered as the last turn: the ids before it (``messages[:i]`` + generation prompt), the
    ids with it (``messages[:i+1]``), and its labelled span in the latter (up to and including its last special
    token). Raises :class:`ChatTemplateError` when the render with it does not start with the render before it."""
    before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=template_kwargs)
    after = chat_ids(tokenizer, messages[: i + 1], template_kwargs=template_kwargs)
    if len(after) <= len(before) or after[: len(before)] != before:
        raise ChatTemplateError(
            f"The chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} does not start assistant "
            f"turn {i + 1} with its generation prompt: the conversation rendered up to that turn with "
            "add_generation_prompt is not a prefix of it rendered with the turn, so the answer's tokens cannot be "
            "located. With data.chat_template_kwargs that change the generation prompt (Qwen3's enable_thinking: "
            "false) the answers must match it (no reasoning in them); else set tokenizer.chat_template."
        )
    span = after[len(before):]
    last_special = max((k for k, t in enumerate(span) if t in specials), default=len(span) - 1)
    return before, after, (len(before), len(before) + last_special + 1)


FORMATS = ("chat", "text")  # data.format: conversations under the chat template | plain text (a base model's)


def text_example(tokenizer, messages: Sequence[Mapping[str, str]], max_length: int,
                 overflow: str = "truncate") -> list[dict[str, list[int]]]:
    """The training example of a record as plain text, for a base model (``data.format=text``): the tokenizer's
    opening special tokens (Gemma's ``<bos>``), then each turn's content tokenized alone and joined with nothing
    between them, labelled on the assistant's turns: what scripts/regenerate.py's ``format=text`` records hold (an
    opening and the target's continuation of it). No chat template and no end-of-turn token: the continuation is cut
    where its budget ended. ``overflow``: ``truncate`` cuts at ``max_length``, ``drop`` leaves a longer record out."""
    if overflow not in ("truncate", "drop"):
        raise DataError(f"data.overflow={overflow!r} is not known: use truncate or drop.")
    ids = list(tokenizer("", add_special_tokens=True)["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    for message in messages:
        if message["role"] == "system":
            continue
        piece = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if message["role"] == "assistant" else [IGNORE_INDEX] * len(piece)
    if overflow == "drop" and len(ids) > max_length:
        return []
    return [{"input_ids": ids[:max_length], "labels": labels[:max_length]}]
