"""The end of a training entry (train/medusa.py, train/eagle.py, train/layerskip.py, train/dflash.py): the command
that decodes with the new heads, and a quick speed check of them against plain decoding (:func:`speed_check`), as
the entry config's ``speed_check`` block says (conf/<family>.yaml, where its defaults are written)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from accelerate import PartialState

from selfspec.core.config import cfg_get, to_dict
from selfspec.core.errors import SettingError
from selfspec.decode.prompts import prompt_ids
from selfspec.decode.session import load_session
from selfspec.decode.settings import decode_config

SPEED_CHECK_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a Python function that checks whether a string is a palindrome, with a few tests.",
    "What are the main differences between a list and a tuple in Python?",
)
# For heads trained on plain text (``data.format=text``, a base model's continuations): openings a document or a
# program goes on from. A base model given an instruction mostly repeats it, which a copying drafter then predicts:
# a speedup no user of the model gets.
SPEED_CHECK_OPENINGS = (
    "The lighthouse keeper had lived alone on the island for eleven years when, one grey morning,",
    "A refrigerator keeps food cold by moving heat out of its insulated box. Inside the walls, a refrigerant",
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards, '
    'ignoring case and spaces."""\n',
    "Lists and tuples are both ordered sequences in Python, but they differ in one important way:",
)


def after_training(cfg: Any, heads_dir: str | Path, whole_target: bool = True) -> None:
    """:func:`speed_check` as ``cfg.speed_check`` says, on the main process only (the one that saved the heads).
    After a run that held only parts of the target (``whole_target`` false: trained from a feature store, perhaps for
    a target the trainer's device cannot hold) the decoding is left out, with a line saying so: it would load the
    whole target; the decode command is printed as always."""
    check = to_dict(cfg_get(cfg, "speed_check"))
    missing = sorted({"prompts", "max_new_tokens"} - set(check))
    if missing:
        raise SettingError(f"Missing speed_check option(s) {missing}: compose the entry's config from conf/ "
                           "(conf/<family>.yaml writes them).")
    if check["prompts"] is not None and PartialState().is_main_process:
        prompts = int(check["prompts"])
        if prompts > 0 and not whole_target:
            print("[selfspec] quick speed check skipped: this run trained from a feature store holding only the "
                  "target's embeddings, final norm and LM head, and decoding loads the whole target. Decode or "
                  "benchmark the heads where it fits (the command below; scripts/bench.py).", file=sys.stderr)
            prompts = 0
        # heads trained on plain text (a base model's continuations) are checked on text openings
        chat = cfg_get(cfg_get(cfg, "data"), "format", "chat") != "text"
        speed_check(heads_dir, prompts, int(check["max_new_tokens"]), chat)


def speed_check(heads_dir: str | Path, prompts: int, max_new_tokens: int, chat: bool,
                out: TextIO | None = None) -> dict:
    """What a training run prints at its end: the command that decodes with its heads, and a quick speed check on a
    few short prompts (not from any benchmark): tokens/s of the heads' default decoder against plain decoding in the
    same engine, greedy, interleaved prompt by prompt after a warm-up. ``chat``: instructions under the chat
    template (:data:`SPEED_CHECK_PROMPTS`), else text openings (:data:`SPEED_CHECK_OPENINGS`). Returns {"heads",
    "plain", "ratio"}.
    ``out``: where it prints (None: ``sys.stderr`` as it is at the call, not at import, which a test's capture may
    have closed since)."""
    out = out or sys.stderr
    # a text opening in Hydra's quotes inside the shell's: its commas are text, not a list
    prompt = 'prompt="Write a haiku about the sea."' if chat else f"chat=false 'prompt=\"{SPEED_CHECK_OPENINGS[0]}\"'"
    command = f"selfspec-decode heads={heads_dir} {prompt}"
    print(f"[selfspec] decode with these heads:\n  {command}", file=out)
    if prompts <= 0:
        return {}
    session = load_session(decode_config({"heads": str(heads_dir), "max_new_tokens": int(max_new_tokens)}))
    plain = session.decoder_for("vanilla")
    tokenizer = session.target.tokenizer
    ids = speed_check_ids(tokenizer, prompts, chat)
    for decoder in (session.decoder, plain):
        decoder.generate(ids[0], max_new_tokens=8)  # warm-up
    totals = {"heads": [0, 0.0], "plain": [0, 0.0]}
    for prompt in ids:
        for name, decoder in (("heads", session.decoder), ("plain", plain)):
            res = decoder.generate(prompt, max_new_tokens=max_new_tokens)
            totals[name][0] += res.stats.new_tokens
            totals[name][1] += res.stats.total_s
    rate = {k: n / s if s > 0 else 0.0 for k, (n, s) in totals.items()}
    result = {**rate, "ratio": rate["heads"] / rate["plain"] if rate["plain"] else 0.0}
    kind = "prompts" if chat else "text openings"
    print(f"[selfspec] quick speed check ({len(ids)} {kind}, {max_new_tokens} new tokens, greedy, "
          f"{session.family} with its defaults {session.draft_settings}): {rate['heads']:.1f} tokens/s against "
          f"{rate['plain']:.1f} for plain decoding: {result['ratio']:.2f}x. The benchmark: scripts/bench.py.",
          file=out)
    return result


def speed_check_ids(tokenizer, prompts: int, chat: bool) -> list[list[int]]:
    """The token ids of the speed check's first ``prompts`` prompts: instructions under the chat template, or text
    openings as plain text (``chat`` false)."""
    texts = SPEED_CHECK_PROMPTS if chat else SPEED_CHECK_OPENINGS
    return [prompt_ids(tokenizer, [{"role": "user", "content": t}], chat) for t in texts[:prompts]]
