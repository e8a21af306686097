"""selfspec.cpu_kernels.linear_kernels: the small-batch linear layers the engine swaps in on a CPU compute what
nn.Linear computes, at the widths a row plan says; the swap is undone after the block (also on errors), touching
nothing but plain nn.Linear modules; a machine's plan is the fastest measured option per row count, cached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfspec.cpu_kernels.linear_kernels import (MAX_ROWS, PACKED, PROBE_ROWS, RowPlan, SmallBatchLinear, can_pack,
                                   candidate_widths, choose_widths, measured_row_plan, sample_weights,
                                   small_batch_linears, use_small_batch)


def kernels_can_pack() -> bool:
    return can_pack(torch.zeros(1))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 7), (1, 2, 7), (2, 3, 7), (MAX_ROWS, 7), (MAX_ROWS + 1, 7), (1, 0, 7)])
def test_small_batch_linear_equals_nn_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(7, 33, bias=bias)
    x = torch.randn(*shape)
    ref = lin(x)
    with small_batch_linears(lin) as swapped:
        assert swapped == 1 and type(lin) is SmallBatchLinear
        out = lin(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_gradients_still_flow_through_swapped_layers():
    lin = nn.Linear(5, 4)
    x = torch.randn(3, 5, requires_grad=True)
    with small_batch_linears(lin):
        lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


class LoRALike(nn.Linear):
    """A subclass of nn.Linear with its own forward: must be left alone."""


def test_swap_covers_plain_linears_once_and_is_undone():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Sequential(shared, LoRALike(4, 4)), nn.LayerNorm(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with small_batch_linears(model, None, model) as swapped:
        assert swapped == 2  # the first layer and the shared one (counted once); not the subclass
        assert type(model[0]) is SmallBatchLinear and type(shared) is SmallBatchLinear
        assert type(model[2][1]) is LoRALike
        assert set(model.state_dict()) == set(state)
    assert type(model[0]) is nn.Linear and type(shared) is nn.Linear
    with pytest.raises(RuntimeError, match="boom"):
        with small_batch_linears(model):
            raise RuntimeError("boom")
    assert all(type(m) in (nn.Linear, LoRALike) for m in model.modules() if isinstance(m, nn.Linear))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_disabled_swaps_nothing():
    lin = nn.Linear(3, 3)
    with small_batch_linears(lin, enabled=False) as swapped:
        assert swapped == 0 and type(lin) is nn.Linear


def test_kernel_choice():
    assert use_small_batch("auto", "cpu") and use_small_batch("small_batch", "cpu")
    assert not use_small_batch("torch", "cpu") and not use_small_batch("auto", "cuda")
    with pytest.raises(ValueError, match="linear_kernel='fast'"):
        use_small_batch("fast", "cpu")


def test_rows_are_padded_to_the_fast_widths():
    from selfspec.cpu_kernels.linear_kernels import padded_rows

    assert [padded_rows(n) for n in (2, 3, 4, 5, 8, 9, 16, 17, 63)] == [4, 4, 4, 8, 8, 16, 16, 24, 64]


def test_frozen_weights_under_no_grad_take_the_small_batch_product(monkeypatch):
    """Decoding runs under no_grad with weights that may still require grad (a model as from_pretrained loads it):
    the small-batch product must be taken there, not only for weights with requires_grad off."""
    lin = nn.Linear(6, 5)
    assert lin.weight.requires_grad
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape) or real_mm(a, b))
    x = torch.randn(3, 6)
    with small_batch_linears(lin), torch.no_grad():
        out = lin(x)
    assert calls == [(5, 6)]  # the weight was the left operand of one product
    torch.testing.assert_close(out, nn.functional.linear(x, lin.weight, lin.bias))
    with small_batch_linears(lin), torch.no_grad():
        lin(x[:1])  # one row: PyTorch's matrix-vector path
    assert len(calls) == 1


def _recording_mm(monkeypatch) -> list[tuple[int, ...]]:
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(tuple(b.shape)) or real_mm(a, b))
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_a_plan_pads_rows_to_its_widths_and_computes_the_same(monkeypatch, bias):
    """One row padded to two, three to eight, four left to PyTorch: each the same product as nn.Linear (a float32
    dot product of 9 terms: its rounding differs by a few ulps between summation orders)."""
    widths = [0] * MAX_ROWS
    widths[0], widths[2] = 2, 8
    plan = RowPlan(tuple(widths))
    lin = nn.Linear(9, 17, bias=bias)
    calls = _recording_mm(monkeypatch)
    for rows, width in ((1, 2), (3, 8), (4, None)):
        x = torch.randn(rows, 9)
        with small_batch_linears(lin, plan=plan), torch.no_grad():
            out = lin(x)
        assert calls[-1:] == ([(9, width)] if width else []) or (width is None and len(calls) == 2)
        torch.testing.assert_close(out, nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [(9, 2), (9, 8)]
    assert "_row_plan" not in lin.__dict__  # the plan goes with the swap


def test_candidate_widths():
    for rows in range(1, MAX_ROWS + 1):
        widths = candidate_widths(rows)
        assert widths[0] == 0 and rows in widths
        assert all(rows <= w <= min(2 * rows, MAX_ROWS) for w in widths[1:])
    assert candidate_widths(1) == [0, 1, 2] and candidate_widths(3) == [0, 3, 4] and candidate_widths(12) == [0, 12, 16]


def test_choose_widths_takes_the_fastest_and_the_smaller_on_a_tie():
    seconds = {(1, 0): 3.0, (1, 1): 3.0, (1, 2): 1.5, (4, 0): 2.0, (4, 4): 2.0, (4, 8): 2.5}
    assert choose_widths(seconds) == {1: 2, 4: 0}


def test_plan_from_choices_fills_rows_between_probes_from_the_next_one_up():
    plan = RowPlan.from_choices({1: 2, 2: 2, 4: 4, 8: 0, 16: 16})
    assert [plan.width(r) for r in range(1, 18)] == [2, 2, 4, 4, 0, 0, 0, 0] + [16] * 8 + [17]
    assert plan.width(0) == 0 and plan.width(MAX_ROWS + 1) == 0
    assert RowPlan.from_choices({1: 2, 4: 0}).width(5) == 0  # above the largest probe: PyTorch's, as it chose
    with pytest.raises(ValueError, match="widths"):
        RowPlan((1,) * (MAX_ROWS - 1))
    with pytest.raises(ValueError, match="widths"):
        RowPlan((2, 1) + (0,) * (MAX_ROWS - 2))  # two rows cannot be padded to one


def test_sample_weights_keeps_a_stride_and_the_largest():
    weights = [torch.empty(4, 4) for _ in range(9)] + [torch.empty(64, 4)]
    assert [id(w) for w in sample_weights(weights, max_bytes=10**9)] == [id(w) for w in weights]
    sample = sample_weights(weights, max_bytes=400)  # 1,600 bytes in all: every 4th (0, 4, 8), then the largest
    assert [id(w) for w in sample] == [id(w) for w in weights[::4]] + [id(weights[-1])]


def timed_widths(runs: list[int]):
    """A fake ``time_widths``, counting its runs (how many weights each timed) in ``runs``: one row fastest padded to
    two; above that, PyTorch's own product."""
    def fake_time_widths(weights, probes=PROBE_ROWS, **_):
        runs.append(len(weights))
        return {(r, w): (0.5 if (r, w) == (1, 2) else 1.0 if w == 0 else 2.0) for r in probes
                for w in candidate_widths(r)}

    return fake_time_widths


