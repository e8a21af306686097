"""Each family's drafter, as the decode room knows them, keyed by the family's name (core/families.py):

- ``build(heads, target, settings) -> Drafter``: the engine's drafter from the loaded heads module (None for a
  training-free family), the target (``selfspec.core.target.Target``) and its decode settings;
- ``random_heads(model, seed, **options) -> nn.Module``: untrained heads for ``heads=random`` dry runs (None: the
  family drafts without heads);
- for a family whose row ``exports`` heads to vLLM: ``chain(k) -> dict``, the draft settings under which it proposes
  what vLLM's proposer of its heads proposes when asked for ``k`` tokens (the serving check compares the two), and
  ``served_depth(meta, k) -> int``, the tokens vLLM drafts a step when asked for ``k`` (None: ``k``).

decode/registry.py joins each with its family's row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.decode.dflash_drafter import dflash_chain, dflash_from_settings, dflash_served_depth, random_dflash_heads
from selfspec.decode.drafters import (medusa_chain, medusa_from_settings, medusa_served_depth, random_medusa_heads,
                                      vanilla_from_settings)
from selfspec.decode.eagle_drafter import eagle_chain, eagle_from_settings, random_eagle3_heads, random_eagle_heads
from selfspec.decode.layerskip import layerskip_from_settings
from selfspec.decode.suffix import suffix_from_settings
from selfspec.decode.types import Drafter


@dataclass(frozen=True)
class Drafting:
    """A family's decode code: its drafter's builder, its untrained heads where it drafts with heads, and what vLLM's
    proposer of its exported heads drafts (module docstring)."""

    build: Callable[[torch.nn.Module | None, Any, dict], Drafter]
    random_heads: Callable[..., torch.nn.Module] | None = None
    chain: Callable[[int], dict] | None = None
    served_depth: Callable[[dict, int], int] | None = None


DRAFTERS: dict[str, Drafting] = {
    "vanilla": Drafting(vanilla_from_settings),
    "suffix": Drafting(suffix_from_settings),
    "layerskip": Drafting(layerskip_from_settings),
    "medusa": Drafting(medusa_from_settings, random_medusa_heads, medusa_chain, medusa_served_depth),
    "eagle": Drafting(eagle_from_settings, random_eagle_heads, eagle_chain),
    "eagle3": Drafting(eagle_from_settings, random_eagle3_heads, eagle_chain),
    "dflash": Drafting(dflash_from_settings, random_dflash_heads, dflash_chain, dflash_served_depth),
}
