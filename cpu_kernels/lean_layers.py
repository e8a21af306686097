"""Llama-style decoder layers with fewer ops per token: the same maths as transformers' forwards, in fewer calls.

A plain decoding step of SmolLM2-135M (30 Llama layers, float32) on a 2-core AMD EPYC (Zen 5) ran slower in the
engine than vLLM-CPU's eager step with the linear products equally fast and the engine's own loop no part of the gap
(docs/journal/2026-12-02-plain-step-avx512.md): the rest was transformers' eager layer code, which makes many more
op calls a token than vLLM's (views, transposes and reshapes around each projection, four multiplies and a ``cat``
for each rotary) and an ``nn.Module`` call for every norm, projection and activation. The forwards below make the
same products in fewer calls (the counts before and after: docs/benchmarks.md, "The plain step against vLLM-CPU's").

:func:`lean_layers` gives, for a ``with`` block, the modules of a model whose forward is one of the Llama forms a
lean forward of their own (``sub.__class__`` set to a subclass of the module's class made once, the class set back
after; the same parameters and state dict, transformers' code untouched):

- **RMSNorm** (``LlamaRMSNorm``'s form): one ``F.rms_norm`` on float32, the same bits (tests/test_lean_layers.py).
  Other dtypes keep HF's forward, which rounds the normalised value to the input's dtype before the weight multiplies.
- **Attention** (``LlamaAttention``'s form, Qwen2's and Mistral's that add a sliding window, Qwen3's that adds q/k
  norms): q, k and v from the projection group's one product (cpu_kernels/linear_kernels.py) as views of one
  [B, N, heads, D] tensor; the rotary once over the adjacent q and k heads with cos and the signed sin made once per
  forward (``rotate_half(x) * sin`` is ``roll(x) * (-sin_1, sin_2)`` element for element, so the same bits); then
  ``cache.update`` and the attention interface called exactly as HF calls them (the engine's tree masks included),
  and ``o_proj``.
- **MLP** (``LlamaMLP``'s form with SiLU): ``F.silu(gate) * up`` on the gate/up group's one product.
- **Decoder layer** (``LlamaDecoderLayer``'s form): its norms' and MLP's forwards called directly, without
  ``nn.Module.__call__``, where they carry no hooks.
- **Causal LM** (``LlamaForCausalLM``'s form over ``LlamaModel``'s, every layer of the forms above with SiLU, float32
  and the small-batch kernels' products): the whole stack in one forward (:class:`LeanCausalLM`), each layer's ops on
  its parts read once per block, no module call or hook dispatch per layer, the hidden states collected as
  transformers' capture hooks would. Any hook but those, training, or an argument it does not cover runs HF's forward.

A class takes a form only if its ``forward`` is the reference's bytecode (:func:`lean_class`), and an attention's
rotary functions are Llama's too, so a class that only looks alike (Gemma 3's norm, gpt-oss's sinks, Phi-3's fused
projections, MLA) keeps its own forward, and so does a class in a transformers version that changed it. A call the
lean forward does not cover (training mode, gradients on, an odd head size, hooks on a group's later projections)
runs HF's forward; a model off the CPU is not swapped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import output_capturing
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3


def _code(fn: Callable) -> tuple:
    """What a function does, not where it is written: its bytecode, constants, global and local names."""
    code = inspect.unwrap(fn).__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks (its own or global ones); then it is called, not its ``forward``."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks or torch_module._global_backward_hooks
                or torch_module._global_backward_pre_hooks)


def _run(module: nn.Module, x: torch.Tensor) -> Any:
    return module(x) if _hooked(module) else module.forward(x)


def _lean_call(module: nn.Module, kwargs: dict) -> bool:
    """Whether a lean forward covers this call: inference (no training mode, no gradients) with the cache passed by
    its current name."""
    return not (module.training or torch.is_grad_enabled() or "past_key_values" in kwargs)


def _group_product(linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The product of the projection group ``linear`` leads, [..., sum of out_features], where the small-batch kernels
    run it (``small_batch_linears`` sets a group on its first member, a ``SmallBatchLinear``; this module is below
    linear_kernels.py, which enters :func:`lean_layers`) and no member has hooks (which one call for all would skip);
    else None."""
    group = linear.__dict__.get("_group")
    if group is None or any(_hooked(m) for m in group.members):
        return None
    return linear.group_product(x)


