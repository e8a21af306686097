"""Sequence packing (trainer.packing, selfspec.train.data.collate_packed).

- Layout: every example lands once, rows hold at most pack_length tokens, positions restart per example.
- Attention does not cross examples: the target's hidden states of a packed row equal each example's own forward
  (transformers' packed-sequence masks), and the EAGLE and Medusa losses and gradients of a packed batch equal the
  padded batch's over the same examples (a packed row read as one sequence gives other values: the check can fail).
- Training: a packed run ends with the padded run's parameters (and resumes exactly: tests/test_eagle.py), and a
  method that cannot read packed batches refuses them before any work.
- trainer.hold_freed_memory: big tensors come from the heap (kept for reuse), not from fresh mappings; free pages
  go back every few steps and after evaluations.
- selfspec.core.runtime.rows_through: gathered rows reach an LM head in repeating shapes, with the same values and gradients.
"""

from __future__ import annotations

import pytest
import torch

from selfspec.core.target import build_tiny
from selfspec.heads.medusa import medusa_targets
from selfspec.train.data import IGNORE_INDEX, collate, collate_packed, pack_rows, target_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# fp32 forwards of the same examples in different layouts differ only by summation order: relative 1e-6 per matmul,
# a few orders of magnitude below these bounds.
RTOL, ATOL = 1e-4, 1e-5


def examples(lengths, seed=0, prompt=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 259, (n,), generator=g)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


# --- layout ----------------------------------------------------------------------------------------------------------


def test_pack_rows_is_first_fit_longest_first():
    assert pack_rows([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    assert pack_rows([9, 2], 8) == [[0], [1]]  # too long for any row: a row of its own
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 40, (50,), generator=g).tolist()
    rows = pack_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(50))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) < 50 and all(row == sorted(row) for row in rows)


