"""decode/run.py and its library (decode/answers.py, decode/session.py) on the tiny target: every decode option composes and runs,
prompts and MT-bench style files are answered (conversation carried between turns), the HF baseline agrees under
greedy decoding, trained heads bring their own target, and bad input fails clearly."""

from __future__ import annotations

import io
import os
import json
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF, compose, load_script
from selfspec.core.families import FAMILIES
from selfspec.decode.drafters import MedusaDrafter, VanillaDrafter
from selfspec.decode import registry
from selfspec.decode.eagle_drafter import EagleTreeDrafter
from selfspec.decode.answers import run
from selfspec.decode.session import load_session
from selfspec.decode.types import DecodeSetupError
from selfspec.decode.hybrid import HybridDrafter
from selfspec.decode.tree import TreeError

TINY = ["model=tiny", "max_new_tokens=12"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_decodes_through_the_registry(name, device):
    """Every family of the table (core/families.py) is a registry entry, and decodes (untrained heads: heads=random)."""
    assert {"medusa", "eagle", "eagle3", "vanilla"} <= set(FAMILIES) and list(registry.REGISTRY) == list(FAMILIES)
    assert registry.entry(name).family is FAMILIES[name]
    session = load_session(compose("decode", TINY + [f"drafter={name}"]))
    drafter = session.decoder.drafter
    if "suffix" in registry.entry(name).defaults:  # trained families decode as hybrid trees by default
        assert isinstance(drafter, HybridDrafter)
        drafter = drafter.inner
    # tree=auto on a CPU: small_16 and the root; on an accelerator Medusa's own mc_sim_7b_63 (64 nodes)
    expected = {"medusa": (MedusaDrafter, 17 if device.type == "cpu" else 64),
                "eagle": (EagleTreeDrafter, None), "eagle3": (EagleTreeDrafter, None), "vanilla": (VanillaDrafter, None)}
    if name in expected:
        cls, nodes = expected[name]
        assert isinstance(drafter, cls)
        if nodes:
            assert drafter.tree.num_nodes == nodes
    ids = [5, 6, 7, 8]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=12, pad_token_id=0)[0, 4:].tolist()
    first = session.decoder.generate(ids, max_new_tokens=12)
    assert first.tokens == ref
    # Greedy output does not depend on the draft, so equality alone would pass a broken drafter. The second answer to
    # the same prompt drafts from the first one (the suffix drafter's memory, in every family that merges it), so
    # its drafts are accepted and the equality is checked over accepted drafted tokens.
    again = session.decoder.generate(ids, max_new_tokens=12)
    assert again.tokens == ref
    if name != "vanilla":
        assert again.stats.accepted >= len(ref) // 2, (name, again.stats)


def test_draft_settings_apply_the_same_way_for_every_family():
    chain = load_session(compose("decode", TINY + ["draft.tree=chain"])).decoder.drafter.inner
    assert isinstance(chain, MedusaDrafter) and chain.tree.num_nodes == 5
    alone = load_session(compose("decode", TINY + ["draft.tree=chain", "draft.suffix=false"])).decoder.drafter
    assert isinstance(alone, MedusaDrafter) and alone.tree.num_nodes == 5
    eagle = load_session(compose("decode", TINY + ["drafter=eagle", "draft.top_k=3"])).decoder.drafter.inner
    assert (eagle.depth, eagle.top_k, eagle.total_tokens) == (5, 3, 48)
    with pytest.raises(DecodeSetupError, match="draft.tree is not a setting of the eagle drafter"):
        load_session(compose("decode", TINY + ["drafter=eagle", "draft.tree=chain"]))
    with pytest.raises(DecodeSetupError, match="Unknown drafter 'medussa'"):
        load_session(compose("decode", TINY + ["drafter=medussa"]))
    with pytest.raises(DecodeSetupError, match="needs heads"):
        load_session(compose("decode", TINY + ["heads=null", "drafter=medusa"]))
    assert isinstance(load_session(compose("decode", TINY + ["heads=null"])).decoder.drafter, VanillaDrafter)


