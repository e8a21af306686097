"""The drafter families, each registered once (:data:`FAMILIES`): what every layer looks up by a family's name.

A family's name is the ``head_type`` its heads folder records and the ``drafter=`` that decode/run.py takes. Its row:

- ``summary``: one line on how it drafts (decode/run.py and the benchmark print it);
- ``drafter``: ``build(heads, target, settings) -> Drafter``, the engine's drafter from the loaded heads module (None
  for a training-free family), the target (``core.target.Target``) and its decode settings (decode/registry.py);
- ``heads``: ``build(head_config, target_model) -> nn.Module``, which rebuilds saved heads (heads/io.py); None: the
  family trains nothing;
- ``method``: ``method(cfg) -> TrainMethod``, its training (train/cli.py runs it through train/loop.py);
- ``train_conf``: the entry config it trains under, ``conf/<train_conf>.yaml``; ``heads_conf``: the ``conf/heads/``
  option that makes it, where it is not that config's default (EAGLE-3: ``heads=eagle3`` under conf/eagle.yaml);
- ``random_heads``: ``random_heads(model, seed, **options) -> nn.Module``, untrained heads for ``heads=random``;
- the decode flags ``needs_heads``, ``optional_heads``, ``hybrid`` and ``saved_key`` (decode/registry.py says what each
  does); the decode settings and their defaults are the family's block of conf/decode/drafters.yaml.

``drafter``, ``heads``, ``method`` and ``random_heads`` are ``"module:attribute"`` strings into the packages above
``core`` (decode, heads, train), imported on first use by :meth:`Family.load`: this table imports none of them
(tests/test_layering.py), and each layer imports only the parts it uses. A part that does not import is a
:class:`FamilyError` naming the family, the part and the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from core.errors import SelfspecError

PARTS = ("drafter", "heads", "method", "random_heads")  # the fields that name code in another package


class FamilyError(SelfspecError, ImportError):
    """A family's row names code that cannot be imported; the message says which row, part and why."""


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    drafter: str
    heads: str | None = None
    method: str | None = None
    train_conf: str | None = None
    heads_conf: str | None = None
    random_heads: str | None = None
    needs_heads: bool = False  # drafts with trained heads (a heads folder, or heads=random with ``random_heads``)
    optional_heads: bool = False  # runs without heads, or with a heads folder of its type (layerskip: a trained exit)
    hybrid: bool = False  # takes the suffix drafter's proposals too (decode/hybrid.py): the ``hybrid`` settings
    saved_key: str | None = None  # where its heads folder's config.json keeps the decode settings training chose

    @property
    def trains(self) -> bool:
        return self.method is not None

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
                raise FamilyError(f"The {self.name} family's {part} is {ref}, which cannot be imported: {err}. "
                                  "Fix the module or its row in core/families.py.") from err
        return _loaded[ref]


_loaded: dict[str, Any] = {}  # "module:attribute" -> the object, once imported


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("vanilla", "no draft: plain decoding, one token per target forward",
           drafter="decode.drafters:vanilla_from_settings"),
    Family("suffix", "training-free: continuations of the longest earlier match in the prompt, the answer and an "
           "optional corpus; adaptive tree size", drafter="decode.suffix:suffix_from_settings"),
    Family("layerskip", "self-speculation: the target's first layers and an exit (a trained one from "
           "train/layerskip.py, or the target's own final norm and LM head) draft a chain, the remaining layers "
           "verify it (no layer recomputed)", drafter="decode.layerskip:layerskip_from_settings",
           heads="heads.layerskip:build_layerskip_exit", method="train.layerskip_method:LayerSkipMethod",
           train_conf="layerskip", optional_heads=True, hybrid=True, saved_key="decode"),
    Family("medusa", "Medusa-1 / Medusa-2 heads: a static tree of their top-k tokens",
           drafter="decode.drafters:medusa_from_settings", heads="heads.medusa:build_medusa_heads",
           method="train.medusa_method:medusa_method",  # Medusa-1 or Medusa-2, by heads.type
           train_conf="medusa", random_heads="decode.drafters:random_medusa_heads", needs_heads=True, hybrid=True,
           saved_key="decode"),
    Family("eagle", "EAGLE heads: an EAGLE-2 dynamic tree grown by draft log-probability",
           drafter="decode.eagle_drafter:eagle_from_settings", heads="heads.eagle:build_eagle_heads",
           method="train.eagle_method:EagleMethod", train_conf="eagle",
           random_heads="decode.eagle_drafter:random_eagle_heads", needs_heads=True, hybrid=True, saved_key="tree"),
    Family("eagle3", "EAGLE3 heads: an EAGLE-2 dynamic tree grown by draft log-probability",
           drafter="decode.eagle_drafter:eagle_from_settings", heads="heads.eagle:build_eagle_heads",
           method="train.eagle_method:EagleMethod", train_conf="eagle", heads_conf="eagle3",
           random_heads="decode.eagle_drafter:random_eagle3_heads", needs_heads=True, hybrid=True, saved_key="tree"),
    Family("dflash", "DFlash block drafter: one forward over a block of mask tokens drafts a chain (and the first "
           "position's top-k siblings with top_k > 1)", drafter="decode.dflash_drafter:dflash_from_settings",
           heads="heads.dflash:build_dflash_heads", method="train.dflash_method:DFlashMethod", train_conf="dflash",
           random_heads="decode.dflash_drafter:random_dflash_heads", needs_heads=True, hybrid=True,
           saved_key="decode"),
)}
