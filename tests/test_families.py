"""A family is its row and the code each room registers for it, and nothing else decides by a family's name: a toy
family (its row, decode defaults and training entry in one conf file in a temporary folder, its code in one module
there, and one entry in each room's ``families`` module: heads/families.py, decode/families.py, train/families.py) is
found by the heads loader, the decode registry (a session decodes with it, its draft.* setting given on the command
line), the export and serving decisions, online learning and selfspec-train, with no other file edited. A row that
is not a row is refused naming its file."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from conftest import CONF, compose
from selfspec.core import families
from selfspec.core.config import compose as compose_in
from selfspec.core.families import FAMILIES
from selfspec.decode.families import DRAFTERS, Drafting
from selfspec.heads.families import HEADS
from selfspec.train.families import METHODS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOY_MODULE = '''
"""A toy family: heads that score the vocabulary from the last hidden state; a chain of their top token."""
import torch
from torch import nn

from selfspec.decode.tree import chain_tree
from selfspec.decode.types import Draft, DrafterBase


class ToyHeads(nn.Module):
    def __init__(self, config, target_model=None):
        super().__init__()
        self.config = config
        self.score = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)


def build_toy_heads(config, target_model):
    return ToyHeads(config, target_model)


def random_toy_heads(model, seed=0, **_):
    torch.manual_seed(seed)
    config = {"hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size}
    return ToyHeads(config).to(model.device).eval()


class ToyDrafter(DrafterBase):
    def __init__(self, heads, chain):
        self.heads, self.chain = heads, chain

    def propose(self, state, max_depth):
        depth = min(self.chain, max_depth)
        guess = int(self.heads.score(state.hidden).argmax())
        tokens = torch.tensor([state.next_token] + [guess] * depth, device=state.hidden.device)
        return Draft(tokens=tokens, tree=chain_tree(depth).to(state.hidden.device))


def toy_from_settings(heads, target, settings):
    return ToyDrafter(heads, chain=settings["chain"])


def toy_chain(k):
    return {"chain": k}


def toy_served_depth(meta, k):
    return min(k, 2)


class ToyMethod:
    def __init__(self, cfg):
        self.heads = dict(cfg.heads)
'''

TOY_CONF = '''
# The toy family's conf: its row, its decode defaults and its training entry, one file.
families:
  toy:
    summary: "a toy: a chain of the heads' top token"
    needs_heads: true
    saved_key: decode
    trains: true
    exports: {{eagle3: eagle3}}  # served as vLLM's eagle3 serves it (a toy claim: the decisions are what is checked)
    export_needs: {{served: true}}
    vllm_hybrid: true
    learns_online: true
    draft:
      chain: 2             # the drafted chain's length
      adaptive: false

defaults:
  - model: tiny
  - data: sharegpt
  - trainer: default
  - logger: none
  - _self_

hydra:
  searchpath: [file://{conf}]  # the real conf groups (model, data, trainer, logger), from this temporary folder

task: toy
run_name: ${{task}}-tiny
run_dir: outputs/${{run_name}}
heads:                     # its heads' settings inline: a family without heads variants needs no conf/heads/ option
  type: toy
  hidden_size: 64
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy family: its row declared in ``tmp_path/conf/toy.yaml`` and added to the table as core/families.py adds
    what conf/ declares; its code in ``tmp_path/toy_family_<n>.py``, registered as the rooms' families modules
    register theirs (one entry each)."""
    import importlib

    name = f"toy_family_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TOY_MODULE)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "toy.yaml").write_text(TOY_CONF.format(conf=CONF))
    monkeypatch.syspath_prepend(str(tmp_path))
    declared = families.declared(conf)
    assert list(declared) == ["toy"] and declared["toy"].conf == conf / "toy.yaml"
    module = importlib.import_module(name)
    monkeypatch.setitem(FAMILIES, "toy", declared["toy"])  # the row: conf/toy.yaml
    monkeypatch.setitem(HEADS, "toy", module.build_toy_heads)  # heads/families.py
    monkeypatch.setitem(DRAFTERS, "toy", Drafting(module.toy_from_settings, module.random_toy_heads,  # decode/
                                                  module.toy_chain, module.toy_served_depth))
    monkeypatch.setitem(METHODS, "toy", module.ToyMethod)  # train/families.py
    yield declared["toy"]
    sys.modules.pop(name, None)


