"""Set decoding up from a ``conf/decode.yaml`` config and run it over prompts: the library behind ``decode/run.py``
and ``scripts/bench.py``. Batch size 1.

- :func:`load_session`: the target (from ``model=`` or from the heads' own record), the heads (a trained folder, or
  ``random``: untrained heads), the drafter (its entry in decode/registry.py), the engine, the sampling.
- :func:`answer_question`: every turn of an MT-bench style question, carrying the conversation between turns.
- :func:`hf_generate`: Hugging Face ``generate`` on the same prompt ids, for a speedup measured in the same run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

import torch

from decode import registry
from decode.adaptive import AdaptiveDepth, measured_cost_curve
from decode.engine import DecodeResult, SpeculativeDecoder
from decode.kernels import KERNELS, use_small_batch
from decode.registry import DrafterEntry
from decode.step import synchronize
from decode.types import DecodeSetupError, Drafter
from decode.verify import Sampling
from core.config import MISSING, cfg_get, to_dict, to_plain
from core.target import SMOLLM2_ID, Target, load_target

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "conf" / "model"
DECODE_CONFIG = MODEL_CONFIGS.parent / "decode" / "decode.yaml"


# --- setup ----------------------------------------------------------------------------------------------------------


def target_config_from_heads(heads_config: dict) -> dict:
    """A model config for the target a heads folder records (``model`` if the trainer saved it, else
    ``base_model`` + fingerprint): the embedded SmolLM2, a tiny model, or a hub id / local folder."""
    if isinstance(heads_config.get("model"), dict):
        return dict(heads_config["model"])
    name = heads_config.get("base_model")
    if not name:
        raise DecodeSetupError("The heads' config.json names no base_model: pass the target with model=NAME.")
    if name == SMOLLM2_ID:
        return {"source": "smollm2"}
    if str(name).startswith("tiny-"):
        fp = heads_config.get("target_fingerprint", {})
        tiny = {"arch": str(name)[5:]}
        tiny.update({k: fp[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k in fp})
        return {"source": "tiny", "dtype": "float32", "device": "cpu", "tiny": tiny}
    return {"source": "hub", "name_or_path": name}


def model_config(model: Any) -> dict:
    """``model=``: a config dict, a name in conf/model/ (smollm2, tiny, ...), or a hub id / local folder."""
    if not isinstance(model, str):
        return to_dict(model)
    named = MODEL_CONFIGS / f"{model}.yaml"
    if "/" not in model and named.is_file():
        from omegaconf import OmegaConf

        return to_dict(OmegaConf.load(named))
    return {"source": "hub", "name_or_path": model}


def resolve_target_config(cfg: Any, heads_config: dict | None) -> dict:
    """``model=`` wins; else the heads' target; else (random heads, vanilla) the embedded SmolLM2."""
    model = to_plain(cfg_get(cfg, "model"))
    if model is not None:
        model_cfg = model_config(model)
    else:
        model_cfg = target_config_from_heads(heads_config) if heads_config else {"source": "smollm2"}
    for key in ("device", "dtype"):
        if cfg_get(cfg, key) is not None:
            model_cfg[key] = cfg_get(cfg, key)
    return model_cfg


