"""Reading configs that arrive as Hydra ``DictConfig``s, plain dicts or dataclasses: one way, used everywhere."""

from __future__ import annotations

import importlib.resources
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from selfspec.core.errors import reported_errors

MISSING = "???"  # Hydra's mark for a value with no default
# the configs: the package selfspec.conf, the repository's conf/ in an editable install, package data in a wheel's
CONF_DIR = Path(str(importlib.resources.files("selfspec.conf")))


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` of a dict, DictConfig or object; ``default`` when absent or left as ``???`` (a value set to None
    stays None)."""
    if cfg is None:
        return default
    try:
        value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    except Exception:  # omegaconf's MissingMandatoryValue when ``???`` is read from a struct config
        return default
    return default if isinstance(value, str) and value == MISSING else value


def to_plain(x: Any) -> Any:
    """A DictConfig / ListConfig as resolved plain containers; anything else unchanged."""
    try:
        # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra-core is a dependency
        return x
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def to_dict(cfg: Any) -> dict:
    """A config group as a plain dict ({} for None)."""
    return {} if cfg is None else dict(to_plain(cfg))


OPEN_DICT = "open_dict"  # the name of :func:`store_open_dict`'s node, for a config's defaults list


def store_open_dict() -> None:
    """Store ``open_dict`` in Hydra's ConfigStore: an empty mapping that stays open when Hydra closes the composed
    config (struct mode), so that ``NODE.KEY=value`` adds a key the config does not list. conf/decode/decode.yaml puts
    it at ``draft`` (``- open_dict@draft``): each family declares its draft.* settings in its own conf file, and the
    family chosen checks them (decode/registry.py); every other key stays closed. :func:`hydra_app` and
    :func:`compose` store it before composing."""
    # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    node = OmegaConf.create({})
    OmegaConf.set_struct(node, False)  # its own flag: Hydra sets struct on the root only, which the node then overrides
    ConfigStore.instance().store(name=OPEN_DICT, node=node)


MODEL_KEY = re.compile(r"^([+~]{0,2})model\.([^=]+)=(.*)$", re.S)


def model_keys(overrides: Sequence[str], config_dir: Path) -> list[str]:
    """``overrides`` with ``model.KEY=VALUE`` read as ``target.KEY=VALUE`` for the configs of conf/decode/, where
    ``model`` names a target (a plain value: a name in conf/model/, a hub id or a folder) and ``target`` holds settings
    over its model config: a target setting is then given at decode as at training (``model.attn_implementation=
    eager``), where ``model`` is the config group itself. Other configs' overrides are returned unchanged."""
    if Path(config_dir).resolve() != (CONF_DIR / "decode").resolve():
        return list(overrides)
    return [MODEL_KEY.sub(lambda m: f"{'~' if '~' in m.group(1) else ''}target.{m.group(2)}={m.group(3)}", o) for o in overrides]


def compose(config_name: str, overrides: Sequence[str] = (), config_dir: Path = CONF_DIR) -> Any:
    """``config_dir/<config_name>.yaml`` composed with ``overrides``, as :func:`hydra_app` composes it from the command
    line: for code that composes an entry config itself (the benchmark, scripts, tests). Inside a running Hydra app
    (decode/run.py with learn=true composes the heads' training config) the app's Hydra is set aside and restored."""
    # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    store_open_dict()
    outer = get_gh_backup() if GlobalHydra.instance().is_initialized() else None
    if outer is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=model_keys(overrides, config_dir))
    finally:
        if outer is not None:
            restore_gh_from_backup(outer)


def hydra_app(task: Callable[[Any], None], config_name: str, job_name: str, config_dir: Path = CONF_DIR) -> None:
    """Run ``task(cfg)`` as a Hydra app over the command line: ``config_dir/<config_name>.yaml`` found from the package
    (whether a script, an installed command or ``python -m`` runs it), the job named ``job_name``, as Hydra names an
    entry file's own app after the file (its ``--help`` and ``hydra.job.name``)."""
    # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
    import hydra

    def app(cfg: Any) -> None:
        task(cfg)

    store_open_dict()
    sys.argv[1:] = model_keys(sys.argv[1:], config_dir)  # read by hydra.main: it takes no list of overrides
    app.__module__ = job_name  # Hydra names the job after the task function's module
    with _reported_by_hydra():
        hydra.main(config_path=str(config_dir), config_name=config_name, version_base="1.3")(app)()


@contextmanager
def _reported_by_hydra() -> Iterator[None]:
    """While ``hydra.main`` runs, each stage it runs and reports itself (composing the config from the overrides,
    running the job, ``--cfg``) goes through :func:`~selfspec.core.errors.reported_errors` first: a mistyped key or
    option, an override Hydra cannot parse or a :class:`~selfspec.core.errors.SelfspecError` prints one ``error:``
    line and exits 2, where Hydra would print its report and exit 1. Any other exception keeps Hydra's report, and
    ``HYDRA_FULL_ERROR=1`` the full trace. Hydra has no hook for this: ``hydra.main`` runs each stage through
    ``hydra._internal.utils.run_and_report``, which is wrapped for the call (and left alone where a Hydra lacks it;
    tests/test_cli_errors.py runs every console script through it)."""
    # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
    from hydra._internal import utils as hydra_utils

    original = getattr(hydra_utils, "run_and_report", None)
    if original is None:
        yield
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def reported() -> Any:
            with reported_errors():
                return func()

        return original(reported)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original
