"""Exported heads in real vLLM (the CPU build, in its own venv): every format loads, decodes the target's own greedy
tokens, and accepts at each draft position what selfspec's engine accepts with the same heads.

The target is a tiny random Llama saved to disk with its tokenizer (head size 32: vLLM's CPU attention has no kernel
for the usual tiny model's 16). The heads are trained for a few dozen steps through the real training loop on the
target's own greedy continuations, so their drafts are accepted often: a broken export or a misread weight shows as
acceptance that differs, not only as tokens that differ.

The tests that run vLLM are opt-in (``pytest -m vllm``; .ci/run runs them after the suite). Without vLLM's venv
(``scripts/make_vllm_venv.sh``) they skip with the reason; under CI they fail instead, since .ci/run makes the venv.

Tolerance. Both engines run float32 on the same weights, but in different kernels, so a float near-tie between two
tokens can break differently: a drafted token (or the target's token) then differs at one step. A near-tie needs two
logits within float32 rounding of each other (relative 1e-6 over logits of size ~10: gaps below ~1e-5); over the few
hundred steps of these prompts the chance of one is far below a percent, and the check asserts the counters equal
exactly. The tokens are compared exactly too (greedy output is the target's, in every engine).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from selfspec.serve.serving import (
    CheckSettings,
    ServingError,
    acceptance_per_position,
    run_vllm,
    serve_check,
    vllm_available,
)
from selfspec.core.target import Target, build_tiny

HIDDEN = 128  # 4 heads of 32: a head size vLLM's CPU attention runs
LAYERS = 8  # EAGLE-3's default layers are three different ones (2, 4, 5)
K = 3
MAX_NEW = 32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_settings(**changes) -> CheckSettings:
    """conf/decode/serve_check.yaml's settings (where their defaults are written), ``changes`` over them."""
    import dataclasses

    from conftest import compose

    return dataclasses.replace(CheckSettings.from_config(compose("serve_check", ["heads=x", "prompts=y"])), **changes)


def vllm_or_skip():
    reason = vllm_available()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI makes vLLM's venv (.ci/run), but: {reason}")
    pytest.skip(reason.split(":")[0] + " (scripts/make_vllm_venv.sh makes it)")


def tiny_target() -> Target:
    model, tokenizer = build_tiny("llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    return Target(model=model, tokenizer=tokenizer, name="tiny-llama")


def own_continuations(model, n: int, seed: int, length: int = 48):
    """The target's greedy continuations of random byte prompts: input_ids, labels on the continuation."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 259, (n, 6), generator=g)
    with torch.no_grad():
        seqs = model.generate(prompts, max_new_tokens=length, min_new_tokens=length, do_sample=False,
                              pad_token_id=0).tolist()
    return datasets.Dataset.from_dict({"input_ids": seqs, "labels": [[-100] * 6 + s[6:] for s in seqs]})


def prompts(n: int = 6, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    """Medusa-1, EAGLE-1 in vLLM's shape (no fc bias, no input norm), midlayer EAGLE-3 and DFlash heads (blocks of
    K + 1), trained briefly by the real loop on the tiny target's own answers."""
    import datasets

    from conftest import compose
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    vllm_or_skip()
    target = tiny_target()
    data = datasets.DatasetDict({"train": own_continuations(target.model, 48, 0),
                                 "eval": own_continuations(target.model, 8, 1)})
    common = ["experiment=debug", f"model.tiny.hidden_size={HIDDEN}", f"model.tiny.num_hidden_layers={LAYERS}", "trainer.batch_size=8",
              "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=10",
              "trainer.target_dtype=float32", "speed_check.prompts=0"]
    root = tmp_path_factory.mktemp("serving")
    out = {}
    cfg = compose("medusa", common + [f"run_dir={root / 'medusa'}", "trainer.max_steps=60",
                                      "trainer.learning_rate=1e-2", "heads.num_heads=3"])
    out["medusa"] = train(cfg, medusa_method(cfg), target=target, datasets=data).run_dir / "heads"
    cfg = compose("eagle", common + [f"run_dir={root / 'eagle'}", "heads=eagle", "heads.fc_bias=false",
                                     "heads.input_norm=false", "trainer.max_steps=80", "trainer.learning_rate=3e-3"])
    out["eagle"] = train(cfg, EagleMethod(cfg), target=target, datasets=data).run_dir / "heads"
    cfg = compose("eagle", common + [f"run_dir={root / 'eagle3'}", "heads=eagle3", "heads.layout=midlayer",
                                     "trainer.max_steps=80", "trainer.learning_rate=3e-3"])
    out["eagle3"] = train(cfg, EagleMethod(cfg), target=target, datasets=data).run_dir / "heads"
    cfg = compose("dflash", common + [f"run_dir={root / 'dflash'}", f"heads.block_size={K + 1}",
                                      "trainer.max_steps=150", "trainer.learning_rate=3e-3"])
    out["dflash"] = train(cfg, DFlashMethod(cfg), target=target, datasets=data).run_dir / "heads"
    return out