def target_config_from_overrides(overrides: list[str]) -> dict:
    """The target conf/decode/decode.yaml names under command-line ``overrides`` (its ``model``, ``device``,
    ``dtype``): for scripts that need a target and no drafter (scripts/kernel_plan.py, scripts/engine_ceiling.py)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(MODEL_CONFIGS.parent / "decode"), version_base="1.3"):
        cfg = compose(config_name="decode", overrides=list(overrides))
    return resolve_target_config(cfg, None)


@dataclass
class Session:
    target: Target  # the model to decode with (a Medusa-2 adapter already merged in)
    decoder: SpeculativeDecoder
    sampling: Sampling
    drafter: str = "vanilla"  # the registry entry the drafter came from
    draft_settings: dict = field(default_factory=dict)  # its settings (defaults < saved with the heads < draft.*)
    heads: torch.nn.Module | None = None
    heads_config: dict | None = None
    settings: dict = field(default_factory=dict)  # max_new_tokens, stop, seed, chat, system_prompt

    def engine_for(self, drafter: Drafter) -> SpeculativeDecoder:
        """An engine for ``drafter`` on this session's target, with its decoder's EOS ids, text decoding and linear
        kernels (and no depth policy)."""
        return SpeculativeDecoder(self.target.model, drafter, eos_token_ids=self.decoder.eos_token_ids,
                                  decode=self.decoder.decode, linear_kernel=self.decoder.linear_kernel)


def choose_drafter(name: str | None, heads: str | None, heads_config: dict | None) -> DrafterEntry:
    """The registry entry for ``drafter=`` and ``heads=``: by default the family the heads were trained as."""
    if name is None:
        name = heads_config["head_type"] if heads_config else ("medusa" if heads == "random" else "vanilla")
    chosen = registry.entry(str(name))
    if heads_config and chosen.takes_heads and chosen.name != heads_config["head_type"]:
        raise DecodeSetupError(
            f"{heads} holds {heads_config['head_type']!r} heads; drafter={chosen.name} drafts with {chosen.name} "
            f"heads. Leave drafter unset to use the heads' own drafter."
        )
    if chosen.needs_heads and heads is None:
        raise DecodeSetupError(f"The {chosen.name} drafter needs heads: give heads=FOLDER (or heads=random).")
    return chosen


def load_drafter_heads(chosen: DrafterEntry, heads: str | None, heads_config: dict | None, target: Target,
                       random_options: dict) -> tuple[Target, torch.nn.Module | None]:
    """The heads module the drafter runs (loaded and checked against the target, or random), and the target to
    decode with (a Medusa-2 adapter merged in)."""
    if not chosen.takes_heads or (heads_config is None and not chosen.needs_heads):
        return target, None
    if heads_config is None:
        return target, chosen.random_heads(target.model, **random_options)
    from heads.io import load_heads

    loaded = load_heads(heads, target=target)  # refuses heads trained for another target
    return Target(model=loaded.target, tokenizer=target.tokenizer, name=target.name), loaded.module


def depth_policy(model: torch.nn.Module, linear_kernel: str, full_depth: int | None = None,
                 verify_share: float = 1.0, drafter: Drafter | None = None) -> AdaptiveDepth:
    """Adaptive draft depth under this machine's verify cost curve, measured with the kernels the engine will run;
    ``full_depth``: the deepest draft the drafter proposes (None: the first step shows it); ``verify_share``: the
    share of a forward its verify pass runs (a layer-skip drafter's ``verify_share``; 1 for the others);
    ``drafter``: the drafter whose ``draft_nodes`` give each depth's tree size from the first step (a static tree's
    first levels can cost several forwards: guessed as a chain, they were drafted whole at the start)."""
    device = next(model.parameters()).device
    curve = measured_cost_curve(model, "small_batch" if use_small_batch(linear_kernel, device) else "torch")
    nodes = {}
    if drafter is not None and full_depth is not None:
        nodes = {d: n for d in range(1, full_depth + 1) if (n := drafter.draft_nodes(d)) is not None}
    return AdaptiveDepth(curve, full_depth=full_depth, verify_share=verify_share, nodes=nodes)


def build_decoder(target: Target, drafter: Drafter, settings: dict, kernel: str,
                  eos_token_ids: list[int] | None = None) -> SpeculativeDecoder:
    """The engine for ``drafter`` under its settings (a family without a setting has it off): adaptive depth if
    ``adaptive``; with ``suffix``, the drafter and the suffix drafter merged into one tree per step
    (decode/hybrid.py:build_hybrid), the engine's depth policy then applied to the drafter's part."""
    policy = (depth_policy(target.model, kernel, drafter.max_draft_depth, drafter.verify_share, drafter)
              if settings.get("adaptive") else None)
    if settings.get("suffix"):
        from decode.hybrid import build_hybrid

        drafter = build_hybrid(target, drafter, settings)
    return SpeculativeDecoder(target.model, drafter, eos_token_ids=eos_token_ids, decode=target.tokenizer.decode,
                              linear_kernel=kernel, depth_policy=policy)


def decode_config(overrides: dict | None = None) -> Any:
    """conf/decode/decode.yaml with ``overrides`` merged in: a whole decode config for code that sets a few keys."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.load(DECODE_CONFIG), overrides or {})


SESSION_KEYS = ("heads", "drafter", "draft", "random_heads", "model", "device", "dtype", "acceptance", "temperature",
                "top_k", "top_p", "linear_kernel", "max_new_tokens", "stop", "seed", "chat", "system_prompt")


def required(cfg: Any, keys: Sequence[str]) -> dict:
    """``cfg``'s values of ``keys``. Decode defaults live in conf/decode/ only (decode.yaml; bench.yaml for the
    benchmark), so a key the config lacks is an error that names it, never a default written here."""
    missing = [k for k in keys if cfg is None or k not in cfg or cfg_get(cfg, k, MISSING) == MISSING]
    if missing:
        raise DecodeSetupError(f"Missing decode setting(s) {missing}: compose the config from conf/decode/ "
                               "(decode.yaml, or bench.yaml for the benchmark; decode.pipeline.decode_config() in "
                               "code) rather than writing one of its own.")
    return {k: to_plain(cfg_get(cfg, k)) for k in keys}


