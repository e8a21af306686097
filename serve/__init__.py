"""vLLM: the serve check of exported heads in real vLLM beside selfspec's engine (serving.py, with serving_worker.py
in vLLM's own venv), selfspec's proposers inside vLLM (vllm_suffix.py, vllm_hybrid.py) and the commands selfspec-export
and selfspec-serve-check (cli.py). It imports ``core``, ``cpu_kernels``, ``heads`` and ``decode``."""
