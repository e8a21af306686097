"""The benchmark's outputs: bench.json, bench.md (also the terminal summary) and three PNG plots."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import transformers


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(split: dict | None, key: str) -> str:
    return "-" if not split else f"{100 * split[key]:.0f}%"


def format_markdown(report: dict) -> str:
    """bench.md: one row per method; per-category speedup over HF generate, then the overall figures."""
    cats, figs = report["categories"] + report.get("sources", []), report["figures"]
    lines = [f"# Decoding benchmark ({report['date']})", "", f"`{report['command']}`", "",
             f"target {report['target']} on {report['machine']['device']} ({report['dtype']}), "
             f"{report['settings']['questions']} questions, max_new_tokens={report['settings']['max_new_tokens']}, "
             f"acceptance {report['settings']['acceptance']}"
             + (", a fresh decoder per question" if report["settings"].get("fresh") else "")
             + (f", vLLM's rows and the others alternating in {report['settings']['vllm_rounds']} rounds of prompts"
                if report["settings"].get("vllm_rounds", 1) > 1 else ""), "",
             "| method | " + " | ".join(f"{c} vs HF" for c in cats) + " | tau | tokens/s | vs HF | vs vanilla "
             "| draft | verify | other | peak MiB |",
             "|---" * (len(cats) + 9) + "|"]
    for name, per_cat in figs.items():
        o = per_cat["overall"]
        mem = "-" if o["peak_memory_bytes"] is None else f"{o['peak_memory_bytes'] / 2**20:.0f}"
        tau = "-" if o["tau"] is None else f"{o['tau']:.2f}"
        lines.append(f"| {name} | " + " | ".join(_x(per_cat[c]["speedup_vs_hf"]) for c in cats)
                     + f" | {tau} | {o['tokens_per_s']:.1f} | {_x(o['speedup_vs_hf'])} | "
                     f"{_x(o['speedup_vs_vanilla'])} | {_pct(o['split'], 'draft')} | {_pct(o['split'], 'verify')} | "
                     f"{_pct(o['split'], 'other')} | {mem} |")
    lines += ["", "Acceptance per draft depth (fraction of steps whose d-th drafted token was accepted):", ""]
    for name, per_cat in figs.items():
        acc = per_cat["overall"]["acceptance_by_depth"]
        if acc:
            lines.append(f"- {name}: " + ", ".join(f"d{d}={a:.2f}" for d, a in enumerate(acc, start=1)))
    costs = {k: v for k, v in (report.get("draft_cost") or {}).items() if v}
    if costs:
        lines += ["", "One draft step against one one-token target forward (a whole proposal at full depth, and per "
                  "draft step: one per proposal, or one per level for EAGLE trees):", "",
                  "| method | proposal ms | levels | nodes | draft steps | forward ms | draft step / forward |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {c['propose_ms']:.2f} | {c['levels']} | {c['nodes']} | {c['draft_steps']} | "
                  f"{c['forward_ms']:.2f} | {c['step_vs_forward']:.1%} |" for name, c in costs.items()]
    if report.get("early_exit"):
        lines += ["", f"hf_early_exit: assistant_early_exit={report['early_exit']['layer']}"]
    for name, error in (report.get("vllm_not_run") or {}).items():
        lines += ["", f"{name} did not run in vLLM: {' '.join(error.split())[:300]}"]
    lines += ["", _mismatch_text(report)]
    return "\n".join(lines) + "\n"


def _mismatch_text(report: dict) -> str:
    if not report["lossless_checked"]:
        return "Losslessness not checked (sampling: outputs differ from HF generate's by design)."
    if not report["mismatches"]:
        return "Lossless: every method's tokens equal HF generate's on every prompt."
    lines = [f"**LOSSLESSNESS MISMATCHES ({len(report['mismatches'])})**", ""]
    lines += [f"- {m['method']}: question {m['question_id']} turn {m['turn']}, new token {m['position']}: "
              f"HF {m['hf_token']}, {m['method']} {m['method_token']}" for m in report["mismatches"]]
    return "\n".join(lines)


def write_plots(report: dict, out: Path) -> list[Path]:
    """speedup_by_category.png, tree_size.png, verify_cost.png (matplotlib's Agg canvas, no display needed)."""
    # deferred: matplotlib (slow to import) only when the plots are written
    from matplotlib.figure import Figure

    cats, figs = report["categories"] + report.get("sources", []) + ["overall"], report["figures"]
    fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(figs)) / 3), 4))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(figs))
    for i, (name, per_cat) in enumerate(figs.items()):
        ax.bar([j + i * width for j in range(len(cats))], [per_cat[c]["speedup_vs_hf"] or 0 for c in cats],
               width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speedup over HF generate")
    ax.legend(fontsize="small")
    paths = [_save(fig, out / "speedup_by_category.png")]

    fig = Figure(figsize=(9, 4))
    ax_tau, ax_speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, per_cat in figs.items():
        o = per_cat["overall"]
        if o["nodes_per_step"] is None:
            continue
        for ax, value in ((ax_tau, o["tau"]), (ax_speed, o["speedup_vs_hf"] or 0)):
            ax.scatter([o["nodes_per_step"]], [value])
            ax.annotate(name, (o["nodes_per_step"], value), fontsize="small")
    ax_tau.set(xlabel="nodes verified per step", ylabel="tau (tokens per target forward)")
    ax_speed.set(xlabel="nodes verified per step", ylabel="speedup over HF generate")
    paths.append(_save(fig, out / "tree_size.png"))

    fig = Figure(figsize=(5, 4))
    ax = fig.add_subplot()
    for kernel, rows in report["verify_cost"]["curves"].items():
        ax.plot([r["nodes"] for r in rows], [r["ms"] for r in rows], marker="o", label=f"linear layers: {kernel}")
    ax.set(xlabel="tree nodes verified", ylabel="ms per target forward", xscale="log")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "verify_cost.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_outputs(report: dict, out: Path) -> list[Path]:
    """bench.json, bench.md and the plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(format_markdown(report))
    return [out / "bench.json", out / "bench.md", *write_plots(report, out)]


def format_report(report: dict) -> str:
    """The terminal summary: bench.md's table and the losslessness verdict."""
    return format_markdown(report).split("\n", 2)[2]
