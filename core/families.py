"""The drafter families (:data:`FAMILIES`): what each family is, one row each, which every layer asks instead of
comparing names.

A family is declared once, in its own conf file: a ``families:`` block of a top-level ``conf/<file>.yaml`` holds its
row, keyed by its name (conf/medusa.yaml declares medusa, conf/eagle.yaml eagle and eagle3, conf/suffix.yaml the
training-free suffix). :func:`declared` reads them. For a trained family that file is also its training entry config,
so its row, its decode defaults and its training settings are one file.

A row is data: it names no code. The code a family has is registered in Python, in the room that owns it, with
imports a reader can follow: ``selfspec.heads.families`` (the builder that rebuilds saved heads),
``selfspec.decode.families`` (the drafter, untrained heads for ``heads=random``) and ``selfspec.train.families`` (the
training method). This module imports none of them (tests/test_layering.py), so the table reads without torch.

A family's name is the ``head_type`` its heads folder records and the ``drafter=`` that decode/run.py takes. Its row:

- ``summary``: one line on how it drafts (decode/run.py and the benchmark print it);
- ``draft``: its decode settings (``draft.KEY=`` at decode) and their defaults, the only place they are written;
- the decode flags ``needs_heads``, ``optional_heads``, ``hybrid`` and ``saved_key`` (decode/registry.py says what each
  does), and ``forward_per_level``: a proposal runs one draft forward per tree level (EAGLE trees, layer-skip chains)
  rather than one per proposal (the benchmark's draft-cost facts, bench/cost.py);
- ``trains``: it trains heads under its conf file (:attr:`Family.train_conf`), by the method train/families.py
  registers; ``heads_conf``: the ``conf/heads/`` option that makes it, where it is not that config's default
  (EAGLE-3: ``heads=eagle3`` under conf/eagle.yaml);
- ``exports``: the heads/export.py formats vLLM serves its heads in, each with the vLLM speculative method that serves
  it (null: the exported folder is served itself, as speculators' is); ``export_needs``: the saved ``head_config``
  values those exports need (EAGLE-3: ``layout: midlayer``); ``vllm_hybrid``: selfspec's hybrid proposer extends the
  vLLM proposer of its first export (serve/vllm_hybrid.py);
- ``reads_layers``: which of the target's layers its heads read beside the last: ``inputs`` (EAGLE-3: the inputs of
  the layers ``model.draft_layers.<name>`` names) or ``outputs`` (DFlash: their outputs), or null (the last hidden
  state only). A family that reads layers shares a feature store with the others that do (train/features.py's
  ``read_by``) and learns online from those layers of each verify forward;
- ``learns_online``: ``learn=true`` trains its heads between a session's requests (train/online.py).

A row that is not a row (a field it lacks or does not have) is a :class:`FamilyConfError` naming the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from selfspec.core.config import CONF_DIR
from selfspec.core.errors import SelfspecError

BLOCK = "families"  # the block of a conf file that declares families
READS_LAYERS = (None, "inputs", "outputs")  # what ``reads_layers`` may say


class FamilyConfError(SelfspecError, ValueError):
    """A conf file's ``families:`` block holds something that is not a row; the message names the file and field."""


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    draft: dict[str, Any] = field(default_factory=dict, compare=False)  # its decode settings and their defaults
    needs_heads: bool = False  # drafts with trained heads (a heads folder, or heads=random with untrained heads)
    optional_heads: bool = False  # runs without heads, or with a heads folder of its type (layerskip: a trained exit)
    hybrid: bool = False  # takes the suffix drafter's proposals too (decode/hybrid.py): the ``hybrid`` settings
    saved_key: str | None = None  # where its heads folder's config.json keeps the decode settings training chose
    forward_per_level: bool = False  # a proposal runs one draft forward per tree level, not one per proposal
    trains: bool = False  # it trains heads under its conf file, by the method train/families.py registers
    heads_conf: str | None = None  # the conf/heads/ option that makes it, where not its entry config's default
    exports: dict[str, str | None] = field(default_factory=dict, compare=False)  # vLLM format -> vLLM's method
    export_needs: dict[str, Any] = field(default_factory=dict, compare=False)  # head_config values exports need
    vllm_hybrid: bool = False  # selfspec's hybrid proposer extends the vLLM proposer of its first export
    reads_layers: str | None = None  # "inputs" or "outputs" of model.draft_layers.<name>; None: the last only
    learns_online: bool = False  # learn=true trains its heads while decoding (train/online.py)
    conf: Path | None = None  # the conf file that declares it: a trained family's entry config

    @property
    def train_conf(self) -> str | None:
        """The entry config it trains under, ``conf/<train_conf>.yaml``: the file that declares it."""
        return self.conf.stem if self.trains and self.conf is not None else None

    def train_overrides(self) -> list[str]:
        """The overrides that make its entry config train this family (``heads=eagle3``), beside the user's."""
        return [f"heads={self.heads_conf}"] if self.heads_conf else []

    def exportable(self, head_config: dict) -> bool:
        """Whether heads of this family saved with ``head_config`` have its vLLM exports: it has exports, and the
        heads hold every value ``export_needs`` names (a value they lack does not count as held)."""
        return bool(self.exports) and all(head_config.get(k) == v for k, v in self.export_needs.items())

    @property
    def hybrid_export(self) -> str | None:
        """The export whose vLLM proposer selfspec's hybrid extends (its first), None where it joins no hybrid."""
        return next(iter(self.exports)) if self.vllm_hybrid and self.exports else None


REQUIRED = ("summary", "draft")  # a row's fields without a default: a row states them
FIELDS = tuple(f.name for f in dataclasses.fields(Family) if f.name not in ("name", "conf"))  # what a row may state


def declared(conf_dir: Path = CONF_DIR) -> dict[str, Family]:
    """The families the top-level ``*.yaml`` files of ``conf_dir`` declare in their ``families:`` blocks: the
    training-free ones first (the baselines, which the benchmark runs first), then by file name and in each file's
    order. A row that lacks a field of :data:`REQUIRED`, states one a row does not have, or a name two files declare,
    is a :class:`FamilyConfError`."""
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
            for key in ("draft", "exports", "export_needs"):
                if not isinstance(row.get(key, {}), dict):
                    raise FamilyConfError(f"{where}: `{key}:` is a mapping ({{}} for none), not {row[key]!r}.")
            if row.get("reads_layers") not in READS_LAYERS:
                raise FamilyConfError(f"{where}: `reads_layers:` is inputs, outputs or null, not "
                                      f"{row['reads_layers']!r}.")
            if name in families:
                raise FamilyConfError(f"{where}: {families[name].conf} declares a family of that name already.")
            families[name] = Family(name=str(name), conf=path, **row)
    return dict(sorted(families.items(), key=lambda item: item[1].trains))  # a stable sort: file order within each


FAMILIES: dict[str, Family] = declared()