def test_the_table_is_what_the_conf_files_declare():
    assert families.declared() == FAMILIES and len(FAMILIES) >= 7
    for family in FAMILIES.values():  # each is declared in one top-level conf file, its entry config if it trains
        assert family.conf.parent == CONF and family.name in yaml.safe_load(family.conf.read_text())["families"]
        assert family.train_conf == (family.conf.stem if family.trains else None)


def test_every_row_has_the_code_its_flags_promise():
    """A family that exports to vLLM has the chain its decode code drafts for the serving check; one that reads
    layers has its default rule; one that joins vLLM's hybrid names a method whose proposer serve/vllm_hybrid.py
    extends (vLLM's own names, which that module keeps because it runs in vLLM's venv)."""
    from selfspec.serve.vllm_hybrid import METHODS as HYBRID_METHODS
    from selfspec.heads.families import DEFAULT_LAYERS

    for name, family in FAMILIES.items():
        assert (DRAFTERS[name].chain is not None) == bool(family.exports), name
        assert (name in DEFAULT_LAYERS) == bool(family.reads_layers), name
        assert not family.learns_online or family.trains, name
    assert {f.exports[f.hybrid_export] for f in FAMILIES.values() if f.vllm_hybrid} == set(HYBRID_METHODS)


def test_a_toy_family_is_found_by_decode_heads_export_serving_learning_and_training(toy, tmp_path, monkeypatch,
                                                                                     capsys):
    from hydra.core.global_hydra import GlobalHydra

    from selfspec.decode import registry
    from selfspec.decode.session import load_session
    from selfspec.decode.types import DecodeSetupError
    from selfspec.heads import load as load_heads
    from selfspec.heads.export import ExportError, resolve_format
    from selfspec.heads.io import head_builder, save_heads
    from selfspec.serve import serving
    from selfspec.train.cli import main, trainable
    from selfspec.train.online import learning_families, training_method

    # decode: the registry's entry, a session with random toy heads, and the draft.* setting it declares
    assert registry.entry("toy").family is toy and registry.entry("toy").settings() == {"chain": 2, "adaptive": False}
    session = load_session(compose("decode", ["model=tiny", "heads=random", "drafter=toy", "draft.chain=3",
                                              "max_new_tokens=12"]))
    assert session.family == "toy" and session.decoder.drafter.chain == 3
    ids = [5, 6, 7, 8]
    plain = session.decoder_for(family="vanilla").generate(ids, max_new_tokens=12).tokens
    drafted = session.decoder.generate(ids, max_new_tokens=12)
    assert drafted.tokens == plain and drafted.stats.drafted > 0  # lossless, and it drafted
    refused = r"draft.chian is no drafter's setting: the toy drafter takes draft.chain, draft.adaptive\.$"
    with pytest.raises(DecodeSetupError, match=refused):
        load_session(compose("decode", ["model=tiny", "heads=random", "drafter=toy", "draft.chian=3"]))

    # heads: the loader rebuilds its heads by its registered builder, and decoding picks the family and its saved
    # settings from them
    assert head_builder("toy") is HEADS["toy"]
    save_heads(tmp_path / "heads", session.heads, "toy", session.heads.config, session.target, {"decode": {"chain": 4}})
    loaded = load_heads(tmp_path / "heads", session.target)
    assert type(loaded.module) is type(session.heads)
    assert torch.equal(loaded.module.score.weight, session.heads.score.weight)
    again = load_session(compose("decode", ["model=tiny", f"heads={tmp_path / 'heads'}"]))
    assert again.family == "toy" and again.draft_settings == {"chain": 4, "adaptive": False}

    # export and serving: the row's exports, what they need, the hybrid; the chain its decode code drafts for vLLM
    assert resolve_format("auto", "toy", {"served": True}) == "eagle3"
    with pytest.raises(ExportError, match=r"these toy heads: use format=eagle3 \(for heads trained with "
                                          r"heads.served=true\)"):
        resolve_format("vllm", "toy", {"served": True})
    with pytest.raises(ExportError, match="Retrain with `selfspec-train toy heads.served=true`"):
        resolve_format("auto", "toy", {})
    assert serving.formats_for("toy", {"served": True}) == ["eagle3", serving.HYBRID]
    assert serving.formats_for("toy", {}) == [] and serving.default_formats("toy", {"served": True}) == ["eagle3"]
    assert serving.served_format(serving.HYBRID, "toy") == serving.ServedFormat("eagle3", "eagle3", hybrid=True)
    assert serving.chain_settings("toy", 3) == {"chain": 3, "adaptive": False, "suffix": False}
    assert serving.served_depth({"head_type": "toy"}, 3) == 2
    with pytest.raises(serving.ServingError, match="toy heads draft 2 tokens a step in vLLM when asked for 3"):
        serving.checked_formats({"head_type": "toy", "head_config": {"served": True}}, None, 3)

    # online learning: its row says it learns, and its method is built from its own entry config
    assert "toy" in learning_families()
    assert training_method("toy", {"heads": {"hidden_size": 32}}).heads == {"type": "toy", "hidden_size": 32}

    # training: selfspec-train lists it, takes it and composes its own conf file
    assert trainable("toy") is toy
    monkeypatch.setattr(sys, "argv", ["selfspec-train"])
    with pytest.raises(SystemExit):
        main()
    assert "toy" in capsys.readouterr().err.splitlines()[0]  # the usage line's family list
    monkeypatch.setattr(sys, "argv", ["selfspec-train", "toy", "trainer.max_steps=7", "--cfg", "job", "--resolve"])
    try:
        main()
    finally:
        GlobalHydra.instance().clear()
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["task"] == "toy" and shown["heads"] == {"type": "toy", "hidden_size": 64}
    assert shown["model"]["source"] == "tiny" and shown["trainer"]["max_steps"] == 7  # the real groups, composed
    cfg = compose_in("toy", ["trainer.max_steps=7"], config_dir=toy.conf.parent)
    assert METHODS["toy"](cfg).heads == {"type": "toy", "hidden_size": 64}


