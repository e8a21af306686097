"""Heads remember how their target was loaded (core/target.py load_settings, heads/io.py): a local checkpoint folder of
every architecture of core/archs.py is loaded, its heads saved and decoded from ``heads=`` alone with the attention,
dtype and chat template it trained with; ``model.KEY=VALUE`` overrides any of them at decode as at training; an
architecture transformers has no sdpa attention for (gpt-oss) gets eager without being asked.

Serving such a folder in vLLM is checked by tests/test_serving_archs*.py (vLLM loads the folder itself: prompts reach it
as token ids, so it needs none of these settings).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import compose
from selfspec.core.archs import TINY_ARCHS
from selfspec.core.target import build_tiny, load_target
from selfspec.decode.prompts import prompt_ids
from selfspec.decode.session import load_session
from selfspec.heads.io import read_heads_config, save_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


def local_folder(arch: str, root: Path) -> Path:
    """A tiny model of ``arch`` saved as a user's checkpoint folder (config, safetensors, tokenizer)."""
    model, tokenizer = build_tiny(arch)
    folder = root / f"{arch}-checkpoint"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy(model, ids: list[int], new: int, stop: bool = True) -> list[int]:
    """HF generate's greedy tokens (``stop``: at the target's EOS, as the engine stops; else exactly ``new``)."""
    fixed = {} if stop else {"min_new_tokens": new, "eos_token_id": None}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=new, pad_token_id=0, **fixed)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_a_local_folder_of_every_architecture_decodes_with_the_settings_it_was_loaded_with(arch, tmp_path):
    folder = local_folder(arch, tmp_path)
    asked = {"source": "hub", "name_or_path": str(folder), "dtype": "float32", "device": "cpu",
             "attn_implementation": "sdpa", "chat_template": TEMPLATE, "revision": None}
    target = load_target(asked)
    attention = "eager" if arch == "gpt_oss" else "sdpa"  # gpt-oss: no sdpa in transformers, eager unasked
    assert target.model.config._attn_implementation == attention
    assert target.settings == {"source": "hub", "name_or_path": str(folder), "dtype": "float32",
                               "attn_implementation": attention, "chat_template": TEMPLATE}
    assert target.tokenizer.chat_template == TEMPLATE

    session = load_session(compose("decode", [f"model={folder}", "heads=random", "drafter=medusa",
                                              "model.dtype=float32", "model.device=cpu"]))
    path = save_heads(tmp_path / "heads", session.heads, "medusa", session.heads.config.to_dict(), target)
    assert read_heads_config(path)["model"] == target.settings

    again = load_session(compose("decode", [f"heads={path}", "max_new_tokens=10"]))  # heads= alone
    model = again.target.model
    assert model.config._attn_implementation == attention and model.dtype == torch.float32
    assert again.target.tokenizer.chat_template == TEMPLATE  # the prompt is rendered as in training
    ids = prompt_ids(again.target.tokenizer, [{"role": "user", "content": "hello"}])
    assert ids == target.tokenizer("[user] hello\n[assistant] ", add_special_tokens=False)["input_ids"]
    assert again.decoder.generate(ids, max_new_tokens=10).tokens == greedy(target.model, ids, 10)


def test_gpt_oss_heads_trained_on_a_folder_decode_from_the_heads_alone(tmp_path):
    """The case that failed: heads trained on a gpt-oss folder recorded only the folder, so decoding loaded it with
    sdpa and transformers raised. Trained through the real loop (which loads the target itself), decoded from
    ``heads=`` alone, and overridden at decode with ``model.KEY=VALUE``."""
    import datasets

    from selfspec.train.families import METHODS
    from selfspec.train.loop import train

    folder = local_folder("gpt_oss", tmp_path)
    prompts = torch.randint(3, 259, (4, 6), generator=torch.Generator().manual_seed(0))
    model = load_target({"source": "hub", "name_or_path": str(folder), "dtype": "float32", "device": "cpu"}).model
    rows = [p + greedy(model, p, 12, stop=False) for p in prompts.tolist()]
    split = datasets.Dataset.from_dict({"input_ids": rows, "labels": [[-100] * 6 + r[6:] for r in rows]})
    cfg = compose("dflash", ["experiment=debug", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=0",
                             "speed_check.prompts=null", "model=tiny", "model.source=hub",
                             f"model.name_or_path={folder}", "model.tiny=null", f"run_dir={tmp_path / 'run'}",
                             "trainer.target_dtype=bfloat16"])  # as auto chooses where a CPU has native bfloat16
    result = train(cfg, METHODS["dflash"](cfg), datasets=datasets.DatasetDict({"train": split}))
    heads = Path(result.heads_dir)
    recorded = read_heads_config(heads)["model"]
    assert recorded["attn_implementation"] == "eager" and recorded["name_or_path"] == str(folder)
    assert recorded["dtype"] == cfg.model.dtype != "bfloat16"  # the model's dtype, not the one training ran it in

    session = load_session(compose("decode", [f"heads={heads}", "max_new_tokens=12"]))
    assert session.target.model.config._attn_implementation == "eager" and session.target.model.dtype == torch.float32
    ids = rows[0][:6]
    assert session.decoder.generate(ids, max_new_tokens=12).tokens == greedy(session.target.model, ids, 12)

    wider = load_session(compose("decode", [f"heads={heads}", "model.dtype=bfloat16", "max_new_tokens=4"]))
    assert wider.target.model.dtype == torch.bfloat16  # any target setting overrides the recorded one
    assert wider.target.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("config,given", [("decode", []), ("export", ["heads=x"]), ("bench", []),
                                          ("serve_check", ["heads=x", "prompts=x"])])
def test_model_key_value_sets_the_target_s_setting_in_every_decode_side_config(config, given):
    """``model.KEY=VALUE`` (and ``+model.KEY=VALUE``) is read as ``target.KEY=VALUE`` in the configs of conf/decode/,
    beside ``model=NAME``; the decode settings apply it over the named config (a tiny recipe key by key)."""
    from selfspec.decode.settings import resolve_target_config

    cfg = compose(config, [*given, "model=tiny", "model.attn_implementation=eager",
                           "+model.tiny.num_hidden_layers=2", "model.revision=abc"])
    assert cfg.model == "tiny"
    assert dict(cfg.target) == {"attn_implementation": "eager", "tiny": {"num_hidden_layers": 2}, "revision": "abc"}
    resolved = resolve_target_config(cfg.model, None, target=cfg.target)
    assert resolved.attn_implementation == "eager" and resolved.revision == "abc"
    assert resolved.tiny["num_hidden_layers"] == 2 and resolved.tiny["hidden_size"] == 64


def test_a_mistyped_target_setting_is_refused_naming_the_settings():
    from selfspec.decode.settings import DecodeSettings
    from selfspec.decode.types import DecodeSetupError

    settings = DecodeSettings.from_config(compose("decode", ["model=tiny", "model.attn_implementaton=eager"]))
    with pytest.raises(DecodeSetupError, match=r"model.attn_implementaton is not a setting .* attn_implementation, "):
        settings.target_settings(None)


def test_training_configs_keep_model_as_their_config_group():
    """Only conf/decode/'s configs read model.KEY as the target's setting: a training config's ``model`` is the group."""
    cfg = compose("medusa", ["model=tiny", "model.attn_implementation=eager", "model.chat_template=x"])
    assert cfg.model.attn_implementation == "eager" and cfg.model.chat_template == "x" and "target" not in cfg