def reference(session, ids: list[int], new: int) -> list[int]:
    """HF generate's greedy answer on the session's target."""
    model = session.target.model
    return model.generate(torch.tensor([ids], device=model.device), do_sample=False, max_new_tokens=new,
                          pad_token_id=0)[0, len(ids):].tolist()


def test_decoder_for_builds_what_a_session_loaded_for_those_settings_builds():
    """Session.decoder_for, the one way to an engine under other settings: plain decoding gives HF generate's greedy
    tokens; another family, or other draft.* settings, give the drafter and the steps a session loaded for them
    gives; the session's own settings give a decoder like its own."""
    session = load_session(compose("decode", TINY))  # random Medusa heads, a hybrid with adaptive depth
    ids = [5, 6, 7, 8, 5, 6, 7]
    ref = reference(session, ids, 12)
    plain = session.decoder_for("vanilla")
    assert isinstance(plain.drafter, VanillaDrafter) and plain.depth_policy is None
    assert plain.generate(ids, max_new_tokens=12).tokens == ref
    own = session.decoder_for()
    assert type(own.drafter) is type(session.decoder.drafter) is HybridDrafter and own is not session.decoder
    assert own.drafter.inner.tree.num_nodes == session.decoder.drafter.inner.tree.num_nodes
    assert own.generate(ids, max_new_tokens=12).tokens == ref
    for family, over in (("suffix", {}), ("layerskip", {"adaptive": False, "suffix": False})):  # as loaded for it
        built = session.decoder_for(family, over)
        args = [f"draft.{k}={str(v).lower()}" for k, v in over.items()]
        loaded = load_session(compose("decode", TINY + ["heads=null", f"drafter={family}", *args])).decoder
        assert type(built.drafter) is type(loaded.drafter)
        assert (built.depth_policy is None) == (loaded.depth_policy is None)
        first, again = built.generate(ids, max_new_tokens=12), loaded.generate(ids, max_new_tokens=12)
        assert first.tokens == again.tokens == ref and first.stats.accept_lengths == again.stats.accept_lengths
    # other draft settings of the session's own family and heads
    over = ["draft.suffix=false", "draft.adaptive=false", "draft.tree=chain"]
    loaded = load_session(compose("decode", TINY + over)).decoder
    built = session.decoder_for(draft={"suffix": False, "adaptive": False, "tree": "chain"})
    assert isinstance(built.drafter, MedusaDrafter) and built.drafter.tree.num_nodes == loaded.drafter.tree.num_nodes
    first, again = built.generate(ids, max_new_tokens=12), loaded.generate(ids, max_new_tokens=12)
    assert first.tokens == again.tokens == ref and first.stats.accept_lengths == again.stats.accept_lengths
    with pytest.raises(DecodeSetupError, match="needs heads of its own"):
        session.decoder_for("eagle")
    with pytest.raises(DecodeSetupError, match="draft.tree is not a setting of the suffix drafter"):
        session.decoder_for("suffix", {"tree": "chain"})


@pytest.mark.real_model
def test_decoder_for_is_lossless_on_smollm2():
    """On the real target: the default decoder (random Medusa heads merged with the suffix drafter, adaptive depth)
    and plain decoding through decoder_for give HF generate's greedy tokens."""
    from selfspec.decode.prompts import prompt_ids

    session = load_session(compose("decode", ["max_new_tokens=24"]))  # heads=random: the embedded SmolLM2
    plain = session.decoder_for("vanilla")
    for text in ["Name three colours.", "What is 12 times 7?"]:
        ids = prompt_ids(session.target.tokenizer, [{"role": "user", "content": text}])
        ref = reference(session, ids, 24)
        assert session.decoder.generate(ids, max_new_tokens=24).tokens == ref
        assert plain.generate(ids, max_new_tokens=24).tokens == ref