# --- RMSNorm ----------------------------------------------------------------------------------------------------------

class LeanRMSNorm:
    """``LlamaRMSNorm``'s form: ``weight * (x * rsqrt(mean(x^2) + eps))``, as one ``F.rms_norm`` on float32."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if (hidden_states.dtype is torch.float32 and self.weight.dtype is torch.float32
                and _lean_call(self, {})):
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


# --- rotary -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeadRotary:
    """A forward's cos and sin as the lean attention applies them to [B, heads, N, D]: made once, since every layer
    of a forward gets the same two tensors."""

    cos: torch.Tensor  # the model's [B, N, D]: what this is for
    sin: torch.Tensor
    cos_heads: torch.Tensor  # [B, 1, N, D]
    signed_sin_heads: torch.Tensor  # [B, 1, N, D]: (-sin[:D/2], sin[D/2:]): roll(x) * it = rotate_half(x) * sin


_last_rotary: list[HeadRotary | None] = [None]  # the latest forward's (it holds its cos and sin, so ids stay unique)


def head_rotary(cos: torch.Tensor, sin: torch.Tensor) -> HeadRotary:
    last = _last_rotary[0]
    if last is not None and last.cos is cos and last.sin is sin:
        return last
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    rotary = _last_rotary[0] = HeadRotary(cos, sin, cos.unsqueeze(1), signed.unsqueeze(1))
    return rotary


def rotated(x: torch.Tensor, rotary: HeadRotary) -> torch.Tensor:
    """x [B, heads, N, D] -> x * cos + rotate_half(x) * sin, element for element as HF's ``apply_rotary_pos_emb``
    computes it (``rotate_half(x)`` is ``roll(x)`` with its first half negated, moved onto the sin)."""
    return x * rotary.cos_heads + x.roll(x.shape[-1] // 2, dims=-1) * rotary.signed_sin_heads


# --- attention --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionForm:
    """One of the Llama attention forwards a lean forward reproduces."""

    reference: Callable  # the forward whose bytecode a class's must be
    qk_norm: bool  # q_norm and k_norm on each head before the rotary (Qwen3)
    window: Callable[[nn.Module], dict[str, Any]]  # what the interface gets beyond Llama's (a sliding window)


ATTENTION_FORMS = (
    AttentionForm(llama.LlamaAttention.forward, False, lambda m: {}),
    AttentionForm(qwen2.Qwen2Attention.forward, False, lambda m: {"sliding_window": m.sliding_window}),
    AttentionForm(mistral.MistralAttention.forward, False,
                  lambda m: {"sliding_window": getattr(m.config, "sliding_window", None)}),
    AttentionForm(qwen3.Qwen3Attention.forward, True, lambda m: {"sliding_window": m.sliding_window}),
)


class LeanAttention:
    """A Llama-form attention (:data:`ATTENTION_FORMS`) in fewer ops; the interface and the cache as HF calls them."""

    _lean_form: AttentionForm
    _lean_eager: Callable  # the module's own eager_attention_forward, HF's default interface

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Any = None, **kwargs) -> tuple[torch.Tensor, Any]:
        cos, sin = position_embeddings
        if not _lean_call(self, kwargs) or cos.shape[-1] % 2:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        form, d = self._lean_form, self.head_dim
        rotary = head_rotary(cos, sin)
        input_shape = hidden_states.shape[:-1]  # [B, N]
        qkv = _group_product(self.q_proj, hidden_states)  # [B, N, (H + 2 H_kv) D] or None
        if qkv is None:
            query, key, value = (p(hidden_states).view(*input_shape, -1, d).transpose(1, 2)  # [B, heads, N, D]
                                 for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            heads = qkv.view(*input_shape, -1, d).transpose(1, 2)  # [B, H + 2 H_kv, N, D]
            h, h_kv = self.q_proj.out_features // d, self.k_proj.out_features // d
            value = heads[:, h + h_kv:]
        if qkv is not None and not form.qk_norm:  # q's and k's heads are adjacent: one rotary over both
            rotated_qk = rotated(heads[:, :h + h_kv], rotary)
            query, key = rotated_qk[:, :h], rotated_qk[:, h:]
        else:
            if qkv is not None:
                query, key = heads[:, :h], heads[:, h:h + h_kv]
            if form.qk_norm:  # each head normed over D, as HF norms it before its transpose
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = rotated(query, rotary), rotated(key, rotary)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._lean_eager)
        out, weights = interface(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **form.window(self), **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


# --- MLP and decoder layer --------------------------------------------------------------------------------------------

class LeanMLP:
    """``LlamaMLP``'s form, ``down(act(gate(x)) * up(x))``: SiLU as ``F.silu`` on the gate/up group's one product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.act_fn) is not SiLUActivation or _hooked(self.act_fn) or not _lean_call(self, {}):
            return super().forward(x)
        gate_up = _group_product(self.gate_proj, x)  # [..., 2 I] or None
        if gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = gate_up.split(self.gate_proj.out_features, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LeanDecoderLayer:
    """``LlamaDecoderLayer``'s form, its norms and MLP run by their forwards where they carry no hooks."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        if not _lean_call(self, kwargs):
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=_run(self.input_layernorm, hidden_states),
                                          attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                          use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + _run(self.mlp, _run(self.post_attention_layernorm, hidden_states))


# --- the whole stack ---------------------------------------------------------------------------------------------------

_STACK_KWARGS = frozenset({"output_hidden_states", "output_attentions"})  # what the stack's forward reads of kwargs


def _capture_hook(hook: Callable) -> bool:
    """Whether a forward hook is transformers' output capturing hook (``capture_outputs`` sets one on each decoder
    layer and attention, to collect hidden states and attentions when asked)."""
    code = getattr(hook, "__code__", None)
    return code is not None and code.co_name == "output_capturing_hook" and hook.__module__ == output_capturing.__name__


@dataclass(frozen=True)
class StackProduct:
    """One product of the stack as its small-batch linear computes it (a group's first member: the group's)."""

    linear: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    product: Callable  # the small-batch linear's ``stack_product`` (linear_kernels.py's ``_product``)

    @classmethod
    def of(cls, linear: nn.Module) -> "StackProduct":
        group = linear.__dict__.get("_group")
        return cls(linear, *((linear.weight, linear.bias) if group is None else (group.weight, group.bias)),
                   type(linear).stack_product)

    def width(self, rows: int) -> int | None:
        """The plan's kernel for ``rows`` rows, None where it leaves the product to PyTorch."""
        return self.linear.kernel_width(rows)

    def __call__(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """x [rows, in] -> [rows, out], the same product as the linear's own call."""
        y = self.product(self.weight, x, width, self.linear._packed)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class StackLayer:
    """One Llama decoder layer's parts, read once per block."""

    index: int
    attention: nn.Module
    input_norm: tuple[torch.Tensor, float]  # weight, eps
    post_norm: tuple[torch.Tensor, float]
    qkv: StackProduct
    o: StackProduct
    gate_up: StackProduct
    down: StackProduct
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int  # gate_proj's out_features


def _small_batch(linear: nn.Module) -> bool:
    """Whether ``linear`` is linear_kernels.py's ``SmallBatchLinear`` (that module imports this one, so it is known by
    what it offers the stack: its products)."""
    return isinstance(linear, nn.Linear) and callable(getattr(type(linear), "stack_product", None))


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, module.variance_epsilon


@dataclass(frozen=True)
class LeanStack:
    """A Llama-form model's decoder stack as :class:`LeanCausalLM` runs it: every layer a lean decoder layer with a
    lean Llama attention, a lean SiLU MLP and lean norms, its projections small-batch linears, all in float32, each
    projection group one product."""

    layers: tuple[StackLayer, ...]
    norm: tuple[torch.Tensor, float]
    products: tuple[StackProduct, ...]
    hook_dicts: tuple[dict, ...]  # every hook dict of the modules the stack runs but the ones below: all empty
    capture_dicts: tuple[dict, ...]  # the layers' and attentions' forward hooks: transformers' capture hooks only
    capture_keys: list  # [the capture dicts' keys when last found all capture hooks]
    widths: dict[int, int | None] = field(default_factory=dict)  # :meth:`width` by rows (the plans hold for the block)

    @classmethod
    def of(cls, model: nn.Module) -> "LeanStack | None":
        """The stack of ``model`` (a lean causal LM's ``model``), or None where any part of it is not of the form."""
        if _code(type(model).forward) != _code(llama.LlamaModel.forward):
            return None
        captured, plain, layers = [], [model, model.embed_tokens, model.norm, model.rotary_emb], []
        for index, layer in enumerate(model.layers[: model.config.num_hidden_layers]):
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
            if not (isinstance(layer, LeanDecoderLayer) and isinstance(attention, LeanAttention)
                    and attention._lean_form.reference is llama.LlamaAttention.forward
                    and isinstance(mlp, LeanMLP) and type(mlp.act_fn) is SiLUActivation
                    and all(isinstance(n, LeanRMSNorm) and n.weight.dtype is torch.float32 for n in norms)):
                return None
            linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj)
            if not (all(_small_batch(m) and m.weight.dtype is torch.float32 for m in linears)
                    and attention.q_proj.__dict__.get("_group") is not None
                    and mlp.gate_proj.__dict__.get("_group") is not None):
                return None
            d = attention.head_dim
            if d % 2:  # the rotary's halves
                return None
            layers.append(StackLayer(index, attention, _norm(norms[0]), _norm(norms[1]),
                                     StackProduct.of(attention.q_proj), StackProduct.of(attention.o_proj),
                                     StackProduct.of(mlp.gate_proj), StackProduct.of(mlp.down_proj),
                                     attention.q_proj.out_features // d, attention.k_proj.out_features // d, d,
                                     mlp.gate_proj.out_features))
            captured += [layer, attention]
            plain += [mlp, mlp.act_fn, *norms, *linears]
        if not (layers and isinstance(model.norm, LeanRMSNorm) and model.norm.weight.dtype is torch.float32
                and model.embed_tokens.weight.dtype is torch.float32):
            return None
        products = tuple(p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        hook_dicts = tuple(d for m in plain for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                                      m._backward_pre_hooks))
        hook_dicts += tuple(d for m in captured for d in (m._forward_pre_hooks, m._backward_hooks,
                                                          m._backward_pre_hooks))
        return cls(tuple(layers), _norm(model.norm), products, hook_dicts,
                   tuple(m._forward_hooks for m in captured), [None])

    def unhooked(self) -> bool:
        """Whether running the stack's parts directly skips nothing: no hooks but transformers' capture hooks
        (whose work :meth:`LeanCausalLM.forward` does itself). Checked every forward (a hook may come at any time),
        on the hook dicts gathered once."""
        if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks
                or any(self.hook_dicts)):
            return False
        keys = tuple(tuple(d) for d in self.capture_dicts)
        if keys != self.capture_keys[0]:  # hooks added or removed there since the last check: look at each
            if not all(_capture_hook(hook) for d in self.capture_dicts for hook in d.values()):
                return False
            self.capture_keys[0] = keys
        return True

    def width(self, rows: int) -> int | None:
        """The one kernel every product of the stack takes for ``rows`` rows, or None (then HF's forward runs)."""
        if rows not in self.widths:
            widths = {p.width(rows) for p in self.products}
            self.widths[rows] = widths.pop() if len(widths) == 1 and None not in widths else None
        return self.widths[rows]

    def layer(self, part: StackLayer, x: torch.Tensor, mask: Any, rotary: HeadRotary, cache: Any, width: int,
              interface: Callable, kwargs: dict) -> torch.Tensor:
        """One decoder layer on x [B, N, hidden]: LeanDecoderLayer's, LeanAttention's and LeanMLP's forwards' ops,
        in their order, on the parts read once."""
        shape = x.shape[:-1]
        rows = x.numel() // x.shape[-1]
        h, h_kv, d = part.heads, part.kv_heads, part.head_dim
        normed = F.rms_norm(x, part.input_norm[0].shape, *part.input_norm)
        qkv = part.qkv(normed.reshape(rows, normed.shape[-1]), width).reshape(*shape, -1)
        heads = qkv.view(*shape, -1, d).transpose(1, 2)  # [B, H + 2 H_kv, N, D]
        rotated_qk = rotated(heads[:, :h + h_kv], rotary)
        key, value = cache.update(rotated_qk[:, h:], heads[:, h + h_kv:], part.index, kwargs=kwargs)
        out, _ = interface(part.attention, rotated_qk[:, :h], key, value, mask, dropout=0.0,
                           scaling=part.attention.scaling, **kwargs)
        out = out.reshape(*shape, -1).contiguous()
        x = x + part.o(out.reshape(rows, out.shape[-1]), width).reshape(*shape, -1)
        normed = F.rms_norm(x, part.post_norm[0].shape, *part.post_norm)
        gate_up = part.gate_up(normed.reshape(rows, normed.shape[-1]), width).reshape(*shape, -1)
        gate, up = gate_up.split(part.intermediate, dim=-1)
        act = F.silu(gate) * up
        return x + part.down(act.reshape(rows, act.shape[-1]), width).reshape(*shape, -1)