def load_session(cfg: Any) -> Session:
    """Everything decode/run.py needs, from a composed ``conf/decode/decode.yaml``."""
    c = required(cfg, SESSION_KEYS)
    heads = None if c["heads"] in (None, "none", "null") else str(c["heads"])
    heads_config = None
    if heads not in (None, "random"):
        from heads.io import read_heads_config

        heads_config = read_heads_config(heads)
    chosen = choose_drafter(c["drafter"], heads, heads_config)
    draft_settings = chosen.settings(heads_config, to_dict(c["draft"]))
    target = load_target(resolve_target_config(cfg, heads_config))
    target, module = load_drafter_heads(chosen, heads, heads_config, target, to_dict(c["random_heads"]))
    drafter = chosen.build(module, target, draft_settings)
    sampling = Sampling(acceptance=str(c["acceptance"]), temperature=float(c["temperature"]), top_k=int(c["top_k"]),
                        top_p=float(c["top_p"]))
    kernel = str(c["linear_kernel"])
    if kernel not in KERNELS:
        raise DecodeSetupError(f"linear_kernel={kernel!r}: use one of {', '.join(KERNELS)}.")
    decoder = build_decoder(target, drafter, draft_settings, kernel)
    settings = {"max_new_tokens": int(c["max_new_tokens"]), "stop": [str(s) for s in (c["stop"] or [])],
                "seed": int(c["seed"]), "chat": bool(c["chat"]), "system_prompt": c["system_prompt"]}
    return Session(target=target, decoder=decoder, sampling=sampling, drafter=chosen.name,
                   draft_settings=draft_settings, heads=module, heads_config=heads_config, settings=settings)


