"""Learning while decoding (train/online.py): the recorded examples are the target's own forward, answers stay the
target's (greedy token for token, sampling in distribution) while the heads change between requests, the guard
rolls back an update that lowers held-out acceptance, a killed session resumes from its last save, and learning
over a repeated prompt raises the drafter's own acceptance beyond what chance gives."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import compose, load_script
from selfspec.decode.session import hf_generate, load_session
from selfspec.decode.types import DecodeSetupError
from selfspec.train.online import online_learner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23]]  # token ids of the tiny byte-level target
LEARN = ["learn=true", "learner.resume=false", "learner.mixed_precision=no", "learner.steps=8",
         "learner.learning_rate=3e-3", "learner.holdout_every=4", "learner.min_tokens=1", "learner.save_every=0"]


def learning_session(tmp_path, family: str, *extra: str, name: str = "learned"):
    """A session on the tiny Llama with untrained heads of ``family`` drafting alone at full depth, learning."""
    return load_session(compose("decode", ["model=tiny", "heads=random", f"drafter={family}", "draft.suffix=false",
                                           "draft.adaptive=false", "max_new_tokens=32",
                                           f"learner.dir={tmp_path / name}", *LEARN, *extra]), learner=online_learner)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["eagle3", "dflash", "medusa"])
def test_the_recorded_example_is_the_targets_own_forward(tmp_path, family):
    s = learning_session(tmp_path, family)
    recorder = s.learner.recorder()
    result = s.decoder.generate(PROMPTS[0], max_new_tokens=24, observer=recorder)
    example = recorder.example(result.tokens)
    ids = PROMPTS[0] + result.tokens[:-1]  # the last answer token was never fed to the target
    assert example["input_ids"].tolist() == ids
    assert example["labels"].tolist() == [-100] * len(PROMPTS[0]) + result.tokens[:-1]
    with torch.no_grad():
        model = s.target.model
        hs = [h.cpu() for h in model(torch.tensor([ids], device=model.device), output_hidden_states=True).hidden_states]
    config = s.target.model.config
    # float32 rounding of a tree-masked forward over a cache against one plain forward: a few ulps per dot product of
    # hidden_size terms, compounded over the layers (the bound of tests/test_feature_store_vllm.py)
    bound = 4 * torch.finfo(torch.float32).eps * math.sqrt(config.hidden_size) * (config.num_hidden_layers + 1)
    pairs = [(example["hidden"], hs[-1][0])]
    if s.learner.layers:
        pairs += [(example["aux"][:, j], hs[i][0]) for j, i in enumerate(s.learner.layers)]
    for got, ref in pairs:
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) <= bound * float(ref.abs().max())


@pytest.mark.parametrize("family", ["eagle3", "dflash", "medusa"])
def test_greedy_answers_stay_the_targets_while_the_heads_learn(tmp_path, family):
    s = learning_session(tmp_path, family)
    start = weights(s.heads)
    refs, late_accepted = {}, 0
    for i in range(10):
        ids = PROMPTS[i % len(PROMPTS)]
        result = s.generate(ids)
        if tuple(ids) not in refs:
            refs[tuple(ids)] = hf_generate(s, ids)[0]
        assert result.tokens == refs[tuple(ids)], f"request {i}"
        if i >= 6:
            late_accepted += result.stats.accepted
    assert s.learner.updates > 0 and not same_weights(start, weights(s.heads))  # the weights did change mid-stream
    assert late_accepted > 0  # and drafts of the changed weights were accepted


@pytest.mark.parametrize("every_tokens", [0, 1])
def test_sampled_tokens_follow_the_target_distribution_while_the_heads_learn(tmp_path, every_tokens):
    """The first three sampled tokens of the 12-token target over many seeds, the DFlash heads learning from every
    request (one step each, unguarded, so the weights change every request), follow the target's own distribution.
    With ``every_tokens=1`` the weights also change in the middle of an answer, after its first step, whenever that
    step did not end it."""
    from test_engine import SAMPLING, exact_first_three, small_vocab_target
    from test_verify import chi_square_pvalue

    from selfspec.core.target import Target
    from selfspec.decode.dflash_drafter import DFlashBlockDrafter, random_dflash_heads
    from selfspec.decode.engine import SpeculativeDecoder
    from selfspec.train.online import LearnSettings, OnlineLearner

    model = small_vocab_target()
    heads = random_dflash_heads(model, seed=0)
    settings = LearnSettings.from_dict({
        "dir": str(tmp_path / "learned"), "resume": False, "buffer_tokens": 256, "holdout_every": 1000, "steps": 1,
        "batch_size": 8, "learning_rate": 3e-3, "min_tokens": 1, "guard": False, "guard_z": 2.0, "save_every": 0,
        "every_tokens": every_tokens, "max_length": 64, "mixed_precision": "no", "seed": 0})
    learner = OnlineLearner(heads, "dflash", {}, Target(model=model, tokenizer=SimpleNamespace(pad_token_id=0), name="small"),
                            settings)
    decoder = SpeculativeDecoder(model, DFlashBlockDrafter(heads, top_k=1, dtype=torch.float32), eos_token_ids=[])
    prompt = torch.tensor([3, 5, 7, 1])
    v = model.config.vocab_size
    counts, accepted, seeds, during = torch.zeros(v ** 3), 0, 1000, 0
    for seed in range(seeds):
        recorder = learner.recorder()
        res = decoder.generate(prompt, max_new_tokens=3, sampling=SAMPLING, seed=seed, observer=recorder)
        during += len(learner.learn(recorder.example(res.tokens)).get("during", ()))
        a, b, c = res.tokens
        counts[(a * v + b) * v + c] += 1
        accepted += res.stats.accepted
    exact = exact_first_three(model, prompt).reshape(-1)
    assert learner.updates > seeds // 2  # the weights changed on most requests
    assert (during > seeds // 10) if every_tokens else during == 0  # ...and mid-answer with every_tokens
    assert accepted / seeds > 0.2  # drafts were accepted often enough for the test to mean something
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_the_guard_rolls_back_an_update_that_lowers_held_out_acceptance(tmp_path):
    s = learning_session(tmp_path, "eagle3")
    for _ in range(5):  # learn the repeated answer: held-out acceptance well above zero
        s.generate(PROMPTS[0])
    before = s.learner.held_out_acceptance()
    assert before > 0
    kept, module, rollbacks = weights(s.heads), weights(s.learner.module), s.learner.rollbacks
    for group in s.learner.optimizer.param_groups:
        group["lr"] = 10.0  # steps this large wreck the drafter
    report = s.generate(PROMPTS[0]) and s.last_learned
    assert report["rolled_back"] and report["after"] < report["before"] and s.learner.rollbacks == rollbacks + 1
    assert same_weights(kept, weights(s.heads))  # the session's heads never saw the wrecked weights
    assert same_weights(module, weights(s.learner.module))  # and training goes on from where it was
    assert s.learner.held_out_acceptance() == before

    unguarded = learning_session(tmp_path, "eagle3", "learner.guard=false", name="unguarded")
    for _ in range(5):
        unguarded.generate(PROMPTS[0])
    kept = weights(unguarded.heads)
    for group in unguarded.learner.optimizer.param_groups:
        group["lr"] = 10.0
    unguarded.generate(PROMPTS[0])
    assert not same_weights(kept, weights(unguarded.heads))  # without the guard the same update lands


def test_the_guard_keeps_a_fall_within_its_noise_and_rolls_back_one_beyond_it():
    """The guard's test: the per-request changes d = after - before of a held-out set, mean m and standard error
    se = sd / sqrt(n). It rolls back when m < -z se; z=0 rolls back any fall of the mean."""
    from selfspec.train.online import significantly_lower

    before = [0.5, 0.5, 0.5, 0.5]
    noisy = [0.7, 0.3, 0.6, 0.3]  # d = .2 -.2 .1 -.2: m = -0.025, sd = 0.206, se = 0.103
    assert not significantly_lower(before, noisy, 2.0)  # -0.025 > -0.206
    assert significantly_lower(before, noisy, 0.0)
    assert significantly_lower(before, noisy, 0.24) and not significantly_lower(before, noisy, 0.25)  # |m| / se = 0.243
    steady = [0.4, 0.41, 0.39, 0.4]  # d = -.1 -.09 -.11 -.1: m = -0.1, se = 0.0041: far beyond 2 se
    assert significantly_lower(before, steady, 2.0)
    assert significantly_lower([0.5], [0.49], 2.0)  # one example: any fall
    assert not significantly_lower(before, [0.5, 0.6, 0.5, 0.5], 0.0)  # a rise is never rolled back


def test_a_killed_session_resumes_where_its_last_save_left_off(tmp_path):
    every = ["learner.save_every=1"]
    whole = learning_session(tmp_path, "eagle3", *every, name="whole")
    for i in range(6):
        whole.generate(PROMPTS[i % 2])

    first = learning_session(tmp_path, "eagle3", *every, name="killed")
    for i in range(3):
        first.generate(PROMPTS[i % 2])
    saved = weights(first.heads)
    del first  # killed: no close

    again = learning_session(tmp_path, "eagle3", *every, "learner.resume=true", name="killed")
    assert same_weights(saved, weights(again.heads)) and again.learner.requests == 3
    for i in range(3, 6):
        again.generate(PROMPTS[i % 2])
    assert same_weights(weights(whole.heads), weights(again.heads))  # as if it had never stopped
    assert (whole.learner.updates, whole.learner.rollbacks) == (again.learner.updates, again.learner.rollbacks)


def test_the_learner_state_and_a_recorded_stream_load_with_weights_only(tmp_path):
    """What the learner saves (optimizer, buffers, RNG states, counters) and what the replay records (identity and
    examples) are tensors and plain containers: both load back with ``torch.load(weights_only=True)``, whole."""
    import selfspec.bench.learn_replay as replay
    from selfspec.train.online import STATE_FILE

    session = learning_session(tmp_path, "eagle3", "learner.save_every=1")
    for ids in PROMPTS[:2]:
        session.generate(ids)
    state = torch.load(session.learner.dir / STATE_FILE, weights_only=True)
    assert state["counters"]["requests"] == 2 and state["optimizer"]["state"] and state["buffer"]
    again = learning_session(tmp_path, "eagle3", "learner.resume=true")  # its _resume loads the same way
    assert again.learner.requests == 2 and same_weights(weights(session.heads), weights(again.heads))

    identity = replay.record_identity(session, "prompts.jsonl", 2)
    recorded = replay.record_stream(session, [{"turns": ["hello"]}, {"turns": ["the sea"]}], tmp_path / "s.pt",
                                    identity)
    loaded = replay.load_record(tmp_path / "s.pt", identity)
    assert len(loaded) == len(recorded) == 2
    for a, b in zip(recorded, loaded, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_save_cut_midway_leaves_the_last_one_whole(tmp_path, monkeypatch):
    s = learning_session(tmp_path, "eagle3")
    for i in range(3):
        s.generate(PROMPTS[i % 2])
    s.close()
    saved = (tmp_path / "learned" / "learner.pt").read_bytes()
    s.generate(PROMPTS[0])

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", cut)
    with pytest.raises(KeyboardInterrupt):
        s.close()
    assert (tmp_path / "learned" / "learner.pt").read_bytes() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learned"]  # no half-written folder left beside it


def test_learning_over_a_repeated_prompt_raises_the_drafters_own_acceptance(tmp_path):
    """Frozen, the untrained heads accept the same drafts on every repeat of the prompt (greedy, deterministic);
    learning, the last repeat accepts more than that, and more than drafts guessed uniformly from the draft
    vocabulary would reach with probability 1e-6 (a binomial tail bound: the threshold is derived, not tuned)."""
    frozen = load_session(compose("decode", ["model=tiny", "heads=random", "drafter=eagle3", "draft.suffix=false",
                                             "draft.adaptive=false", "max_new_tokens=32"]))
    learning = learning_session(tmp_path, "eagle3")
    for _ in range(8):
        base = frozen.generate(PROMPTS[0])
        last = learning.generate(PROMPTS[0])
    n, vd = last.stats.drafted, learning.heads.lm_head.out_features
    k = next(k for k in range(n + 1) if binomial_tail(n, 1 / vd, k) < 1e-6)
    assert last.stats.accepted > base.stats.accepted and last.stats.accepted >= k


def binomial_tail(n: int, p: float, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def test_learn_refuses_what_it_cannot_train(tmp_path):
    from selfspec.train.online import LearnSetupError

    with pytest.raises(LearnSetupError, match="learn=true trains dflash, eagle, eagle3, medusa heads"):
        load_session(compose("decode", ["model=tiny", "heads=null", "drafter=suffix", "learn=true",
                                         f"learner.dir={tmp_path / 'l'}"]), learner=online_learner)
    with pytest.raises(DecodeSetupError, match="learn=true trains the heads while decoding, which this command"):
        load_session(compose("decode", ["model=tiny", "heads=random", "drafter=eagle3", "learn=true",
                                         f"learner.dir={tmp_path / 'l'}"]))  # no learner handed: decode trains nothing
    with pytest.raises(Exception, match="learner.steps=-1 must be >= 0"):
        learning_session(tmp_path, "eagle3", "learner.steps=-1")


def tiny_stream(tmp_path, n: int):
    """Untrained EAGLE-3 heads of the tiny target saved to ``tmp_path/heads``, and a stream of ``n`` prompts (two
    alternating) in MT-bench form; returns the stream's file."""
    import json

    from selfspec.heads.io import save_heads

    seed_session = load_session(compose("decode", ["model=tiny", "heads=random", "drafter=eagle3"]))
    save_heads(tmp_path / "heads", seed_session.heads, "eagle3", seed_session.heads.config.to_dict(),
               seed_session.target)
    prompts = tmp_path / "stream.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "code", "turns": [f"def f{i % 2}(x):"]})
                               + "\n" for i in range(n)))
    return prompts


