"""Tokenizing a conversation with the target's chat template, labelling the assistant's tokens.

Labels are ``-100`` everywhere except the tokens the assistant writes: its content and the end-of-turn token that
closes each of its turns (``<|im_end|>``, ``<|eot_id|>``, ...), in every assistant turn. The spans come from the chat
template itself (the token ids of the conversation rendered up to each assistant turn, with and without that turn), so
no template-specific parsing is needed; a template whose renders of a prefix are not a prefix of the whole
conversation (it rewrites earlier turns) is reported with :class:`ChatTemplateError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core.records import DataError

IGNORE_INDEX = -100


class ChatTemplateError(DataError):
    """The tokenizer's chat template cannot give assistant-token labels for a conversation."""


def chat_ids(tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template.

    Control tokens written inside contents (a literal "<|im_end|>" in a chat about chat formats) are encoded as
    text, so only the template's own control tokens delimit turns.
    """
    return list(tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        sanitize_control_tokens=True,
    ))


def _special_ids(tokenizer) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return frozenset(ids)


def _require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: set "
                                "tokenizer.chat_template, or train from a chat (instruct) model.")


def tokenize_conversation(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int, overflow: str = "truncate"
) -> dict[str, list[int]] | None:
    """``{"input_ids", "labels"}`` for one conversation; labels are -100 except on the assistant's tokens.

    For each assistant turn i the labelled span is the tokens that ``messages[:i+1]`` adds to
    ``messages[:i]`` + generation prompt, up to and including its last special token (the end-of-turn token;
    a newline the template writes after it is not labelled). ``overflow``: ``truncate`` cuts at ``max_length``,
    ``drop`` returns None for a longer conversation. Raises :class:`ChatTemplateError` when a prefix does not render
    to a prefix of the whole conversation's ids.
    """
    if overflow not in ("truncate", "drop"):
        raise DataError(f"data.overflow={overflow!r} is not known: use truncate or drop.")
    _require_chat_template(tokenizer)
    if overflow == "drop" and len(chat_ids(tokenizer, messages)) > max_length:
        return None
    specials = _special_ids(tokenizer)
    spans = []  # (start, stop) of each assistant turn's labelled tokens
    renders = []  # (before, after) ids of each assistant turn: both must be prefixes of the whole
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        after = chat_ids(tokenizer, messages[: i + 1])
        renders.append((before, after))
        span = after[len(before):]
        last_special = max((k for k, t in enumerate(span) if t in specials), default=len(span) - 1)
        spans.append((len(before), len(before) + last_special + 1))
        if len(after) >= max_length or i + 1 == len(messages):
            # Only the first max_length tokens are kept, and this render is a prefix of the whole conversation
            # that reaches them: a long conversation costs no more than its first max_length tokens plus one turn.
            full = after
            break
    else:
        full = chat_ids(tokenizer, messages)
    for k, (before, after) in enumerate(renders):
        if len(after) <= len(before) or full[: len(after)] != after or after[: len(before)] != before:
            raise ChatTemplateError(
                f"The chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} is not prefix-stable "
                f"at assistant turn {k + 1}: rendering the conversation up to an assistant turn does not give a "
                "prefix of the whole conversation's tokens (the template rewrites earlier turns, or tokens merge "
                "across turn boundaries), so assistant tokens cannot be located. Use a template that renders each "
                "turn independently (set tokenizer.chat_template)."
            )
    labels = [IGNORE_INDEX] * len(full)
    for start, stop in spans:
        labels[start:stop] = full[start:stop]
    return {"input_ids": full[:max_length], "labels": labels[:max_length]}
