"""Decode defaults are written once, in conf/ (as training's are: see test_medusa_train.py's
test_settings_defaults_are_written_once_in_conf): each family's settings in its row's `draft:` in its conf file, the
hybrid's node budget in conf/decode/hybrid.yaml, the session's, the benchmark's and the serving check's in
conf/decode/decode.yaml, bench.yaml and serve_check.yaml; the code writes none of its own, and a key the config lacks
is an error that names it. decode.yaml lists no family's draft.* keys: a family's keys compose as they are, and the
family refuses one it does not take."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF, compose
from selfspec.decode import registry
from selfspec.decode.session import load_session
from selfspec.decode.settings import SESSION_KEYS, DecodeSettings
from selfspec.decode.types import DecodeSetupError


def test_every_family_takes_the_settings_its_row_declares_with_their_defaults():
    hybrid = OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "hybrid.yaml"))
    assert OmegaConf.to_container(OmegaConf.load(CONF / "decode" / "decode.yaml").draft) == {}  # no family's key
    assert "defaults" not in {f.name for f in dataclasses.fields(registry.DrafterEntry)}  # no settings in Python
    declared = []
    for path in sorted(CONF.glob("*.yaml")):  # each family's own conf file, read here as a file
        for name, row in (OmegaConf.to_container(OmegaConf.load(path)).get("families") or {}).items():
            entry = registry.entry(name)
            assert entry.family.conf == path
            assert entry.settings() == {**row["draft"], **(hybrid if entry.hybrid else {})}, name
            assert entry.needs_heads == (entry.random_heads is not None)
            declared.append(name)
    assert sorted(declared) == sorted(registry.REGISTRY) and len(declared) >= 7


def test_draft_composes_each_family_s_keys_and_the_family_refuses_another():
    """Every key a family declares composes as ``draft.KEY=`` with nothing listed in decode.yaml, and reaches the
    family's settings; a key the chosen family does not take is refused naming those it takes, before any model
    loads; the rest of decode.yaml stays closed."""
    from hydra.errors import ConfigCompositionException

    for name, entry in registry.REGISTRY.items():
        given = {k: v for k, v in entry.defaults.items() if v is not None}
        settings = DecodeSettings.from_config(compose("decode", [f"drafter={name}"] + [
            f"draft.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in given.items()]))
        assert settings.draft == given, name
        assert entry.settings(None, settings.draft) == entry.defaults, name
    takes = "draft.depth, draft.top_k, draft.total_tokens, draft.adaptive, draft.suffix"
    # model=nowhere/none: no such target, so each refusal comes before the session loads one
    with pytest.raises(DecodeSetupError, match=rf"draft.deph is no drafter's setting: the eagle drafter takes {takes}"):
        load_session(compose("decode", ["model=nowhere/none", "drafter=eagle", "draft.deph=3"]))
    with pytest.raises(DecodeSetupError, match=rf"draft.tree is not a setting of the eagle drafter \(it takes {takes}"):
        load_session(compose("decode", ["model=nowhere/none", "drafter=eagle", "draft.tree=chain"]))
    with pytest.raises(ConfigCompositionException, match="Could not override 'max_new_tokns'"):
        compose("decode", ["max_new_tokns=3"])


# draft.* key -> the constructor parameter the registry passes it to, where the names differ
RENAMED = {"hybrid": {"merged_nodes": "max_nodes"}}
# keys the registry turns into something else before the constructor sees them: a corpus file into its index, a dtype
# name (auto) into a torch dtype
TRANSFORMED = {"corpus", "dtype"}


def test_the_constructors_the_registry_builds_write_no_default_of_a_conf_setting():
    """A setting a family's row declares reaches its drafter's constructor as an argument without a default, so its
    default is written only there (a hybrid's ``merged_nodes``, of conf/decode/hybrid.yaml, included)."""
    from selfspec.decode.dflash_drafter import DFlashBlockDrafter
    from selfspec.decode.drafters import MedusaDrafter
    from selfspec.decode.eagle_drafter import EagleTreeDrafter
    from selfspec.decode.hybrid import HybridDrafter
    from selfspec.decode.layerskip import LayerSkipDrafter
    from selfspec.decode.suffix import SuffixDrafter

    table = {name: registry.defaults_of(name) for name in ("medusa", "eagle", "dflash", "layerskip", "suffix")}
    table["hybrid"] = registry.defaults_of("hybrid")
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
    from selfspec.serve.serving import CheckSettings

    yaml = OmegaConf.load(CONF / "decode" / "serve_check.yaml")
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(CheckSettings))
    settings = CheckSettings.from_config(compose("serve_check", ["heads=x", "prompts=y"]))
    assert (settings.max_new_tokens, settings.timeout, settings.k, settings.tolerance) == (
        yaml.max_new_tokens, yaml.serving.timeout, yaml.k, yaml.tolerance)
    assert (settings.warmup, settings.vocab, settings.venv) == (yaml.warmup, yaml.vocab, yaml.serving.vllm_venv)
    assert settings.suffix_tokens == yaml.suffix_tokens
    partial = OmegaConf.create({k: v for k, v in OmegaConf.to_container(yaml).items() if k != "max_new_tokens"})
    with pytest.raises(DecodeSetupError, match=r"\['max_new_tokens'\]"):
        CheckSettings.from_config(partial)


def test_a_training_run_s_speed_check_reads_its_config():
    from selfspec.core.errors import SettingError
    from selfspec.train.speed_check import after_training, speed_check

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
    from selfspec.bench import run_bench

    bench = OmegaConf.to_container(compose("bench", ["model=tiny"]), resolve=False)
    for key in ("methods", "prompt_lookup_num_tokens", "out"):
        with pytest.raises(DecodeSetupError, match=rf"\['{key}'\]"):
            run_bench(OmegaConf.create({k: v for k, v in bench.items() if k != key}))


def test_medusa_s_default_tree_follows_the_target_s_device(device):
    """tree=auto: the 16-node small_16 on a CPU, Medusa's own mc_sim_7b_63 on an accelerator; a named tree is kept
    as given; a session on the CPU drafts small_16 (on the test's device, that device's tree)."""
    from selfspec.decode.drafters import medusa_tree
    from selfspec.decode.tree import load_tree

    assert medusa_tree("auto", "cpu") == "small_16"
    assert medusa_tree("auto", torch.device("cuda", 0)) == "mc_sim_7b_63"
    assert medusa_tree("mc_sim_7b_63", "cpu") == "mc_sim_7b_63" and medusa_tree("chain-3", "cuda") == "chain-3"
    session = load_session(compose("decode", ["heads=random", "model=tiny"]))  # random Medusa heads, on `device`
    assert session.draft_settings["tree"] == "auto"
    drafter = getattr(session.decoder.drafter, "inner", session.decoder.drafter)  # the hybrid's Medusa part
    expected = "small_16" if device.type == "cpu" else "mc_sim_7b_63"
    assert torch.equal(drafter.tree.parents.cpu(), load_tree(expected, num_heads=4).parents)
