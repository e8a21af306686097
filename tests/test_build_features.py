"""A feature store built once by its own command (``selfspec-features``, train/features.py), read by every later run.

- the store the command builds is the one EAGLE-3 and DFlash training runs with the same model and data settings
  read: they start no engine, load no more of the target and build nothing (every way to start one fails here);
- a store of more layers (a union) serves a run that reads some of them, with the same losses as its own store;
- a killed build resumes from the shards it wrote, computes only the others, never publishes a half-made store, and
  ends equal to an uninterrupted build;
- a store for another target, layer set or tokenizer is refused in one line naming what differs and the
  ``selfspec-features`` command that builds the run's store; ``feature_store.rebuild=true`` rebuilds it;
- a store another process is still writing is waited for, never read half-made;
- engine=hf with ``feature_store.device_map`` loads a checkpoint through from_pretrained's device_map (on the CPU
  here: ``device_map=cpu``; ``auto`` over several GPUs is checked only where there are GPUs);
- vLLM engines start from one process only: any other rank of a launch is refused, and an engine started from rank
  0 does not inherit the launch's process-group variables;
- two processes (torchrun, gloo): the command under a launch writes each rank's share of the shards; a training run
  with no store builds it on rank 0 alone while the other waits, a run with a store starts no engine on any rank,
  and the ranks read disjoint examples that together are the one-process order.

Run as a script by torchrun, this file is the worker of the two-process test: ``test_build_features.py <root>``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = ["data.max_records=24", "data.max_length=256"]  # experiment=debug's data, fewer records: the runs below
SHARD = 8
WORKER_TIMEOUT = 240

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def features_cfg(store: Path, *overrides: str):
    from conftest import compose

    return compose("features", ["model=tiny", *DATA, f"feature_store.examples_per_shard={SHARD}",
                                f"feature_store.dir={store}", f"run_dir={store.parent / 'features-run'}",
                                *overrides])


def eagle3_cfg(run_dir: Path, store: Path, *overrides: str):
    from test_eagle import eagle_cfg

    return eagle_cfg(run_dir, "heads=eagle3", "heads.draft_vocab_size=64", *DATA, "trainer.max_steps=2",
                     "features=store", f"feature_store.dir={store}", "speed_check.prompts=null", *overrides)


def dflash3_cfg(run_dir: Path, store: Path, *overrides: str):
    from test_dflash_train import dflash_cfg

    return dflash_cfg(run_dir, *DATA, "trainer.max_steps=2", "features=store", f"feature_store.dir={store}",
                      "speed_check.prompts=null", *overrides)


def train_eagle3(run_dir: Path, store: Path, *overrides: str):
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    cfg = eagle3_cfg(run_dir, store, *overrides)
    return train(cfg, EagleMethod(cfg))  # the target and data from the config, as the command line loads them


def counted_extract(monkeypatch, calls: list, fail_at: int | None = None):
    """HiddenStatesExtract.__call__ counting its calls (one per batch), raising at call ``fail_at`` (a kill)."""
    from selfspec.train import feature_store

    original = feature_store.HiddenStatesExtract.__call__

    def call(self, batch):
        calls.append(len(batch["input_ids"]))
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt("killed")
        return original(self, batch)

    monkeypatch.setattr(feature_store.HiddenStatesExtract, "__call__", call)


@pytest.fixture
def no_engine(monkeypatch):
    forbid_engines(monkeypatch)


def forbid_engines(monkeypatch) -> None:
    """Every way a run could compute a feature fails: the HF forward, vLLM's engine, loading the rest of the target,
    a build."""
    from selfspec.core import target_parts
    from selfspec.train import feature_store

    def started(*args, **kwargs):
        raise AssertionError("an engine was started, or the store built, where the store exists")

    for owner, name in ((feature_store.HiddenStatesExtract, "__call__"), (feature_store.VllmHiddenStates, "_start"),
                        (feature_store.WholeTargetExtract, "__call__"), (feature_store, "_build"),
                        (target_parts, "load_rest")):
        monkeypatch.setattr(owner, name, started)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store built by the command once: its folder; and how many batches that took."""
    from selfspec.train.features import run

    store = tmp_path_factory.mktemp("features") / "store"
    with pytest.MonkeyPatch.context() as m:  # the tests' data cache (conftest.py), before its fixture sets it
        m.setenv("SELFSPEC_DATA_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
        out = run(features_cfg(store))
    assert out["layers"] == [1, 2, 3]  # the tiny 4-layer target: EAGLE-3's and DFlash's sets are one
    return store


def shards(store: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {str(f.relative_to(store)): load_file(str(f)) for f in sorted(store.glob("*/shard-*.safetensors"))}


# --- configs ---------------------------------------------------------------------------------------------------------


def test_the_features_config_keeps_what_the_training_entries_read():
    """The command's defaults are the training entries' (dtype, data), and its layers are the union of EAGLE-3's and
    DFlash's defaults for every model entry that names them (llama8b: one set for both)."""
    from types import SimpleNamespace

    from conftest import compose

    from selfspec.heads.dflash import default_target_layer_ids
    from selfspec.heads.eagle import default_layer_ids
    from selfspec.train.features import store_layers

    features = compose("features", ["feature_store.dir=x"])
    for entry in ("eagle", "dflash"):
        cfg = compose(entry)
        for key in ("dtype", "examples_per_shard", "engine"):
            assert features.feature_store[key] == cfg.feature_store[key], (entry, key)
        assert features.data == cfg.data
        assert dict(features.feature_store.vllm) == dict(cfg.feature_store.vllm)
    assert cfg.feature_store.rebuild is False and features.feature_store.rebuild is True

    def model(layers):
        text = SimpleNamespace(num_hidden_layers=layers)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder=True: text))

    for name in ("llama8b", "qwen3_8b", "smollm2", "tiny"):
        cfg = compose("features", [f"model={name}", "feature_store.dir=x"])
        n = 32 if name != "tiny" else 4
        draft = cfg.model.get("draft_layers") or {}
        eagle3 = list(draft.get("eagle3") or default_layer_ids(n))
        dflash = [i + 1 for i in (draft.get("dflash") or default_target_layer_ids(n))]
        assert store_layers(cfg, model(n)) == sorted(set(eagle3) | set(dflash))
    llama = compose("features", ["model=llama8b", "feature_store.dir=x"])
    assert store_layers(llama, model(32)) == [2, 16, 29]  # EAGLE-3's inputs of 2, 16, 29: DFlash's 1, 15, 28 + 1
    assert store_layers(compose("features", ["feature_store.dir=x", "layers=[4,0,4]"]), model(32)) == [0, 4]
    for bad, message in (("layers=[40]", "outside 0..32"), ("layers=abc", "auto, or a list"),
                         ("read_by=[medusa2]", "read_by: 'medusa2'")):
        with pytest.raises(Exception, match=message.replace("(", r"\(").replace("[", r"\[")):
            store_layers(compose("features", ["feature_store.dir=x", bad]), model(32))