def test_a_row_without_its_drafter_is_refused_naming_where_to_register_it(toy, monkeypatch):
    from selfspec.decode import registry
    from selfspec.decode.types import DecodeSetupError

    monkeypatch.delitem(DRAFTERS, "toy")
    with pytest.raises(DecodeSetupError, match=r"The toy family \(.*toy.yaml\) has no drafter: register its builder "
                                               r"in selfspec/decode/families.py"):
        registry.entry("toy")


@pytest.mark.parametrize("row, problem", [
    ("{summary: s}", "the toy family's row lacks 'draft'"),
    ("{summary: s, draft: {}, train_conf: toy}", "the toy family's row has no field 'train_conf'"),
    ("{summary: s, drafter: a:b, draft: {}}", "the toy family's row has no field 'drafter'"),  # rows name no code
    ("{summary: s, draft: [chain]}", r"the toy family's row: `draft:` is a mapping"),
    ("{summary: s, draft: {}, exports: [eagle3]}", r"the toy family's row: `exports:` is a mapping"),
    ("{summary: s, draft: {}, reads_layers: middle}", r"the toy family's row: `reads_layers:` is inputs, outputs"),
])
def test_a_row_that_is_not_a_row_is_refused_naming_its_file(tmp_path, row, problem):
    (tmp_path / "toy.yaml").write_text(f"families:\n  toy: {row}\n")
    with pytest.raises(families.FamilyConfError, match=rf"{tmp_path / 'toy.yaml'}: {problem}"):
        families.declared(tmp_path)


def test_two_files_declaring_one_name_are_refused(tmp_path):
    row = "{summary: s, draft: {}}"
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"families:\n  toy: {row}\n")
    with pytest.raises(families.FamilyConfError, match=rf"{tmp_path / 'b.yaml'}.*{tmp_path / 'a.yaml'} declares"):
        families.declared(tmp_path)
