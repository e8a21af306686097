"""Medusa-1, Medusa-2, DFlash and layer-skip on every architecture of core/archs.py (TINY_ARCHS: Llama, Qwen2, Qwen3,
Qwen3-MoE, Mistral, Gemma 3, gpt-oss, Phi-3, DeepSeek-V3), trained through the real loop (train/loop.py) and decoded
by the engine with the drafter each family's row builds.

Per architecture, one module-scoped fixture: the tiny target's own greedy continuations of 8 random prompts (24 new
tokens each, past every sliding window), and each family trained on them for a few dozen steps, online; the families
that take a feature store (all but Medusa-2) also train a few steps from a float32 one. Invariants:

- training lowers the loss and leaves the frozen target bit-identical (Medusa-2: its base weights under the LoRA it
  trains on every linear layer of the target's attention, ``heads.lora.target_modules=auto``);
- from the store, the first steps' losses equal the online run's (same hidden states, same teacher, same updates);
- greedy decoding with the trained heads equals HF ``generate`` (Medusa-2: of the target with its adapter merged),
  with drafts accepted; layer-skip runs the target's first layers itself on the shared cache, so there the cache
  (and the hidden state, and the next token) also equals a fresh forward's after every commit;
- sampling keeps the target's distribution (one check per drafter, on a 12-token Gemma 3 target), with drafts
  trained the same way on the target's own samples and accepted often;
- Medusa-2 refuses a feature store, saying why and what to use instead.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from test_engine import CacheCheck

from selfspec.core.archs import TINY_ARCHS, attention_linear_names
from selfspec.core.families import FAMILIES
from selfspec.train.families import METHODS
from selfspec.core.target import Target, build_tiny

ARCHS = sorted(TINY_ARCHS)
PROMPT, NEW, ROWS = 6, 24, 8  # the training data: ROWS prompts of PROMPT tokens and NEW greedy tokens each
DECODED = 2  # the first prompts of the training data, decoded


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run of the matrix: its family (core/families.py), the overrides of the family's entry config, its
    steps (as few as make its drafts accepted), and whether it also trains from a feature store."""

    family: str
    overrides: tuple[str, ...]
    steps: int
    store: bool


RUNS = {
    "medusa1": Run("medusa", ("heads=medusa", "heads.loss=kl", "feature_store.teacher_topk=320"), 20, store=True),
    "medusa2": Run("medusa", ("heads=medusa2",), 12, store=False),
    "dflash": Run("dflash", (), 30, store=True),
    "layerskip": Run("layerskip", ("exit_layer=2",), 10, store=True),
}
STORE_STEPS = 2
COMMON = ("experiment=debug", "trainer.learning_rate=1e-2", f"trainer.batch_size={ROWS}", "trainer.warmup_steps=0",
          "trainer.lr_scheduler=constant", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
          "trainer.target_dtype=float32", "speed_check.prompts=null", "feature_store.dtype=float32")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def entry_config(run: str):
    """The run's composed entry config (composed once: each run below changes only a few values)."""
    from conftest import compose

    spec = RUNS[run]
    return compose(FAMILIES[spec.family].train_conf, [*COMMON, f"trainer.max_steps={spec.steps}", *spec.overrides])


def train_run(run: str, target: Target, data, run_dir: Path, *overrides: str):
    """``run`` trained on ``target`` through selfspec.train.loop.train, with ``overrides`` (dotted keys) over its config."""
    from omegaconf import OmegaConf

    from selfspec.train.loop import train

    arch = target.name.removeprefix("tiny-")
    cfg = OmegaConf.merge(entry_config(run), OmegaConf.from_dotlist(
        [f"run_dir={run_dir}", f"model.tiny.arch={arch}", f"model.name_or_path={target.name}", *overrides]))
    method = METHODS[RUNS[run].family](cfg)
    return train(cfg, method, target=target, datasets=data)


def tiny(arch: str, **shape) -> Target:
    model, tokenizer = build_tiny(arch, **shape)
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-{arch}")


