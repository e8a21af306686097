"""Each family's heads, as the heads room knows them: the builder that rebuilds a saved heads folder
(``build(head_config, target_model) -> nn.Module``, heads/io.py), keyed by the family's name (core/families.py), which
is the ``head_type`` the folder records. A training-free family has no entry."""

from __future__ import annotations

from typing import Callable

from torch import nn

from selfspec.heads.dflash import build_dflash_heads
from selfspec.heads.eagle import build_eagle_heads
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