def test_acceptance_counted_over_the_steps_vllm_runs():
    # steps: (drafted, accepted, emitted) after the prefill's token; the answer is 8 tokens: vLLM runs the first three
    # steps (1 + 3 + 1 + 4 = 9 >= 8)
    counts = acceptance_per_position([3, 3, 3, 3], [2, 0, 3, 1], [3, 1, 4, 2], length=8, k=3)
    assert counts == {"drafts": 3, "draft_tokens": 9, "accepted": 5, "accepted_per_pos": [2, 2, 1]}
    # a step without a draft (depth 0) emits a token but is no draft
    counts = acceptance_per_position([0, 2], [0, 2], [1, 3], length=5, k=2)
    assert counts == {"drafts": 1, "draft_tokens": 2, "accepted": 2, "accepted_per_pos": [1, 1]}


def test_the_benchmarks_vllm_rows_draft_what_each_family_can():
    """scripts/bench.py's ``vllm_heads`` rows: Medusa at most its heads, DFlash its own block (another length drafts
    other tokens in vLLM's non-causal block), EAGLE-3 the proposers' k."""
    from selfspec.serve.serving import served_depth

    assert served_depth({"head_type": "medusa", "head_config": {"num_heads": 2}}, 3) == 2
    assert served_depth({"head_type": "medusa", "num_heads": 4}, 3) == 3
    assert served_depth({"head_type": "dflash", "head_config": {"block_size": 3}}, 3) == 2
    assert served_depth({"head_type": "dflash", "head_config": {"block_size": 8}}, 3) == 7
    assert served_depth({"head_type": "eagle3", "head_config": {"layout": "midlayer"}}, 3) == 3


def test_the_serve_checks_k_auto_is_what_each_family_drafts_and_a_bad_k_is_named():
    from selfspec.serve.serving import AUTO_DEPTH, requested_depth

    assert requested_depth({"head_type": "dflash", "head_config": {"block_size": 8}}, "auto") == 7
    assert requested_depth({"head_type": "medusa", "head_config": {"num_heads": 2}}, "auto") == 2
    assert requested_depth({"head_type": "eagle3", "head_config": {"layout": "midlayer"}}, "auto") == AUTO_DEPTH
    assert requested_depth({"head_type": "dflash", "head_config": {"block_size": 8}}, 5) == 5  # refused later
    for bad in (0, -2, "two", 1.5, True):
        with pytest.raises(ServingError, match="whole number >= 1, or k=auto"):
            requested_depth({"head_type": "eagle3"}, bad)