def own_continuations(model, prompt: torch.Tensor, new: int):
    """The target's greedy continuations of ``prompt`` [n, p] as a training split: labels on the new tokens."""
    import datasets

    with torch.no_grad():
        seqs = model.generate(prompt.to(model.device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, eos_token_id=None).tolist()
    p = prompt.shape[1]
    return datasets.Dataset.from_dict({"input_ids": seqs, "labels": [[-100] * p + s[p:] for s in seqs]})


@dataclasses.dataclass
class Trained:
    arch: str
    target: Target  # trained on by every run but Medusa-2 (which injects its LoRA into a target of its own)
    before: dict[str, torch.Tensor]  # the target's weights before any training
    data: object  # DatasetDict
    references: list[list[int]]  # HF generate's greedy tokens after the first DECODED prompts, on the plain target
    online: dict[str, object]  # run -> TrainResult
    store: dict[str, object]  # run -> TrainResult (the runs that take a store)
    medusa2_target: Target


@pytest.fixture(scope="module", params=ARCHS)
def trained(request, tmp_path_factory):
    import datasets

    arch = request.param
    root = tmp_path_factory.mktemp(f"families-{arch}")
    target = tiny(arch)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    prompts = torch.randint(3, 259, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    split = own_continuations(target.model, prompts, NEW)
    data = datasets.DatasetDict({"train": split, "eval": split.select(range(4))})
    references = [hf_greedy(target.model, row["input_ids"][:PROMPT]) for row in split.select(range(DECODED))]
    medusa2_target = tiny(arch)
    online, store = {}, {}
    for run, spec in RUNS.items():
        on = medusa2_target if run == "medusa2" else target
        online[run] = train_run(run, on, data, root / run)
        if spec.store:
            store[run] = train_run(run, target, data, root / f"{run}-store", "features=store",
                                   f"trainer.max_steps={STORE_STEPS}")
    return Trained(arch, target, before, data, references, online, store, medusa2_target)


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def losses(result) -> list[float]:
    return [h["loss"] for h in result.history]


@pytest.mark.parametrize("run", RUNS)
def test_training_lowers_the_loss_and_leaves_the_target_frozen(trained, run):
    history = losses(trained.online[run])
    assert len(history) == RUNS[run].steps and all(torch.isfinite(torch.tensor(history)))
    assert sum(history[-3:]) < 0.8 * sum(history[:3]), f"{trained.arch} {run}: {history}"
    if run != "medusa2":
        after = trained.target.model.state_dict()
        assert all(torch.equal(trained.before[k], after[k]) for k in trained.before)
        return
    # Medusa-2: the LoRA went into this target in place, on every linear layer of its attention; the weights under
    # it did not move, and every adapter matrix that starts at zero did.
    from safetensors.torch import load_file

    for name, p in trained.medusa2_target.model.named_parameters():
        if "lora_" not in name:
            base = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, trained.before[base]), name
    adapter = load_file(str(trained.online[run].run_dir / "heads" / "adapter" / "adapter_model.safetensors"))
    lora_b = {k: v for k, v in adapter.items() if "lora_B" in k}
    adapted = {k.split(".lora_B")[0].split(".")[-1] for k in lora_b}
    assert adapted == set(attention_linear_names(trained.target.model)) and adapted
    assert all(v.abs().sum() > 0 for v in lora_b.values())


@pytest.mark.parametrize("run", [r for r, spec in RUNS.items() if spec.store])
def test_training_from_the_feature_store_takes_the_online_steps(trained, run):
    """The same examples in the same order: a float32 store's hidden states (and teacher) are the online run's, so
    its losses are too, step for step, to float32 rounding (the store's forward pads its batches otherwise: sums in
    another order, ~1e-6 relative; allowed 1e-4)."""
    store = trained.store[run]
    assert (store.run_dir / "features" / "meta.json").is_file()
    assert losses(store) == pytest.approx(losses(trained.online[run])[:STORE_STEPS], rel=1e-4)


class SharedCacheCheck(CacheCheck):
    """CacheCheck (after every commit: the cache, the hidden state and the next token equal a fresh forward's) around
    a drafter that runs part of the verify pass itself, on the shared cache (layer-skip's ``verify_forward``)."""

    def __init__(self, inner, model):
        super().__init__(inner, model)
        self.verify_forward, self.max_draft_depth = inner.verify_forward, inner.max_draft_depth

    def start(self, state, prefill):
        self.inner.start(state, prefill)


# Decode settings over those saved with the heads: layer-skip's saved threshold comes from the end-of-run estimate,
# which weighs this machine's timings; 0 drafts the whole chain every step, so acceptance does not depend on them.
DRAFT = {"layerskip": {"threshold": 0.0}}


def decoder_for(heads_dir: Path, target: Target, check_cache: bool, **draft):
    """The engine with the drafter its family's row builds from a heads folder (its saved decode settings, then
    :data:`DRAFT`, then ``draft``), on ``target`` (Medusa-2 heads: their adapter merged into it): (decoder, the model
    it decodes with). ``check_cache`` (greedy): a drafter that runs part of the verify pass itself is wrapped in a
    :class:`SharedCacheCheck`."""
    from selfspec import heads
    from selfspec.decode import registry
    from selfspec.decode.engine import SpeculativeDecoder

    loaded = heads.load(heads_dir, target)
    entry = registry.entry(loaded.config["head_type"])
    model = loaded.target
    settings = entry.settings(loaded.config, {**DRAFT.get(entry.name, {}), **draft})
    drafter = entry.build(loaded.module, dataclasses.replace(target, model=model), settings)
    if check_cache and drafter.verify_forward is not None:
        drafter = SharedCacheCheck(drafter, model)
    return SpeculativeDecoder(model, drafter, eos_token_ids=[]), model


@pytest.mark.parametrize("run", RUNS)
def test_greedy_decoding_equals_hf_generate_with_drafts_accepted(trained, run):
    target = tiny(trained.arch) if run == "medusa2" else trained.target  # a fresh one takes the saved adapter
    decoder, model = decoder_for(trained.online[run].run_dir / "heads", target, check_cache=True)
    accepted = 0
    for i, row in enumerate(trained.data["train"].select(range(DECODED))):
        prompt = row["input_ids"][:PROMPT]
        ref = hf_greedy(model, prompt) if run == "medusa2" else trained.references[i]
        result = decoder.generate(prompt, max_new_tokens=NEW)
        assert result.tokens == ref, f"{trained.arch} {run}"
        accepted += result.stats.accepted
    assert accepted > 0, f"{trained.arch} {run}: no draft accepted"
    if run == "layerskip":
        assert decoder.drafter.checks > 0


# --- sampling ---------------------------------------------------------------------------------------------------------

SAMPLING_ARCH = "gemma3"  # the one that differs most from Llama: alternating layers, soft-capping, scaled embeddings


@pytest.fixture(scope="module")
def small_trained(tmp_path_factory):
    """A 12-token Gemma 3 target (the sampling tests' shape) and each drafter trained on its own samples after the
    sampling prompt."""
    import datasets

    from test_engine import exact_first_three

    target = tiny(SAMPLING_ARCH, vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    prompt = torch.tensor([3, 5, 7, 1])
    torch.manual_seed(0)
    with torch.no_grad():
        seqs = target.model.generate(prompt.expand(64, -1), max_new_tokens=8, min_new_tokens=8, do_sample=True,
                                     pad_token_id=0, eos_token_id=None).tolist()
    split = datasets.Dataset.from_dict({"input_ids": seqs, "labels": [[-100] * 4 + s[4:] for s in seqs]})
    data = datasets.DatasetDict({"train": split, "eval": split.select(range(8))})
    root = tmp_path_factory.mktemp("families-sampling")
    shape = ["model.tiny.vocab_size=12", "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2",
             "model.tiny.intermediate_size=64", "model.tiny.seed=1"]
    runs = {run: train_run(run, target, data, root / run, *shape, *(["exit_layer=1"] if run == "layerskip" else []))
            for run in ("medusa1", "dflash", "layerskip")}
    return target, runs, exact_first_three(target.model, prompt).reshape(-1)


@pytest.mark.parametrize("run", ["medusa1", "dflash", "layerskip"])
def test_sampled_tokens_follow_the_target_distribution(small_trained, run):
    """The first three sampled tokens over 300 seeds follow the target's own distribution, with the family's drafts
    accepted often. Medusa-2 drafts with Medusa-1's drafter, on the target with its adapter merged (a model like any
    other): its check is Medusa-1's."""
    from test_engine import sampled_first_three
    from test_verify import chi_square_pvalue

    target, runs, exact = small_trained
    # the test samples three tokens: the first from the prompt's forward, two from a step; deeper chains are not read
    draft = {"max_depth": 2} if run == "layerskip" else {}
    decoder, model = decoder_for(runs[run].run_dir / "heads", target, check_cache=False, **draft)
    counts, accepted = sampled_first_three(model, decoder.drafter, seeds=300)
    assert accepted > 0.3  # drafts were accepted often enough for the test to mean something
    assert chi_square_pvalue(counts, exact) > 1e-3


# --- refusals ---------------------------------------------------------------------------------------------------------


def test_medusa2_refuses_a_feature_store(tmp_path):
    from omegaconf import OmegaConf

    from selfspec.core.errors import SettingError

    cfg = OmegaConf.merge(entry_config("medusa2"), OmegaConf.from_dotlist([f"run_dir={tmp_path}", "features=store"]))
    with pytest.raises(SettingError) as refused:
        METHODS["medusa"](cfg)
    assert str(refused.value) == ("heads=medusa2 trains LoRA inside the target, so its hidden states change every "
                                  "step and cannot come from a feature store: use features=online.")