class LeanCausalLM:
    """``LlamaForCausalLM``'s form over ``LlamaModel``'s, the whole stack in one forward (:class:`LeanStack`): the
    embedding, HF's mask and rotary, each layer's lean ops on its parts read once (no ``nn.Module`` call, no hook
    dispatch: the stack has no hooks but transformers' capture hooks, whose hidden states this forward collects as
    they would), the final norm and the LM head on the rows ``logits_to_keep`` selects. The same ops as the lean
    layers', so the same bits; any other call is HF's forward."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> Any:
        stack = self.__dict__.get("_lean_stack")
        if stack is None:
            stack = self.__dict__["_lean_stack"] = LeanStack.of(self.model) or False
        config = self.model.config
        hidden_flag = kwargs.get("output_hidden_states", config.output_hidden_states)
        covered = not (not stack or input_ids is None or inputs_embeds is not None or labels is not None
                       or cache is None or not use_cache or not _lean_call(self, kwargs)
                       or not _STACK_KWARGS.issuperset(kwargs)
                       or kwargs.get("output_attentions", config.output_attentions)
                       or not isinstance(hidden_flag, bool)
                       or getattr(config, "tie_last_hidden_states", None) is False or not stack.unhooked())
        # the kernel every product takes for these rows; None (a product PyTorch runs) is HF's forward too
        width = stack.width(input_ids.numel()) if covered else None
        if width is None:
            if cache is not None:  # else none given, or by its old name in kwargs, which HF's forward maps
                kwargs["cache"] = cache
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, **kwargs)
        model = self.model
        inputs_embeds = model.embed_tokens.forward(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
                            + cache.get_seq_length()).unsqueeze(0)
        mask = llama.create_causal_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                        cache=cache, position_ids=position_ids)
        hidden_states = inputs_embeds
        position_embeddings = model.rotary_emb.forward(hidden_states, position_ids=position_ids)
        collected = [hidden_states] if hidden_flag else None
        rotary = head_rotary(*position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                          stack.layers[0].attention._lean_eager)
        step = {"position_ids": position_ids, "use_cache": use_cache}  # what HF's layers pass on as kwargs
        for part in stack.layers:
            hidden_states = stack.layer(part, hidden_states, mask, rotary, cache, width, interface, step)
            if collected is not None:
                collected.append(hidden_states)
        hidden_states = F.rms_norm(hidden_states, stack.norm[0].shape, *stack.norm)
        if collected is not None:
            collected[-1] = hidden_states  # as capture_outputs ties the last one to the normed output
        logits = self.lm_head(llama.slice_logits_to_keep(hidden_states, logits_to_keep))
        return llama.CausalLMOutputWithPast(loss=None, logits=logits, cache=cache,
                                            hidden_states=None if collected is None else tuple(collected))


# --- the swap ---------------------------------------------------------------------------------------------------------

_LEAN_CLASSES: dict[type, type | None] = {}


def _rotary_is_llamas(forward: Callable) -> bool:
    """Whether the rotary functions an attention forward reads are Llama's (same bytecode)."""
    scope = inspect.unwrap(forward).__globals__
    apply, half = scope.get("apply_rotary_pos_emb"), scope.get("rotate_half")
    return (apply is not None and half is not None and _code(apply) == _code(llama.apply_rotary_pos_emb)
            and _code(half) == _code(llama.rotate_half)
            and inspect.unwrap(apply).__globals__.get("rotate_half") is half
            and scope.get("ALL_ATTENTION_FUNCTIONS") is ALL_ATTENTION_FUNCTIONS)


