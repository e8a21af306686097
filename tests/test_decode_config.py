"""Decode defaults are written once, in conf/ (as training's are: see test_medusa_train.py's
test_settings_defaults_are_written_once_in_conf): each family's settings in conf/decode/drafters.yaml (the hybrid's
node budget too), the session's, the benchmark's and the serving check's in conf/decode/decode.yaml, bench.yaml and
serve_check.yaml; the code writes none of its own, and a key the config lacks is an error that names it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF, compose
from decode import registry
from decode.session import load_session
from decode.settings import SESSION_KEYS, DecodeSettings
from decode.types import DecodeSetupError


def test_every_family_takes_the_settings_its_conf_block_names_with_their_defaults():
    table = OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "drafters.yaml"))
    draft_keys = OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "decode.yaml").draft)
    assert "defaults" not in {f.name for f in dataclasses.fields(registry.DrafterEntry)}  # no settings in Python
    assert set(table) == set(registry.REGISTRY) | {"hybrid"}
    for name, entry in registry.REGISTRY.items():
        expected = {**table[name], **(table["hybrid"] if entry.hybrid else {})}
        assert entry.settings() == expected, name
        assert set(expected) <= set(draft_keys) and all(draft_keys[k] is None for k in expected)  # null: "the default"
        assert entry.needs_heads == (entry.random_heads is not None)
    assert set(draft_keys) == {k for block in table.values() for k in block}  # no draft.* key that no family takes


# drafters.yaml key -> the constructor parameter the registry passes it to, where the names differ
RENAMED = {"hybrid": {"merged_nodes": "max_nodes"}}
# keys the registry turns into something else before the constructor sees them: a corpus file into its index, a dtype
# name (auto) into a torch dtype
TRANSFORMED = {"corpus", "dtype"}


def test_the_constructors_the_registry_builds_write_no_default_of_a_conf_setting():
    """A setting of conf/decode/drafters.yaml reaches its drafter's constructor as an argument without a default, so
    its default is written only there (a hybrid's ``merged_nodes`` included)."""
    from decode.dflash_drafter import DFlashBlockDrafter
    from decode.drafters import MedusaDrafter
    from decode.eagle_drafter import EagleTreeDrafter
    from decode.hybrid import HybridDrafter
    from decode.layerskip import LayerSkipDrafter
    from decode.suffix import SuffixDrafter

    table = OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "drafters.yaml"))
    assert table["hybrid"]["merged_nodes"] > 0
    built = ((MedusaDrafter, "medusa"), (EagleTreeDrafter, "eagle"), (DFlashBlockDrafter, "dflash"),
             (LayerSkipDrafter, "layerskip"), (SuffixDrafter, "suffix"), (HybridDrafter, "hybrid"))
    for cls, family in built:
        params = inspect.signature(cls.__init__).parameters
        passed = [RENAMED.get(family, {}).get(k, k) for k in table[family] if k not in TRANSFORMED]
        taken = [k for k in passed if k in params]
        assert taken, (cls.__name__, passed)  # the walk found the constructor's settings
        assert all(params[k].default is inspect.Parameter.empty for k in taken), (cls.__name__, taken)


def test_a_hybrid_s_node_budget_is_the_conf_setting():
    session = load_session(compose("decode", ["model=tiny"]))
    assert session.decoder.drafter.max_nodes == registry.defaults_of("hybrid")["merged_nodes"]
    smaller = session.decoder_for(draft={"merged_nodes": 5})
    assert smaller.drafter.max_nodes == 5


def test_the_serve_check_s_settings_are_serve_check_yaml_s():
    from decode.serving import CheckSettings

    yaml = OmegaConf.load(CONF / "decode" / "serve_check.yaml")
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(CheckSettings))
    settings = CheckSettings.from_config(compose("serve_check", ["heads=x", "prompts=y"]))
    assert (settings.max_new_tokens, settings.timeout, settings.k, settings.tolerance) == (
        yaml.max_new_tokens, yaml.serving.timeout, yaml.k, yaml.tolerance)
    assert (settings.warmup, settings.vocab, settings.venv) == (yaml.warmup, yaml.vocab, yaml.serving.vllm_venv)
    partial = OmegaConf.create({k: v for k, v in OmegaConf.to_container(yaml).items() if k != "max_new_tokens"})
    with pytest.raises(DecodeSetupError, match=r"\['max_new_tokens'\]"):
        CheckSettings.from_config(partial)


def test_a_training_run_s_speed_check_reads_its_config():
    from core.errors import SettingError
    from train.speed_check import after_training, speed_check

    assert all(p.default is inspect.Parameter.empty
               for name, p in inspect.signature(speed_check).parameters.items() if name != "out")
    cfg = compose("medusa", ["experiment=debug"])
    assert cfg.speed_check.max_new_tokens > 0
    with pytest.raises(SettingError, match=r"Missing speed_check option\(s\) \['max_new_tokens'\]"):
        after_training(OmegaConf.create({"speed_check": {"prompts": 1}}), "nowhere")


def test_a_session_reads_decode_yaml_and_names_a_missing_key():
    yaml = OmegaConf.load(CONF / "decode" / "decode.yaml")
    session = load_session(compose("decode", ["model=tiny", "heads=null"]))
    settings = session.settings
    assert isinstance(settings, DecodeSettings)
    assert (settings.max_new_tokens, settings.stop, settings.seed, settings.chat, settings.system_prompt) == (
        yaml.max_new_tokens, list(yaml.stop), yaml.seed, yaml.chat, yaml.system_prompt)
    assert (settings.heads, settings.family, settings.draft) == (None, None, {})  # draft.*: null keeps the defaults
    s = session.sampling
    assert (s.acceptance, s.temperature, s.top_k, s.top_p) == (yaml.acceptance, yaml.temperature, yaml.top_k,
                                                               yaml.top_p)
    assert session.decoder.linear_kernel == yaml.linear_kernel
    for key in SESSION_KEYS:
        partial = OmegaConf.create({k: v for k, v in OmegaConf.to_container(yaml).items() if k != key})
        with pytest.raises(DecodeSetupError, match=rf"Missing decode setting\(s\) \['{key}'\]"):
            load_session(partial)


def test_the_benchmark_names_a_missing_key_before_loading_anything():
    from decode.bench import run_bench

    bench = OmegaConf.to_container(compose("bench", ["model=tiny"]), resolve=False)
    for key in ("methods", "prompt_lookup_num_tokens", "out"):
        with pytest.raises(DecodeSetupError, match=rf"\['{key}'\]"):
            run_bench(OmegaConf.create({k: v for k, v in bench.items() if k != key}))


def test_medusa_s_default_tree_follows_the_target_s_device():
    """tree=auto: the 16-node small_16 on a CPU, Medusa's own mc_sim_7b_63 on an accelerator; a named tree is kept
    as given; a session on the CPU drafts small_16."""
    from decode.drafters import medusa_tree
    from decode.tree import load_tree

    assert medusa_tree("auto", "cpu") == "small_16"
    assert medusa_tree("auto", torch.device("cuda", 0)) == "mc_sim_7b_63"
    assert medusa_tree("mc_sim_7b_63", "cpu") == "mc_sim_7b_63" and medusa_tree("chain-3", "cuda") == "chain-3"
    session = load_session(compose("decode", ["heads=random", "model=tiny"]))  # random Medusa heads, on the CPU
    assert session.draft_settings["tree"] == "auto"
    drafter = getattr(session.decoder.drafter, "inner", session.decoder.drafter)  # the hybrid's Medusa part
    assert torch.equal(drafter.tree.parents, load_tree("small_16", num_heads=4).parents)
