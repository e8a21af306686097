"""One vLLM ``LLM`` kept open, answering batches of requests read from standard input (core/vllm_env.py's
:class:`VllmSession` runs it).

This file runs inside vLLM's virtualenv, not selfspec's: vLLM pins its own torch and transformers. It imports nothing
of selfspec, only vLLM and the standard library:

    <vllm-venv>/bin/python -P core/vllm_worker.py job.json

The job (JSON): ``engine``, the ``LLM(...)`` keywords, and ``cpu_defaults``, keywords added where the engine leaves
them out on vLLM's CPU build. Then, per line of standard input, ``{"requests": [...]}``, each request
``{"prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "stop_token_ids"}``: all of them go to one
``LLM.generate`` call (vLLM batches them continuously). On an engine that captures hidden states (its
``kv_transfer_config`` names a hidden-states connector), a request's ``hidden_states_path`` is where they go; the
answer comes once every such file is written. Every answer is one line of standard output: first
``{"vllm_version", "init_s"}`` once the engine is up, then per batch ``{"tokens": [[...], ...], "seconds"}``, or
``{"error", "traceback"}``. vLLM's own output goes to standard error. The worker ends when its input ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main(job_path: str) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # our answers; everything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    with open(job_path) as f:
        job = json.load(f)
    t0 = time.perf_counter()
    try:
        # in the try, in vLLM's venv: an engine that cannot even import is reported as the job's error
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        engine = dict(job["engine"])
        if current_platform.is_cpu():
            engine = {**job.get("cpu_defaults", {}), **engine}
        llm = LLM(**engine)
    except Exception as err:  # noqa: BLE001 - the caller reports why the engine did not start
        reply({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)})
        return
    reply({"vllm_version": vllm.__version__, "init_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            requests = json.loads(line)["requests"]
            prompts = [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in requests]
            params = [SamplingParams(temperature=float(r["temperature"]), top_p=float(r["top_p"]), seed=r.get("seed"),
                                     max_tokens=int(r["max_tokens"]), stop_token_ids=list(r["stop_token_ids"]),
                                     detokenize=False, extra_args=(
                                         {"kv_transfer_params": {"hidden_states_path": r["hidden_states_path"]}}
                                         if r.get("hidden_states_path") else None)) for r in requests]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wait_for_files(llm, [r["hidden_states_path"] for r in requests if r.get("hidden_states_path")])
            reply({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": time.perf_counter() - t})
        except Exception as err:  # noqa: BLE001
            reply({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)})


def wait_for_files(llm, paths: list[str], max_steps: int = 100) -> None:
    """Step the engine until every file in ``paths`` exists: a hidden-states connector writes a finished request's
    states in the engine step after the one that finished it, which ``LLM.generate`` does not wait for."""
    for _ in range(max_steps):
        if all(os.path.exists(p) for p in paths):
            return
        llm.llm_engine.step()
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"vLLM wrote no hidden states for {len(missing)} of {len(paths)} requests "
                           f"(first: {missing[0]}) after {max_steps} engine steps")


if __name__ == "__main__":  # vLLM starts worker processes: everything runs under this guard
    main(sys.argv[1])
