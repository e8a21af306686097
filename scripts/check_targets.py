"""Check entries of conf/model/ without their weights: each target is built from its config.json on the meta device
(selfspec.core.target.load_target with model.config_only=true, nothing allocated), and the layers EAGLE-3 and DFlash read
are checked against it. Prints one line per entry: its class, parameters, memory in bf16, attention layers and the
layers the drafters read.

    python scripts/check_targets.py                      # every hub entry, from its config.json in tests/assets/configs/
    python scripts/check_targets.py qwen3_8b gemma3_12b  # some entries
    python scripts/check_targets.py qwen3_8b --hub       # the config.json from the Hub (network; weights not fetched)

tests/test_model_configs.py checks the same entries against their published sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from selfspec.core.errors import SettingError, reported_errors

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "assets" / "configs"  # each hub entry's config.json, as the Hub has it


def hub_entries() -> list[str]:
    """The entries of conf/model/ that name a hub checkpoint."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.decode.settings import MODEL_CONFIGS

    return sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml") if OmegaConf.load(p).get("source") == "hub")


def check(entry: str, from_hub: bool = False) -> str:
    """One line describing ``entry``'s target built from its config; raises when a drafter's layers do not fit it."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.core.archs import SLIDING, layer_kinds, sliding_window
    from selfspec.core.target import load_target
    from selfspec.decode.settings import MODEL_CONFIGS, model_config
    from selfspec.heads.dflash import DFlashConfig
    from selfspec.heads.eagle import EagleConfig

    if entry not in hub_entries():
        raise SettingError(f"{entry!r} is not a hub entry of {MODEL_CONFIGS}: use one of {', '.join(hub_entries())}.")
    cfg = model_config(entry)
    hub_id = cfg["name_or_path"]
    layers = cfg.get("draft_layers") or {}
    cfg.update(config_only=True, device="cpu", name_or_path=hub_id if from_hub else str(CONFIGS / entry))
    model = load_target(cfg, allow_config_only=True).model
    eagle3 = EagleConfig.from_target(model, variant="eagle3", layer_ids=layers.get("eagle3")).layer_ids
    dflash = DFlashConfig.from_target(model, target_layer_ids=layers.get("dflash")).target_layer_ids
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    total = sum(p.numel() for p in model.parameters())
    body = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    kinds = layer_kinds(model.config)
    sliding = kinds.count(SLIDING)
    attention = (f"{sliding} sliding (window {sliding_window(model.config)}) + {len(kinds) - sliding} full"
                 if sliding else "all full")
    return (f"{entry}: {hub_id} as {type(model).__name__}, {total / 1e9:.2f}B parameters ({body / 1e9:.2f}B without "
            f"embeddings), {total * 2 / 1e9:.1f} GB in bf16; {len(kinds)} layers, {attention} attention "
            f"({model.config._attn_implementation}); EAGLE-3 reads the inputs of {eagle3}, DFlash the outputs of "
            f"{dflash}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="*", help="names in conf/model/ (default: every hub entry)")
    parser.add_argument("--hub", action="store_true", help="read config.json from the Hub, not tests/assets/configs/")
    args = parser.parse_args(argv)
    with reported_errors():
        for entry in args.entries or hub_entries():
            print(check(entry, args.hub), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
