"""Each trained family's training method, as the training room knows them: ``method(cfg) -> TrainMethod`` under its
entry config (core/families.py's ``Family.train_conf``), keyed by the family's name. train/cli.py runs it through
train/loop.py; train/online.py runs it between a session's requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from selfspec.train.dflash_method import DFlashMethod
from selfspec.train.eagle_method import EagleMethod
from selfspec.train.layerskip_method import LayerSkipMethod
from selfspec.train.medusa_method import medusa_method
from selfspec.train.method import TrainMethod

METHODS: dict[str, Callable[[Any], TrainMethod]] = {
    "layerskip": LayerSkipMethod,
    "medusa": medusa_method,  # Medusa-1 or Medusa-2, by heads.type
    "eagle": EagleMethod,
    "eagle3": EagleMethod,
    "dflash": DFlashMethod,
}
