"""Check trained heads in real vLLM: export them in every format vLLM serves, decode the same prompts greedily in vLLM
(plain, and with each export) and in selfspec's engine, and compare.

    bash scripts/make_vllm_venv.sh      # once: vLLM's CPU build in its own venv (.venv-vllm)
    python scripts/serve_check.py heads=outputs/medusa-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl
    python scripts/serve_check.py heads=outputs/eagle3-smollm2/heads prompts=humaneval limit=4 k=2 max_new_tokens=64
    python scripts/serve_check.py heads=outputs/dflash-smollm2/heads prompts=humaneval limit=4   # k: its block less one
    selfspec-serve-check heads=outputs/medusa-smollm2/heads prompts=humaneval limit=4   # the installed command

It prints, per format and prompt: that the export loaded; that vLLM's tokens equal vLLM's plain decoding and HF
``generate`` (a mismatch is printed and the exit status is 1); vLLM's acceptance counters per draft position beside
selfspec's for the same heads proposing the same chain (adaptive depth and the suffix drafter off); tokens/s in both
engines and the speedup the heads give inside vLLM. ``out`` gets the exports, vLLM's log, report.json and report.md.
How it works: serve/serving.py. Exit status 1 also when a format does not load or acceptance differs by more than
``tolerance``.
"""

from selfspec.serve.cli import serve_check_main

if __name__ == "__main__":
    serve_check_main()
