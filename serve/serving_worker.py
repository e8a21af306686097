"""Decode prompts in vLLM and report tokens, timings and vLLM's own speculative-decoding counters.

This file runs inside vLLM's virtualenv (``serving.vllm_venv``), not selfspec's: vLLM pins its own torch and
transformers. It imports nothing of selfspec, only vLLM and the standard library; ``serve/serving.py`` writes its job
and reads its answer:

    <vllm-venv>/bin/python serve/serving_worker.py job.json result.json

The job (JSON): ``model`` (a target folder), ``dtype``, ``max_model_len``, ``max_new_tokens``, ``prompts`` (lists of
token ids: both engines decode the very same ids, so no tokenizer or chat template can differ), ``stop_token_ids``,
``warmup`` (prompts decoded first and not reported), ``engine`` (extra ``LLM(...)`` arguments) and ``runs``: each
``{"name", "speculative_config"}`` (``null``: plain decoding), with ``model`` where the run serves another folder
(a speculators export names its verifier itself); a run may set any of the job's other keys for itself too (its
``engine`` arguments are added to the job's), and ``rpc``: a method of its ``worker_extension_cls`` whose answer (the
first worker's) is reported as ``rpc_result`` after the prompts; ``ignore_eos``: every answer ``max_new_tokens`` long;
``profile``: torch.profiler over the prompts, each op's self CPU time reported as ``profile`` (the engine must run in
this process: VLLM_ENABLE_V1_MULTIPROCESSING=0, the default of serve/serving.py). Every run gets its own ``LLM``; a
run whose model does not load is reported with the error and the others still run.

The result (JSON), per run: ``loaded``, ``error``, ``init_s`` and per prompt ``tokens``, ``seconds`` and the
difference of vLLM's counters over that prompt: ``drafts``, ``draft_tokens``, ``accepted`` and
``accepted_per_pos`` (how many drafts had their token at position i accepted).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (summed over engines)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POS:
            values = [int(v) for v in metric.values]
            pos = out["accepted_per_pos"]
            pos.extend([0] * (len(values) - len(pos)))
            for i, v in enumerate(values):
                pos[i] += v
    return out


def difference(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}, "accepted_per_pos": per_pos}


def run_one(job: dict, run: dict) -> dict:
    # deferred: vLLM is only in its own venv, where this runs
    from vllm import LLM, SamplingParams

    spec = {**job, **run, "engine": {**job.get("engine", {}), **run.get("engine", {})}}  # the run's own settings win
    result = {"name": run["name"], "loaded": False, "error": None, "prompts": []}
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=int(spec["max_model_len"]),
            speculative_config=run.get("speculative_config"), disable_log_stats=False, seed=0, **spec["engine"],
        )
    except Exception as err:  # noqa: BLE001 - the caller reports why a model did not load
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=8)
        cleanup()
        return result
    result["loaded"] = True
    result["init_s"] = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_new_tokens"]),
                            stop_token_ids=list(spec.get("stop_token_ids") or []), detokenize=False,
                            ignore_eos=bool(spec.get("ignore_eos", False)))
    try:
        for ids in spec.get("warmup") or []:
            llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
        with profiler() if spec.get("profile") else contextlib.nullcontext() as prof:
            for ids in spec["prompts"]:
                before = spec_counters(llm)
                t = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
                seconds = time.perf_counter() - t
                counts = difference(spec_counters(llm), before)
                result["prompts"].append({"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds, **counts})
        if prof is not None:
            result["profile"] = [{"name": e.key, "self_us": e.self_cpu_time_total, "count": e.count}
                                 for e in prof.key_averages()]
        if run.get("rpc"):  # a method of the run's worker_extension_cls, called on every worker after the prompts
            result["rpc_result"] = llm.collective_rpc(run["rpc"])[0]
    except Exception as err:  # noqa: BLE001
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=8)
    finally:
        del llm
        cleanup()
    return result


def profiler():
    """torch.profiler of this process's CPU ops (a run's ``profile``: the engine runs in this process)."""
    import torch  # vLLM's own torch, imported where a run asks for it

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def cleanup() -> None:
    """Tear down what an engine left in this process (its distributed groups), so that the next run's engine starts
    as in a fresh process: without it a MoE model's engine after another model's finds the groups made without its
    expert-parallel one (``AssertionError: expert parallel group is not initialized``)."""
    # deferred: vLLM is only in its own venv, where this runs
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    results = {"vllm_version": None, "runs": []}
    # deferred: vLLM is only in its own venv, where this runs
    import vllm

    results["vllm_version"] = vllm.__version__
    for run in job["runs"]:
        print(f"[serving_worker] {run['name']}", file=sys.stderr, flush=True)
        results["runs"].append(run_one(job, run))
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:  # after every run: a killed worker still leaves what it measured
            json.dump(results, f)
        os.replace(tmp, result_path)


if __name__ == "__main__":  # vLLM starts worker processes: everything runs under this guard
    main(sys.argv[1], sys.argv[2])
