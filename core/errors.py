"""Expected mistakes (a missing folder, heads for another target, an unknown tree, a bad setting, a mistyped key or
option on the command line) and how the entry points report them: one line naming the problem and the fix, no Python
traceback, exit status 2. ``HYDRA_FULL_ERROR=1`` (Hydra's own switch for full traces) re-raises them with the whole
trace, for debugging."""

from __future__ import annotations

import difflib
import os
import re
import sys
from contextlib import contextmanager
from typing import Iterator


class SelfspecError(Exception):
    """Base of every error whose message already tells the user what to change. Each concrete error also derives
    from the built-in it refines (ValueError, RuntimeError), so callers catching those keep working."""


class SettingError(SelfspecError, ValueError):
    """A setting has a value it cannot take; the message names the setting and the values it can."""


@contextmanager
def reported_errors() -> Iterator[None]:
    """Around an entry point's body: a :class:`SelfspecError`, or a mistake in the config Hydra composed from the
    command line (:func:`config_error_message`), prints ``error: <message>`` on one line and exits with status 2.
    :func:`selfspec.core.config.hydra_app` puts it around each stage Hydra runs, composing the config included."""
    try:
        yield
    except Exception as err:
        message = str(err) if isinstance(err, SelfspecError) else config_error_message(err)
        if message is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {_one_line(message)}", file=sys.stderr)
        sys.exit(2)


def config_error_message(err: BaseException) -> str | None:
    """What to tell the user about ``err`` when it is a mistake in a config or its overrides, as Hydra and OmegaConf
    raise it: a key the config does not have (``trainer.max_stepz=1``), an option a config group does not have
    (``heads=bogus``), an override Hydra cannot parse, a value of the wrong type, a ``${...}`` that does not resolve, a
    ``???`` left unset. None for any other exception (neither library is imported here: an exception of theirs means
    they are loaded)."""
    hydra_errors, omegaconf_errors = sys.modules.get("hydra.errors"), sys.modules.get("omegaconf.errors")
    if hydra_errors is not None and isinstance(err, hydra_errors.CompactHydraException):
        if isinstance(err, hydra_errors.OverrideParseException):
            found = re.search(r"https?://\S+", err.message)
            grammar = f"; the syntax: {found.group(0)}" if found else ""
            return (f"cannot read the override {err.override!r}: {_first_line(err.message)}. Quote a value that holds "
                    f"spaces, commas or brackets (key='a,b'){grammar}.")
        if isinstance(err, hydra_errors.MissingConfigException) and err.options and err.missing_cfg_file:
            group, _, name = str(err.missing_cfg_file).rpartition("/")
            if group:
                return f"{group}={name}: no such option of {group}; use one of {', '.join(map(str, err.options))}."
        cause = err.__cause__
        key_error = None if omegaconf_errors is None else (omegaconf_errors.ConfigKeyError,
                                                           omegaconf_errors.ConfigAttributeError)
        if key_error and isinstance(cause, key_error) and getattr(cause, "full_key", None):
            return _unknown_key_message(err, cause)
        text = "\n".join(line for line in str(err).splitlines() if line.strip())
        text = text.split("\nConfig search path:")[0]
        if omegaconf_errors is not None and isinstance(cause, omegaconf_errors.OmegaConfBaseException):
            text += f"\n{_omegaconf_message(cause)}"
        return text
    if omegaconf_errors is not None and isinstance(err, (
            omegaconf_errors.ValidationError, omegaconf_errors.MissingMandatoryValue,
            omegaconf_errors.InterpolationResolutionError, omegaconf_errors.GrammarParseError,
            omegaconf_errors.ConfigKeyError, omegaconf_errors.ConfigAttributeError)):
        if isinstance(err, omegaconf_errors.MissingMandatoryValue) and getattr(err, "full_key", None):
            return f"{err.full_key} is not set: give {err.full_key}=... on the command line."
        return _omegaconf_message(err)
    return None


def _unknown_key_message(err: BaseException, cause: BaseException) -> str:
    """``full_key`` is not a key of the config: its near spellings among the keys beside it, and how to add it."""
    full_key = str(cause.full_key)
    parent, _, key = full_key.rpartition(".")
    try:
        known = [str(k) for k in cause.parent_node.keys()]
    except Exception:  # no node to list: no suggestion
        known = []
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" (did you mean {' or '.join(f'{parent}.{k}' if parent else k for k in close)}?)" if close else ""
    append = re.search(r"use (\+\S+)", str(err))
    add = f", or write {append.group(1)} to add a key of your own" if append else ""
    return f"{full_key} is not a setting of this config{hint}: check its spelling{add}."


def _omegaconf_message(err: BaseException) -> str:
    """An OmegaConf error's first line, with the key it is about when that line does not name it."""
    text = _first_line(getattr(err, "msg", None) or str(err))
    full_key = getattr(err, "full_key", None)
    named = full_key and re.search(rf"(?<![\w.]){re.escape(str(full_key))}(?![\w.])", text)
    return f"{text} (at {full_key})" if full_key and not named else text


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "").rstrip(".")


def _one_line(text: str) -> str:
    """``text``'s non-empty lines joined into one sentence after another."""
    parts = [line.strip() for line in str(text).splitlines() if line.strip()]
    out = ""
    for part in parts:
        out = part if not out else f"{out}{'' if out[-1] in '.:;,?!' else '.'} {part}"
    return out