def test_measured_plan_is_cached_and_remeasured_when_unreadable(monkeypatch, tmp_path):
    import selfspec.cpu_kernels.linear_kernels as kernels

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    runs = []
    monkeypatch.setattr(kernels, "time_widths", timed_widths(runs))
    plan = measured_row_plan(model)
    assert runs == [2] and plan.width(1) == 2 and plan.width(2) == 0 and plan.width(40) == 0
    assert measured_row_plan(model) == plan and runs == [2]  # read back from the cache
    (files := list((tmp_path / "kernel_plans").glob("*.json")))[0].write_text("{not json")
    assert len(files) == 1 and measured_row_plan(model) == plan and runs == [2, 2]
    other = nn.Sequential(nn.Linear(8, 32))  # other shapes: measured for themselves
    measured_row_plan(other)
    assert runs == [2, 2, 1]


def test_a_plan_measured_while_other_processes_used_the_cpus_serves_this_process_alone(monkeypatch, tmp_path,
                                                                                        capsys):
    import selfspec.cpu_kernels.linear_kernels as kernels
    from selfspec.cpu_kernels import machine_load
    from selfspec.cpu_kernels.machine_load import CpuTimes

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_UNKEPT", {})
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    runs = []
    monkeypatch.setattr(kernels, "time_widths", timed_widths(runs))
    # others used 60% of the CPUs' time while it was timed (a compile beside it, say)
    busy = iter([CpuTimes(0.0, 0.0, 0.0), CpuTimes(busy=700.0, total=1000.0, own=100.0)])
    monkeypatch.setattr(machine_load, "cpu_times", lambda: next(busy))
    plan = measured_row_plan(model)
    assert plan.width(1) == 2 and runs == [2]
    assert not list((tmp_path / "kernel_plans").glob("*.json"))  # not kept for later processes
    err = capsys.readouterr().err
    assert "not kept" in err and "60%" in err and err.count("\n") == 1  # said in one line
    assert measured_row_plan(model) == plan and runs == [2]  # this process measures it once
    # the next process, on a quiet machine, measures it again and keeps it
    monkeypatch.setattr(kernels, "_UNKEPT", {})
    monkeypatch.setattr(machine_load, "cpu_times", lambda: None)
    assert measured_row_plan(model) == plan and runs == [2, 2]
    assert len(list((tmp_path / "kernel_plans").glob("*.json"))) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_off_a_cpu_the_plan_is_the_default_unmeasured():
    assert measured_row_plan(nn.Linear(4, 4).cuda()) == RowPlan.default()


