"""Generic pieces of a Hugging Face decoder-only CausalLM that every drafter family uses: the target's base model
reached without owning it, a new module's linear initialisation, the scale of an RMS norm, the plain additive causal
mask, and a left shift of per-position tensors."""

from __future__ import annotations

import torch
from torch import nn

from selfspec.core.kv import additive_mask


def init_linears(module: nn.Module, std: float) -> None:
    """A new drafter's linear layers: normal(0, std) weights, zero biases (the target's ``initializer_range``)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def decoder_of(target: nn.Module) -> nn.Module:
    """The base model (embeddings, ``layers``, ``norm``, ``rotary_emb``) of a Hugging Face CausalLM."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise TypeError(
            f"{type(target).__name__} has no decoder with a `layers` list; drafters need a Hugging Face "
            "decoder-only CausalLM (Llama, Qwen2, Mistral, ...)."
        )
    return base


def rms_norm_scale(norm: nn.Module, size: int) -> torch.Tensor | None:
    """The per-channel scale an RMS norm multiplies by after normalising (Llama's ``weight``, Gemma's ``1 + weight``),
    read off the module itself: a constant input of size ``size`` normalises to ones, so what comes out is the scale
    (float32, on the norm's device). None when that is not a usable scale (a norm that centres its input, a
    non-finite weight)."""
    param = next(norm.parameters(), None)
    if param is None:
        return None
    with torch.no_grad():
        scale = norm(torch.full((1, size), 1e3, dtype=param.dtype, device=param.device))[0].float()
    return scale if bool(torch.isfinite(scale).all()) and bool(scale.abs().max() > 0) else None


def causal_mask(
    q_len: int,
    past_len: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive causal mask [B|1, 1, q, past + q]: query i sees every past key and new keys 0..i.

    key_padding [B, past + q] bool (True = a real token) additionally hides padded keys.
    """
    q = torch.arange(q_len, device=device)[:, None]
    k = torch.arange(past_len + q_len, device=device)[None, :]
    allowed = (k <= q + past_len)[None, None]  # [1, 1, q, S]
    if key_padding is not None:
        allowed = allowed & key_padding.bool()[:, None, None, :]
    return additive_mask(allowed, dtype)


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x [B, T, ...] -> [B, T, ...] with out[:, t] = x[:, t + n] (``fill`` past the end)."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out