def test_trained_heads_bring_their_target(tmp_path):
    pytest.importorskip("selfspec.heads.io")
    from selfspec.heads.io import save_heads
    from selfspec.core.target import TargetMismatchError

    session = load_session(compose("decode", TINY))
    heads = session.heads
    save_heads(tmp_path / "heads", heads, "medusa", heads.config.to_dict(), session.target)
    loaded = load_session(compose("decode", ["max_new_tokens=8", f"heads={tmp_path / 'heads'}"]))
    assert loaded.target.name == "tiny-llama" and isinstance(loaded.decoder.drafter.inner, MedusaDrafter)
    assert all(torch.equal(a, b) for a, b in zip(loaded.heads.state_dict().values(), heads.state_dict().values()))
    with pytest.raises(TargetMismatchError):
        load_session(compose("decode", ["model=tiny_qwen2", f"heads={tmp_path / 'heads'}"]))


def test_entry_script_runs(tmp_path, monkeypatch, capsys):
    import runpy

    script = CONF.parent / "decode" / "run.py"
    # heads=... is a plain key of the decode config (conf/decode/ has no heads/ group), not rewritten in sys.argv
    argv = [str(script), *TINY, "heads=random", "prompt=hi", f"run_dir={tmp_path}", "drafter=vanilla"]
    monkeypatch.setattr(sys, "argv", list(argv))
    runpy.run_path(str(script), run_name="__main__")
    assert "tau 1.00" in capsys.readouterr().out
    saved = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "heads: random" in saved and sys.argv == argv


def test_bad_input_fails_clearly(tmp_path):
    with pytest.raises(DecodeSetupError, match="empty"):
        run(compose("decode", TINY + ["prompt=  "]), io.StringIO())
    with pytest.raises(ValueError, match="context"):
        run(compose("decode", TINY + ["prompt=" + "x" * 600]), io.StringIO())
    with pytest.raises(DecodeSetupError, match="Give one of"):
        run(compose("decode", TINY), io.StringIO())
    with pytest.raises(DecodeSetupError, match="no such file"):
        run(compose("decode", TINY + [f"prompts={tmp_path / 'missing.jsonl'}"]), io.StringIO())
    with pytest.raises(TreeError, match="4 heads"):
        load_session(compose("decode", TINY + ["draft.tree=chain-6"]))
    with pytest.raises(ValueError, match="acceptance"):
        load_session(compose("decode", TINY + ["acceptance=beam"]))
    with pytest.raises(DecodeSetupError, match="baseline=hf"):
        run(compose("decode", TINY + ["prompt=hi", "baseline=vllm"]), io.StringIO())
    with pytest.raises(Exception, match="No heads folder"):
        load_session(compose("decode", TINY + [f"heads={tmp_path / 'nowhere'}"]))
    with pytest.raises(DecodeSetupError, match="linear_kernel='fast'.*auto, torch, small_batch"):
        load_session(compose("decode", TINY + ["linear_kernel=fast"]))