# --- one build, read by every run -------------------------------------------------------------------------------------


def test_the_built_store_trains_eagle3_and_dflash_and_no_engine_starts(built, tmp_path, no_engine):
    from selfspec.train.dflash_method import DFlashMethod
    from selfspec.train.loop import train

    meta = (built / "meta.json").read_text()
    eagle = train_eagle3(tmp_path / "eagle3", built)
    assert eagle.steps == 2 and not eagle.whole_target  # the trainer held only the target's parts
    cfg = dflash3_cfg(tmp_path / "dflash", built)
    assert train(cfg, DFlashMethod(cfg)).steps == 2
    # engine=vllm with no vLLM venv at all: nothing of vLLM is needed where the store exists
    vllm = train_eagle3(tmp_path / "eagle3-vllm", built, "feature_store.engine=vllm",
                        f"feature_store.vllm.venv={tmp_path / 'no-venv'}")
    assert vllm.steps == 2
    assert (built / "meta.json").read_text() == meta


def test_a_store_of_more_layers_serves_a_run_that_reads_some(built, tmp_path, monkeypatch):
    """A store of hidden states 0..4 (a union, given by ``layers``) trains EAGLE-3 (layers 1..3) with the losses of
    its own store: the same hidden states, picked out of the union."""
    from selfspec.train.features import run

    union = tmp_path / "union"
    assert run(features_cfg(union, "layers=[0,1,2,3,4]"))["layers"] == [0, 1, 2, 3, 4]
    forbid_engines(monkeypatch)
    wide = train_eagle3(tmp_path / "wide", union)
    own = train_eagle3(tmp_path / "own", built)
    assert [h["loss"] for h in wide.history] == pytest.approx([h["loss"] for h in own.history], rel=1e-6)
    assert wide.eval_metrics == pytest.approx(own.eval_metrics, rel=1e-6)


