"""What the wheel ships (pyproject.toml): every package folder of the repository under the one top-level name
``selfspec``, and the configs as package data. scripts/check_wheel.sh (run by .ci/run) installs the built wheel in a
fresh venv outside the checkout and trains and decodes there; this checks the lists it is built from."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


# every folder at the top of the repository with an __init__.py: the rooms and conf/
TOP_FOLDERS = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))


def test_every_package_folder_is_shipped_under_selfspec():
    assert {"core", "cpu_kernels", "heads", "decode", "serve", "bench", "train", "conf"} <= set(TOP_FOLDERS)
    folders = {"selfspec." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in TOP_FOLDERS for p in (ROOT / top).rglob("__init__.py")}
    assert {"selfspec.core", "selfspec.cpu_kernels", "selfspec.serve", "selfspec.bench", "selfspec.train.data",
            "selfspec.conf"} <= folders
    assert set(SETUPTOOLS["packages"]) == folders
    assert all(name.startswith("selfspec.") for name in SETUPTOOLS["packages"])  # no generic top-level name
    for name, folder in SETUPTOOLS["package-dir"].items():
        assert name == f"selfspec.{folder}" and (ROOT / folder / "__init__.py").is_file()


def test_the_configs_ship_and_are_found_as_the_package():
    from selfspec.core.config import CONF_DIR

    assert CONF_DIR.resolve() == (ROOT / "conf").resolve()  # the editable install reads the repository's folder
    data = SETUPTOOLS["package-data"]["selfspec.conf"]
    shipped = {p for pattern in data for p in (ROOT / "conf").glob(pattern)}
    assert set((ROOT / "conf").rglob("*.yaml")) == shipped and len(shipped) > 40
    plugins = {p for pattern in SETUPTOOLS["package-data"]["selfspec.core"] for p in (ROOT / "core").glob(pattern)}
    assert plugins == set((ROOT / "core" / "vllm_plugins").glob("*.py")) and plugins


def test_every_console_script_names_a_function_of_the_package():
    import importlib

    scripts = PYPROJECT["project"]["scripts"]
    assert {"selfspec-train", "selfspec-decode", "selfspec-export"} <= set(scripts)
    for name, ref in scripts.items():
        module, _, attr = ref.partition(":")
        assert module.startswith("selfspec.") and callable(getattr(importlib.import_module(module), attr)), name
