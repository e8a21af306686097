"""feature_store.engine=vllm: the target's hidden states captured by vLLM (its ``extract_hidden_states`` method and
selfspec's synchronous connector, core/vllm_plugins/) are the store the target's forward here writes, within float32
rounding, and a drafter trains from them like from any store."""

from __future__ import annotations

import math

import pytest
import torch

from test_serving import own_continuations, vllm_or_skip

HIDDEN, LAYERS = 128, 4  # heads of 32: the smallest head size vLLM's CPU attention runs
TINY = ["model=tiny", f"model.tiny.hidden_size={HIDDEN}", f"model.tiny.num_hidden_layers={LAYERS}"]


def store_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from selfspec.train.feature_store import read_meta

    meta = read_meta(folder)
    out: dict[str, list] = {}
    for split in sorted(meta["splits"]):
        for shard in meta["splits"][split]["shards"]:
            for k, v in load_file(str(folder / shard["file"])).items():
                out.setdefault(f"{split}/{k}", []).append(v)
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.vllm
def test_vllm_builds_the_store_the_targets_forward_builds_and_eagle3_trains_from_it(tmp_path):
    import datasets

    from conftest import compose
    from selfspec.core.target import load_target
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    vllm_or_skip()
    target = load_target(compose("eagle", TINY).model)
    data = datasets.DatasetDict({"train": own_continuations(target.model, 12, 0),
                                 "eval": own_continuations(target.model, 3, 1)})
    runs = {}
    for engine in ("hf", "vllm"):
        cfg = compose("eagle", [*TINY, "experiment=debug", f"run_dir={tmp_path / engine}", "heads=eagle3",
                                "features=store", "feature_store.dtype=float32", f"feature_store.engine={engine}",
                                "feature_store.vllm.batch_size=5", "trainer.max_steps=3", "trainer.eval_every=0",
                                "trainer.save_every=0", "speed_check.prompts=0", "trainer.target_dtype=float32"])
        runs[engine] = train(cfg, EagleMethod(cfg), target=target, datasets=data)
    hf, vllm = store_tensors(tmp_path / "hf" / "features"), store_tensors(tmp_path / "vllm" / "features")
    assert sorted(hf) == sorted(vllm) and "train/aux" in hf  # EAGLE-3's three layers, and the last hidden state
    for key in hf:
        if key.endswith(("input_ids", "labels", "offsets")):
            assert torch.equal(hf[key], vllm[key]), key
            continue
        # The same float32 maths in two engines, summed in other orders: each product over K terms is off by about
        # eps * sqrt(K) relative, and every layer (LAYERS, plus the final norm) adds its own. Four times that bound.
        a, b = hf[key].double(), vllm[key].double()
        k = max(HIDDEN, int(target.model.config.intermediate_size))
        bound = 4 * torch.finfo(torch.float32).eps * math.sqrt(k) * (LAYERS + 1)
        per_token = (a - b).norm(dim=-1) / a.norm(dim=-1)
        assert per_token.max() < bound, (key, float(per_token.max()), bound)
    # training read them: three steps from each store give the same drafter. A store off by a layer would move the
    # weights apart by about the learning rate a step (1e-3); that rounding moves them ~1e-7 (as tests/test_eagle.py
    # compares a float32 store with online features)
    from test_eagle import saved_weights

    a, b = saved_weights(tmp_path / "hf"), saved_weights(tmp_path / "vllm")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)


def test_vllm_engine_refuses_a_store_of_more_than_hidden_states(tmp_path):
    from conftest import compose
    from test_medusa_train import tiny_datasets, tiny_target

    from selfspec.train.feature_store import FeatureStoreError
    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    cfg = compose("medusa", ["experiment=debug", f"run_dir={tmp_path}", "features=store", "feature_store.engine=vllm",
                             "feature_store.teacher_topk=4", "trainer.max_steps=1", "speed_check.prompts=0"])
    with pytest.raises(FeatureStoreError, match="hidden states only.*feature_store.teacher_topk=0.*engine=hf"):
        train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets())
