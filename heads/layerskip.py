"""Trained early exits for layer-skip self-speculation: read the target's layer-E hidden state, predict its next token.

An exit after layer E (``exit_layer``; the hidden state entering layer E, i.e. ``out.hidden_states[E]``) comes in two
forms (``form``):

- ``head``: a final norm and an LM head, both initialised from the target's own (the training-free exit is exactly
  this, untrained). The LM head is tuned (``tune_lm_head``) or frozen; frozen over the whole vocabulary, the exit
  reads the target's own LM head and does not save a copy.
- ``adapter``: one decoder block (attention + MLP, as in Kangaroo) before that norm and LM head: a copy of the
  target's layer E (its class, experts included on a mixture-of-experts target) with its output projections zeroed
  (:func:`adapter_block`), so an untrained adapter is the identity and the exit starts as the ``head`` form. The
  block attends over every earlier position (in training and decoding alike, whatever the kind of layer E), with
  layer E's rotary embedding, so decoding keeps a small KV cache of its own (decode/layerskip.py).

Both forms give logits as the target does, soft-capped where it is (selfspec.core.archs.output_logits).

A reduced exit vocabulary (``draft_vocab_size``) keeps the LM head rows of the ``token_map`` target ids only, chosen
by coverage of the training data (selfspec.train.data.choose_draft_vocab): on a small target the LM head costs as much as
several layers, so a full-vocabulary exit would eat the gain of skipping them.

Training (train/layerskip_method.py) fits an exit to the target's final distribution; ``exit_layer=auto`` trains one
exit per candidate layer in one pass (:class:`ExitSet`) and keeps the best.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from selfspec.core.archs import (RESIDUAL_OUTPUTS, layer_position_embeddings, output_logits, position_embeddings_in,
                         residual_outputs)
from selfspec.core.errors import SettingError
from selfspec.core.layers import causal_mask, decoder_of
from selfspec.core.kv import cache_length
from selfspec.core.target import cache_kwarg

FORMS = ("head", "adapter")


def other_exit_dir(heads_folder, exit_layer: int) -> Path:
    """Where an ``exit_layer=auto`` run keeps the exit after ``exit_layer`` that it did not keep in ``heads_folder``."""
    return Path(heads_folder).parent / "exits" / f"layer-{exit_layer}"


@dataclass
class ExitConfig:
    """The shape of one exit, as saved with it."""

    exit_layer: int
    form: str  # head | adapter
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    draft_vocab_size: int | None  # None: the whole vocabulary; else the size of ``token_map``
    tune_lm_head: bool

    def __post_init__(self):
        if self.form not in FORMS:
            raise SettingError(f"exit form {self.form!r}: use one of {', '.join(FORMS)}.")
        if not 1 <= self.exit_layer < self.num_hidden_layers:
            raise SettingError(f"exit_layer={self.exit_layer}: an exit goes after a layer in "
                               f"1..{self.num_hidden_layers - 1} (this target has {self.num_hidden_layers} layers).")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise SettingError(f"draft_vocab_size={self.draft_vocab_size} must be in 1..{self.vocab_size}.")

    @property
    def owns_lm_head(self) -> bool:
        return self.tune_lm_head or self.draft_vocab_size is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, target: nn.Module, **kwargs) -> "ExitConfig":
        config = target.config.get_text_config(decoder=True)
        return cls(hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                   num_hidden_layers=config.num_hidden_layers, **kwargs)


class LayerSkipExit(nn.Module):
    """One exit; see the module docstring. ``target``: the frozen Hugging Face CausalLM (its norm, LM head, layer
    class and rotary embedding are copied or used, never modified). ``token_map``: the reduced vocabulary's target
    ids (ascending); None with ``draft_vocab_size`` set keeps the first ids until :meth:`set_token_map`."""

    def __init__(self, config: ExitConfig, target: nn.Module, token_map: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        base = decoder_of(target)
        self.adapter = None
        if config.form == "adapter":
            self.adapter = adapter_block(base.layers[config.exit_layer])
        self.norm = copy.deepcopy(base.norm)
        target_head = target.get_output_embeddings()
        if config.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))
        else:
            self.token_map = None
        if config.owns_lm_head:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size or config.vocab_size, bias=False)
        else:
            self.lm_head = None
        self._target = [target]  # used, never owned: kept out of state_dict() and parameters()
        self._target_head = [target_head]
        self.set_token_map(token_map if token_map is not None else self.token_map)
        for p in self.parameters():
            p.requires_grad_(True)
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(config.tune_lm_head)
        self.to(next(target.parameters()).device)  # new layers beside the copied norm: all on the target's device

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def set_token_map(self, token_map: torch.Tensor | None) -> None:
        """Install the reduced vocabulary (and copy the target's LM head rows for it into the exit's own)."""
        head = self._target_head[0]
        with torch.no_grad():
            if token_map is not None:
                token_map = torch.as_tensor(token_map, dtype=torch.long).reshape(-1).to(self.token_map.device)
                if token_map.shape != self.token_map.shape:
                    raise ValueError(f"token_map has {token_map.numel()} ids; this exit takes draft_vocab_size="
                                     f"{self.config.draft_vocab_size}.")
                self.token_map.copy_(token_map)
            if self.lm_head is not None:
                weight = head.weight if self.token_map is None else head.weight[self.token_map.to(head.weight.device)]
                self.lm_head.weight.copy_(weight.to(self.lm_head.weight))

    def head_weight(self) -> torch.Tensor:
        """[K, H] the LM head rows the exit scores (K = draft_vocab_size or the vocabulary)."""
        return self.lm_head.weight if self.lm_head is not None else self._target_head[0].weight

    def features(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Layer-E hidden states [B, q, H] -> normed exit features [B, q, H]. The adapter form needs
        ``position_ids`` [B, q] and an additive ``attention_mask`` [B|1, 1, q, past + q] (None: causal, no past),
        and writes its rows into ``cache`` (its own, layer 0) when given."""
        if self.adapter is not None:
            if position_ids is None:
                position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None] + cache_length(cache)
            if attention_mask is None:
                attention_mask = causal_mask(hidden.shape[1], cache_length(cache), hidden.dtype, hidden.device)
            (rotary,) = layer_position_embeddings(decoder_of(self.target), hidden, position_ids, [self.exit_layer])
            hidden = self.adapter(hidden, attention_mask=attention_mask.to(hidden.dtype), position_ids=position_ids,
                                  use_cache=cache is not None, **{cache_kwarg(self.adapter): cache},
                                  position_embeddings=position_embeddings_in(rotary, hidden.dtype))
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return self.norm(hidden)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Exit features [..., H] -> logits [..., K] over the exit vocabulary, soft-capped as the target's own
        (selfspec.core.archs.output_logits)."""
        head = self.lm_head if self.lm_head is not None else self._target_head[0]
        return output_logits(self.target.config, head(features.to(head.weight.dtype)))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Exit-vocabulary ids -> target ids."""
        return ids if self.token_map is None else self.token_map[ids]