def test_bench_script_runs(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"Question {i}?"]})
                                   for i in range(3)) + "\n")
    bench = load_script("bench")
    report = bench.main([*TINY[:1], "max_new_tokens=6", "curve_sizes=[1,4]", "curve_repeats=1", f"prompts={questions}",
                         "limit=2", "draft.tree=small_16", "heads=[random]", "early_exit_layers=[2]",
                         f"out={tmp_path / 'bench'}"])
    out = capsys.readouterr().out
    assert "| medusa:random |" in out and "Lossless" in out and report["mismatches"] == []
    assert [r["nodes"] for r in report["verify_cost"]["curves"]["torch"]] == [1, 4]
    assert (tmp_path / "bench" / "bench.json").is_file()
    # on a CPU the engine's small-batch kernels get their own curve beside PyTorch's
    assert [r["nodes"] for r in report["verify_cost"]["curves"]["small_batch"]] == [1, 4]
    assert report["settings"]["linear_kernel"] == "auto"
    figures = report["figures"]
    assert figures["medusa:random"]["overall"]["new_tokens"] == figures["hf"]["overall"]["new_tokens"] > 0
    # heads of another target are refused
    from selfspec.heads.io import save_heads
    from selfspec.core.target import TargetMismatchError

    other = load_session(compose("decode", ["model=tiny_qwen2"]))
    save_heads(tmp_path / "qwen_heads", other.heads, "medusa", other.heads.config.to_dict(), other.target)
    with pytest.raises(TargetMismatchError):
        bench.main(["curve_sizes=[1]", "curve_repeats=1", "model=tiny", f"prompts={questions}", "limit=1",
                    "max_new_tokens=4", f"heads=[random,{tmp_path / 'qwen_heads'}]", f"out={tmp_path / 'refused'}"])


def test_tree_sweep_script(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"Question {i}?"]})
                                   for i in range(3)) + "\n")
    sweep = load_script("sweep_trees")
    ways = sweep.main(["model=tiny", f"prompts={questions}", "max_questions=3", "max_new_tokens=10",
                       "--trees", "single,chain-2,small_16", "--out", str(tmp_path / "s.json")])
    assert list(ways) == ["tree single", "tree chain-2", "tree small_16", "vanilla"]
    # greedy: every tree gives the first tree's tokens on every prompt
    assert all(w["same_as_first"] == 3 and w["prompts"] == 3 for w in ways.values())
    assert ways["tree single"]["tau"] == ways["vanilla"]["tau"] == 1.0  # a one-node tree drafts nothing
    assert all(w["new_tokens"] == ways["vanilla"]["new_tokens"] > 0 for w in ways.values())
    assert ways["tree chain-2"]["steps"] <= ways["vanilla"]["steps"]
    assert "tree small_16" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["ways"]["vanilla"]["prompts"] == 3
    # EAGLE heads under dynamic trees: the same tokens as plain decoding
    ways = sweep.main(["model=tiny", "drafter=eagle", f"prompts={questions}", "max_questions=2", "max_new_tokens=8",
                       "--eagle", "2:2:3,3:4:8"])
    assert all(w["same_as_first"] == 2 for w in ways.values())
    # --as-decoded: each setting in the decoder decode/run.py builds (adaptive depth, the suffix hybrid by default;
    # the command's draft.* switch them off for every setting)
    session = load_session(compose("decode", ["model=tiny", "drafter=eagle"]))
    hybrid = sweep.build_decoders(session, [], ["2:1:2"], False, as_decoded=True)["eagle 2:1:2"]
    assert isinstance(hybrid.drafter, HybridDrafter) and hybrid.depth_policy is not None
    assert (hybrid.drafter.inner.top_k, hybrid.drafter.inner.total_tokens) == (1, 2)
    alone = sweep.build_decoders(session, [], ["2:1:2"], False, as_decoded=True, draft={"suffix": False})["eagle 2:1:2"]
    assert not isinstance(alone.drafter, HybridDrafter) and alone.depth_policy is not None
    as_given = sweep.build_decoders(session, [], ["2:1:2"], False)["eagle 2:1:2"]  # the tree alone, whole each step
    assert not isinstance(as_given.drafter, HybridDrafter) and as_given.depth_policy is None
    ways = sweep.main(["model=tiny", "drafter=eagle", f"prompts={questions}", "max_questions=2", "max_new_tokens=8",
                       "--eagle", "2:1:2,3:4:8", "--as-decoded"])
    assert all(w["same_as_first"] == 2 for w in ways.values())
    with pytest.raises(DecodeSetupError, match="draft.tree is not a setting of the eagle drafter"):
        sweep.main(["model=tiny", "drafter=eagle", f"prompts={questions}", "--trees", "chain"])
    with pytest.raises(DecodeSetupError, match="depth:top_k:total_tokens, e.g."):
        sweep.main(["model=tiny", "drafter=eagle", f"prompts={questions}", "--eagle", "5:8"])