def test_a_killed_build_resumes_from_its_shards_and_equals_an_uninterrupted_one(built, tmp_path, monkeypatch):
    from selfspec.train.features import run

    store = tmp_path / "store"
    calls: list = []
    counted_extract(monkeypatch, calls, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        run(features_cfg(store))
    assert not store.exists()  # never published half-made
    [partial] = tmp_path.glob(".store.tmp-*")
    assert len(list(partial.glob("*/shard-*.safetensors"))) == 2  # the two shards before the kill, whole
    total = len(shards(built))
    monkeypatch.undo()
    calls.clear()
    counted_extract(monkeypatch, calls)
    run(features_cfg(store))
    assert len(calls) == total - 2  # only the shards still missing
    assert (store / "meta.json").read_text() == (built / "meta.json").read_text()
    mine, reference = shards(store), shards(built)
    assert mine.keys() == reference.keys()
    for name in mine:
        assert mine[name].keys() == reference[name].keys()
        for key in mine[name]:
            assert torch.equal(mine[name][key], reference[name][key]), (name, key)
    assert not list(tmp_path.glob(".store.tmp-*"))
    calls.clear()
    run(features_cfg(store))  # complete: the command finds it and runs nothing
    assert calls == []


# --- bad input --------------------------------------------------------------------------------------------------------


def test_a_store_for_another_target_layer_set_or_tokenizer_is_refused_by_name(built, tmp_path, no_engine, monkeypatch):
    from selfspec.train import feature_store
    from selfspec.train.feature_store import FeatureStoreError

    meta = (built / "meta.json").read_text()
    cases = [
        # the same name and, whatever the embeddings, another config: other layers make other features
        ((["model.tiny.intermediate_size=96"]), "another target", "model.tiny.intermediate_size=96"),
        ((["model.tiny.seed=1"]), "another target", "model.tiny.seed=1"),
        ((["heads.layer_ids=[0,1,3]"]), "another layer set", "layers=[0,1,3]"),
    ]
    for overrides, what, fix in cases:
        with pytest.raises(FeatureStoreError) as err:
            train_eagle3(tmp_path / "refused", built, *overrides)
        line = str(err.value)
        assert "\n" not in line and what in line and fix in line, line
        assert f"`selfspec-features model=tiny data=sharegpt" in line and f"feature_store.dir={built}`" in line
        assert "feature_store.rebuild=true" in line
    assert "[0] missing" in line
    with monkeypatch.context() as m:
        m.setattr(feature_store, "tokenizer_digest", lambda tokenizer: "another-vocabulary")
        with pytest.raises(FeatureStoreError, match="another tokenizer .*tokenizer: vocabulary "):
            train_eagle3(tmp_path / "refused", built)
    assert (built / "meta.json").read_text() == meta  # untouched


def test_rebuild_true_rebuilds_a_named_store_for_this_run(built, tmp_path):
    import json

    store = tmp_path / "copy"
    shutil.copytree(built, store)
    before = json.loads((store / "meta.json").read_text())["identity"]
    train_eagle3(tmp_path / "run", store, "model.tiny.seed=1", "feature_store.rebuild=true")
    after = json.loads((store / "meta.json").read_text())["identity"]
    assert after["target"] != before["target"] and after["splits"] == before["splits"]


def test_a_store_being_written_is_waited_for_and_never_read_half_made(tmp_path):
    """Another process's build holds the store's lock while it writes: a run that names the store waits for it,
    then reads the finished store and builds nothing."""
    import functools

    from test_folders import tiny_splits

    from selfspec.train.data import collate
    from selfspec.train.feature_store import ensure_feature_store

    path, splits = tmp_path / "store", tiny_splits()
    writing, finish = threading.Event(), threading.Event()
    out, errors = {}, []

    def slow(batch):
        writing.set()
        finish.wait(60)
        return {"hidden": (batch["input_ids"].float() * 0.5).unsqueeze(-1)}

    def never(batch):
        raise AssertionError("the reader computed features")

    def open_with(name, extract, **kw):
        try:
            out[name] = ensure_feature_store(path, splits, extract, {"fields": "test"},
                                             functools.partial(collate, pad_token_id=0), batch_size=4,
                                             examples_per_shard=5, **kw)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    writer = threading.Thread(target=open_with, args=("writer", slow))
    writer.start()
    assert writing.wait(60)
    reader = threading.Thread(target=open_with, args=("reader", never), kwargs={"refuse_other": True})
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive() and "reader" not in out  # waiting: the store is half-made
    assert not (path / "meta.json").exists()
    finish.set()
    writer.join(60)
    reader.join(60)
    assert not errors, errors
    for name in splits:
        a, b = out["writer"][name], out["reader"][name]
        assert len(a) == len(b) == len(splits[name])
        assert all(torch.equal(a[i]["hidden"], b[i]["hidden"]) for i in range(len(a)))


# --- engines ----------------------------------------------------------------------------------------------------------


def test_device_map_loads_the_checkpoint_through_from_pretrained(built, tmp_path, monkeypatch):
    """engine=hf with feature_store.device_map: the checkpoint is loaded with from_pretrained's device_map (cpu on
    this machine) and the store equals one of the target loaded whole."""
    import transformers

    from selfspec.core.target import build_tiny
    from selfspec.train.features import run

    folder = tmp_path / "tiny-checkpoint"
    model, tokenizer = build_tiny("llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    asked = []
    load = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    checkpoint = ["model=tiny", "model.source=hub", f"model.name_or_path={folder}"]
    mapped = run(features_cfg(tmp_path / "mapped", *checkpoint, "feature_store.device_map=cpu"))
    whole = run(features_cfg(tmp_path / "whole", *checkpoint))
    assert asked == ["cpu", None]
    a, b = shards(mapped["dir"]), shards(whole["dir"])
    assert a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])
    from selfspec.core.target import TargetLoadError, load_target

    with pytest.raises(TargetLoadError, match="give a device"):
        load_target({"source": "tiny", "device_map": "auto"})