def test_kernel_plan_script_measures_prints_and_caches_the_plan(monkeypatch, tmp_path, capsys):
    import json

    from conftest import load_script

    kernel_plan = load_script("kernel_plan")
    import selfspec.cpu_kernels.linear_kernels as kernels
    from selfspec.decode.settings import model_config
    from selfspec.core.target import load_target

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    # the machine read as quiet: other test workers may be busy beside this one (their effect: the next test)
    monkeypatch.setattr("selfspec.cpu_kernels.machine_load.cpu_times", lambda: None)
    out = tmp_path / "plan.json"
    report = kernel_plan.main(["--repeats", "1", "--out", str(out), "model=tiny"])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["widths"] == report["widths"] and len(report["widths"]) == MAX_ROWS
    assert set(report["ms"]) == set(PROBE_ROWS)
    assert report["packing"] == kernels.packing_offered(kernels.linear_weights(load_target(model_config("tiny")).model))
    assert all(set(report["ms"][r]) == {str(w) for w in candidate_widths(r, report["packing"])} for r in PROBE_ROWS)
    assert "| 1 |" in printed and "plan written to" in printed
    # the engine reads that plan from the cache instead of measuring again
    monkeypatch.setattr(kernels, "time_widths", lambda *a, **k: pytest.fail("measured again"))
    model = load_target(model_config("tiny")).model
    assert measured_row_plan(model).widths == tuple(report["widths"])


