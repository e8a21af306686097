"""Draft vocabulary size against tau and drafting cost, from one trained DFlash drafter whose draft LM head is the
target's own rows (``heads.freeze_lm_head=true``, as the hour recipes train it). Such a head holds nothing learned,
so the same drafter over any other set of the target's rows is what training with that vocabulary would give, up to
the loss's normalisation over the draft vocabulary. For each size this writes a copy of the heads with the ``size``
most frequent answer tokens of ``--data`` (counted as training counts them: the target's tokens of each record's
answers) and the target's rows for them; then one ``scripts/bench.py`` run decodes every copy alone, prompt by
prompt, and reports each one's tau and its draft step against a target forward.

    python scripts/draft_vocab.py --heads outputs/dflash-gemma3-cpu1h/heads --data outputs/regen/gemma-text.jsonl \\
        --sizes 1024,2048,4096,8192,16384,32768 --out outputs/draft-vocab
    # then the printed command, e.g.
    python scripts/bench.py model=gemma3_270m chat=false 'heads=[outputs/draft-vocab/v1024,...]' \\
        'prompts=[outputs/openings.jsonl,humaneval]' limit=8 max_new_tokens=128 methods=[hf,heads] \\
        draft.suffix=false draft.adaptive=false out=outputs/draft-vocab/bench

Writes ``--out``/v<size>/ (heads folders) and coverage.json (each size's share of the answer tokens).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from selfspec.core.errors import SettingError, reported_errors
from selfspec.core.records import parse_turns
from selfspec.decode.session import load_session
from selfspec.decode.settings import decode_config
from selfspec.heads.io import head_builder, save_heads
from selfspec.heads.vocab import build_draft_vocab, count_tokens


def answer_counts(path: Path, tokenizer, vocab_size: int) -> torch.Tensor:
    """Token counts [V] of every assistant turn of the records in ``path`` (JSONL, any form core/records.py reads)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            turns, _ = parse_turns(json.loads(line))
            for turn in turns or ():
                if turn["role"] == "assistant":
                    ids = torch.tensor(tokenizer(turn["content"], add_special_tokens=False)["input_ids"],
                                       dtype=torch.long)
                    counts += count_tokens(ids, vocab_size)
    return counts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", required=True, help="a trained DFlash heads folder with the target's LM head rows")
    p.add_argument("--data", required=True, help="the JSONL its answers are counted from (what it trained on)")
    p.add_argument("--sizes", required=True, help="draft vocabulary sizes, comma-separated")
    p.add_argument("--out", required=True, help="a new folder for the copies")
    a = p.parse_args(argv)
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    session = load_session(decode_config({"heads": a.heads}))
    config = session.heads_config or {}
    if config.get("head_type") != "dflash" or not (config.get("heads") or {}).get("freeze_lm_head"):
        raise SettingError(f"{a.heads}: give DFlash heads trained with heads.freeze_lm_head=true (their draft LM head "
                           "is the target's rows, so other rows can replace them); these are "
                           f"{config.get('head_type')} heads, their draft LM head trained.")
    target = session.target.model
    vocab_size = int(target.config.vocab_size)
    counts = answer_counts(Path(a.data), session.target.tokenizer, vocab_size)
    if int(counts.sum()) == 0:
        raise SettingError(f"{a.data}: no assistant turns to count.")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    learned = {k: v for k, v in session.heads.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    coverage = {}
    for size in sizes:
        d2t, t2d = build_draft_vocab(counts, size)
        head_config = {**config["head_config"], "draft_vocab_size": int(d2t.numel())}
        module = head_builder("dflash")(head_config, target)
        module.load_state_dict(learned, strict=False)
        module.set_draft_vocab(d2t, init_lm_head_from=target.get_output_embeddings())
        coverage[size] = float(counts[t2d].sum()) / float(counts.sum())
        extra = {k: config[k] for k in ("run_name", "steps", "data", "trainer", "heads", "features") if k in config}
        save_heads(out / f"v{size}", module, "dflash", head_config, session.target,
                   extra_meta={**extra, "draft_vocab_coverage": coverage[size], "draft_vocab_from": str(a.heads)},
                   overwrite=False)
        print(f"v{size}: covers {coverage[size]:.1%} of the answer tokens", file=sys.stderr)
    (out / "coverage.json").write_text(json.dumps({"heads": a.heads, "data": a.data, "coverage": coverage}, indent=2))
    folders = ",".join(str(out / f"v{s}") for s in sizes)
    print("bench: " + shlex.join(["python", "scripts/bench.py", f"heads=[{folders}]", "methods=[hf,heads]",
                                  "draft.suffix=false", "draft.adaptive=false", f"out={out / 'bench'}"]))
    return coverage


if __name__ == "__main__":
    with reported_errors():
        main()
