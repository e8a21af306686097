"""Measure this machine's row plan for a target's linear layers (cpu_kernels/linear_kernels.py); print what it timed.

    python scripts/kernel_plan.py                          # SmolLM2: the options per row count, the plan chosen
    python scripts/kernel_plan.py -- model=tiny --repeats 3

The engine measures the plan by itself on its first decode and caches it; this script measures it again (same
method: a pass over a stride of the model's weights per option, medians of ``--repeats`` interleaved rounds), prints
per row count the time of PyTorch's own product, of oneDNN's on packed weights (where offered) and of each padded
width, writes the plan into the cache (so the
engine uses it from now on; not where other processes used the CPUs meanwhile, cpu_kernels/machine_load.py) and the
table as JSON to ``--out``. The config is conf/decode/decode.yaml with the
overrides after ``--`` (its ``model``, ``dtype``, ``device``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.core.errors import reported_errors
from selfspec.core.target import load_target
from selfspec.cpu_kernels.linear_kernels import (PACKED, PLAN_REPEATS, PROBE_ROWS, RowPlan, choose_widths,
                                                 linear_weights, packing_offered, sample_weights, time_widths,
                                                 write_row_plan)
from selfspec.cpu_kernels.machine_load import OthersLoad
from selfspec.decode.settings import target_config_from_overrides


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=PLAN_REPEATS)
    parser.add_argument("--out", default="outputs/kernel_plan.json")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)

    with reported_errors():
        target = load_target(target_config_from_overrides(args.overrides))
        weights = linear_weights(target.model)
        sample = sample_weights(weights)
        packing = packing_offered(weights)
        with OthersLoad() as load:
            seconds = time_widths(sample, repeats=args.repeats, packed=packing)
        plan = RowPlan.from_choices(choose_widths(seconds))
        path = write_row_plan(weights, plan) if load.quiet else None
    rows = {r: {str(w): 1000 * t for (rr, w), t in sorted(seconds.items()) if rr == r} for r in PROBE_ROWS}
    report = {"model": target.name, "threads": torch.get_num_threads(), "weights_timed": len(sample),
              "weights": len(weights), "repeats": args.repeats, "packing": packing, "ms": rows, "widths": list(plan.widths),
              "others_share": load.share, "written": str(path) if path else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{target.name}: one pass over {len(sample)} of its {len(weights)} linear weights, ms (median of "
          f"{args.repeats}); width 0 is PyTorch's own x @ W.T, {PACKED} oneDNN's product on packed weights"
          + ("" if packing else " (not offered here: see selfspec.cpu_kernels.linear_kernels.packing_offered)"))
    print("| rows | PyTorch | packed | padded to: ms | chosen |")
    print("|---|---|---|---|---|")
    names = {0: "PyTorch", PACKED: "packed"}
    for r in PROBE_ROWS:
        padded = ", ".join(f"{w}: {ms:.1f}" for w, ms in rows[r].items() if int(w) > 0)
        packed = f"{rows[r][str(PACKED)]:.1f}" if str(PACKED) in rows[r] else "-"
        chosen = plan.width(r)
        print(f"| {r} | {rows[r]['0']:.1f} | {packed} | {padded} | {names.get(chosen, chosen)} |")
    if path:
        print(f"plan written to {path}")
    else:
        print(f"plan not written: other processes used {load.describe()} of the CPUs while it was timed, so these "
              "are not this machine's own times; run it again when the machine is quiet")
    return report


if __name__ == "__main__":
    main()
