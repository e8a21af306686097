"""scripts/draft_vocab.py: copies of a DFlash drafter whose draft LM head is the target's rows, over other draft
vocabulary sizes. Each copy keeps every learned weight, takes the most frequent answer tokens of the data and the
target's rows for them, and decodes as a heads folder; a drafter with a trained head is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_script
from selfspec.core.errors import SettingError
from selfspec.decode.session import load_session
from selfspec.decode.settings import decode_config
from selfspec.heads.io import save_heads
from test_dflash import continuations, train_dflash

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frozen_heads(tmp_path_factory):
    """A tiny-target DFlash drafter trained with its LM head frozen at the target's rows, saved as the hour recipe
    saves one, and a JSONL of the target's own continuations as answers."""
    root = tmp_path_factory.mktemp("vocab")
    target = load_session(decode_config({"model": {"source": "tiny"}, "heads": None})).target
    seqs = continuations(target.model, rows=8, new=24)
    heads = train_dflash(target.model, seqs, steps=200, freeze_lm_head=True)
    save_heads(root / "heads", heads, "dflash", heads.config.to_dict(), target,
               extra_meta={"heads": {"freeze_lm_head": True}})
    with open(root / "data.jsonl", "w") as f:
        for row in seqs.tolist():
            f.write(json.dumps({"messages": [{"role": "user", "content": target.tokenizer.decode(row[:4])},
                                             {"role": "assistant", "content": target.tokenizer.decode(row[4:])}]})
                    + "\n")
    return root, target, seqs


def test_each_copy_keeps_the_drafter_and_takes_the_targets_rows(frozen_heads):
    root, target, seqs = frozen_heads
    vocab = int(target.model.config.vocab_size)
    main = load_script("draft_vocab").main
    coverage = main(["--heads", str(root / "heads"), "--data", str(root / "data.jsonl"),
                     "--sizes", f"8,32,{vocab}", "--out", str(root / "sweep")])
    assert coverage[8] < coverage[32] <= coverage[vocab] == 1.0
    source = load_session(decode_config({"heads": str(root / "heads")})).heads.state_dict()
    rows = target.model.get_output_embeddings().weight
    for size in (8, 32):
        copy = load_session(decode_config({"heads": str(root / "sweep" / f"v{size}")})).heads
        ids = torch.arange(size) + copy.d2t
        assert copy.lm_head.weight.shape[0] == size and int(copy.t2d.sum()) == size
        assert torch.equal(copy.lm_head.weight, rows[ids])
        assert all(torch.equal(v, source[k]) for k, v in copy.state_dict().items() if k not in ("lm_head.weight",
                                                                                             "d2t", "t2d"))


def test_the_whole_vocabulary_copy_decodes_as_the_drafter_it_copies(frozen_heads):
    """At the target's whole vocabulary the copy is the same drafter: the same tokens (the target's own greedy
    output) with the same drafts accepted, and some are."""
    root, target, seqs = frozen_heads
    vocab = int(target.model.config.vocab_size)
    alone = {"max_new_tokens": 16, "draft": {"suffix": False, "adaptive": False}}
    runs = [load_session(decode_config({**alone, "heads": str(path)}))
            for path in (root / "heads", root / "sweep" / f"v{vocab}")]
    prompt = seqs[0, :4].tolist()
    ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=0)[0, 4:]
    first, again = (s.decoder.generate(prompt, max_new_tokens=16) for s in runs)
    assert first.tokens == again.tokens == ref.tolist()
    assert first.stats.accepted_per_step == again.stats.accepted_per_step and first.stats.accepted > 0


def test_a_trained_draft_head_is_refused(frozen_heads, tmp_path):
    root, target, _ = frozen_heads
    trained = load_session(decode_config({"heads": str(root / "heads")})).heads
    save_heads(tmp_path / "trained", trained, "dflash", trained.config.to_dict(), target)  # no freeze_lm_head
    with pytest.raises(SettingError, match="freeze_lm_head=true"):
        load_script("draft_vocab").main(["--heads", str(tmp_path / "trained"), "--data", str(root / "data.jsonl"),
                                         "--sizes", "8", "--out", str(tmp_path / "sweep")])