def _make_lean_class(cls: type) -> type | None:
    forward = getattr(cls, "forward", None)
    if forward is None or not issubclass(cls, nn.Module):
        return None
    code = _code(forward)
    attrs: dict[str, Any] = {"__module__": __name__}
    if code == _code(llama.LlamaRMSNorm.forward):
        lean = LeanRMSNorm
    elif code == _code(llama.LlamaMLP.forward):
        lean = LeanMLP
    elif code == _code(llama.LlamaDecoderLayer.forward):
        lean = LeanDecoderLayer
    elif code == _code(llama.LlamaForCausalLM.forward):
        lean = LeanCausalLM
    else:
        form = next((f for f in ATTENTION_FORMS if code == _code(f.reference)), None)
        if form is None or not _rotary_is_llamas(forward):
            return None
        eager = inspect.unwrap(forward).__globals__.get("eager_attention_forward")
        lean, attrs = LeanAttention, {**attrs, "_lean_form": form, "_lean_eager": staticmethod(eager)}
    return type(f"Lean{cls.__name__}", (lean, cls), attrs)


def lean_class(cls: type) -> type | None:
    """The lean subclass of module class ``cls`` (made once), or None where its forward is none of the forms."""
    if cls not in _LEAN_CLASSES:
        _LEAN_CLASSES[cls] = _make_lean_class(cls)
    return _LEAN_CLASSES[cls]


@contextmanager
def lean_layers(model: nn.Module | None, enabled: bool = True) -> Iterator[int]:
    """Within the block, every submodule of ``model`` (on a CPU) whose class has a lean subclass (:func:`lean_class`)
    is of that subclass; yields how many were swapped, and sets each class back after. A block inside another swaps
    nothing again: the outer one's lean classes have none."""
    swapped: list[tuple[nn.Module, type]] = []
    if enabled and model is not None and any(p.device.type == "cpu" for p in model.parameters()):
        for sub in model.modules():
            lean = lean_class(type(sub))
            if lean is not None and all(p.device.type == "cpu" for p in sub.parameters(recurse=False)):
                swapped.append((sub, type(sub)))
                sub.__class__ = lean
    try:
        yield len(swapped)
    finally:
        for sub, cls in swapped:
            sub.__class__ = cls
            sub.__dict__.pop("_lean_stack", None)
        if swapped:
            _last_rotary[0] = None