@pytest.fixture(scope="module")
def reports(trained_heads, tmp_path_factory) -> dict:
    """Each family's serve check, their vLLM engines in one worker process (serve_checks; serve_check runs one)."""
    from selfspec.serve.serving import plan_check, serve_checks

    root = tmp_path_factory.mktemp("serve-checks")
    plans = []
    for family, heads in trained_heads.items():
        # DFlash's k left to auto: its block less one, the K its heads were trained for
        settings = check_settings(k="auto" if family == "dflash" else K, max_new_tokens=MAX_NEW,
                                  out=str(root / family), timeout=900)
        formats = {"eagle3": ["eagle3", "speculators", "hybrid"], "dflash": ["dflash", "hybrid"]}.get(family)
        plans.append(plan_check(heads, prompts(), formats, settings=settings))
    return dict(zip(trained_heads, serve_checks(plans, timeout=900, log_path=root / "vllm.log")))


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "dflash"])
def test_every_export_loads_in_vllm_and_accepts_what_selfspec_accepts(reports, family):
    report = reports[family]
    assert report["k"] == K
    assert not report["mismatches"], report["mismatches"]
    formats = {"medusa": ["vllm"], "eagle": ["eagle"], "eagle3": ["eagle3", "speculators", "hybrid"],
               "dflash": ["dflash", "hybrid"]}[family]
    assert sorted(report["formats"]) == sorted(formats)
    for fmt, entry in report["formats"].items():
        assert entry["loaded"] and not entry["error"], (fmt, entry["error"])
        assert entry["lossless"]
        if fmt == "hybrid":  # selfspec's hybrid proposer inside vLLM: both drafters' chains were sent and accepted
            assert entry["acceptance_equal"] is None and entry["vllm"]["accepted"] > 0
            assert entry["sent"]["trained"] > 0 and entry["sent"]["suffix"] > 0, entry["sent"]
            # its own time: every step through it, the trained drafter's share within the whole proposer's
            assert entry["sent"]["steps"] > 0 and 0 < entry["sent"]["trained_ms"] <= entry["sent"]["propose_ms"]
            continue
        # the heads were trained to be accepted: the comparison has something to compare at every position
        assert all(a > 0 for a in entry["selfspec"]["accepted_per_pos"]), entry["selfspec"]
        assert entry["vllm"]["drafts"] == entry["selfspec"]["drafts"], fmt
        assert entry["vllm"]["accepted_per_pos"] == entry["selfspec"]["accepted_per_pos"], fmt
        for p in entry["prompts"]:
            assert p["vllm"]["accepted_per_pos"] == p["selfspec"]["accepted_per_pos"], fmt


@pytest.mark.vllm
def test_the_hybrid_skips_its_trained_drafter_where_the_suffix_chain_must_win_and_stays_lossless(trained_heads,
                                                                                                  tmp_path):
    # Each prompt decoded twice, one at a time, the hybrid sending chains of up to suffix_tokens (8) as users run it:
    # the second time the suffix drafter holds the whole answer and plans chains longer than the DFlash drafter's 3
    # that no trained chain could beat, so vLLM's DFlash proposer only stores the step's context (the skip path),
    # in the real engine, lossless.
    twice = prompts(3) * 2
    report = serve_check(trained_heads["dflash"], twice, formats=["hybrid"],
                         settings=check_settings(k="auto", max_new_tokens=MAX_NEW, out=str(tmp_path), timeout=900))
    assert not report["mismatches"], report["mismatches"]
    entry = report["formats"]["hybrid"]
    assert entry["loaded"] and entry["lossless"], entry["error"]
    sent = entry["sent"]
    assert sent["skipped"] > 0 and sent["trained"] > 0 and sent["suffix"] > 0, sent
    # one request at a time: the proposer timed the engine's steps for its verify cost curve (exploring lengths not
    # yet timed, cut or padded chains among them), and the output stayed the target's
    assert sent["timed_steps"] > 0 and isinstance(sent["cost_curve"], dict), sent


@pytest.mark.vllm
def test_formats_that_vllm_cannot_serve_are_refused(trained_heads, tmp_path):
    with pytest.raises(ServingError, match="do not export to eagle3"):
        serve_check(trained_heads["medusa"], prompts(1), formats=["eagle3"], settings=check_settings(k=K))
    with pytest.raises(ServingError, match="medusa heads draft 3 tokens a step in vLLM when asked for 4"):
        serve_check(trained_heads["medusa"], prompts(1), settings=check_settings(k=4))
    with pytest.raises(ServingError, match=f"dflash heads draft {K} tokens a step in vLLM when asked for {K - 1}; "
                                           f"check them with k={K}"):
        serve_check(trained_heads["dflash"], prompts(1), settings=check_settings(k=K - 1))