@pytest.mark.vllm
def test_the_command_builds_in_vllm_the_store_it_builds_here(tmp_path, monkeypatch):
    """feature_store.engine=vllm through the command (one engine; this process holds the target's parts): the store
    of the HF forward within float32 rounding (tests/test_feature_store_vllm.py's bound), and EAGLE-3 trains from it
    with no engine. Skipped without vLLM's venv."""
    import math

    from test_feature_store_vllm import HIDDEN, LAYERS, TINY, store_tensors
    from test_serving import vllm_or_skip

    from selfspec.train.features import run

    vllm_or_skip()
    shape = [*TINY[1:], "feature_store.dtype=float32", "feature_store.vllm.batch_size=5"]
    hf = run(features_cfg(tmp_path / "hf", *shape))
    vllm = run(features_cfg(tmp_path / "vllm", *shape, "feature_store.engine=vllm"))
    a, b = store_tensors(hf["dir"]), store_tensors(vllm["dir"])
    assert sorted(a) == sorted(b) and "train/aux" in a
    bound = 4 * torch.finfo(torch.float32).eps * math.sqrt(max(HIDDEN, 128)) * (LAYERS + 1)  # 128: intermediate
    for key in a:
        if key.endswith(("input_ids", "labels", "offsets")):
            assert torch.equal(a[key], b[key]), key
        else:
            per_token = (a[key].double() - b[key].double()).norm(dim=-1) / a[key].double().norm(dim=-1)
            assert per_token.max() < bound, key
    forbid_engines(monkeypatch)
    assert train_eagle3(tmp_path / "run", vllm["dir"], *TINY[1:], "feature_store.dtype=float32").steps == 2


def test_vllm_engines_start_from_one_process_of_a_launch(monkeypatch):
    from selfspec.core.errors import SettingError
    from selfspec.core.vllm_env import VllmSettings, replica_env, worker_env

    from conftest import compose

    settings = VllmSettings.from_config(compose("eagle").feature_store.vllm)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(SettingError, match="rank 1 of a distributed launch"):
        replica_env(settings, ["0", "1"])
    monkeypatch.setenv("RANK", "0")
    assert replica_env(settings, ["0", "1"]) == [{}]
    env = worker_env()
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)  # the engine is not a member of the trainer's group


def test_the_command_refuses_a_launch_for_vllm_and_a_device_map(monkeypatch, tmp_path):
    from selfspec.core.errors import SettingError
    from selfspec.train.features import run

    monkeypatch.setenv("WORLD_SIZE", "2")
    for setting, message in (("feature_store.engine=vllm", "runs one engine for the machine"),
                             ("feature_store.device_map=auto", "spreads one target over the GPUs of one process")):
        with pytest.raises(SettingError, match=message):
            run(features_cfg(tmp_path / "store", setting))


