"""HF generate's early-exit assistant (``hf_early_exit``): which layer it exits after, swept on a few prompts when
not given."""

from __future__ import annotations

from typing import Any

import torch

from selfspec.bench.methods import Method
from selfspec.decode.types import DecodeSetupError


def early_exit_candidates(model: torch.nn.Module, layers: Any) -> list[int]:
    """``early_exit_layers``: the layers to try (one: no sweep); null: an eighth, a quarter, half and three quarters
    deep (on SmolLM2 the shallowest was fastest: docs/journal/2026-11-benchmarks.md)."""
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    if layers not in (None, "", []):
        chosen = [int(x) for x in ([layers] if isinstance(layers, (int, str)) else layers)]
        bad = [e for e in chosen if not 1 <= e < n]
        if bad:
            raise DecodeSetupError(f"early_exit_layers: {bad[0]} is not a layer to exit after (1..{n - 1}).")
        return chosen
    return sorted({min(max(1, n * k // 8), n - 1) for k in (1, 2, 4, 6)})


def choose_early_exit(method: Method, candidates: list[int], prompts: list[list[int]],
                      generate: dict | None = None) -> dict:
    """Set ``method`` (hf_early_exit) to the fastest of ``candidates`` on ``prompts`` (each warmed up once, then timed
    over all of them); one candidate is taken as given. ``generate``: more ``generate`` settings of the assistant
    (e.g. ``num_assistant_tokens``). Returns {"layer", "sweep": [{layer, tokens, s, tokens/s}]}."""
    sweep, generate = [], dict(generate or {})
    for layer in candidates if len(candidates) > 1 else []:
        method.generate_config = {"assistant_early_exit": layer, **generate}
        method.run(prompts[0], max_new_tokens=8)
        runs = [method.run(ids) for ids in prompts]
        tokens, seconds = sum(r["new_tokens"] for r in runs), sum(r["total_s"] for r in runs)
        sweep.append({"layer": layer, "new_tokens": tokens, "total_s": seconds,
                      "tokens_per_s": tokens / seconds if seconds else 0.0})
    layer = max(sweep, key=lambda r: r["tokens_per_s"])["layer"] if sweep else candidates[0]
    method.generate_config = {"assistant_early_exit": layer, **generate}
    method.info = {"assistant_early_exit": layer, **generate,
                   "chosen_by": "sweep" if sweep else "early_exit_layers"}
    return {"layer": layer, "sweep": sweep}