def test_a_missing_venv_is_named_with_the_command_that_makes_it(tmp_path):
    reason = vllm_available(tmp_path / "nowhere")
    assert reason and "scripts/make_vllm_venv.sh" in reason and str(Path(tmp_path / "nowhere")) in reason


@pytest.mark.vllm
def test_bench_has_vllm_rows_in_its_tables_and_checks_their_tokens(trained_heads, tmp_path):
    import json

    from conftest import compose
    from selfspec.bench import run_bench

    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in
            enumerate([("writing", "Write a poem about rain."), ("math", "What is 12 times 7?")])]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose("bench", [f"heads=[{trained_heads['medusa']}]", f"prompts={questions}", "max_new_tokens=16",
                            "curve_sizes=[1,4]", "curve_repeats=1", "methods=[hf,vllm,vllm_heads]", "draft.tree=chain-3",
                            f"out={tmp_path / 'bench'}"])
    report = run_bench(cfg, progress=False)
    vllm_heads = next(name for name in report["figures"] if name.startswith("vllm:medusa"))
    assert list(report["figures"]) == ["hf", "vllm", vllm_heads]
    assert report["mismatches"] == [] and report["lossless_checked"]
    for name in ("vllm", vllm_heads):
        overall = report["figures"][name]["overall"]
        assert overall["prompts"] == 2 and overall["tokens_per_s"] > 0 and overall["speedup_vs_hf"] > 0
    assert report["methods"][vllm_heads]["speculative_config"]["method"] == "medusa"
    assert "| vllm |" in (tmp_path / "bench" / "bench.md").read_text()


@pytest.mark.vllm
def test_selfspec_suffix_drafter_runs_inside_vllm_and_remembers_answers(tmp_path):
    """serve/vllm_suffix.py through vLLM's custom_class: lossless, and a prompt asked again drafts from the
    remembered answer, so far more of its drafts are accepted the second time. vLLM's own suffix proposer (Arctic
    Inference, built by scripts/make_vllm_venv.sh) runs beside it, lossless too."""
    from selfspec.core.vllm_env import selfspec_pythonpath
    from selfspec.serve.serving import run_vllm, served_target_dir

    vllm_or_skip()
    target = tiny_target()
    ask = prompts(3, seed=11)
    ids = ask + [ask[0]]  # the first prompt again, after two others
    job = {"model": str(served_target_dir(target)), "dtype": "float32", "max_model_len": 128, "max_new_tokens": 48,
           "prompts": ids, "stop_token_ids": [2], "pythonpath": [selfspec_pythonpath()],
           "runs": [{"name": "suffix", "speculative_config": {"method": "custom_class", "num_speculative_tokens": 6,
                                                              "model": "selfspec.serve.vllm_suffix.SuffixProposer"}},
                    {"name": "vllm_suffix", "speculative_config": {"method": "suffix", "num_speculative_tokens": 6}}]}
    result = run_vllm(job, log_path=tmp_path / "vllm.log")
    suffix, theirs = result["runs"]
    assert suffix["loaded"] and not suffix["error"], suffix["error"]
    assert theirs["loaded"] and not theirs["error"], theirs["error"]
    for s, t, prompt in zip(suffix["prompts"], theirs["prompts"], ids):
        with torch.no_grad():
            hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                       eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert s["tokens"] == t["tokens"] == hf
    assert theirs["prompts"][-1]["accepted"] > 0
    first, again = suffix["prompts"][0], suffix["prompts"][-1]
    assert again["accepted"] > first["accepted"] and again["accepted"] >= 0.5 * len(again["tokens"])


