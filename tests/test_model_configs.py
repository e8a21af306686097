"""The conf/model/ entries of real checkpoints, checked without their weights (there is no Hub here).

Each hub entry's config.json is recorded in tests/assets/configs/<entry>/ as the Hub has it; the target is built from it
on the meta device through selfspec.core.target.load_target (model.config_only=true), and must have the size its publisher
gives: their figures are the same count rounded (or cut) to the digit shown, so the tolerance is one unit of that
digit (0.1B on "8.2B", 0.01B on "20.91B"); a wrong layer count, hidden or expert size, expert count or vocabulary
moves the count by more. Small attention dimensions can slip under the coarser figures; where the publisher also gives
the count without embeddings (the decoder alone), that is checked too, and it is the precise one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import CONF, REPO, compose
from selfspec.core.archs import FULL, SLIDING, layer_kinds, sliding_window
from selfspec.core.target import TargetLoadError, load_target
from selfspec.heads.dflash import DFlashConfig
from selfspec.heads.eagle import EagleConfig, engine_layer_ids

CONFIGS = REPO / "tests" / "assets" / "configs"

# entry: [(what is counted, published figure in billions, one unit of its last digit)], and where it is published
PUBLISHED = {
    "llama3b": [("total", 3.21, 0.01)],  # Hub model page, Llama-3.2-3B-Instruct: 3.21B params
    "llama8b": [("total", 8.03, 0.01)],  # Hub model page, Llama-3.1-8B-Instruct: 8.03B params
    "qwen2_5_7b": [("total", 7.61, 0.01), ("decoder", 6.53, 0.01)],  # Qwen2.5-7B-Instruct card: 7.61B, 6.53B
    "qwen3_8b": [("total", 8.2, 0.1), ("decoder", 6.95, 0.01)],  # Qwen3-8B card: 8.2B, non-embedding 6.95B
    "qwen3_30b_a3b": [("total", 30.5, 0.1), ("decoder", 29.9, 0.1)],  # Qwen3-30B-A3B card: 30.5B, 29.9B
    "gpt_oss_20b": [("total", 20.91, 0.01)],  # OpenAI's gpt-oss model card: 20.91B total parameters
    "gemma3_12b": [("decoder", 10.759, 0.001)],  # Gemma 3 technical report, table 1: 10,759M non-embedding
    "deepseek_v2_lite": [("total", 15.7, 0.1)],  # DeepSeek-V2-Lite card: 15.7B total parameters
}
# entry: (sliding layers, window), as the architectures are published; every other layer attends to everything
SLIDING_LAYERS = {"gemma3_12b": (40, 1024), "gpt_oss_20b": (12, 128)}  # Gemma 3: 5 local to 1 global; gpt-oss: 1:1


def hub_entries() -> list[str]:
    return sorted(p.stem for p in (CONF / "model").glob("*.yaml") if OmegaConf.load(p).get("source") == "hub")


def entry_config(entry: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{entry}.yaml"))


@pytest.fixture(scope="module")
def targets():
    """Each entry's target built from its recorded config (meta device), built on first use."""
    built = {}

    def get(entry: str):
        if entry not in built:
            cfg = {**entry_config(entry), "name_or_path": str(CONFIGS / entry), "config_only": True, "device": "cpu"}
            built[entry] = load_target(cfg, allow_config_only=True)
        return built[entry]

    return get


def test_every_hub_entry_has_its_config_and_published_size():
    entries = hub_entries()
    assert {"llama8b", "qwen3_8b", "qwen3_30b_a3b", "gpt_oss_20b", "gemma3_12b", "deepseek_v2_lite"} <= set(entries)
    assert sorted(PUBLISHED) == entries
    assert sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file()) == entries