def test_layerskip_sweep_over_exit_layer_depth_and_threshold(tmp_path):
    from test_layerskip_train import trained_like_exit

    from selfspec.heads.io import save_heads

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"Question {i}?"]})
                                   for i in range(2)) + "\n")
    sweep = load_script("sweep_trees")
    target = load_session(compose("decode", ["model=tiny", "heads=null"])).target
    for layer, folder in ((1, tmp_path / "run" / "heads"), (2, tmp_path / "run" / "exits" / "layer-2")):
        exit_module = trained_like_exit(target.model, layer, "adapter", 64, seed=layer)
        save_heads(folder, exit_module, "layerskip", exit_module.config.to_dict(), target)
    ways = sweep.main([f"heads={tmp_path / 'run'}", f"prompts={questions}", "max_new_tokens=8",
                       "--layerskip", "1:2:0.0,2:3:0.0,2:1:0.9"])
    assert list(ways) == ["layerskip 1:2:0.0", "layerskip 2:3:0.0", "layerskip 2:1:0.9", "vanilla"]
    assert all(w["same_as_first"] == 2 for w in ways.values())  # greedy: the same tokens whatever the exit
    # it drafted (whether these random exits' drafts are accepted is luck: tests/test_layerskip_train.py checks that)
    assert ways["layerskip 2:3:0.0"]["draft_s"] > 0 and ways["layerskip 2:3:0.0"]["steps"] <= ways["vanilla"]["steps"]
    with pytest.raises(DecodeSetupError, match="No trained exit after layer 3"):
        sweep.main([f"heads={tmp_path / 'run'}", f"prompts={questions}", "--layerskip", "3:2:0.5"])
    ways = sweep.main(["model=tiny", "heads=null", "drafter=layerskip", f"prompts={questions}", "max_new_tokens=8",
                       "--layerskip", "1:2:0.0,3:2:0.0", "--no-vanilla"])  # the target's own exit at any layer
    assert all(w["same_as_first"] == 2 for w in ways.values())


EXPECTED_MISTAKES = [
    ("decode/run.py", ["heads=/no/such/heads", "prompt=hi"], "error: No heads folder at /no/such/heads"),
    ("decode/run.py", ["model=tiny", "draft.tree=nosuch", "prompt=hi"], "error: Unknown tree 'nosuch'"),
    ("train/medusa.py", ["experiment=debug", "trainer.max_steps=abc"], "error: trainer.max_steps='abc' is not a whole"),
]


@pytest.mark.parametrize("script, args, message", EXPECTED_MISTAKES)
def test_expected_mistakes_print_one_line_without_a_traceback(script, args, message, tmp_path, monkeypatch, capfd):
    """The entry file run as ``__main__`` in this process (tests/test_cli_errors.py's run_in_process: its exit status,
    stdout and stderr as a process would give them back); the first case also runs as a real process below."""
    from test_cli_errors import run_in_process

    args = [*args, f"run_dir={tmp_path}"]
    proc = run_in_process(script, args, tmp_path, monkeypatch, capfd)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    full = run_in_process(script, args, tmp_path, monkeypatch, capfd, full_error=True)
    assert full.returncode != 0 and "Traceback" in full.stderr  # the whole trace, for debugging
    assert not list(tmp_path.rglob("*.log"))  # Hydra's job log is off: no empty <script>.log in run or working folder