def test_kernel_plan_script_does_not_write_a_plan_timed_beside_other_work(monkeypatch, tmp_path, capsys):
    from conftest import load_script
    from selfspec.cpu_kernels.machine_load import CpuTimes

    kernel_plan = load_script("kernel_plan")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    busy = iter([CpuTimes(0.0, 0.0, 0.0), CpuTimes(busy=900.0, total=1000.0, own=400.0)])
    monkeypatch.setattr("selfspec.cpu_kernels.machine_load.cpu_times", lambda: next(busy))
    report = kernel_plan.main(["--repeats", "1", "--out", str(tmp_path / "plan.json"), "model=tiny"])
    assert report["written"] is None and report["others_share"] == pytest.approx(0.5)
    assert "plan not written" in capsys.readouterr().out
    assert not (tmp_path / "cache" / "kernel_plans").exists()


# --- grouped projections ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k, v
def test_grouped_projections_compute_the_same_forward_with_fewer_products(monkeypatch, arch):
    """Inside the block each layer's q/k/v and gate/up are one product each (7 linears -> 4), the forward's logits
    equal the ungrouped ones within float32 rounding (each element is the same dot product of at most 128 terms; the
    kernels may sum it in another order), and the parameters keep their values and their state-dict names, now as
    views of one tensor per group, reused on the next entry."""
    from selfspec.core.target import build_tiny

    model, _ = build_tiny(arch, device="cpu")  # the small-batch linears are CPU kernels (any other device: F.linear)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = RowPlan(tuple([2] + list(range(2, MAX_ROWS + 1))))  # every row count through (W @ x.T).T
    calls = _recording_mm(monkeypatch)
    ids = torch.tensor([[5, 9, 40, 7, 3]])
    layers = model.config.num_hidden_layers
    results = {}
    for grouped in ((), (model,)):
        calls.clear()
        with small_batch_linears(model, plan=plan, grouped=grouped), torch.no_grad():
            results[len(grouped)] = model(ids).logits
        results[f"calls{len(grouped)}"] = len(calls)
    assert results["calls0"] == 7 * layers + 1  # 7 linears a layer and the LM head
    assert results["calls1"] == 4 * layers + 1
    scale = float(results[0].abs().max())
    assert (results[1] - results[0]).abs().max() <= 1e-5 * max(scale, 1.0)
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    pointer = q.untyped_storage().data_ptr()
    with small_batch_linears(model, plan=plan, grouped=(model,)):
        assert q.untyped_storage().data_ptr() == pointer  # grouped once: the next entry copies nothing
    assert all("_group" not in m.__dict__ and "_handed" not in m.__dict__ for m in model.modules())


def test_a_member_called_on_another_input_computes_its_own_product():
    torch.manual_seed(0)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = nn.Linear(6, 4), nn.Linear(6, 2), nn.Linear(6, 2)
    plan = RowPlan(tuple(range(1, MAX_ROWS + 1)))
    x, other = torch.randn(2, 6), torch.randn(2, 6)
    with small_batch_linears(parent, plan=plan, grouped=(parent,)), torch.no_grad():
        q = parent.q_proj(x)
        k = parent.k_proj(other)  # not the group's input: its own product, and the handed slice is dropped
        v = parent.v_proj(x)
        v_again = parent.v_proj(x)  # a slice is handed once; a second call computes
    for out, lin, inp in ((q, parent.q_proj, x), (k, parent.k_proj, other), (v, parent.v_proj, x),
                          (v_again, parent.v_proj, x)):
        torch.testing.assert_close(out, nn.functional.linear(inp, lin.weight, lin.bias), rtol=1e-5, atol=1e-6)


def test_projections_that_cannot_be_one_product_are_left_alone():
    from selfspec.cpu_kernels.linear_kernels import group_storage

    a, b = nn.Linear(6, 4), nn.Linear(5, 4)  # different inputs
    assert group_storage([a, b]) is None
    c, d = nn.Linear(6, 4), nn.Linear(6, 4, bias=False)  # a bias on one only
    assert group_storage([c, d]) is None
    e, f = nn.Linear(6, 4), nn.Linear(6, 3, dtype=torch.float64)  # different dtypes
    assert group_storage([e, f]) is None
    f = nn.Linear(6, 3)
    group = group_storage([e, f])
    assert group is not None and group.sizes == (4, 3) and group.weight.shape == (7, 6) and group.bias.shape == (7,)
    assert torch.equal(group.weight[4:], f.weight) and torch.equal(group.bias[:4], e.bias)


