"""The serving commands: the export of heads in the formats serving engines load, and the check of them in real
vLLM, as installed commands and as scripts/export.py and scripts/serve_check.py (whose docstrings list the commands;
the installed ones take the same arguments).

    selfspec-export heads=outputs/medusa-smollm2/heads
    selfspec-serve-check heads=outputs/medusa-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl

Each command's config is in conf/decode/ (export.yaml, serve_check.yaml); its library is heads/export.py and
serve/serving.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.core import folders
from selfspec.core.config import CONF_DIR, hydra_app, to_plain
from selfspec.core.errors import SettingError, reported_errors

DECODE_CONF = CONF_DIR / "decode"


# --- selfspec-export: scripts/export.py ------------------------------------------------------------------------------


def run_export(cfg) -> dict:
    """Export as ``cfg`` (conf/decode/export.yaml) says; returns {"out", "format", "url"}."""
    # deferred: torch and the target's loaders only once the command runs, after Hydra has read its config
    import torch

    from selfspec.core.target import load_target
    from selfspec.decode.settings import resolve_target_config
    from selfspec.heads.export import export_heads, push_to_hub, resolve_format
    from selfspec.heads.io import heads_dir, read_heads_config

    heads_path = heads_dir(str(cfg.heads))
    meta = read_heads_config(heads_path)
    fmt = resolve_format(str(cfg.format), meta["head_type"], meta.get("head_config", {}))
    out = Path(str(cfg.out)) if cfg.get("out") else heads_path.parent / f"{heads_path.name}-{fmt}"
    overwrite = bool(cfg.get("overwrite", False))
    folders.in_the_way(out, "export", overwrite, setting="out")  # before the target loads: a user's folder is refused
    target = load_target(resolve_target_config(cfg.get("model"), meta, device=cfg.get("device"),
                                               target=cfg.get("target")))
    dtype = getattr(torch, str(cfg.dtype)) if cfg.get("dtype") else None
    repo = str(cfg.push_to_hub) if cfg.get("push_to_hub") else None
    folder, fmt = export_heads(heads_path, out, target, fmt=fmt, include_embeddings=bool(cfg.include_embeddings),
                               dtype=dtype, repo=repo, vocab=str(cfg.get("vocab", "auto")),
                               heads_check=str(cfg.get("heads_check", "full")), overwrite=overwrite)
    print(f"[selfspec] exported {meta['head_type']} heads as {fmt}: {folder}")
    url = None
    if repo:
        url = push_to_hub(folder, repo, private=bool(cfg.private))
        print(f"[selfspec] pushed to {url}")
    return {"out": str(folder), "format": fmt, "url": url}


def export_main() -> None:
    def export(cfg: DictConfig) -> None:
        with reported_errors():
            run_export(cfg)

    hydra_app(export, "export", job_name="export", config_dir=DECODE_CONF)


# --- selfspec-serve-check: scripts/serve_check.py --------------------------------------------------------------------


def run_check(cfg) -> dict:
    """Check the heads in real vLLM as ``cfg`` (conf/decode/serve_check.yaml) says; writes report.json and report.md
    into ``out`` and returns the report."""
    # deferred: torch and the engine only once the command runs, after Hydra has read its config
    from selfspec.bench import load_prompts
    from selfspec.serve.serving import CheckSettings, format_report, serve_check, vllm_python

    examples = {"heads": "outputs/medusa-smollm2/heads", "prompts": "../shared/data/mt_bench/question.jsonl"}
    for key, example in examples.items():
        if OmegaConf.is_missing(cfg, key):
            raise SettingError(f"{key} is not set: give {key}=... (e.g. {key}={example}).")
    vllm_python(cfg.serving.vllm_venv)  # before loading anything: say at once when vLLM's venv is missing
    # before anything loads: a folder of the user's at out is refused (or moved to a backup with overwrite=true)
    folders.claim(Path(str(cfg.out)), "serve-check", bool(cfg.get("overwrite", False)), setting="out")
    questions = load_prompts(to_plain(cfg.prompts), limit=cfg.get("limit"))
    out = Path(str(cfg.out))
    settings = CheckSettings.from_config(cfg)
    report = serve_check(str(cfg.heads), [q["turns"][0] for q in questions], formats=to_plain(cfg.formats),
                         settings=settings)
    text = format_report(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(text + "\n")
    print(text)
    return report


def serve_check_main() -> None:
    def serve_check(cfg: DictConfig) -> None:
        with reported_errors():
            report = run_check(cfg)
        if not report["ok"]:
            sys.exit(1)

    hydra_app(serve_check, "serve_check", job_name="serve_check", config_dir=DECODE_CONF)