# --- prompts --------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, messages: list[dict], chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of a conversation ending with a user turn (chat template + generation prompt), or of the raw text
    of its last message when ``chat`` is off."""
    if any(not str(m.get("content", "")).strip() for m in messages if m["role"] == "user"):
        raise DecodeSetupError("The prompt is empty: give some text (prompt=\"...\").")
    if not chat:
        return tokenizer(messages[-1]["content"], add_special_tokens=True)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise DecodeSetupError("The tokenizer has no chat template: pass chat=false to decode raw text.")
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + messages
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def read_questions(path: str | Path, max_questions: int | None = None) -> list[dict]:
    """MT-bench style jsonl: {"question_id", "category", "turns": [str, ...]} per line."""
    path = Path(path)
    if not path.is_file():
        raise DecodeSetupError(f"prompts={path}: no such file. Give a jsonl of MT-bench form.")
    questions = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as err:
                raise DecodeSetupError(f"{path}:{n} is not valid JSON: {err}") from err
            if not isinstance(q.get("turns"), list) or not q["turns"]:
                raise DecodeSetupError(
                    f"{path}:{n} has no \"turns\" list (MT-bench form: question_id, category, turns)."
                )
            questions.append(q)
            if max_questions is not None and len(questions) >= max_questions:
                break
    return questions


class TokenStream:
    """Prints text as tokens arrive (decoding the whole answer so multi-token characters come out whole)."""

    def __init__(self, tokenizer, out: TextIO | None = None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


# --- runs -----------------------------------------------------------------------------------------------------------


def decode_prompt(
    session: Session, ids: list[int], on_tokens: Callable[[list[int]], None] | None = None
) -> DecodeResult:
    s = session.settings
    return session.decoder.generate(ids, max_new_tokens=s["max_new_tokens"], sampling=session.sampling, stop=s["stop"],
                                    seed=s["seed"], on_tokens=on_tokens, timings=True)


def hf_generate(session: Session, ids: list[int]) -> tuple[list[int], float]:
    """Hugging Face ``generate`` with the same settings on the same ids: (new tokens, seconds)."""
    model, tokenizer, s, sampling = session.target.model, session.target.tokenizer, session.settings, session.sampling
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {
        "max_new_tokens": s["max_new_tokens"],
        "eos_token_id": sorted(session.decoder.eos_token_ids) or None,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if sampling.acceptance == "greedy":
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if s["stop"]:
        kwargs.update(stop_strings=s["stop"], tokenizer=tokenizer)
    torch.manual_seed(s["seed"])
    input_ids = torch.tensor([ids], device=device)
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    synchronize(device)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def warm_up(session: Session, baseline: bool) -> None:
    """One short run of each path, so one-time costs (kernels, allocator) stay out of the timings."""
    ids = prompt_ids(session.target.tokenizer, [{"role": "user", "content": "Hi"}], session.settings["chat"])
    session.decoder.generate(ids, max_new_tokens=4, sampling=session.sampling)
    if baseline:
        saved = dict(session.settings)
        session.settings.update(max_new_tokens=4, stop=[])
        hf_generate(session, ids)
        session.settings.update(saved)


def answer_question(session: Session, question: dict, baseline: bool = False, out: TextIO | None = None) -> dict:
    """Answer every turn of a question, each turn seeing the earlier turns and answers; returns a jsonl record."""
    tokenizer, s = session.target.tokenizer, session.settings
    messages: list[dict] = []
    answers, turns = [], []
    for turn in question["turns"]:
        messages.append({"role": "user", "content": turn})
        ids = prompt_ids(tokenizer, messages, s["chat"], s["system_prompt"])
        stream = TokenStream(tokenizer, out) if out is not None else None
        result = decode_prompt(session, ids, stream)
        if out is not None:
            out.write("\n")
        answer = tokenizer.decode(result.tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        stats = result.stats.to_dict()
        stats["finish_reason"] = result.finish_reason
        if baseline:
            hf_tokens, hf_s = hf_generate(session, ids)
            stats["hf"] = {"new_tokens": len(hf_tokens), "total_s": hf_s,
                           "tokens_per_s": len(hf_tokens) / hf_s if hf_s > 0 else 0.0,
                           "same_tokens": hf_tokens == result.tokens}
        turns.append(stats)
    return {"question_id": question.get("question_id"), "category": question.get("category"),
            "answers": answers, "turns": turns}


def summarize(turn_stats: list[dict]) -> dict:
    """Totals over turns: tau over all steps, tokens/s over all time, the drafting/verifying split, HF speedup."""
    steps = sum(t["steps"] for t in turn_stats)
    step_tokens = sum(t["new_tokens"] - 1 for t in turn_stats)  # the prefill's token is not a step's
    total_s = sum(t["total_s"] for t in turn_stats)
    new = sum(t["new_tokens"] for t in turn_stats)
    out = {
        "turns": len(turn_stats), "new_tokens": new, "steps": steps, "tau": step_tokens / steps if steps else 0.0,
        "tokens_per_s": new / total_s if total_s else 0.0, "total_s": total_s,
        "prefill_s": sum(t["prefill_s"] for t in turn_stats), "draft_s": sum(t["draft_s"] for t in turn_stats),
        "verify_s": sum(t["verify_s"] for t in turn_stats),
    }
    hf = [t["hf"] for t in turn_stats if "hf" in t]
    if hf:
        hf_s = sum(h["total_s"] for h in hf)
        out["hf_tokens_per_s"] = sum(h["new_tokens"] for h in hf) / hf_s if hf_s else 0.0
        out["speedup_vs_hf"] = out["tokens_per_s"] / out["hf_tokens_per_s"] if out["hf_tokens_per_s"] else 0.0
        out["same_tokens_as_hf"] = sum(h["same_tokens"] for h in hf)
    return out


def format_summary(summary: dict) -> str:
    timed = summary["prefill_s"] + summary["draft_s"] + summary["verify_s"]
    share = (lambda x: 100 * x / timed) if timed else (lambda x: 0.0)
    lines = [
        f"steps {summary['steps']}  tau {summary['tau']:.2f} tokens/step  {summary['new_tokens']} tokens  "
        f"{summary['tokens_per_s']:.1f} tokens/s",
        f"time: prefill {summary['prefill_s']:.2f}s ({share(summary['prefill_s']):.0f}%)  drafting "
        f"{summary['draft_s']:.2f}s ({share(summary['draft_s']):.0f}%)  verifying {summary['verify_s']:.2f}s "
        f"({share(summary['verify_s']):.0f}%)",
    ]
    if "hf_tokens_per_s" in summary:
        lines.append(
            f"HF generate {summary['hf_tokens_per_s']:.1f} tokens/s -> speedup {summary['speedup_vs_hf']:.2f}x; "
            f"same tokens as HF in {summary['same_tokens_as_hf']}/{summary['turns']} turns"
        )
    return "\n".join(lines)


def run(cfg: Any, out: TextIO | None = None) -> dict:
    """decode/run.py's body: one streamed prompt, or every question of a prompts file written to ``out=``.
    Returns the summary (tau, tokens/s, time split, HF speedup with baseline=hf)."""
    out = out or sys.stdout
    prompt, prompts = cfg_get(cfg, "prompt"), cfg_get(cfg, "prompts")
    if (prompt is None) == (prompts is None):
        raise DecodeSetupError('Give one of prompt="..." (one prompt) or prompts=FILE.jsonl (MT-bench form).')
    baseline = cfg_get(cfg, "baseline")
    if baseline not in (None, "hf"):
        raise DecodeSetupError(f"baseline={baseline!r}: use baseline=hf (or leave it unset).")
    session = load_session(cfg)
    stream = bool(required(cfg, ["stream"])["stream"])
    if prompt is not None:
        if baseline:
            warm_up(session, baseline=True)
        record = answer_question(session, {"question_id": None, "turns": [str(prompt)]}, baseline == "hf",
                                 out if stream else None)
        if not stream:
            out.write(record["answers"][0] + "\n")
        summary = summarize(record["turns"])
        out.write(format_summary(summary) + "\n")
        return summary

    from omegaconf import OmegaConf

    questions = read_questions(prompts, cfg_get(cfg, "max_questions"))
    answers_path = Path(str(cfg_get(cfg, "out")))
    answers_path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(cfg, dict):
        OmegaConf.save(cfg, answers_path.parent / "config.yaml", resolve=True)
    warm_up(session, baseline == "hf")
    turn_stats = []
    with open(answers_path, "w") as f:
        for q in questions:
            out.write(f"\n=== question {q.get('question_id')} ({q.get('category')}) ===\n")
            record = answer_question(session, q, baseline == "hf", out if stream else None)
            record["summary"] = summarize(record["turns"])
            f.write(json.dumps(record) + "\n")
            f.flush()
            turn_stats.extend(record["turns"])
    summary = summarize(turn_stats)
    (answers_path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    out.write(f"\n{len(questions)} questions -> {answers_path}\n" + format_summary(summary) + "\n")
    return summary


# --- after training ---------------------------------------------------------------------------------------------------

SPEED_CHECK_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a Python function that checks whether a string is a palindrome, with a few tests.",
    "What are the main differences between a list and a tuple in Python?",
)


def after_training(cfg: Any, heads_dir: str | Path) -> None:
    """The end of a training entry (train/medusa.py, train/eagle.py): :func:`speed_check` as ``cfg.speed_check``
    says (``prompts: null``: nothing), on the main process only (the one that saved the heads)."""
    from accelerate import PartialState

    check = to_dict(cfg_get(cfg, "speed_check")) or {}
    if check.get("prompts") is not None and PartialState().is_main_process:
        speed_check(heads_dir, int(check["prompts"]), int(check.get("max_new_tokens", 64)))


def speed_check(heads_dir: str | Path, prompts: int = 3, max_new_tokens: int = 64, out: TextIO = sys.stderr) -> dict:
    """What a training run prints at its end: the command that decodes with its heads, and a quick speed check on a
    few short prompts (not from any benchmark): tokens/s of the heads' default decoder against plain decoding in the
    same engine, greedy, interleaved prompt by prompt after a warm-up. Returns {"heads", "plain", "ratio"}."""
    from omegaconf import OmegaConf

    command = f'python decode/run.py heads={heads_dir} prompt="Write a haiku about the sea."'
    print(f"[selfspec] decode with these heads:\n  {command}", file=out)
    if prompts <= 0:
        return {}
    session = load_session(decode_config({"heads": str(heads_dir), "max_new_tokens": int(max_new_tokens)}))
    plain = build_decoder(session.target, registry.entry("vanilla").build(None, session.target, {}), {},
                          session.decoder.linear_kernel, sorted(session.decoder.eos_token_ids))
    tokenizer = session.target.tokenizer
    ids = [prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in SPEED_CHECK_PROMPTS[:prompts]]
    for decoder in (session.decoder, plain):
        decoder.generate(ids[0], max_new_tokens=8)  # warm-up
    totals = {"heads": [0, 0.0], "plain": [0, 0.0]}
    for prompt in ids:
        for name, decoder in (("heads", session.decoder), ("plain", plain)):
            res = decoder.generate(prompt, max_new_tokens=max_new_tokens)
            totals[name][0] += res.stats.new_tokens
            totals[name][1] += res.stats.total_s
    rate = {k: n / s if s > 0 else 0.0 for k, (n, s) in totals.items()}
    result = {**rate, "ratio": rate["heads"] / rate["plain"] if rate["plain"] else 0.0}
    print(f"[selfspec] quick speed check ({len(ids)} prompts, {max_new_tokens} new tokens, greedy, "
          f"{session.drafter} with its defaults {session.draft_settings}): {rate['heads']:.1f} tokens/s against "
          f"{rate['plain']:.1f} for plain decoding: {result['ratio']:.2f}x. The benchmark: scripts/bench.py.",
          file=out)
    return result
