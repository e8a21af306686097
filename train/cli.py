"""Train any drafter family of core/families.py on a frozen target: one Hydra app over the family's entry config.

    selfspec-train medusa                                    # = python train/medusa.py
    selfspec-train medusa heads=medusa2 experiment=debug     # the overrides its entry file takes
    selfspec-train eagle3 experiment=cpu_1h                  # = python train/eagle.py heads=eagle3 experiment=cpu_1h
    selfspec-train dflash --cfg job                          # print the composed config
    torchrun --nproc_per_node 2 -m selfspec.train.cli layerskip       # two processes (python -m selfspec.train.cli works alike)
    selfspec-regenerate model=smollm2 n=200 out=outputs/regen/sharegpt.jsonl    # = python scripts/regenerate.py
    selfspec-features model=smollm2 feature_store.dir=outputs/stores/smollm2    # = python scripts/build_features.py

A family trains under its entry config, the conf file that declares it (``conf/<train_conf>.yaml``), with its
``heads_conf`` option (EAGLE-3: ``heads=eagle3``); the run is ``train(cfg, method(cfg))`` (train/loop.py, the method
train/families.py registers for it) and the end-of-run speed check. Each family's entry file (train/medusa.py, train/eagle.py, ...) is
:func:`main` with its family named, and its docstring lists the commands.
"""

from __future__ import annotations

import functools
import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from selfspec.core.config import hydra_app
from selfspec.core.errors import SettingError, reported_errors
from selfspec.core.families import FAMILIES, Family


def trainable(name: str) -> Family:
    """The family ``name``, refused clearly when there is none of that name or it trains nothing."""
    family = FAMILIES.get(name)
    if family is None or not family.trains:
        names = ", ".join(n for n, f in FAMILIES.items() if f.trains)
        raise SettingError(f"No family {name!r} to train: one of {names}.")
    return family


def run(cfg: DictConfig, family: Family) -> None:
    """Train ``family`` as ``cfg`` (its composed entry config) says, then decode with the heads for a speed check."""
    from selfspec.train.families import METHODS  # the methods and the loop import torch: not for --help or a typo
    from selfspec.train.loop import train

    with reported_errors():
        job_run_dir(cfg)
        result = train(cfg, METHODS[family.name](cfg))
        # deferred: torch only once a run starts, as above
        from selfspec.train.speed_check import after_training

        after_training(cfg, result.heads_dir, whole_target=result.whole_target)


def job_run_dir(cfg: DictConfig) -> None:
    """In a Hydra multirun (``-m``), job N of the sweep trains in ``<run_dir>/N`` (Hydra's folder of the job,
    ``hydra.sweep`` in the entry config) instead of the ``run_dir`` every job of the sweep shares; a single run is
    left as it is. What names ``${run_dir}`` (``feature_store.dir``'s default, ...) follows."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    cfg.run_dir = f"{cfg.run_dir}/{HydraConfig.get().job.num}"


def main(family: str | None = None) -> None:
    """The Hydra app of ``family`` over the command line's overrides; without ``family`` (``selfspec-train``), the
    first argument names it."""
    if family is None:
        family = _family_argument()
    with reported_errors():
        chosen = trainable(family)
    sys.argv[1:1] = chosen.train_overrides()  # before the user's: Hydra keeps the last value of a key
    hydra_app(functools.partial(run, family=chosen), chosen.train_conf, job_name=chosen.train_conf,
              config_dir=chosen.conf.parent)


def _family_argument() -> str:
    """``selfspec-train FAMILY [overrides]``: FAMILY, taken off sys.argv so that Hydra reads the overrides."""
    if len(sys.argv) < 2 or sys.argv[1].startswith("-") or "=" in sys.argv[1]:
        names = " | ".join(n for n, f in FAMILIES.items() if f.trains)
        print(f"usage: selfspec-train {{{names}}} [overrides ...] [hydra options]\n{__doc__}", file=sys.stderr)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    return sys.argv.pop(1)


def regenerate_main() -> None:
    """``selfspec-regenerate``: scripts/regenerate.py (conf/regenerate.yaml, train/regenerate.py)."""

    def regenerate(cfg: DictConfig) -> None:
        # deferred: torch only once the command runs: not for --help or a typo
        from selfspec.train.regenerate import run as regenerate_run

        with reported_errors():
            regenerate_run(cfg)

    hydra_app(regenerate, "regenerate", job_name="regenerate")


def features_main() -> None:
    """``selfspec-features``: scripts/build_features.py (conf/features.yaml, train/features.py): build a feature
    store once, for every later ``features=store feature_store.dir=...`` run."""

    def features(cfg: DictConfig) -> None:
        # deferred: torch only once the command runs: not for --help or a typo
        from selfspec.train.features import run as features_run

        with reported_errors():
            features_run(cfg)

    hydra_app(features, "features", job_name="build_features")


if __name__ == "__main__":
    main()