def test_serve_check_script_names_a_missing_setting_and_venv(tmp_path, monkeypatch):
    from conftest import compose
    from selfspec.core.errors import SettingError
    from selfspec.serve.cli import run_check

    with pytest.raises(SettingError, match="prompts is not set"):
        run_check(compose("serve_check", ["heads=somewhere"]))
    monkeypatch.setenv("SELFSPEC_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(ServingError, match="make_vllm_venv.sh"):  # before any model is loaded
        run_check(compose("serve_check", ["heads=somewhere", "prompts=humaneval"]))


def test_each_vllm_run_gets_a_process_of_its_own_with_the_engine_inside(tmp_path, monkeypatch):
    """run_vllm starts one worker per run (vLLM 0.32 does not start a second kind of engine reliably in one process)
    and gives it VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in that process: faster at batch 1 on a small CPU)
    unless the caller's environment sets it; VLLM_PLUGINS stays empty regardless. The runs come back in order."""
    import json
    import subprocess

    from selfspec.serve import serving

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    seen = []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        job = json.loads(Path(cmd[-2]).read_text())
        seen.append((env, [r["name"] for r in job["runs"]]))
        stdout.write(f"log of {job['runs'][0]['name']}\n")
        Path(cmd[-1]).write_text(json.dumps({"vllm_version": "x", "runs": [{"name": r["name"], "loaded": True}
                                                                           for r in job["runs"]]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(serving.subprocess, "run", fake_run)
    job = {"runs": [{"name": "plain", "speculative_config": None}, {"name": "ngram", "speculative_config": {}}]}
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv("VLLM_PLUGINS", "someplugin")
    result = run_vllm(job, venv, log_path=tmp_path / "vllm.log")
    assert [r["name"] for r in result["runs"]] == ["plain", "ngram"]
    assert [names for _, names in seen] == [["plain"], ["ngram"]]
    assert (tmp_path / "vllm.log").read_text() == "log of plain\nlog of ngram\n"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    run_vllm({"runs": job["runs"][:1]}, venv)
    assert [env["VLLM_ENABLE_V1_MULTIPROCESSING"] for env, _ in seen] == ["0", "0", "1"]
    assert all(env["VLLM_PLUGINS"] == "" for env, _ in seen)


def test_serve_checks_runs_every_engine_in_one_process_and_a_shared_plain_run_once(monkeypatch):
    """Two checks on one target and one on another: vLLM gets one job for one worker process, with each target's plain
    run once; each check gets back its own runs under its own names, and a check whose target vLLM cannot decode gets
    the error serve_check would raise."""
    from selfspec.serve import serving
    from selfspec.serve.serving import CheckPlan, serve_checks

    def plan(model: str, formats: list[str]) -> CheckPlan:
        job = {"model": model, "dtype": "float32", "max_model_len": 40, "max_new_tokens": 8, "prompts": [[5, 6]],
               "stop_token_ids": [2], "warmup": [], "engine": {},
               "runs": [{"name": "plain", "speculative_config": None}]
               + [{"name": f, "speculative_config": {"method": f}} for f in formats]}
        return CheckPlan(heads=Path(model), head_type="x", settings=None, formats=formats, exports={}, vocab=None,
                         chain=None, plain=None, eos={2}, job=job, out_root=Path(model))

    jobs = []

    def fake_run_vllm(job, venv, timeout, log_path, one_process):
        jobs.append((job, one_process))
        return {"vllm_version": "x", "runs": [{"name": r["name"], "loaded": True, "model": r["model"],
                                                "error": "broken" if r["model"] == "b" else None}
                                               for r in job["runs"]]}

    shared = []

    def fake_finish_check(plan, vllm, plain_runs):
        shared.append(plain_runs)
        if any(r["error"] for r in vllm["runs"]):
            raise ServingError("vLLM could not decode the target itself: broken")
        return vllm["runs"]

    monkeypatch.setattr(serving, "run_vllm", fake_run_vllm)
    monkeypatch.setattr(serving, "finish_check", fake_finish_check)
    first, second, third = serve_checks([plan("a", ["medusa"]), plan("a", ["dflash"]), plan("b", ["dflash"])])
    [(job, one_process)] = jobs
    assert one_process
    assert [(r["name"], r["model"]) for r in job["runs"]] == [
        ("0/plain", "a"), ("0/medusa", "a"), ("1/dflash", "a"), ("2/plain", "b"), ("2/dflash", "b")]
    assert [(r["name"], r["model"]) for r in first] == [("plain", "a"), ("medusa", "a")]
    assert [(r["name"], r["model"]) for r in second] == [("plain", "a"), ("dflash", "a")]
    assert isinstance(third, ServingError) and str(third).endswith("broken")
    assert len(shared) == 3 and shared[0] is shared[1] is shared[2]  # one store of plain answers for all the checks
