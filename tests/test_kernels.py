"""decode.kernels: the small-batch linear layers the engine swaps in on a CPU compute what nn.Linear computes, and
the swap is undone after the block (also on errors), touching nothing but plain nn.Linear modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decode.kernels import MAX_ROWS, SmallBatchLinear, small_batch_linears, use_small_batch


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
    from decode.kernels import padded_rows

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