def adapter_block(layer: nn.Module) -> nn.Module:
    """An adapter: a copy of the target's decoder ``layer`` (its class, configuration and weights, experts and all)
    that caches as layer 0 of a cache of its own, with its residual outputs zeroed (selfspec.core.archs.residual_outputs),
    so that it starts as the identity."""
    adapter = copy.deepcopy(layer)
    for module in adapter.modules():
        if hasattr(module, "layer_idx"):
            module.layer_idx = 0
    outputs = residual_outputs(adapter)
    written = {name.split(".")[0] for name, _ in outputs}  # the submodules that write: attention and MLP
    if len(written) < 2:
        raise SettingError(
            f"exit.form=adapter starts from a copy of the target's layer with its output projections zeroed, but "
            f"{type(layer).__name__} has none named {' or '.join(RESIDUAL_OUTPUTS)} in both its attention and its "
            "MLP (core/archs.py). Use exit.form=head.")
    with torch.no_grad():
        for _, p in outputs:
            p.zero_()
    return adapter


class ExitSet(nn.Module):
    """One exit per candidate layer, trained together from one target forward (``exit_layer=auto``)."""

    def __init__(self, exits: dict[int, LayerSkipExit]):
        super().__init__()
        self.exits = nn.ModuleDict({str(e): module for e, module in sorted(exits.items())})

    @property
    def layers(self) -> list[int]:
        return [int(e) for e in self.exits]

    def __getitem__(self, layer: int) -> LayerSkipExit:
        return self.exits[str(layer)]


def build_layerskip_exit(head_config: dict, target_model: nn.Module | None) -> LayerSkipExit:
    """selfspec.heads.io builder for head type ``layerskip``: rebuild the exit from its saved config."""
    if target_model is None:
        raise ValueError("Layer-skip exits are rebuilt from the target's own norm, LM head and layer class: load them "
                         "with the target, heads.load(path, target=...).")
    return LayerSkipExit(ExitConfig(**head_config), target_model)
