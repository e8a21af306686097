"""The drafter families (:data:`FAMILIES`): what every layer looks up by a family's name, read from the conf files
that declare them.

A family is declared once, in its own conf file: a ``families:`` block of a top-level ``conf/<file>.yaml`` holds its
row, keyed by its name (conf/medusa.yaml declares medusa, conf/eagle.yaml eagle and eagle3, conf/suffix.yaml the
training-free suffix). :func:`declared` reads them; nothing else lists the families. For a trained family that file is
also its training entry config, so its row, its decode defaults and its training settings are one file.

A family's name is the ``head_type`` its heads folder records and the ``drafter=`` that decode/run.py takes. Its row:

- ``summary``: one line on how it drafts (decode/run.py and the benchmark print it);
- ``drafter``: ``build(heads, target, settings) -> Drafter``, the engine's drafter from the loaded heads module (None
  for a training-free family), the target (``selfspec.core.target.Target``) and its decode settings (decode/registry.py);
- ``draft``: its decode settings (``draft.KEY=`` at decode) and their defaults, the only place they are written;
- ``heads``: ``build(head_config, target_model) -> nn.Module``, which rebuilds saved heads (heads/io.py); absent: the
  family trains nothing;
- ``method``: ``method(cfg) -> TrainMethod``, its training (train/cli.py runs it through train/loop.py) under the file
  that declares it, its entry config (:attr:`Family.train_conf`); ``heads_conf``: the ``conf/heads/`` option that
  makes it, where it is not that config's default (EAGLE-3: ``heads=eagle3`` under conf/eagle.yaml);
- ``random_heads``: ``random_heads(model, seed, **options) -> nn.Module``, untrained heads for ``heads=random``;
- the decode flags ``needs_heads``, ``optional_heads``, ``hybrid`` and ``saved_key`` (decode/registry.py says what each
  does).

``drafter``, ``heads``, ``method`` and ``random_heads`` are ``"module:attribute"`` strings into the packages above
``core`` (decode, heads, train), imported on first use by :meth:`Family.load`: this table imports none of them
(tests/test_layering.py), and each layer imports only the parts it uses. A part that does not import is a
:class:`FamilyError` naming the family, the part and the reason; a row that is not a row (a field it lacks or does
not have) is a :class:`FamilyConfError` naming the file.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.core.config import CONF_DIR
from selfspec.core.errors import SelfspecError

PARTS = ("drafter", "heads", "method", "random_heads")  # the fields that name code in another package
BLOCK = "families"  # the block of a conf file that declares families


class FamilyError(SelfspecError, ImportError):
    """A family's row names code that cannot be imported; the message says which row, part and why."""


class FamilyConfError(SelfspecError, ValueError):
    """A conf file's ``families:`` block holds something that is not a row; the message names the file and field."""


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    drafter: str
    heads: str | None = None
    method: str | None = None
    heads_conf: str | None = None
    random_heads: str | None = None
    needs_heads: bool = False  # drafts with trained heads (a heads folder, or heads=random with ``random_heads``)
    optional_heads: bool = False  # runs without heads, or with a heads folder of its type (layerskip: a trained exit)
    hybrid: bool = False  # takes the suffix drafter's proposals too (decode/hybrid.py): the ``hybrid`` settings
    saved_key: str | None = None  # where its heads folder's config.json keeps the decode settings training chose
    draft: dict[str, Any] = field(default_factory=dict, compare=False)  # its decode settings and their defaults
    conf: Path | None = None  # the conf file that declares it: a trained family's entry config

    @property
    def trains(self) -> bool:
        return self.method is not None

    @property
    def train_conf(self) -> str | None:
        """The entry config it trains under, ``conf/<train_conf>.yaml``: the file that declares it."""
        return self.conf.stem if self.trains and self.conf is not None else None

    def train_overrides(self) -> list[str]:
        """The overrides that make its entry config train this family (``heads=eagle3``), beside the user's."""
        return [f"heads={self.heads_conf}"] if self.heads_conf else []

    def load(self, part: str) -> Any:
        """The object the ``part`` field names (one of :data:`PARTS`), imported on first use; None where the family
        has none (a training-free family's ``heads`` and ``method``)."""
        if part not in PARTS:
            raise ValueError(f"{part!r} is not a part of a family: one of {', '.join(PARTS)}")
        ref = getattr(self, part)
        if ref is None:
            return None
        if ref not in _loaded:
            module, _, attr = ref.partition(":")
            try:
                _loaded[ref] = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as err:
                where = self.conf or "its conf file"
                raise FamilyError(f"The {self.name} family's {part} is {ref}, which cannot be imported: {err}. "
                                  f"Fix the module or its row in {where}.") from err
        return _loaded[ref]


_loaded: dict[str, Any] = {}  # "module:attribute" -> the object, once imported

REQUIRED = ("summary", "drafter", "draft")  # a row's fields without a default: a row states them
FIELDS = tuple(f.name for f in dataclasses.fields(Family) if f.name not in ("name", "conf"))  # what a row may state


def declared(conf_dir: Path = CONF_DIR) -> dict[str, Family]:
    """The families the top-level ``*.yaml`` files of ``conf_dir`` declare in their ``families:`` blocks: the
    training-free ones first (the baselines, which the benchmark runs first), then by file name and in each file's
    order. A row that lacks a field of :data:`REQUIRED`, states one a row does not have, or a name two files declare,
    is a :class:`FamilyConfError`."""
    from omegaconf import OmegaConf

    families: dict[str, Family] = {}
    for path in sorted(Path(conf_dir).glob("*.yaml")):
        block = OmegaConf.to_container(OmegaConf.load(path), resolve=False).get(BLOCK)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise FamilyConfError(f"{path}: `{BLOCK}:` is a mapping of family names to rows, not {block!r}.")
        for name, row in block.items():
            where = f"{path}: the {name} family's row"
            if not isinstance(row, dict):
                raise FamilyConfError(f"{where} is a mapping of its fields, not {row!r}.")
            unknown = sorted(set(row) - set(FIELDS))
            missing = [k for k in REQUIRED if k not in row]
            if unknown or missing:
                problem = (f"has no field {unknown[0]!r}" if unknown else f"lacks {missing[0]!r}")
                raise FamilyConfError(f"{where} {problem}: a row states {', '.join(REQUIRED)} and may state "
                                      f"{', '.join(k for k in FIELDS if k not in REQUIRED)}.")
            if not isinstance(row["draft"], dict):
                raise FamilyConfError(f"{where}: `draft:` maps each decode setting to its default ({{}} for none).")
            if name in families:
                raise FamilyConfError(f"{where}: {families[name].conf} declares a family of that name already.")
            families[name] = Family(name=str(name), conf=path, **row)
    return dict(sorted(families.items(), key=lambda item: item[1].trains))  # a stable sort: file order within each


FAMILIES: dict[str, Family] = declared()