def test_the_stream_benchmark_checks_every_method_and_reports_each_window(tmp_path):
    main = load_script("stream_bench").main

    prompts = tiny_stream(tmp_path, 6)
    report = main([f"heads={tmp_path / 'heads'}", f"prompts={prompts}", "window=3", "max_new_tokens=16",
                   f"out={tmp_path / 'out'}", "learner.mixed_precision=no", "learner.min_tokens=1",
                   "learner.holdout_every=3", "learner.steps=2", "learner.save_every=0"])
    assert report["mismatches"] == [] and len(report["runs"]) == 6
    assert [(w["start"], w["end"]) for w in report["windows"]] == [(0, 3), (3, 6)]
    for name in ("suffix", "frozen", "learn", "learn_untrained"):
        assert all(r[name]["new_tokens"] == r["hf"]["new_tokens"] for r in report["runs"])
    for name in ("learn", "learn_untrained"):
        assert report["learned"][name]["requests"] == 6 and report["learned"][name]["updates"] > 0
        assert all("alone_tau" in r[name] for r in report["runs"])
        assert (tmp_path / "out" / ("learned" if name == "learn" else "learned-untrained") / "heads").is_dir()
    assert sum(r["learn"]["learn_seconds"] for r in report["runs"]) > 0
    assert "learn_vs_suffix_second_half" in report["aims"]
    assert all((tmp_path / "out" / f).is_file() for f in ("stream.json", "stream.md", "stream.png"))
    assert report["machine"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # not the model's repr


def test_a_private_request_leaves_nothing_and_the_adapted_heads_export(tmp_path):
    from selfspec.heads.export import export_heads
    from selfspec.heads.io import load_heads

    s = learning_session(tmp_path, "dflash")
    for i in range(4):
        s.generate(PROMPTS[i % 2])
    state = (s.learner.requests, s.learner.buffer.tokens, s.learner.holdout.tokens, weights(s.heads))
    s.generate(PROMPTS[2], learn=False)  # a request that must not be stored
    assert state[:3] == (s.learner.requests, s.learner.buffer.tokens, s.learner.holdout.tokens)
    assert same_weights(state[3], weights(s.heads))
    s.close()
    folder = tmp_path / "learned" / "heads"
    assert same_weights(weights(load_heads(folder, target=s.target).module), weights(s.heads))
    out, fmt = export_heads(folder, tmp_path / "export", s.target.model)  # vLLM's DFlash form, as for any heads
    assert fmt == "dflash" and (out / "model.safetensors").is_file()


def test_a_recorded_stream_replays_the_learner_without_decoding_again(tmp_path, monkeypatch):
    import selfspec.bench.learn_replay as replay
    main = load_script("learn_replay").main

    prompts = tiny_stream(tmp_path, 8)
    common = [f"heads={tmp_path / 'heads'}", f"prompts={prompts}", f"record={tmp_path / 'stream.pt'}", "window=4",
              "max_new_tokens=16", "learner.mixed_precision=no", "learner.min_tokens=1", "learner.holdout_every=4",
              "learner.steps=4", "learner.learning_rate=3e-3"]
    first = main(common + [f"out={tmp_path / 'a'}"])
    assert (tmp_path / "stream.pt").is_file() and first["requests"] == 8
    assert first["machine"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    rows = first["rows"]
    assert rows[0]["learning"] == rows[0]["frozen"]  # nothing learned before the first request
    assert first["summary"]["updates"] + first["summary"]["rollbacks"] > 0 and not (tmp_path / "a" / "unused").exists()
    assert [(w["start"], w["end"]) for w in first["windows"]] == [(0, 4), (4, 8)]

    def no_decoding(*args, **kwargs):
        raise AssertionError("the recorded stream was decoded again")

    monkeypatch.setattr(replay, "record_stream", no_decoding)
    again = main(common + [f"out={tmp_path / 'b'}"])  # from the recording: the same examples, the same learner
    assert [(r["frozen"], r["learning"], r["rolled_back"]) for r in again["rows"]] == \
        [(r["frozen"], r["learning"], r["rolled_back"]) for r in rows]
    def but(*changes):
        keys = {c.split("=")[0] for c in changes}
        return [c for c in common if c.split("=")[0] not in keys] + list(changes)

    other = main(but(f"out={tmp_path / 'c'}", "learner.steps=0"))  # never learns: the frozen heads' values
    assert [r["learning"] for r in other["rows"]] == [r["frozen"] for r in rows]
    with pytest.raises(DecodeSetupError, match="max_new_tokens"):
        main(but("max_new_tokens=8", f"out={tmp_path / 'd'}"))  # recorded with 16: refused, named
    # learning every 4 answer tokens replays the same record: each trained request also hands over its prefixes
    mid = main(but(f"out={tmp_path / 'e'}", "learner.every_tokens=4"))
    tried = [r["updates"] + r["rollbacks"] for r in rows]
    assert all(m["updates"] + m["rollbacks"] >= t for m, t in zip(mid["rows"], tried, strict=True))
    assert sum(m["updates"] + m["rollbacks"] for m in mid["rows"]) > sum(tried)


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_learning_every_n_tokens_updates_mid_answer_and_answers_stay_the_targets(tmp_path, family):
    """With ``every_tokens`` the heads take updates in the middle of an answer, on the buffer and the answer so far
    (an exact prefix of what the finished request buffers); greedy answers stay the target's, with drafts of the
    changed weights accepted; the time goes to ``stats.learn_s``."""
    from selfspec.train.online import prefixes

    s = learning_session(tmp_path, family, "learner.every_tokens=4", "learner.guard=false")
    handed = []
    learn_partial = s.learner.learn_partial

    def spy(example):
        report = learn_partial(example)
        if report is not None:
            handed.append(example)
        return report

    s.learner.learn_partial = spy
    refs, late_accepted, mid = {}, 0, 0
    for i in range(8):
        ids = PROMPTS[i % len(PROMPTS)]
        before = weights(s.heads)
        handed.clear()
        result = s.generate(ids)
        if tuple(ids) not in refs:
            refs[tuple(ids)] = hf_generate(s, ids)[0]
        assert result.tokens == refs[tuple(ids)], f"request {i}"
        during = s.last_learned.get("during", [])
        if i % 4 == 0:  # held out (holdout_every=4): never trained on, not even mid-answer
            assert handed == [] and during == []
            continue
        assert len(during) == len(handed) >= 1 and result.stats.learn_s > 0
        assert all(d["rolled_back"] is False for d in during)
        assert not same_weights(before, weights(s.heads))
        final = s.learner.buffer.examples[-1]  # the finished request, buffered whole
        for part in handed:  # each answer so far is the final example cut short, labels and all
            n = len(part["input_ids"])
            assert n < len(final["input_ids"])
            assert all(torch.equal(part[k], final[k][:n]) for k in final)
        mid += len(during)
        if i >= 4:
            late_accepted += result.stats.accepted
    assert mid >= 6 and late_accepted > 0
    # the replay hands over the same prefixes, each cut exactly at a multiple of every_tokens answer positions
    cuts = prefixes(final, 4)
    prompt = int((final["labels"] < 0).sum())
    assert [len(c["input_ids"]) - prompt for c in cuts] == list(range(4, len(final["input_ids"]) - prompt, 4))
    assert all(torch.equal(c["hidden"], final["hidden"][: len(c["hidden"])]) for c in cuts)


def test_untrained_heads_of_the_same_make_keep_shape_and_buffers_but_no_learned_weight(tmp_path):
    """The stream's untrained control: a loaded heads folder's weights replaced by those its family builds before
    training (the same as a fresh build under the seed), shapes and buffers (a draft vocabulary's map) kept."""
    from selfspec.heads.io import head_builder, load_heads, save_heads
    from selfspec.heads.io import reinitialize

    seed_session = load_session(compose("decode", ["model=tiny", "heads=random", "drafter=dflash"]))
    target = seed_session.target
    save_heads(tmp_path / "heads", seed_session.heads, "dflash", seed_session.heads.config.to_dict(), target)
    loaded = load_heads(tmp_path / "heads", target=target)
    heads, config = loaded.module, loaded.config
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.5)  # "trained"
    buffers = {k: v.clone() for k, v in heads.named_buffers()}
    trained = weights(heads)
    reinitialize(heads, config, target.model, seed=3)
    torch.manual_seed(3)
    fresh = head_builder("dflash")(config["head_config"], target.model)
    after = weights(heads)
    assert after.keys() == trained.keys() and all(after[k].shape == trained[k].shape for k in after)
    own = {n for n, _ in heads.named_parameters()}
    assert own and all(torch.equal(after[k], fresh.state_dict()[k].to(after[k].dtype)) for k in own)
    assert all(not torch.equal(after[k], trained[k]) for k in own)
    assert all(torch.equal(v, dict(heads.named_buffers())[k]) for k, v in buffers.items())


def test_decode_run_hands_the_session_its_learner(tmp_path, capsys):
    """decode/run.py is the command that asks for learn=true: it hands the session train/online.py's learner, which
    learns from the request and saves on close (decode itself builds none: refused above without one)."""
    from selfspec.decode.run import decode

    learned = tmp_path / "learned"
    decode(compose("decode", ["model=tiny", "heads=random", "drafter=eagle3", "draft.suffix=false", "prompt=abc",
                              "max_new_tokens=8", f"learner.dir={learned}", *LEARN]))
    assert (learned / "learner.pt").is_file()
    assert torch.load(learned / "learner.pt", weights_only=True)["counters"]["requests"] == 1
