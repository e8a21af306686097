"""The drafter registry: how each drafter family becomes a drafter for the engine, keyed by name.

A trained family's name is the ``head_type`` its heads folder records (``heads/io.py`` rebuilds the module; this
registry turns the module into a drafter). A training-free family (``vanilla``, ``suffix``) needs no heads folder.

Each entry says:

- ``build(heads, target, settings) -> Drafter``: the drafter, from the loaded heads module (None for a
  training-free family), the target (``core.target.Target``: model and tokenizer) and its decode settings;
- ``needs_heads``: it drafts with trained heads (a heads folder, or ``heads=random``); ``optional_heads``: it runs
  without heads or with a folder of its type;
- ``hybrid``: it also takes the ``hybrid`` settings (merge the suffix drafter's proposals into its drafts:
  decode/hybrid.py);
- ``saved_key``: where a heads folder's config.json keeps the settings training chose for it (e.g. EAGLE's ``tree``),
  which win over the defaults; ``draft.*`` on the command line wins over both, the same way for every family;
- ``random_heads(model, seed, **options)``: untrained heads for ``heads=random`` dry runs.

The settings a family takes and their defaults are its block of conf/decode/drafters.yaml (:attr:`DrafterEntry.defaults`),
the only place they are written; ``adaptive: true`` lets the engine choose each step how deep the draft goes
(decode/adaptive.py:AdaptiveDepth).

A new family adds one :class:`DrafterEntry` with :func:`register` and its block of conf/decode/drafters.yaml (see
docs/architecture.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from decode.types import DecodeSetupError, Drafter

DEFAULTS_FILE = Path(__file__).resolve().parents[1] / "conf" / "decode" / "drafters.yaml"


@functools.cache
def _defaults_file() -> dict[str, dict[str, Any]]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(DEFAULTS_FILE))


def defaults_of(block: str) -> dict[str, Any]:
    """A block of conf/decode/drafters.yaml: a family's settings and their defaults, or ``hybrid``'s."""
    table = _defaults_file()
    if block not in table:
        raise DecodeSetupError(f"{DEFAULTS_FILE} has no {block!r} block: add the settings it takes, with their "
                               "defaults ({} for none).")
    return dict(table[block] or {})


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    summary: str
    build: Callable[[torch.nn.Module | None, Any, dict], Drafter]
    needs_heads: bool = False  # drafts with trained heads (a heads folder, or heads=random with ``random_heads``)
    optional_heads: bool = False  # runs without heads, or with a heads folder of its type (layerskip: a trained exit)
    hybrid: bool = False  # takes the suffix drafter's proposals too (decode/hybrid.py): the ``hybrid`` settings
    saved_key: str | None = None
    random_heads: Callable[..., torch.nn.Module] | None = None

    @property
    def defaults(self) -> dict[str, Any]:
        """The decode settings this family takes and their defaults (conf/decode/drafters.yaml)."""
        return {**defaults_of(self.name), **(defaults_of("hybrid") if self.hybrid else {})}

    @property
    def takes_heads(self) -> bool:
        return self.needs_heads or self.optional_heads

    def settings(self, heads_config: dict | None = None, overrides: dict | None = None) -> dict:
        """The decode settings: defaults, then those saved with the heads, then the non-null ``overrides``.
        A setting this family does not take is refused, so a typo or a setting of another family is not ignored."""
        defaults = self.defaults
        settings = dict(defaults)
        saved = (heads_config or {}).get(self.saved_key) or {} if self.saved_key else {}
        settings.update({k: v for k, v in saved.items() if k in settings and v is not None})
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(given) - set(settings))
        if unknown:
            takes = ", ".join(f"draft.{k}" for k in defaults) or "no draft.* settings"
            raise DecodeSetupError(
                f"draft.{unknown[0]} is not a setting of the {self.name} drafter (it takes {takes}); remove it or "
                f"pick the drafter it belongs to."
            )
        settings.update(given)
        return settings


REGISTRY: dict[str, DrafterEntry] = {}


def register(entry: DrafterEntry) -> DrafterEntry:
    REGISTRY[entry.name] = entry
    return entry


def entry(name: str) -> DrafterEntry:
    """The registry entry ``name``; a clear error listing the known ones otherwise."""
    if name not in REGISTRY:
        raise DecodeSetupError(f"Unknown drafter {name!r}; known: {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]


# --- the families ---------------------------------------------------------------------------------------------------


def _vanilla(heads, target, settings) -> Drafter:
    from decode.drafters import VanillaDrafter

    return VanillaDrafter()


def _medusa(heads, target, settings) -> Drafter:
    from decode.drafters import MedusaDrafter

    return MedusaDrafter(heads, tree=settings["tree"])


def _eagle(heads, target, settings) -> Drafter:
    from decode.eagle_drafter import EagleTreeDrafter

    return EagleTreeDrafter(heads, **{k: int(settings[k]) for k in ("depth", "top_k", "total_tokens")})


def _dflash(heads, target, settings) -> Drafter:
    from decode.dflash_drafter import DFlashBlockDrafter, draft_dtype

    return DFlashBlockDrafter(heads, top_k=int(settings["top_k"]), dtype=draft_dtype(settings["dtype"], heads))


def _suffix(heads, target, settings) -> Drafter:
    from decode.suffix import SuffixDrafter, load_corpus

    corpus = load_corpus(settings["corpus"], target.tokenizer) if settings.get("corpus") else None
    budget = int(settings["budget"]) if str(settings["budget"]).isdigit() else settings["budget"]  # checked there
    return SuffixDrafter(target.model, corpus=corpus, budget=budget, max_nodes=int(settings["max_nodes"]),
                         max_depth=int(settings["max_depth"]), max_match=int(settings["max_match"]),
                         remember=int(settings["remember"]))


def _layerskip(heads, target, settings) -> Drafter:
    from decode.layerskip import LayerSkipDrafter

    layers = int(target.model.config.get_text_config(decoder=True).num_hidden_layers)
    exit_layer = settings["exit_layer"]
    if exit_layer in (None, "auto"):  # a trained exit's own layer; training-free: half the layers
        exit_layer = None if heads is not None else max(1, layers // 2)
    return LayerSkipDrafter(target.model, exit_layer=None if exit_layer is None else int(exit_layer),
                            threshold=float(settings["threshold"]), max_depth=int(settings["max_depth"]), exit=heads)


def _on_target(heads: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    param = next(model.parameters())
    return heads.to(device=param.device, dtype=param.dtype).eval()


def random_medusa_heads(model: torch.nn.Module, seed: int = 0, num_heads: int = 4) -> torch.nn.Module:
    """Untrained Medusa heads for ``model`` as training starts them (blocks zero, LM heads copied from the target's),
    with the blocks jittered by ``seed`` so that heads differ. For dry runs; their drafts are rarely accepted."""
    from heads.medusa import MedusaConfig, MedusaHeads

    config = model.config.get_text_config(decoder=True)
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=num_heads, num_layers=1,
                                     shared_lm_head=False, draft_vocab_size=None),
                        model.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return _on_target(heads, model)


def random_eagle_heads(model: torch.nn.Module, seed: int = 0, variant: str = "eagle", **_: Any) -> torch.nn.Module:
    """Untrained EAGLE heads for ``model`` (dry runs: their drafts are rarely accepted)."""
    from heads.eagle import EagleConfig, EagleDrafter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = EagleDrafter(EagleConfig.from_target(model, variant=variant), model)
    return _on_target(heads, model)


def random_dflash_heads(model: torch.nn.Module, seed: int = 0, **_: Any) -> torch.nn.Module:
    """An untrained DFlash block drafter for ``model`` (dry runs: its drafts are rarely accepted)."""
    from heads.dflash import DFlashConfig, DFlashDrafter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DFlashDrafter(DFlashConfig.from_target(model), model)
    return _on_target(heads, model)


register(DrafterEntry("vanilla", "no draft: plain decoding, one token per target forward", _vanilla))
register(DrafterEntry("suffix", "training-free: continuations of the longest earlier match in the prompt, the answer "
                      "and an optional corpus; adaptive tree size", _suffix))
register(DrafterEntry("layerskip", "self-speculation: the target's first layers and an exit (a trained one from "
                      "train/layerskip.py, or the target's own final norm and LM head) draft a chain, the remaining "
                      "layers verify it (no layer recomputed)", _layerskip,
                      optional_heads=True, hybrid=True, saved_key="decode"))
register(DrafterEntry("medusa", "Medusa-1 / Medusa-2 heads: a static tree of their top-k tokens", _medusa,
                      needs_heads=True, hybrid=True, saved_key="decode", random_heads=random_medusa_heads))
for _variant in ("eagle", "eagle3"):
    register(DrafterEntry(_variant, f"{_variant.upper()} heads: an EAGLE-2 dynamic tree grown by draft log-probability",
                          _eagle, needs_heads=True, hybrid=True, saved_key="tree",
                          random_heads=functools.partial(random_eagle_heads, variant=_variant)))
register(DrafterEntry("dflash", "DFlash block drafter: one forward over a block of mask tokens drafts a chain (and "
                      "the first position's top-k siblings with top_k > 1)", _dflash, needs_heads=True, hybrid=True,
                      saved_key="decode", random_heads=random_dflash_heads))
