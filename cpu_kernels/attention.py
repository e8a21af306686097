"""Grouped-query attention under a mask without copies of the keys and values, on a CPU.

The engine's forwards attend under a 4D mask: a tree verify's N > 1 queries, and a plain step's one query (a zero
mask, or a sliding window's cut). For a grouped-query target (SmolLM2: 9 query heads on 3 key/value heads)
transformers' ``sdpa`` attention then repeats each key/value head once per query head (``repeat_kv``): a copy of the
layer's whole cache, keys and values, in every layer at every step. It does so because on CUDA, PyTorch's SDPA with
``enable_gqa`` and a mask falls back to its slowest kernel. On a CPU, SDPA's flash kernel takes ``enable_gqa`` with a
mask and reads each key/value head in place. For N > 1 queries that is the same products in the same order as the
copies, the output the same bit for bit; for one query under a zero mask it is bit for bit what transformers computes
in ``generate``'s own step, which passes no mask and so takes ``enable_gqa`` itself (tests/test_attention.py). On a
2-core AMD EPYC (Zen 5) that made one layer's attention and a verify forward of SmolLM2 faster (docs/benchmarks.md,
the engine's cost curve; docs/journal/2026-12-01-figures-from-code.md); the plain step, with its one query, ran
as fast as with the copies (docs/journal/2026-12-02-compiled-layers.md: at a few hundred positions they are small).

:func:`grouped_query_attention` points the modules' ``sdpa`` configs at :data:`GQA_SDPA` for a ``with`` block and back
after. The function is registered with transformers' ``AttentionInterface`` (and sdpa's mask with
``AttentionMaskInterface``), the library's way to bring an attention function, so the model's code is unchanged. Any
call it does not cover (no mask, no grouping, another device) is sdpa's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils.import_utils import is_torch_greater_or_equal

SDPA_TAKES_GQA = is_torch_greater_or_equal("2.5")  # SDPA's enable_gqa came with PyTorch 2.5
GQA_SDPA = "selfspec_sdpa_gqa"  # the attention implementation's name inside a grouped_query_attention block


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that masked queries of a grouped-query layer on a CPU read the key/value
    heads in place (``enable_gqa``) instead of repeated copies. Returns ([B, N, H, D], None) as sdpa does."""
    # query [B, H, N, D]; key, value [B, H_kv, L, D]; attention_mask [B, 1, N, L]
    if (SDPA_TAKES_GQA and attention_mask is not None and key.shape[1] != query.shape[1]
            and query.device.type == "cpu" and dropout == 0.0
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)  # [B, H, N, D]
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)  # masks made as for sdpa (a prefill's, say)


@contextmanager
def grouped_query_attention(*modules: nn.Module | None, enabled: bool = True) -> Iterator[int]:
    """Within the block, every config under ``modules`` (the models', their layers') that names ``sdpa`` names
    :data:`GQA_SDPA`; yields how many were switched. Each is set back after, its sub-configs untouched. A block
    inside another switches nothing: the outer one's configs already name GQA_SDPA."""
    configs: dict[int, PretrainedConfig] = {}
    if enabled:
        for module in modules:
            for sub in module.modules() if module is not None else ():
                config = getattr(sub, "config", None)
                if isinstance(config, PretrainedConfig) and config._attn_implementation == "sdpa":
                    configs[id(config)] = config
    for config in configs.values():
        config._attn_implementation = {"": GQA_SDPA}  # this config only (a str would reach its sub-configs too)
    try:
        yield len(configs)
    finally:
        for config in configs.values():
            config._attn_implementation = {"": "sdpa"}