def test_collate_packed_lays_examples_end_to_end():
    ex = examples([5, 3, 4, 2])
    ex[1]["extra"] = torch.arange(3 * 2, dtype=torch.float16).view(3, 2)  # a per-token feature (a store's field)
    for e in ex:
        e.setdefault("extra", torch.zeros(len(e["input_ids"]), 2, dtype=torch.float16))
    batch = collate_packed(ex, pad_token_id=0, capacity=8)
    assert batch["input_ids"].shape == (2, 8) and batch["extra"].shape == (2, 8, 2)
    assert batch["segment_ids"].tolist() == [[1] * 5 + [2] * 3, [1] * 4 + [2] * 2 + [0] * 2]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1] * 6 + [0] * 2]
    assert batch["input_ids"][0, 5:].tolist() == ex[1]["input_ids"]
    assert torch.equal(batch["extra"][0, 5:], ex[1]["extra"])
    # labels as given, except each example's first token (no position of its own example predicts it)
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] + ex[1]["labels"][1:]
    assert batch["labels"][1, 6:].tolist() == [IGNORE_INDEX] * 2
    # a look-ahead of 2 (Medusa's head 0) keeps within an example: targets only where t + 2 is in t's example
    ahead = medusa_targets(torch.zeros_like(batch["labels"]), 1, batch["segment_ids"])[0] != IGNORE_INDEX
    assert ahead[0].tolist() == [True, True, True, False, False, True, False, False]
    assert ahead[1].tolist() == [True, True, False, False, False, False, False, False]
    # the same tokens as the padded batch
    padded = collate(ex, pad_token_id=0)
    assert int(batch["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    assert batch["input_ids"].numel() < padded["input_ids"].numel()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_target_reads_a_packed_row_as_separate_sequences(arch, device):
    model, _ = build_tiny(arch, seed=0)
    ex = examples([7, 12, 5, 9], seed=2)
    packed = to(collate_packed(ex, pad_token_id=0, capacity=24), device)
    padded = to(collate(ex, pad_token_id=0), device)
    assert packed["input_ids"].shape[0] < len(ex)
    decoder = model.get_decoder()
    with torch.no_grad():
        got = decoder(input_ids=packed["input_ids"], **target_inputs(packed), use_cache=False).last_hidden_state
        want = decoder(input_ids=padded["input_ids"], **target_inputs(padded), use_cache=False).last_hidden_state
        # the packed row read as one sequence: later examples attend to earlier ones
        mixed = decoder(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"],
                        use_cache=False).last_hidden_state
    rows = pack_rows([len(e["input_ids"]) for e in ex], 24)
    crossed = 0.0
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(ex[i]["input_ids"])
            torch.testing.assert_close(got[r, start:start + n], want[i, :n], rtol=RTOL, atol=ATOL)
            crossed = max(crossed, float((mixed[r, start:start + n] - want[i, :n]).abs().max()))
            start += n
    assert crossed > 100 * ATOL


# --- losses ----------------------------------------------------------------------------------------------------------


def _grads(module, loss):
    module.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _compare(method, target, module, ex, capacity):
    device = target.model.device
    padded = to(collate(ex, target.tokenizer.pad_token_id), device)
    packed = to(collate_packed(ex, target.tokenizer.pad_token_id, capacity), device)
    assert packed["input_ids"].shape[0] < len(ex)
    module.eval()  # no dropout (Medusa-2's LoRA): both layouts see the same function; gradients still flow
    num_items = method.count_items(padded)  # each batch is a whole step
    assert torch.equal(method.count_items(packed), num_items)
    want, _ = method.compute_loss(padded, target, module, num_items)
    want_grads = _grads(module, want)
    got, _ = method.compute_loss(packed, target, module, num_items)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=RTOL) and float(want.detach()) > 0
    got_grads = _grads(module, got)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    # the same rows read as single sequences (no segments, positions running on): a different loss
    unpacked = {k: v for k, v in packed.items() if k not in ("segment_ids", "position_ids")}
    crossed, _ = method.compute_loss(unpacked, target, module, num_items)
    assert abs(float(crossed.detach()) - float(want.detach())) > 1e-3 * float(want.detach())


@pytest.mark.parametrize("variant", ["eagle", "eagle3", "eagle3-mid"])
def test_packed_eagle_loss_equals_the_padded_loss(tmp_path, variant):
    from test_eagle import eagle_cfg, heads_overrides
    from test_medusa_train import tiny_target

    from selfspec.train.eagle_method import EagleMethod

    target = tiny_target()
    # noise off: the two forwards would draw different noise
    cfg = eagle_cfg(tmp_path, *heads_overrides(variant), "heads.draft_vocab_size=200", "heads.unroll_steps=3",
                    "heads.feature_noise=0")
    method = EagleMethod(cfg)
    torch.manual_seed(0)
    module = method.build_module(target)
    _compare(method, target, module, examples([14, 9, 20, 6, 11], seed=3), capacity=32)


@pytest.mark.parametrize("heads_option", ["medusa", "medusa2"])
def test_packed_medusa_loss_equals_the_padded_loss(tmp_path, heads_option):
    from test_medusa_train import medusa_cfg, tiny_target

    from selfspec.train.medusa_method import medusa_method

    target = tiny_target()
    cfg = medusa_cfg(tmp_path, f"heads={heads_option}")
    method = medusa_method(cfg)
    torch.manual_seed(0)
    module = method.build_module(target)
    if heads_option == "medusa2":  # LoRA's B starts at zero: move it so the adapter changes the target's forward
        with torch.no_grad():
            for name, p in module.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    _compare(method, target, module, examples([14, 9, 20, 6, 11], seed=3), capacity=32)


# --- training --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_a_packed_run_ends_with_the_padded_runs_parameters(tmp_path, family):
    from test_eagle import eagle_cfg, saved_weights
    from test_medusa_train import heads_weights, medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train
    from selfspec.train.medusa_method import Medusa1Method

    if family == "eagle3":
        make_cfg, method_of, weights = eagle_cfg, EagleMethod, saved_weights
        opts = ["heads=eagle3", "heads.draft_vocab_size=64", "heads.feature_noise=0"]
    else:
        make_cfg, method_of, weights = medusa_cfg, Medusa1Method, heads_weights
        opts = []
    # adam_eps: Adam divides each gradient by its running RMS + eps, so an element whose gradient cancels to ~1e-7
    # (one of the eagle3 fuse weights) moves by a share of lr that rounding decides: at eps 1e-8 the two layouts'
    # summation orders left it 7.6e-6 apart on a CPU (the rest within 1e-6) and further on a GPU; at 1e-5 such an
    # element's update is damped to its gradient's size and every element stays within 2e-7
    opts += ["trainer.max_steps=4", "trainer.batch_size=6", "trainer.pack_length=96", "trainer.adam_eps=1e-5"]
    data = tiny_datasets()  # 20-40 tokens: rows of 96 hold two or three
    class Counted(method_of):
        rows: list[int] = []

        def compute_loss(self, batch, *args, **kwargs):
            self.rows.append(int(batch["input_ids"].shape[0]))
            return super().compute_loss(batch, *args, **kwargs)

    runs = {}
    for name, packing in (("padded", "false"), ("packed", "true")):
        cfg = make_cfg(tmp_path / name, *opts, f"trainer.packing={packing}")
        method = Counted(cfg)
        method.rows = []
        result = train(cfg, method, target=tiny_target(), datasets=data)
        runs[name] = (result, weights(tmp_path / name), method.rows)
    (padded, a, padded_rows), (packed, b, packed_rows) = runs["padded"], runs["packed"]
    assert padded_rows == [6] * 4 and max(packed_rows) < 6
    assert [h["loss"] for h in packed.history] == pytest.approx([h["loss"] for h in padded.history], rel=RTOL)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_packing_is_refused_clearly_where_unsupported(tmp_path):
    from test_layerskip_train import layerskip_cfg
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.core.errors import SettingError
    from selfspec.train.layerskip_method import LayerSkipMethod
    from selfspec.train.config import TrainerConfig
    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    cfg = layerskip_cfg(tmp_path / "ls", "trainer.packing=true")
    with pytest.raises(SettingError, match="trainer.packing=false"):
        train(cfg, LayerSkipMethod(cfg), target=tiny_target(), datasets=tiny_datasets())
    assert not (tmp_path / "ls" / "checkpoints").exists()
    with pytest.raises(SettingError, match="pack_length"):
        TrainerConfig.from_cfg(medusa_cfg(tmp_path / "m", "trainer.pack_length=0").trainer)
    medusa_method(medusa_cfg(tmp_path / "m", "trainer.packing=true"))  # composes


# --- memory held for reuse (trainer.hold_freed_memory) ---------------------------------------------------------------

_MMAPPED_AFTER_A_BIG_TENSOR = """
import ctypes, torch
from selfspec.core.runtime import hold_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
held = hold_freed_memory() if {hold} else False
x = torch.empty(64 * 2**20, dtype=torch.uint8)
print(held, libc.mallinfo2().hblkhd)
"""


def test_held_memory_serves_big_tensors_from_the_heap():
    """With hold_freed_memory, a 64 MiB tensor comes from the heap (kept for reuse) and not from a fresh mapping that
    the kernel zeroes anew after every free; without it glibc maps it."""
    import ctypes
    import subprocess
    import sys

    from conftest import REPO

    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("not glibc 2.33+")
    out = {}
    for hold in (False, True):
        code = _MMAPPED_AFTER_A_BIG_TENSOR.format(hold=hold)  # run in the repository: its own core
        held, mapped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      cwd=REPO).stdout.split()
        out[hold] = (held == "True", int(mapped))
    assert out[False][1] >= 64 * 2**20
    assert out[True] == (True, out[True][1]) and out[True][1] < 64 * 2**20