@pytest.mark.parametrize("entry", sorted(PUBLISHED))
def test_entry_composes_and_its_drafters_read_its_layers(entry):
    model = entry_config(entry)
    eagle = compose("eagle", [f"model={entry}", "heads=eagle3", "trainer=gpu"])
    assert eagle.model.name_or_path == model["name_or_path"] and eagle.model.config_only is False
    assert eagle.model.dtype == "bfloat16" and eagle.trainer.mixed_precision == "bf16"
    assert eagle.heads.layer_ids is None and "draft_layers" not in model  # the rule's, from the layer count
    dflash = compose("dflash", [f"model={entry}"])
    assert dflash.heads.target_layer_ids is None
    # the launch command in the entry's header names an accelerate config that exists, and this entry
    header = (CONF / "model" / f"{entry}.yaml").read_text().split("\nsource:")[0]
    launch = re.search(r"accelerate launch --config_file (\S+) .*model=(\S+)", header)
    assert launch and (REPO / launch.group(1)).is_file() and launch.group(2) == entry


def test_drafters_default_to_their_formula_without_a_model_entry_list():
    assert compose("eagle", ["model=tiny", "heads=eagle3"]).heads.layer_ids is None
    assert compose("dflash", ["model=tiny"]).heads.target_layer_ids is None


@pytest.mark.parametrize("entry", sorted(PUBLISHED))
def test_target_built_from_its_config_has_the_published_size(entry, targets):
    target = targets(entry)
    model = target.model
    assert target.config_only and next(model.parameters()).device.type == "meta"
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    counts = {"total": sum(p.numel() for p in model.parameters()),
              "decoder": sum(p.numel() for p in model.parameters() if id(p) not in embeddings)}
    for what, billions, unit in PUBLISHED[entry]:
        assert abs(counts[what] / 1e9 - billions) <= unit, f"{entry}: {what} {counts[what]:,} against {billions}B"


@pytest.mark.parametrize("entry", sorted(PUBLISHED))
def test_layer_kinds_and_the_layers_drafters_read_fit_the_target(entry, targets):
    model = targets(entry).model
    n = model.config.num_hidden_layers
    kinds = layer_kinds(model.config)
    count, window = SLIDING_LAYERS.get(entry, (0, None))
    assert len(kinds) == n and kinds.count(SLIDING) == count and kinds.count(FULL) == n - count
    assert sliding_window(model.config) == window
    # the layers each drafter reads by its rule from the layer count (heads/families.py's DEFAULT_LAYERS), through
    # the drafters' own checks of the target (range, three distinct layers for EAGLE-3, none repeated for DFlash)
    eagle3 = EagleConfig.from_target(model, variant="eagle3").layer_ids
    dflash = DFlashConfig.from_target(model).target_layer_ids
    assert eagle3 == sorted(set(eagle3)) and 1 <= eagle3[0] and eagle3[-1] < n  # inputs of layers, past the embeddings
    assert eagle3 == engine_layer_ids(n)  # what vLLM and SGLang fuse when an export names no layers
    assert dflash == [i - 1 for i in eagle3]  # the outputs just before: one feature store serves both
    assert dflash[-1] < n - 1  # never the last layer's output, which vLLM does not capture


def test_entries_that_need_eager_attention_say_so(targets):
    # gpt-oss's attention sinks exist in transformers' eager attention only (core/archs.py's tiny gpt_oss uses it too)
    assert entry_config("gpt_oss_20b")["attn_implementation"] == "eager"
    assert targets("gpt_oss_20b").model.config._attn_implementation == "eager"


def test_a_multimodal_checkpoint_is_drafted_through_its_text_decoder(targets):
    model = targets("gemma3_12b").model
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    assert model.lm_head.weight is model.get_input_embeddings().weight  # Gemma's tied head, the checkpoint's own
    assert not any("vision" in name for name, _ in model.named_parameters())


def test_config_only_targets_are_refused_where_they_would_run_and_missing_weights_are_named():
    cfg = {**entry_config("qwen3_8b"), "name_or_path": str(CONFIGS / "qwen3_8b")}
    with pytest.raises(TargetLoadError, match="without weights .* not run"):
        load_target({**cfg, "config_only": True})
    with pytest.raises(TargetLoadError, match="config.json but no weights"):
        load_target(cfg)
    with pytest.raises(TargetLoadError, match="source=hub"):
        load_target({"source": "tiny", "config_only": True}, allow_config_only=True)


def test_check_targets_script_describes_an_entry():
    from conftest import load_script

    line = load_script("check_targets").check("gpt_oss_20b")
    assert "GptOssForCausalLM" in line and "12 sliding (window 128) + 12 full" in line and "[2, 12, 21]" in line