# --- packed weights (oneDNN) -------------------------------------------------------------------------------------------

needs_packing = pytest.mark.skipif(not kernels_can_pack(), reason="this PyTorch cannot pack weights for oneDNN here")


def _within_rounding(out: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> None:
    """``out`` equals x @ W.T + b up to float32 rounding of each dot product in any summation order: at most
    (in_features + 1) * eps * sum_i |x_i w_i| (+ |b|) per element."""
    ref = nn.functional.linear(x, lin.weight, lin.bias)
    bound = nn.functional.linear(x.abs(), lin.weight.abs(), None if lin.bias is None else lin.bias.abs())
    eps = torch.finfo(torch.float32).eps
    assert out.shape == ref.shape
    assert ((out - ref).abs() <= (lin.in_features + 1) * eps * bound + 1e-30).all()


def _recording_packed(monkeypatch) -> list[int]:
    from selfspec.cpu_kernels import linear_kernels as kernels

    calls = []
    real = kernels._packed_product
    monkeypatch.setattr(kernels, "_packed_product", lambda x, p: calls.append(x.shape[0]) or real(x, p))
    return calls


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_plan_computes_the_same_at_every_row_count(monkeypatch, bias):
    """Every row count (above MAX_ROWS too, as the plan's last choice was packed) through oneDNN on the weight packed
    once on entry; each result the same dot products as nn.Linear's."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=bias)
    plan = RowPlan((PACKED,) * MAX_ROWS)
    calls = _recording_packed(monkeypatch)
    row_counts = (1, 2, 5, 16, MAX_ROWS, MAX_ROWS + 7)
    with small_batch_linears(lin, plan=plan), torch.no_grad():
        for rows in row_counts:
            x = torch.randn(rows, 96)
            _within_rounding(lin(x), x, lin)
        x3 = torch.randn(2, 3, 96)  # leading dims kept
        _within_rounding(lin(x3), x3, lin)
    assert calls == list(row_counts) + [6]
    assert "_packed" not in lin.__dict__  # the packed copy goes with the swap (and is kept for the module)


@needs_packing
def test_a_packed_weight_is_kept_across_entries_and_packed_again_when_it_changes(monkeypatch):
    from selfspec.cpu_kernels import linear_kernels as kernels

    torch.manual_seed(0)
    lin = nn.Linear(32, 24)
    plan = RowPlan((PACKED,) * MAX_ROWS)
    packs = []
    real = kernels.pack_weight
    monkeypatch.setattr(kernels, "pack_weight", lambda w: packs.append(w.shape) or real(w))
    x = torch.randn(3, 32)
    with small_batch_linears(lin, plan=plan), torch.no_grad():
        lin(x)
    with small_batch_linears(lin, plan=plan), torch.no_grad():
        lin(x)
    assert len(packs) == 1  # the second entry reused the copy
    changes = [
        lambda: lin.weight.mul_(2.0),  # in place: the version counter moves
        lambda: lin.weight.data.add_(1.0),  # through .data (as a LoRA merge writes): only the values tell
        lambda: setattr(lin.weight, "data", torch.randn(24, 32)),  # new storage
        lambda: lin.load_state_dict({"weight": torch.randn(24, 32), "bias": lin.bias.detach().clone()}),
    ]
    for i, change in enumerate(changes):
        with torch.no_grad():
            change()
        with small_batch_linears(lin, plan=plan), torch.no_grad():
            _within_rounding(lin(x), x, lin)  # a stale copy would give the old weight's product
        assert len(packs) == 2 + i


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_grouped_projections_take_the_packed_product_of_the_group(monkeypatch, arch):
    """A group's first member packs the group's stacked weight: 4 packed products a layer and one for the LM head,
    and the logits equal PyTorch's own within float32 rounding (each a dot product of at most 128 terms)."""
    from selfspec.core.target import build_tiny

    model, _ = build_tiny(arch, device="cpu")  # the small-batch linears are CPU kernels (any other device: F.linear)
    model.eval()
    ids = torch.tensor([[5, 9, 40, 7, 3]])
    with torch.no_grad():
        ref = model(ids).logits
    calls = _recording_packed(monkeypatch)
    with small_batch_linears(model, plan=RowPlan((PACKED,) * MAX_ROWS), grouped=(model,)), torch.no_grad():
        out = model(ids).logits
    assert len(calls) == 4 * model.config.num_hidden_layers + 1
    assert (out - ref).abs().max() <= 1e-5 * max(float(ref.abs().max()), 1.0)


def test_a_plan_with_packed_rows_carries_them_above_the_probes():
    plan = RowPlan.from_choices({1: PACKED, 4: 4, 32: PACKED})
    assert plan.width(1) == PACKED and plan.width(3) == 4 and plan.width(5) == PACKED
    assert plan.width(MAX_ROWS) == PACKED and plan.width(MAX_ROWS + 100) == PACKED and plan.packs
    assert RowPlan.from_choices({1: 2, 32: 0}).width(MAX_ROWS + 1) == 0
    assert not RowPlan.default().packs
    assert candidate_widths(3, packed=True) == [PACKED, 0, 3, 4]


def test_packing_is_offered_only_where_the_copies_fit():
    from selfspec.cpu_kernels.linear_kernels import packing_fits

    weights = [torch.zeros(100, 10), torch.zeros(50, 10)]  # 6,000 bytes
    assert packing_fits(weights, memory_bytes=24_000)  # a quarter of the memory
    assert not packing_fits(weights, memory_bytes=23_996)


@needs_packing
def test_an_autocast_region_keeps_pytorch_s_product():
    """Under CPU autocast the input arrives in bfloat16 while the weight (and its packed copy) is float32: the layer
    computes what F.linear computes there (cast to bfloat16), not a product of mixed dtypes."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
        with small_batch_linears(lin, plan=RowPlan((PACKED,) * MAX_ROWS)):
            out = lin(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)


@needs_packing
def test_a_block_entered_inside_another_leaves_the_outer_one_s_groups(monkeypatch):
    """A decoder entering the kernels on a model whose linears an enclosing block already swapped and grouped swaps
    nothing again, and on exit leaves the outer block's groups and packed weights in place."""
    from selfspec.core.target import build_tiny

    model, _ = build_tiny("llama", device="cpu")  # the small-batch linears are CPU kernels (any other device: F.linear)
    model.eval()
    plan = RowPlan((PACKED,) * MAX_ROWS)
    ids = torch.tensor([[5, 9, 40, 7, 3]])
    layers = model.config.num_hidden_layers
    calls = _recording_packed(monkeypatch)
    with small_batch_linears(model, plan=plan, grouped=(model,)), torch.no_grad():
        with small_batch_linears(model, plan=plan, grouped=(model,)) as inner:
            assert inner == 0
        model(ids)
    assert len(calls) == 4 * layers + 1  # still grouped, still packed
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


@needs_packing
def test_a_weight_of_another_dtype_takes_that_dtypes_plan(monkeypatch):
    """The float32 plan pads one and two rows and packs three; the bfloat16 weight takes the plan given for
    bfloat16 (packed at every row count) instead, within bfloat16's rounding, and the float32 weight keeps its own.
    With the plans the other way round, the bfloat16 weight is not even packed."""
    from selfspec.cpu_kernels.linear_kernels import can_pack

    torch.manual_seed(0)
    half = nn.Linear(96, 40).to(torch.bfloat16)
    if not can_pack(half.weight):
        pytest.skip("this PyTorch cannot pack bfloat16 weights for oneDNN here")
    full = nn.Linear(96, 40)
    plan = RowPlan((2, 2) + (PACKED,) * (MAX_ROWS - 2))
    calls = _recording_packed(monkeypatch)
    with small_batch_linears(half, full, plan=plan, plans={torch.bfloat16: RowPlan((PACKED,) * MAX_ROWS)}), \
            torch.no_grad():
        assert half._row_plan.width(1) == PACKED and full._row_plan == plan
        for rows in (1, 2, 3):
            x = torch.randn(rows, 96)
            out = half(x.to(torch.bfloat16)).float()
            ref = nn.functional.linear(x.to(torch.bfloat16).float(), half.weight.float(), half.bias.float())
            # bfloat16 output: each element within a few of its units in the last place of the exact product
            bound = nn.functional.linear(x.abs(), half.weight.float().abs(), half.bias.float().abs())
            assert ((out - ref).abs() <= 2 ** -7 * bound + 1e-6).all()
        assert calls == [1, 2, 3]
        for rows in (1, 2, 3):
            x = torch.randn(rows, 96)
            _within_rounding(full(x), x, full)
    assert calls == [1, 2, 3, 3]  # the float32 weight: one and two rows padded as its plan says
    assert "_row_plan" not in half.__dict__ and "_row_plan" not in full.__dict__
    padded = RowPlan(tuple(range(1, MAX_ROWS + 1)))
    with small_batch_linears(half, full, plan=RowPlan((PACKED,) * MAX_ROWS), plans={torch.bfloat16: padded}), \
            torch.no_grad():
        assert "_packed" not in half.__dict__ and full.__dict__["_packed"] is not None
        half(torch.randn(2, 96).to(torch.bfloat16))
        full(torch.randn(2, 96))
    assert calls == [1, 2, 3, 3, 2]  # the float32 weight's two rows only


def test_each_other_dtype_of_a_drafter_is_measured_on_its_own_weights(monkeypatch, tmp_path):
    """measured_row_plans: the drafter's bfloat16 weights get a plan measured on them alone (its float32 weight is
    the target's dtype: none of its own), and decoding_kernels hands each linear its dtype's plan."""
    import selfspec.cpu_kernels.linear_kernels as kernels

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    drafter = nn.Sequential(nn.Linear(8, 12).to(torch.bfloat16), nn.Linear(12, 8), nn.Linear(8, 6).to(torch.bfloat16))
    runs = []

    def fake_time_widths(weights, probes=PROBE_ROWS, **_):
        runs.append((len(weights), {w.dtype for w in weights}))
        # float32: one row fastest padded to two; bfloat16: PyTorch's own product everywhere
        fast = (1, 2) if weights[0].dtype == torch.float32 else None
        return {(r, w): (0.5 if (r, w) == fast else 1.0 if w == 0 else 2.0) for r in probes
                for w in candidate_widths(r)}

    monkeypatch.setattr(kernels, "time_widths", fake_time_widths)
    plans = kernels.measured_row_plans(model, drafter)
    assert set(plans) == {torch.bfloat16} and runs == [(2, {torch.bfloat16})]
    assert plans[torch.bfloat16].width(1) == 0
    plan = measured_row_plan(model)
    assert plan.width(1) == 2 and runs[-1] == (2, {torch.float32})
    assert kernels.measured_row_plans(model) == {} and kernels.measured_row_plans(model, model) == {}
    with kernels.decoding_kernels(model, drafter, plan=plan, plans=plans):
        assert [m._row_plan for m in drafter] == [plans[torch.bfloat16], plan, plans[torch.bfloat16]]
        assert all(m._row_plan == plan for m in model)
    with kernels.measured_decoding_kernels(model, drafter, linear_kernel="small_batch"):  # read from the cache
        assert [m._row_plan for m in drafter] == [plans[torch.bfloat16], plan, plans[torch.bfloat16]]
    assert len(runs) == 2