def test_an_expected_mistake_of_python_decode_run_py_is_one_line(tmp_path):
    """``python decode/run.py`` as a real process (its folder first on sys.path, a fresh interpreter)."""
    import subprocess

    script, args, message = EXPECTED_MISTAKES[0]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    cmd = [sys.executable, str(CONF.parent / script), *args, f"run_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not list(tmp_path.rglob("*.log"))


def test_a_training_run_ends_with_the_decode_command_and_a_speed_check(tmp_path, capsys):
    import io

    import shlex

    import selfspec.train.speed_check as sc
    from selfspec.train.speed_check import speed_check
    from selfspec.heads.io import save_heads

    from selfspec.decode.drafters import VanillaDrafter
    from selfspec.decode.engine import SpeculativeDecoder

    session = load_session(compose("decode", ["model=tiny", "max_new_tokens=8"]))
    folder = tmp_path / "run" / "heads"
    save_heads(folder, session.heads, "medusa", session.heads.config.to_dict(), session.target)
    # every timed answer's counts, as the engine reported them (the 8-token warm-ups are not timed)
    recorded = {"heads": [0, 0.0], "plain": [0, 0.0]}
    generate = SpeculativeDecoder.generate

    def recording(self, ids, max_new_tokens=None, **kw):
        res = generate(self, ids, max_new_tokens=max_new_tokens, **kw)
        if max_new_tokens == 6:
            totals = recorded["plain" if isinstance(self.drafter, VanillaDrafter) else "heads"]
            totals[0] += res.stats.new_tokens
            totals[1] += res.stats.total_s
        return res

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpeculativeDecoder, "generate", recording)
        result = speed_check(folder, prompts=2, max_new_tokens=6, chat=True, out=out)
    text = out.getvalue()
    assert f"selfspec-decode heads={folder}" in text and "quick speed check (2 prompts, 6 new tokens" in text
    assert recorded["heads"][0] == recorded["plain"][0] == 12  # both decoders answered both prompts in full
    expected = {k: n / s for k, (n, s) in recorded.items()}
    assert result["heads"] == pytest.approx(expected["heads"]) and result["plain"] == pytest.approx(expected["plain"])
    assert result["ratio"] == pytest.approx(expected["heads"] / expected["plain"])
    assert f"{result['ratio']:.2f}x" in text
    quiet = io.StringIO()
    assert speed_check(folder, prompts=0, max_new_tokens=6, chat=True, out=quiet) == {} and f"selfspec-decode heads={folder}" in quiet.getvalue()
    text_heads = io.StringIO()  # heads trained on plain text: the command decodes a text opening without the template
    speed_check(folder, prompts=0, max_new_tokens=6, chat=False, out=text_heads)
    command = text_heads.getvalue().splitlines()[1].strip()
    assert command.startswith(f"selfspec-decode heads={folder} chat=false 'prompt=")
    assert shlex.split(command)[3] == f'prompt="{sc.SPEED_CHECK_OPENINGS[0]}"'


def test_heads_trained_on_plain_text_are_speed_checked_on_text_openings(monkeypatch):
    # A base model's heads (data.format=text) are checked on openings it continues, without the chat template: under
    # it a base model mostly repeats the instruction, which a copying drafter predicts (a speedup nobody gets).
    import selfspec.train.speed_check as sc

    session = load_session(compose("decode", ["model=tiny", "max_new_tokens=8"]))
    tokenizer = session.target.tokenizer
    chat, text = sc.speed_check_ids(tokenizer, 2, True), sc.speed_check_ids(tokenizer, 2, False)
    assert text == [tokenizer(t)["input_ids"] for t in sc.SPEED_CHECK_OPENINGS[:2]]
    assert chat == [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                       return_dict=False)) for t in sc.SPEED_CHECK_PROMPTS[:2]]
    asked = []
    monkeypatch.setattr(sc, "speed_check", lambda heads, prompts, tokens, chat: asked.append(chat))
    for fmt in ("text", "chat"):
        sc.after_training(OmegaConf.create({"speed_check": {"prompts": 1, "max_new_tokens": 4},
                                            "data": {"format": fmt}}), "heads")
    assert asked == [False, True]
