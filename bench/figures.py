"""The benchmark's figures from its per-run records: per method, per category, per prompt source and overall."""

from __future__ import annotations

from selfspec.bench.methods import Method

_SUMS = ("new_tokens", "total_s", "prefill_s", "draft_s", "verify_s", "steps", "drafted", "accepted")


def _totals(records: list[dict], max_depth: int | None) -> dict:
    """Sums over ``records`` of one method, with the accepted-depth counts of its steps."""
    out: dict = {"prompts": len(records), **{k: sum(r.get(k, 0) for r in records) for k in _SUMS}}
    lengths = [a for r in records for a in r.get("accept_lengths", [])]
    out["step_tokens"] = sum(lengths)
    depth = max([max_depth or 0] + [a - 1 for a in lengths])
    out["accepted_at_depth"] = [sum(a - 1 >= d for a in lengths) for d in range(1, depth + 1)]
    peaks = [r.get("peak_memory_bytes") for r in records]
    out["peak_memory_bytes"] = None if not peaks or None in peaks else max(peaks)
    return out


def _rate(t: dict | None) -> float:
    return t["new_tokens"] / t["total_s"] if t and t["total_s"] else 0.0


def _figures(t: dict, engine: bool, hf: dict, vanilla: dict | None) -> dict:
    """tau, acceptance per depth, tokens/s, speedups and time split from a method's totals (``t``) and those of HF
    generate and vanilla decoding on the same prompts."""
    rate = _rate(t)
    fig = {**t, "tokens_per_s": rate, "speedup_vs_hf": rate / _rate(hf) if _rate(hf) else None,
           "speedup_vs_vanilla": rate / _rate(vanilla) if _rate(vanilla) else None}
    if not engine:
        for k in ("prefill_s", "draft_s", "verify_s", "steps", "drafted", "accepted", "step_tokens",
                  "accepted_at_depth"):
            fig.pop(k)
        return {**fig, "tau": None, "acceptance_by_depth": None, "nodes_per_step": None, "split": None}
    steps = t["steps"]
    other = t["total_s"] - t["draft_s"] - t["verify_s"]
    total = t["total_s"] or 1.0
    return {**fig, "tau": t["step_tokens"] / steps if steps else None,
            "acceptance_by_depth": [n / steps for n in t["accepted_at_depth"]] if steps else [],
            "nodes_per_step": (t["drafted"] + steps) / steps if steps else None, "other_s": other,
            "split": {"draft": t["draft_s"] / total, "verify": t["verify_s"] / total, "other": other / total}}


def summarize_runs(records: list[dict], methods: list[Method]) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """Figures per method per category, per prompt source when there are several (keys ``all <source>``, e.g. all
    of MT-bench beside HumanEval; see :func:`source_groups`), and "overall": (categories, {method: {group:
    figures}})."""
    categories = sorted({r["category"] for r in records})
    groups = {c: [r for r in records if r["category"] == c] for c in categories}
    for name in source_groups(records):
        groups[name] = [r for r in records if f"all {r.get('source')}" == name]
    groups["overall"] = records
    figures: dict[str, dict[str, dict]] = {}
    for m in methods:
        figures[m.name] = {}
        for c, recs in groups.items():
            own = lambda name: _totals([r for r in recs if r["method"] == name], None)  # noqa: E731
            has_vanilla = any(x.name == "vanilla" for x in methods)
            t = _totals([r for r in recs if r["method"] == m.name], m.info.get("max_depth"))
            figures[m.name][c] = _figures(t, m.engine, own("hf"), own("vanilla") if has_vanilla else None)
    return categories, figures


def source_groups(records: list[dict]) -> list[str]:
    """``all <source>`` for each prompt source of the run, when it has more than one (none otherwise)."""
    sources = sorted({str(r["source"]) for r in records if r.get("source")})
    return [f"all {s}" for s in sources] if len(sources) > 1 else []
