"""Each family's heads, as the heads room knows them, keyed by the family's name (core/families.py), which is the
``head_type`` a heads folder records:

- :data:`HEADS`: the builder that rebuilds a saved heads folder (``build(head_config, target_model) -> nn.Module``,
  heads/io.py); a training-free family has no entry;
- :data:`DEFAULT_LAYERS`: for a family whose row ``reads_layers``, the target layers its heads read when neither
  ``model.draft_layers.<name>`` nor its heads settings name them (``rule(num_layers) -> [layer ids]``; the feature
  store keeps them, train/features.py)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from selfspec.heads.dflash import build_dflash_heads, default_target_layer_ids
from selfspec.heads.eagle import build_eagle_heads, default_layer_ids
from selfspec.heads.layerskip import build_layerskip_exit
from selfspec.heads.medusa import build_medusa_heads

HeadBuilder = Callable[[dict, "nn.Module | None"], nn.Module]

HEADS: dict[str, HeadBuilder] = {
    "layerskip": build_layerskip_exit,
    "medusa": build_medusa_heads,
    "eagle": build_eagle_heads,
    "eagle3": build_eagle_heads,
    "dflash": build_dflash_heads,
}

DEFAULT_LAYERS: dict[str, Callable[[int], list[int]]] = {
    "eagle3": default_layer_ids,  # the inputs of layers 2, L//2 and L-3 (what vLLM and SGLang assume)
    "dflash": default_target_layer_ids,  # the outputs of the layers just before those
}
