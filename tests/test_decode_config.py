"""Decode defaults are written once, in conf/ (as training's are: see test_medusa_train.py's
test_settings_defaults_are_written_once_in_conf): each family's settings in conf/decode/drafters.yaml, the session's
and the benchmark's in conf/decode/decode.yaml and bench.yaml; a key they lack is an error that names it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF, compose
from decode import registry
from decode.pipeline import SESSION_KEYS, load_session
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


def test_drafters_built_by_hand_default_to_the_conf_values():
    """The drafters' own keyword defaults (for code that builds one directly) are conf/decode/drafters.yaml's."""
    from decode.drafters import MedusaDrafter
    from decode.eagle_drafter import EagleTreeDrafter
    from decode.layerskip import LayerSkipDrafter
    from decode.suffix import SuffixDrafter

    table = OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "drafters.yaml"))
    for cls, family in ((MedusaDrafter, "medusa"), (EagleTreeDrafter, "eagle"), (LayerSkipDrafter, "layerskip"),
                        (SuffixDrafter, "suffix")):
        params = inspect.signature(cls.__init__).parameters
        for key, value in table[family].items():
            if key in params and params[key].default is not inspect.Parameter.empty and value is not None:
                assert params[key].default == value, (cls.__name__, key)


def test_a_session_reads_decode_yaml_and_names_a_missing_key():
    yaml = OmegaConf.load(CONF / "decode" / "decode.yaml")
    session = load_session(compose("decode", ["model=tiny", "heads=null"]))
    assert session.settings == {"max_new_tokens": yaml.max_new_tokens, "stop": list(yaml.stop), "seed": yaml.seed,
                                "chat": yaml.chat, "system_prompt": yaml.system_prompt}
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
