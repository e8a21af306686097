"""Export trained heads in the format a serving engine loads, and optionally push them to the Hugging Face Hub.

    # Medusa heads -> vLLM's Medusa format (config.json + model.safetensors) in outputs/medusa-smollm2/heads-vllm
    python scripts/export.py heads=outputs/medusa-smollm2/heads
    # EAGLE-3 heads trained with heads.layout=midlayer -> SGLang / vLLM (LlamaForCausalLMEagle3), or speculators
    python scripts/export.py heads=outputs/eagle3-smollm2/heads format=eagle3 out=exports/eagle3-smollm2
    python scripts/export.py heads=outputs/eagle3-smollm2/heads format=speculators dtype=bfloat16
    # upload the exported folder to a Hub model repo (needs `huggingface-cli login` or HF_TOKEN)
    python scripts/export.py heads=outputs/medusa-smollm2/heads push_to_hub=org/name private=true

Formats and what each holds: heads/export.py. The target the heads record is loaded to check that the heads were
trained for it (and to read the LM head / embedding the formats include); ``model=`` names another copy of it.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from core.errors import reported_errors  # noqa: E402


def run_export(cfg) -> dict:
    """Export as ``cfg`` (conf/export.yaml) says; returns {"out", "format", "url"}."""
    import torch

    from decode.settings import resolve_target_config
    from heads.export import export_heads, push_to_hub
    from heads.io import heads_dir, read_heads_config
    from core.target import load_target

    heads_path = heads_dir(str(cfg.heads))
    meta = read_heads_config(heads_path)
    model_cfg = resolve_target_config(cfg.get("model"), meta, device=cfg.get("device"))
    target = load_target(model_cfg)
    dtype = getattr(torch, str(cfg.dtype)) if cfg.get("dtype") else None
    fmt = str(cfg.format)
    from heads.export import resolve_format

    fmt = resolve_format(fmt, meta["head_type"], meta.get("head_config", {}))
    out = Path(str(cfg.out)) if cfg.get("out") else heads_path.parent / f"{heads_path.name}-{fmt}"
    repo = str(cfg.push_to_hub) if cfg.get("push_to_hub") else None
    folder, fmt = export_heads(heads_path, out, target, fmt=fmt, include_embeddings=bool(cfg.include_embeddings),
                               dtype=dtype, repo=repo, vocab=str(cfg.get("vocab", "auto")))
    print(f"[selfspec] exported {meta['head_type']} heads as {fmt}: {folder}")
    url = None
    if repo:
        url = push_to_hub(folder, repo, private=bool(cfg.private))
        print(f"[selfspec] pushed to {url}")
    return {"out": str(folder), "format": fmt, "url": url}


@hydra.main(config_path="../conf/decode", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        run_export(cfg)


if __name__ == "__main__":
    main()