# --- two processes ----------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_one_build_and_each_its_share_of_the_reads(built, tmp_path, device):
    if device.type != "cpu":
        pytest.skip("two ranks on the CPU over gloo")
    from selfspec.train.feature_store import FeatureDataset, read_meta
    from selfspec.train.loaders import EpochSampler

    root = tmp_path / "launch"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1",
               ACCELERATE_DISABLE_RICH="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), __file__, str(root)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT + 60)
    (root / "stderr.log").write_text(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-6000:]
    calls = lambda name: [line.split()[0] for line in (root / name).read_text().splitlines()] \
        if (root / name).exists() else []  # noqa: E731

    # the command under a launch: each rank wrote its share, the store is the one-process build's
    assert sorted(set(calls("extract-command.log"))) == ["0", "1"]
    two, one = root / "command-store", built
    assert read_meta(two)["identity"] == read_meta(one)["identity"]
    for split in ("train", "eval"):
        a, b = FeatureDataset(two, split), FeatureDataset(one, split)
        for i in range(len(b)):
            for key in b[i]:
                torch.testing.assert_close(a[i][key], b[i][key], rtol=0, atol=2e-3)
    # a training run with no store: rank 0 built it alone while rank 1 waited
    assert set(calls("extract-train.log")) == {"0"}
    assert read_meta(root / "rank0-store") is not None
    # a training run on the command's store: no engine on any rank
    assert not (root / "extract-reuse.log").exists()
    # the ranks read disjoint examples, together the first ones of the one-process order
    reads = {r: [int(line) for line in (root / f"reads-{r}.log").read_text().split()] for r in ("0", "1")}
    assert reads["0"] and reads["1"] and not set(reads["0"]) & set(reads["1"])
    seed = int(eagle3_cfg(tmp_path / "any", two).trainer.seed)
    order = list(EpochSampler(len(FeatureDataset(two, "train")), seed=seed))
    union = set(reads["0"]) | set(reads["1"])
    assert union == set(order[:len(union)]) and len(union) >= 2 * 2 * 2  # 2 steps x 2 ranks x batch 2


def _worker(root: str) -> None:
    """Under torchrun: the command (each rank a share), a training run with no store (rank 0 builds it), a training
    run on the command's store (reads logged per rank)."""
    import faulthandler

    faulthandler.dump_traceback_later(WORKER_TIMEOUT, exit=True)
    from accelerate import PartialState

    from selfspec.train import feature_store
    from selfspec.train.features import run

    root = Path(root)
    rank = os.environ["RANK"]
    log = {"name": "extract-command.log"}
    extract = feature_store.HiddenStatesExtract.__call__

    def logged(self, batch):
        with open(root / log["name"], "a") as f:
            f.write(f"{rank} {len(batch['input_ids'])}\n")
        return extract(self, batch)

    feature_store.HiddenStatesExtract.__call__ = logged
    run(features_cfg(root / "command-store"))
    log["name"] = "extract-train.log"
    train_eagle3(root / "rank0-run", root / "rank0-store")
    log["name"] = "extract-reuse.log"
    getitem = feature_store.FeatureDataset.__getitem__

    def read(self, index):
        if self.split == "train":
            with open(root / f"reads-{rank}.log", "a") as f:
                f.write(f"{index}\n")
        return getitem(self, index)

    feature_store.FeatureDataset.__getitem__ = read
    cfg = eagle3_cfg(root / "reuse-run", root / "command-store", "trainer.batch_size=2")
    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.loop import train

    train(cfg, EagleMethod(cfg))
    PartialState().destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:])


def test_states_past_float16_are_refused_in_one_line_naming_the_dtype_to_use(tmp_path):
    """Gemma's intermediate hidden states pass float16's range: cast to a float16 store they are inf, which would
    train a drafter to nan. The store refuses them before writing a shard, naming feature_store.dtype=bfloat16, and
    publishes nothing; the same states in bfloat16 are stored as they are."""
    import functools

    from test_folders import tiny_splits

    from selfspec.train.data import collate
    from selfspec.train.feature_store import FeatureStoreError, ensure_feature_store

    def extract(dtype):
        return lambda batch: {"aux": (batch["input_ids"].float() * 1e4 + 7e4).unsqueeze(-1).to(dtype)}

    build = functools.partial(ensure_feature_store, splits=tiny_splits(), identity={"fields": "test"},
                              collate_fn=functools.partial(collate, pad_token_id=0), batch_size=4, examples_per_shard=5)
    with pytest.raises(FeatureStoreError, match="overflow float16.*feature_store.dtype=bfloat16") as err:
        build(tmp_path / "store", extract=extract(torch.float16))
    assert "\n" not in str(err.value) and not (tmp_path / "store").exists()
    stored = build(tmp_path / "bf16", extract=extract(torch.bfloat16))
    assert torch.isfinite(stored["train"][0]["aux"].float()).all() and stored["train"][0]["aux"].float().min() >= 7e4