_RESIDENT_AFTER_FREE = """
import torch
from selfspec.core.runtime import hold_freed_memory, release_held_memory

def anon_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) / 1024

held = hold_freed_memory()
x = torch.ones(256 * 2**20, dtype=torch.uint8)  # every page written
pin = torch.ones(1024)  # a live block after it, so that it is not the heap's top
del x
kept = anon_mib()
released = release_held_memory()
print(held, released, kept - anon_mib())
"""


def test_released_held_memory_goes_back_to_the_kernel():
    """Held memory stays resident after it is freed (that is the point: no zeroing on reuse); release_held_memory
    gives the pages of free blocks back, even inside the heap, so a long run's heap does not keep its high-water
    mark of every block size it met."""
    import subprocess
    import sys

    from conftest import REPO

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc on Linux only")
    held, released, dropped = subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_FREE], capture_output=True,
                                             text=True, check=True, cwd=REPO).stdout.split()
    if held != "True":
        pytest.skip("not glibc")
    assert released == "True"
    assert float(dropped) > 200  # of the 256 MiB freed


@pytest.mark.parametrize("hold", [True, False])
def test_a_run_releases_held_memory_every_few_steps(tmp_path, monkeypatch, hold):
    """With memory held, the loop gives free pages back every RELEASE_HELD_EVERY steps and after each evaluation;
    without it, never."""
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    import selfspec.train.loop as loop
    from selfspec.train.medusa_method import medusa_method

    calls = []
    monkeypatch.setattr(loop, "RELEASE_HELD_EVERY", 2)
    monkeypatch.setattr(loop, "hold_freed_memory", lambda: True)
    monkeypatch.setattr(loop, "release_held_memory", lambda: calls.append(1) or True)
    cfg = medusa_cfg(tmp_path, "trainer.max_steps=5", "trainer.eval_every=3", f"trainer.hold_freed_memory={hold}")
    loop.train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets())
    assert len(calls) == (2 + 2 if hold else 0)  # steps 2 and 4; the evaluations at step 3 and at the end


def test_rows_through_pads_to_repeating_shapes_with_the_same_values_and_gradients():
    """Gathered rows go through an LM head padded to a multiple of ROW_BUCKET rows (bfloat16 CPU matmuls keep
    buffers per shape): the head sees only such shapes, and values and gradients equal the unpadded call."""
    from selfspec.core.runtime import ROW_BUCKET, rows_through

    head = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 11))
    seen = []
    head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    for n in (1, 37, ROW_BUCKET, ROW_BUCKET + 5):
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n), requires_grad=True)
        padded = rows_through(head, x)
        gx_padded, *gw_padded = torch.autograd.grad(padded.square().sum(), [x, *head.parameters()])
        plain = head(x)
        gx, *gw = torch.autograd.grad(plain.square().sum(), [x, *head.parameters()])
        assert padded.shape == plain.shape
        torch.testing.assert_close(padded, plain)
        torch.testing.assert_close(gx_padded, gx)
        for a, b in zip(gw_padded, gw):
            torch.testing.assert_close(a, b)
    assert all(m % ROW_BUCKET == 0 for m in seen[0::2])  # the padded calls
    assert seen[0::2] == [ROW_BUCKET, ROW_BUCKET, ROW_BUCKET, 2 * ROW_BUCKET]
