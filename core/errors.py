"""Expected mistakes (a missing folder, heads for another target, an unknown tree, a bad setting) and how the entry
points report them: one line naming the problem and the fix, no Python traceback. ``HYDRA_FULL_ERROR=1`` (Hydra's
own switch for full traces) re-raises them with the whole trace, for debugging."""

from __future__ import annotations

import os
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
    """Around an entry point's body: a :class:`SelfspecError` prints ``error: <message>`` and exits with status 2."""
    try:
        yield
    except SelfspecError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
