"""The drafter registry: each family of core/families.py as the engine gets it, keyed by name.

A trained family's name is the ``head_type`` its heads folder records (``heads/io.py`` rebuilds the module; this
registry turns the module into a drafter). A training-free family (``vanilla``, ``suffix``) needs no heads folder.

Each entry (:class:`DrafterEntry`) joins its family's row with the decode code decode/families.py registers for it:

- ``build(heads, target, settings) -> Drafter``: the drafter, from the loaded heads module (None for a
  training-free family), the target (``selfspec.core.target.Target``: model and tokenizer) and its decode settings;
- ``needs_heads``: it drafts with trained heads (a heads folder, or ``heads=random``); ``optional_heads``: it runs
  without heads or with a folder of its type;
- ``hybrid``: it also takes the ``hybrid`` settings (merge the suffix drafter's proposals into its drafts:
  decode/hybrid.py), whose defaults are conf/decode/hybrid.yaml;
- ``saved_key``: where a heads folder's config.json keeps the settings training chose for it (e.g. EAGLE's ``tree``),
  which win over the defaults; ``draft.*`` on the command line wins over both, the same way for every family;
- ``random_heads(model, seed, **options)``: untrained heads for ``heads=random`` dry runs.

The settings a family takes and their defaults are its row's ``draft:`` in its conf file
(:attr:`DrafterEntry.defaults`), the only place they are written; ``adaptive: true`` lets the engine choose each step
how deep the draft goes (decode/adaptive.py:AdaptiveDepth). conf/decode/decode.yaml lists none of them: its ``draft``
is open, and :meth:`DrafterEntry.settings` refuses a key the chosen family does not take, naming those it does.

A new family is a row in its conf file and its drafter in decode/families.py (see docs/architecture.md): the
registry reads both as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from selfspec.core.config import CONF_DIR
from selfspec.core.families import FAMILIES, Family
from selfspec.decode.families import DRAFTERS, Drafting
from selfspec.decode.types import DecodeSetupError, Drafter

HYBRID_FILE = CONF_DIR / "decode" / "hybrid.yaml"


@functools.cache
def _hybrid_defaults() -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(HYBRID_FILE))


def defaults_of(block: str) -> dict[str, Any]:
    """A family's settings and their defaults (its row's ``draft:``), or ``hybrid``'s (conf/decode/hybrid.yaml)."""
    if block == "hybrid":
        return dict(_hybrid_defaults())
    return dict(entry(block).family.draft)


@dataclass(frozen=True)
class DrafterEntry:
    """A family (core/families.py) as a drafter for the engine: its row, its decode code (decode/families.py), its
    settings."""

    family: Family
    drafting: Drafting

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def summary(self) -> str:
        return self.family.summary

    @property
    def build(self) -> Callable[[torch.nn.Module | None, Any, dict], Drafter]:
        return self.drafting.build

    @property
    def needs_heads(self) -> bool:
        return self.family.needs_heads

    @property
    def optional_heads(self) -> bool:
        return self.family.optional_heads

    @property
    def hybrid(self) -> bool:
        return self.family.hybrid

    @property
    def saved_key(self) -> str | None:
        return self.family.saved_key

    @property
    def random_heads(self) -> Callable[..., torch.nn.Module] | None:
        return self.drafting.random_heads

    @property
    def defaults(self) -> dict[str, Any]:
        """The decode settings this family takes and their defaults (its row's ``draft:``, and the hybrid's)."""
        return {**defaults_of(self.name), **(defaults_of("hybrid") if self.hybrid else {})}

    @property
    def takes_heads(self) -> bool:
        return self.needs_heads or self.optional_heads

    def settings(self, heads_config: dict | None = None, overrides: dict | None = None) -> dict:
        """The decode settings: defaults, then those saved with the heads, then the non-null ``overrides``.
        A setting this family does not take is refused, so a typo or a setting of another family is not ignored."""
        defaults = self.defaults
        settings = dict(defaults)
        saved = (heads_config or {}).get(self.saved_key) or {} if self.saved_key else {}
        settings.update({k: v for k, v in saved.items() if k in settings and v is not None})
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(given) - set(settings))
        if unknown:
            takes = ", ".join(f"draft.{k}" for k in defaults) or "no draft.* settings"
            if any(unknown[0] in e.defaults for e in REGISTRY.values()):
                raise DecodeSetupError(f"draft.{unknown[0]} is not a setting of the {self.name} drafter (it takes "
                                       f"{takes}); remove it or pick the drafter it belongs to.")
            raise DecodeSetupError(f"draft.{unknown[0]} is no drafter's setting: the {self.name} drafter takes "
                                   f"{takes}.")
        settings.update(given)
        return settings


class _Registry(Mapping[str, DrafterEntry]):
    """The family table's rows as entries, read as the table and decode/families.py are now (a row added to both is
    an entry). A row without a drafter is a :class:`DecodeSetupError` naming the file to register it in."""

    def __getitem__(self, name: str) -> DrafterEntry:
        family = FAMILIES[name]
        if name not in DRAFTERS:
            raise DecodeSetupError(f"The {name} family ({family.conf}) has no drafter: register its builder in "
                                   "selfspec/decode/families.py's DRAFTERS.")
        return DrafterEntry(family, DRAFTERS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


REGISTRY: Mapping[str, DrafterEntry] = _Registry()


def entry(name: str) -> DrafterEntry:
    """The registry entry ``name``; a clear error listing the known ones otherwise."""
    if name not in REGISTRY:
        raise DecodeSetupError(f"Unknown drafter {name!r}; known: {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]
