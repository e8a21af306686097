"""Linear layers that stay cheap for the few rows speculative decoding feeds them on a CPU.

A tree-verify forward runs every linear layer of the target on N rows (the tree's nodes), a plain decoding step and
most draft steps on one. Which BLAS kernel PyTorch's ``x @ W.T`` reaches for a given number of rows, and how well it
streams a weight too large for the caches, varies between CPUs, and the differences are large:

- on an AVX2 CPU (MKL), one row takes a matrix-vector kernel that reads each weight once, while 2..16 rows cost far
  more: the GEMM handles the large weight as the operand it packs, an extra pass over memory;
- on an AVX-512 CPU (AMD EPYC, 2 cores), one row takes a matrix-vector kernel that streams the weights well below the
  bandwidth a two-row product reaches, and 8 rows cost about what 16 do (docs/journal/2026-12-01-figures-from-code.md).

Computing the same product as ``(W @ x.T).T`` makes the small activation the packed operand and streams the weight
once, and padding the rows (with zeros) to a width the BLAS runs fastest keeps it on its best kernel. The best width
for each number of rows is measured once per machine (:func:`measured_row_plan`, cached as JSON under the selfspec
cache), on the model's own weights: a :class:`RowPlan` says, for 1..``MAX_ROWS`` rows, whether to pad them to some
width for ``(W @ x.T).T`` or to leave the product to PyTorch.

:func:`small_batch_linears` swaps every plain ``nn.Linear`` of the given modules to :class:`SmallBatchLinear` (same
parameters, same state dict) for the duration of a ``with`` block and swaps them back after. The results are the
same products in another summation order (float rounding differs at the last bits, as between any two BLAS kernels).

**Grouped projections.** A decoder layer reads one input through several linears: attention's ``q_proj``,
``k_proj``, ``v_proj`` and the MLP's ``gate_proj``, ``up_proj`` (``PROJECTION_GROUPS``). Serving engines merge each
group into one product (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``). For the modules named in
``grouped``, :func:`small_batch_linears` does the same without changing the model's code: :func:`group_storage`
makes a group's weights (and biases) consecutive row slices of one tensor, once (the values are unchanged, and no
memory is added: the parameters become views of it); inside the block the group's first linear computes the whole
group's product and hands each later member its slice when that member is called on the same input tensor (any
other input: its own product). A plain decoding step of SmolLM2 on a 2-core AMD EPYC (Zen 5) got faster so
(docs/journal/2026-12-01-figures-from-code.md): each product a step skips saves its padding, its kernel call and its
copies. Each output element is the same dot product as before.

**Packed weights (oneDNN).** The fastest product measured for small row counts on a CPU is none of the BLAS calls
above but oneDNN's, on a weight reordered once into the blocked layout its kernel reads (``PACKED`` in a plan: what
PyTorch's compiler and vLLM's CPU backend run). It streams the weight once at any row count, so that verifying 16
rows costs little more than one (SmolLM2 on a 2-core AMD EPYC, Zen 5: docs/benchmarks.md, the engine's cost curve;
docs/journal/2026-12-01-figures-from-code.md). The packed copy is as large as the weight:
it is made at the first decode (:func:`packed_weight`), kept while the module lives and made again when the weight
changes; the option is measured only where every linear weight of the model packed takes at most
``PACK_MEMORY_SHARE`` of the machine's memory (:func:`packing_fits`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.cpu_kernels.allocator import keep_freed_memory
from selfspec.cpu_kernels.attention import grouped_query_attention
from selfspec.cpu_kernels.lean_layers import lean_layers
from selfspec.cpu_kernels.machine_load import OthersLoad
from selfspec.core.errors import SettingError
from selfspec.core.folders import cache_dir

MAX_ROWS = 64  # rows a plan covers; above, PyTorch's product, or the packed one where MAX_ROWS rows take it
KERNELS = ("auto", "torch", "small_batch")
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # row counts measured; others take the next one up's choice
PLAN_REPEATS = 5  # timings per (rows, width), all interleaved; the median of each
PLAN_METHOD = 4  # part of the cache key: plans measured by an earlier method are measured again
PACKED = -1  # a RowPlan width: oneDNN's product on the weight packed once for it (see the module doc)
PACK_ROWS = 16  # the row count a weight is packed for; any count runs on it (packed for 8, 16 or 64 timed alike)
PACK_MEMORY_SHARE = 0.25  # packing is measured only if the packed copies take at most this share of the memory


def padded_rows(rows: int) -> int:
    """Rows rounded up to a multiple of 4 (of 8 above 8): the widths the BLAS kernels ran fastest on an AVX2 CPU
    (an 8-float register). The plan used before a machine's own has been measured."""
    return -(-rows // 4) * 4 if rows <= 8 else -(-rows // 8) * 8


def candidate_widths(rows: int, packed: bool = False) -> list[int]:
    """The options measured for ``rows`` rows: ``PACKED`` (oneDNN on a packed weight) if ``packed``, 0 (PyTorch's
    own product) and the widths ``(W @ x.T).T`` may pad to: the rows themselves, and rounded up to a multiple of 2,
    4, 8 or 16, at most doubled and at most ``MAX_ROWS``."""
    widths = {rows, *(-(-rows // m) * m for m in (2, 4, 8, 16))}
    return [PACKED] * packed + [0] + sorted(w for w in widths if w <= min(2 * rows, MAX_ROWS))


@dataclass(frozen=True)
class RowPlan:
    """For 1..``MAX_ROWS`` input rows, ``widths[rows - 1]``: the width the rows are padded to for ``(W @ x.T).T``,
    0 for PyTorch's own ``F.linear``, or ``PACKED`` for oneDNN's product on the packed weight. More rows than
    ``MAX_ROWS`` take the packed product if ``MAX_ROWS`` rows do, else PyTorch's."""

    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.widths) != MAX_ROWS or any(w not in (0, PACKED) and not r <= w <= MAX_ROWS
                                               for r, w in enumerate(self.widths, start=1)):
            raise ValueError(f"RowPlan: need {MAX_ROWS} widths, each 0, {PACKED} (packed) or from its row count to "
                             f"{MAX_ROWS}.")

    def width(self, rows: int) -> int:
        if 1 <= rows <= MAX_ROWS:
            return self.widths[rows - 1]
        return PACKED if rows > MAX_ROWS and self.widths[-1] == PACKED else 0

    @property
    def packs(self) -> bool:
        """Whether some row count takes the packed product (so the weights are packed on entry)."""
        return PACKED in self.widths

    @classmethod
    def default(cls) -> "RowPlan":
        """Before a measurement: one row to PyTorch, 2..MAX_ROWS padded by :func:`padded_rows`."""
        return cls(tuple(0 if r == 1 else padded_rows(r) for r in range(1, MAX_ROWS + 1)))

    @classmethod
    def from_choices(cls, chosen: dict[int, int]) -> "RowPlan":
        """From the width chosen for each measured row count (``PROBE_ROWS``): a row count between two measured ones
        takes the choice of the next one up (padding it there, or PyTorch's product if that was chosen); one above
        them all takes the largest one's kernel (unpadded if that was ``(W @ x.T).T``)."""
        probes = sorted(chosen)
        top = chosen[probes[-1]]
        widths = []
        for rows in range(1, MAX_ROWS + 1):
            probe = next((p for p in probes if p >= rows), None)
            widths.append(chosen[probe] if probe is not None else (top if top in (0, PACKED) else rows))
        return cls(tuple(widths))


def choose_widths(seconds: dict[tuple[int, int], float]) -> dict[int, int]:
    """{(rows, width): time} -> {rows: the fastest width} (on a tie, the smaller width: ``PACKED``, then 0,
    PyTorch's, then the narrowest padding)."""
    best: dict[int, tuple[float, int]] = {}
    for (rows, width), t in seconds.items():
        if rows not in best or (t, width) < best[rows]:
            best[rows] = (t, width)
    return {rows: width for rows, (_, width) in best.items()}


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W.T by oneDNN, W packed by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def _product(weight: torch.Tensor, x: torch.Tensor, width: int, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight.T as the plan's kernel: ``PACKED`` -> oneDNN on ``packed`` (``weight`` packed by
    :func:`pack_weight`; without it, F.linear); 0 -> F.linear; else (W @ x.T).T with x zero-padded to width.
    Both x and the result are made row-major: the BLAS is several times slower on a column-major x.T (the layout a
    previous small-batch product leaves), and elementwise ops after it slower on a transposed result."""
    if width == PACKED and packed is not None:
        return _packed_product(x, packed)
    if width <= 0:
        return F.linear(x, weight)
    rows = x.shape[0]
    if width != rows:
        x = torch.cat([x, x.new_zeros(width - rows, x.shape[1])])
    return torch.mm(weight, x.contiguous().t()).t()[:rows].contiguous()


@torch.no_grad()
def time_widths(weights: Sequence[torch.Tensor], probes: Sequence[int] = PROBE_ROWS, repeats: int = PLAN_REPEATS,
                clock: Callable[[], float] = time.perf_counter,
                packed: bool | None = None) -> dict[tuple[int, int], float]:
    """Median time of one pass over ``weights`` (a forward's worth of products, so that weights come from memory as
    in a forward) per (rows, width) option of :func:`candidate_widths`, options interleaved across repeats (in
    alternating order, so that a drift of the machine's speed hits all alike). ``packed``: whether to time oneDNN's
    product on packed weights too (default: where :func:`can_pack` says this machine can; the weights are packed
    before the timing)."""
    weights = list(weights)
    if packed is None:
        packed = all(can_pack(w) for w in weights)
    packs = [pack_weight(w) for w in weights] if packed else [None] * len(weights)
    options = [(rows, width) for rows in probes for width in candidate_widths(rows, packed)]
    inputs = {rows: [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
              for rows in probes}
    times: dict[tuple[int, int], list[float]] = {o: [] for o in options}
    for r in range(repeats + 1):  # the first round warms up; every other round runs the options backwards
        for rows, width in options if r % 2 else options[::-1]:
            t0 = clock()
            for w, x, p in zip(weights, inputs[rows], packs):
                _product(w, x, width, p)
            if r:
                times[(rows, width)].append(clock() - t0)
    return {o: statistics.median(t) for o, t in times.items()}


# --- packed weights (oneDNN) -----------------------------------------------------------------------------------------

_CAN_PACK: dict[tuple[torch.dtype, str], bool] = {}


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this machine's PyTorch runs oneDNN's packed product for ``weight``'s dtype on its device (CPUs only;
    tried once per dtype on a small weight, checked against F.linear)."""
    key = (weight.dtype, weight.device.type)
    if key not in _CAN_PACK:
        ok = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if ok:
            try:
                with torch.no_grad():
                    w = torch.randn(8, 16).to(weight.dtype)
                    x = torch.randn(3, 16).to(weight.dtype)
                    ok = bool(torch.allclose(_product(w, x, PACKED, pack_weight(w)).float(),
                                             F.linear(x, w).float(), rtol=1e-2, atol=1e-2))
            except (RuntimeError, AttributeError, NotImplementedError):
                ok = False
        _CAN_PACK[key] = ok
    return _CAN_PACK[key]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into the layout oneDNN's linear kernel reads (a copy, as large)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packing_fits(weights: Sequence[torch.Tensor], memory_bytes: int | None = None) -> bool:
    """Whether packed copies of ``weights`` take at most ``PACK_MEMORY_SHARE`` of ``memory_bytes`` (default: this
    machine's physical memory): the copy is kept beside the weights while the model lives."""
    if memory_bytes is None:
        # deferred: psutil is accelerate's dependency, not selfspec's; read only to size packing
        import psutil

        memory_bytes = psutil.virtual_memory().total
    return sum(w.numel() * w.element_size() for w in weights) <= PACK_MEMORY_SHARE * memory_bytes


# module -> (what its packed weight was made from, a sample of its values, the packed weight); dropped with the module
_PACKS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor, torch.Tensor]]" = weakref.WeakKeyDictionary()
PACK_SAMPLE = 256  # values of a weight compared on each entry with those it was packed from


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: it cannot change outside inference mode
        return 0


def packed_weight(module: nn.Module, weight: torch.Tensor, versions: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``weight`` packed for ``module`` (its own weight, or its projection group's), from the copy kept for it if
    ``weight`` has not changed since (same storage, shape and dtype; none of ``versions`` written in place; a stride
    of ``PACK_SAMPLE`` of its values equal, which catches writes through ``.data`` that skip the version counter,
    as a LoRA merge does), else packed anew and kept. None where this machine cannot pack it."""
    if not can_pack(weight):
        return None
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype,
           tuple(_version(v) for v in versions))
    flat = weight.detach().reshape(-1)
    sample = flat[::max(1, flat.numel() // PACK_SAMPLE)]
    kept = _PACKS.get(module)
    if kept is not None and kept[0] == key and torch.equal(kept[1], sample):
        return kept[2]
    _PACKS.pop(module, None)  # free the stale copy before making the new one
    packed = pack_weight(weight)
    _PACKS[module] = (key, sample.clone(), packed)
    return packed


def linear_weights(*modules: nn.Module | None) -> list[torch.Tensor]:
    """The weights of every ``nn.Linear`` under ``modules``, each once (a tied LM head counted once)."""
    seen, weights = set(), []
    for module in modules:
        for sub in module.modules() if module is not None else ():
            if isinstance(sub, nn.Linear) and id(sub.weight) not in seen:
                seen.add(id(sub.weight))
                weights.append(sub.weight)
    return weights


def sample_weights(weights: Sequence[torch.Tensor], max_bytes: int = 192 << 20) -> list[torch.Tensor]:
    """Every k-th weight, k chosen so that about ``max_bytes`` remain (more than the caches hold, so the pass still
    streams weights from memory as a forward does; a stride keeps the mix of a layer's shapes), and the largest one
    (an LM head) always: what :func:`time_widths` runs, so that measuring takes seconds."""
    weights = list(weights)
    total = sum(w.numel() * w.element_size() for w in weights)
    step = max(1, -(-total // max_bytes))
    sample = weights[::step]
    largest = max(weights, key=lambda w: w.numel())
    return sample if any(w is largest for w in sample) else sample + [largest]


def _plan_file(weights: Sequence[torch.Tensor]) -> Path:
    key = json.dumps({"shapes": [list(w.shape) for w in weights], "dtype": str(weights[0].dtype),
                      "device": str(weights[0].device), "threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "method": PLAN_METHOD, "max_rows": MAX_ROWS, "packing": packing_offered(weights)},
                     sort_keys=True)
    return cache_dir() / "kernel_plans" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measured_row_plan(*modules: nn.Module | None, dtype: torch.dtype | None = None) -> RowPlan:
    """The :class:`RowPlan` for the linear layers of ``modules`` (those whose weights are in ``dtype``, if given) on
    this machine: measured on their own weights the first time (a short one-off cost for SmolLM2-135M on a CPU),
    then read from the cache; the packed product is among the options where :func:`packing_offered` says so. A plan
    measured while other processes used the CPUs (cpu_kernels/machine_load.py) is this process's alone: the next
    process measures again. Off a CPU the small-batch product is not used and the default plan is returned
    unmeasured."""
    weights = [w for w in linear_weights(*modules) if dtype is None or w.dtype == dtype]
    if not weights or weights[0].device.type != "cpu":
        return RowPlan.default()
    path = _plan_file(weights)
    try:
        return RowPlan(tuple(int(w) for w in json.loads(path.read_text())["widths"]))
    except (OSError, ValueError, KeyError, TypeError):  # missing, or unreadable: measure it (again)
        pass
    if path in _UNKEPT:
        return _UNKEPT[path]
    with OthersLoad() as load:
        plan = RowPlan.from_choices(choose_widths(time_widths(sample_weights(weights),
                                                              packed=packing_offered(weights))))
    if load.quiet:
        write_row_plan(weights, plan)
    else:  # beside other work: this process's plan only, measured again by the next one
        _UNKEPT[path] = plan
        print(f"[selfspec] the kernel plan was measured while other processes used {load.describe()} of the CPUs: "
              "used now, not kept (measured again next time)", file=sys.stderr)
    return plan


_UNKEPT: dict[Path, RowPlan] = {}  # plans measured beside other work, this process's alone


def measured_row_plans(model: nn.Module, *modules: nn.Module | None) -> dict[torch.dtype, RowPlan]:
    """A plan for each dtype of the ``modules``' linear weights (a drafter's) that ``model``'s weights are not in,
    measured on the ``modules``' weights in it (:func:`measured_row_plan`); ``model``'s own dtype takes
    ``measured_row_plan(model)``. A plan holds for the dtype it was measured in: a drafter's decode form in bfloat16
    (decode/dflash_drafter.py) beside a float32 target runs other kernels. Its draft LM head (10,742 x 576, one and
    two rows) on a 2-core AMD EPYC (Zen 5) ran fastest packed, slower through F.linear and slowest padded, as the
    target's plan pads two rows (docs/journal/2026-12-01-figures-from-code.md)."""
    own = {w.dtype for w in linear_weights(model)}
    return {dtype: measured_row_plan(*modules, dtype=dtype)
            for dtype in sorted({w.dtype for w in linear_weights(*modules)} - own, key=str)}


def packing_offered(weights: Sequence[torch.Tensor]) -> bool:
    """Whether a plan for ``weights`` (a model's linear weights, all of them) may choose the packed product: this
    machine can pack them and the copies fit (:func:`can_pack`, :func:`packing_fits`)."""
    return bool(weights) and all(can_pack(w) for w in weights) and packing_fits(weights)


def write_row_plan(weights: Sequence[torch.Tensor], plan: RowPlan) -> Path:
    """Cache ``plan`` as the one for these weights on this machine (atomically); returns the file."""
    path = _plan_file(weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"widths": list(plan.widths)}))
    os.replace(tmp, path)
    return path


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` computing its product as its :class:`RowPlan` says for the number of input rows: ``(W @ x.T).T``
    on rows padded to a width, or oneDNN's product on the weight packed on entry (``_packed``), when the input is on a
    CPU and no gradient is needed (see the module doc). The first linear of a projection group (``_group``) computes
    the group's product and leaves each later member its slice (``_handed``)."""

    _row_plan: RowPlan = RowPlan.default()
    _group: "ProjectionGroup | None" = None
    _handed: "tuple[torch.Tensor, torch.Tensor] | None" = None
    _packed: "torch.Tensor | None" = None  # this linear's weight, or its group's, packed (PACKED plans only)
    # what lean_layers.py's whole-stack forward calls for this linear's products (that module is below this one)
    stack_product = staticmethod(_product)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        handed = self.__dict__.pop("_handed", None)
        if handed is not None and handed[0] is x:  # a later member of a group, called on the group's input
            return handed[1]
        y = self._planned_product(x)
        if y is None:
            return F.linear(x, self.weight, self.bias)
        group = self._group
        if group is None:
            return y.reshape(*x.shape[:-1], self.out_features)
        parts = y.split(group.sizes, dim=1)
        for member, part in zip(group.members[1:], parts[1:]):
            member.__dict__["_handed"] = (x, part.reshape(*x.shape[:-1], part.shape[1]))
        return parts[0].reshape(*x.shape[:-1], self.out_features)

    def group_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., in] -> [..., sum of the group's out_features]: every member's output side by side, in the group's
        order, as the first member's call computes them (the same product), for a caller that reads the group as one
        (cpu_kernels/lean_layers.py). None where this linear leads no group or its plan leaves the product to
        PyTorch (then each member's own call)."""
        if self._group is None:
            return None
        y = self._planned_product(x)
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[1])

    def _planned_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., in] as rows [rows, in] @ the weight (its group's, if it leads one) + bias, by this linear's plan;
        None where the plan, the device, a gradient or the dtype leaves the product to F.linear."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        width = self.kernel_width(rows)
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if (width is None or x.device.type != "cpu" or grad
                or x.dtype != self.weight.dtype):  # another dtype: an autocast region's, whose F.linear casts
            return None
        group = self._group
        weight, bias = (self.weight, self.bias) if group is None else (group.weight, group.bias)
        y = _product(weight, x.reshape(rows, x.shape[-1]), width, self._packed)
        return y if bias is None else y + bias

    def kernel_width(self, rows: int) -> int | None:
        """The plan's width for ``rows`` rows, None where the plan leaves the product to F.linear (0, or ``PACKED``
        without a packed weight)."""
        width = self._row_plan.width(rows)
        return None if width == 0 or (width == PACKED and self._packed is None) else width


# --- grouped projections -------------------------------------------------------------------------------------------

PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class ProjectionGroup:
    """Linears that read one input, in call order: their weights (and biases) as one tensor of stacked rows."""

    members: tuple[nn.Linear, ...]
    weight: torch.Tensor  # [sum of out_features, in_features], the members' weights are its row slices
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row slices ``tensors`` are (a view of their shared storage), or None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                   first.stride())


def group_storage(members: Sequence[nn.Linear]) -> ProjectionGroup | None:
    """``members``' weights (and biases) as consecutive row slices of one tensor: already so, or made so once (their
    values copied into one new tensor and the parameters pointed at its slices; the old storage is freed). None when
    they cannot be one product: different input sizes, dtypes or devices, or biases on some only. (Gradients still
    reach each parameter: training through the members' own products is unchanged.)"""
    weights = [m.weight for m in members]
    biases = [m.bias for m in members]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return None
    stacks = []
    for params in (weights, biases if biases[0] is not None else None):
        if params is None:
            stacks.append(None)
            continue
        stacked = _stacked(params)
        if stacked is None:
            stacked = torch.cat([p.detach() for p in params])
            start = 0
            for p in params:
                p.data = stacked[start:start + p.shape[0]]
                start += p.shape[0]
        stacks.append(stacked)
    return ProjectionGroup(members=tuple(members), weight=stacks[0], bias=stacks[1],
                           sizes=tuple(w.shape[0] for w in weights))


def projection_groups(*modules: nn.Module | None) -> list[ProjectionGroup]:
    """The projection groups (``PROJECTION_GROUPS``) of every submodule of ``modules`` whose members are all plain
    linears (or already swapped :class:`SmallBatchLinear`), their storage grouped by :func:`group_storage`."""
    groups = []
    for module in modules:
        for sub in module.modules() if module is not None else ():
            for names in PROJECTION_GROUPS:
                members = [getattr(sub, n, None) for n in names]
                if all(type(m) in (nn.Linear, SmallBatchLinear) for m in members):
                    group = group_storage(members)
                    if group is not None:
                        groups.append(group)
    return groups


def use_small_batch(kernel: str, device: torch.device | str) -> bool:
    """Whether ``linear_kernel=kernel`` means the small-batch linears on ``device`` (auto: on CPUs only)."""
    if kernel not in KERNELS:
        raise SettingError(f"linear_kernel={kernel!r}: use one of {', '.join(KERNELS)}.")
    return kernel == "small_batch" or (kernel == "auto" and torch.device(device).type == "cpu")


@contextmanager
def decoding_kernels(model: nn.Module, *modules: nn.Module | None, plan: RowPlan | None,
                     plans: Mapping[torch.dtype, RowPlan] | None = None, lean: bool = True) -> Iterator[int]:
    """The kernels a decode runs ``model`` and ``modules`` with, for a ``with`` block: their linears as
    :func:`small_batch_linears` (``model``'s projection groups grouped) where ``plan`` is given (None: PyTorch's
    own), a weight of a dtype in ``plans`` with that dtype's plan instead (:func:`measured_row_plans`), their
    attention as cpu_kernels/attention.py runs it, and ``model``'s Llama-form layers as cpu_kernels/lean_layers.py
    runs them (``lean``; the drafters' modules keep their own). With a plan (the kernels on a CPU), the process
    keeps freed activation memory for the next forward (cpu_kernels/allocator.py). Yields how many linears were
    swapped."""
    if plan is not None:
        keep_freed_memory()
    with small_batch_linears(model, *modules, enabled=plan is not None, plan=plan, plans=plans,
                             grouped=(model,)) as swapped, grouped_query_attention(model, *modules), \
            lean_layers(model, enabled=lean):
        yield swapped


def measured_decoding_kernels(model: nn.Module, *modules: nn.Module | None,
                              linear_kernel: str = "auto") -> AbstractContextManager[int]:
    """:func:`decoding_kernels` as decoding with ``linear_kernel`` runs them on the model's device (small-batch
    linears where the kernel says so, with this machine's measured plans), for measurements that must see the costs
    decoding pays."""
    if not use_small_batch(linear_kernel, next(model.parameters()).device):
        return decoding_kernels(model, *modules, plan=None)
    return decoding_kernels(model, *modules, plan=measured_row_plan(model), plans=measured_row_plans(model, *modules))


@contextmanager
def small_batch_linears(*modules: nn.Module | None, enabled: bool = True, plan: RowPlan | None = None,
                        grouped: Sequence[nn.Module] = (),
                        plans: Mapping[torch.dtype, RowPlan] | None = None) -> Iterator[int]:
    """Within the block, every plain ``nn.Linear`` under ``modules`` is a :class:`SmallBatchLinear` padding rows as
    ``plan`` says (default: :meth:`RowPlan.default`), or as ``plans`` says for its weight's dtype where that names
    it (a plan is measured on weights of one dtype: another dtype's products run other kernels); yields how many
    were swapped. Subclasses of ``nn.Linear`` (quantized, LoRA, ...) are left alone. The projection groups under
    ``grouped`` (among ``modules``; their parameters become views of one tensor per group, see the module doc)
    compute one product per group. Where a swapped linear's plan takes the packed product, its weight (a group's
    first member: the group's) is packed on entry, or its kept copy reused (:func:`packed_weight`)."""
    swapped: list[nn.Module] = []
    groups: list[ProjectionGroup] = []
    if enabled:
        for module in modules:
            if module is None:
                continue
            for sub in module.modules():
                if type(sub) is nn.Linear:  # a module reached twice is already swapped: no longer a plain nn.Linear
                    sub.__class__ = SmallBatchLinear
                    own = (plans or {}).get(sub.weight.dtype, plan)
                    if own is not None:
                        sub.__dict__["_row_plan"] = own
                    swapped.append(sub)
        # a group an enclosing block already runs stays that block's (entered again, e.g. by a decoder inside a
        # training run that swapped the target, this block sets and undoes only what it swapped itself)
        groups = [g for g in projection_groups(*grouped)
                  if all(type(m) is SmallBatchLinear for m in g.members) and "_group" not in g.members[0].__dict__]
        for group in groups:
            group.members[0].__dict__["_group"] = group
        firsts = {id(g.members[0]): g for g in groups}
        for sub in swapped:
            if sub._row_plan.packs:  # its own plan (the class default: none)
                group = firsts.get(id(sub))
                weight, versions = ((sub.weight, (sub.weight,)) if group is None
                                    else (group.weight, tuple(m.weight for m in group.members)))
                sub.__dict__["_packed"] = packed_weight(sub, weight, versions)
    try:
        yield len(swapped)
    finally:
        for group in groups:
            for member in group.members:
                member.__dict__.pop("_group", None)
                member.__dict__.pop("_handed", None)
        for sub in swapped:
            sub.__dict__.pop("_row_plan", None)
            sub.__dict__.pop("_packed", None)
            sub.__class__ = nn.Linear
