"""Never delete or overwrite what selfspec did not make (core/folders.py).

Every writer (the training run and its checkpoints, the feature store, heads export, the serve check, the benchmark,
the stream and the replay, regeneration, the online learner) is pointed at a folder holding a user's file and
subfolder: the files are still there afterwards, byte for byte, and a refusal is one line naming the folder.
``overwrite=true`` (or the writer's own key) moves the user's folder to a named backup, whole. Two builds of one
feature store at once end with one complete store, built once.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import compose, load_script
from selfspec.core import folders
from selfspec.core.errors import SelfspecError
from selfspec.core.folders import FolderNotOursError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THESIS = "my thesis\n"
NOTES = "x\n"


def user_folder(path: Path) -> Path:
    """A folder of the user's: a file and a subfolder with a file, no marker."""
    (path / "sub").mkdir(parents=True, exist_ok=True)
    (path / "precious.txt").write_text(THESIS)
    (path / "sub" / "notes.md").write_text(NOTES)
    return path


def kept(path: Path) -> bool:
    """The user's files of :func:`user_folder` are at ``path``, unchanged."""
    return ((path / "precious.txt").is_file() and (path / "precious.txt").read_text() == THESIS
            and (path / "sub" / "notes.md").is_file() and (path / "sub" / "notes.md").read_text() == NOTES)


def one_line_naming(err: BaseException, folder: Path, *words: str) -> bool:
    message = str(err)
    return "\n" not in message and str(folder) in message and all(w in message for w in words)


def backups(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.bak-*"))


# --- the module -------------------------------------------------------------------------------------------------------


def test_claim_makes_and_marks_a_folder_and_refuses_a_users(tmp_path):
    new = folders.claim(tmp_path / "a" / "new", "bench")
    assert folders.read_marker(new)["kind"] == "bench" and folders.is_ours(new)
    assert folders.claim(new, "bench") == new  # ours: used as it is
    (tmp_path / "empty").mkdir()
    assert folders.is_ours(folders.claim(tmp_path / "empty", "bench"))
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(FolderNotOursError) as err:
        folders.claim(mine, "bench", key="feature_store.overwrite")
    assert one_line_naming(err.value, mine, "feature_store.overwrite=true", "mine.bak-")
    assert isinstance(err.value, SelfspecError)
    assert kept(mine) and not folders.is_ours(mine) and not backups(mine)
    (tmp_path / "file").write_text(THESIS)
    with pytest.raises(FolderNotOursError, match="is a file"):
        folders.claim(tmp_path / "file", "bench")
    assert (tmp_path / "file").read_text() == THESIS


def test_overwrite_moves_the_users_folder_whole_to_a_named_backup(tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    folders.claim(mine, "bench", overwrite=True)
    [backup] = backups(mine)
    assert backup.name.startswith("mine.bak-") and len(backup.name) == len("mine.bak-YYYYmmdd-HHMMSS")
    assert kept(backup) and folders.read_marker(backup) is None
    assert folders.is_ours(mine) and [p.name for p in mine.iterdir()] == [folders.MARKER]
    assert f"moved {mine} to {backup}" in capsys.readouterr().err
    taken = folders.backup_path(mine)
    taken.mkdir()
    assert folders.backup_path(mine) != taken  # a name taken (a backup made in the same second) is not reused


def test_replace_dir_replaces_only_a_folder_selfspec_wrote_whole(tmp_path):
    def built(name: str, text: str) -> Path:
        src = folders.temp_dir(tmp_path / name, "export")
        (src / "model.safetensors").write_text(text)
        return src

    dst = tmp_path / "out"
    folders.replace_dir(built("out", "1"), dst, kind="export")  # missing
    assert (dst / "model.safetensors").read_text() == "1" and folders.read_marker(dst)["entries"] == [
        "model.safetensors"]
    folders.replace_dir(built("out", "2"), dst, kind="export")  # ours: replaced
    assert (dst / "model.safetensors").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left

    (dst / "precious.txt").write_text(THESIS)  # a user's file put into our folder
    src = built("out", "3")
    with pytest.raises(FolderNotOursError) as err:
        folders.replace_dir(src, dst, kind="export")
    assert one_line_naming(err.value, dst, "precious.txt", "overwrite=true")
    assert (dst / "precious.txt").read_text() == THESIS and (dst / "model.safetensors").read_text() == "2"
    heads = folders.claim(tmp_path / "h", "heads")
    with pytest.raises(FolderNotOursError, match="selfspec heads folder, not a feature-store one"):
        folders.replace_dir(built("h", "x"), heads, kind="feature-store")
    assert folders.read_marker(heads)["kind"] == "heads"

    mine = user_folder(tmp_path / "mine")
    with pytest.raises(FolderNotOursError) as err:
        folders.replace_dir(built("mine", "4"), mine, kind="export", key="overwrite", setting="out")
    assert one_line_naming(err.value, mine, f"out={mine}") and kept(mine)
    backup = folders.replace_dir(built("mine", "5"), mine, overwrite=True, kind="export")
    assert kept(backup) and (mine / "model.safetensors").read_text() == "5" and not (mine / "precious.txt").exists()


def test_enter_uses_a_users_folder_as_it_is_and_remove_deletes_only_ours(tmp_path):
    assert folders.enter(tmp_path / "run", "run") and folders.is_ours(tmp_path / "run")
    (tmp_path / "hydra" / ".hydra").mkdir(parents=True)  # Hydra's own files come first: still a new run folder
    assert folders.enter(tmp_path / "hydra", "run")
    mine = user_folder(tmp_path / "mine")
    assert not folders.enter(mine, "run") and not folders.is_ours(mine) and kept(mine)
    with pytest.raises(FolderNotOursError):
        folders.remove(mine)
    assert not folders.discard(mine, "checkpoint") and kept(mine)
    folders.remove(tmp_path / "run")
    assert not (tmp_path / "run").exists()


# --- the training run and its checkpoints --------------------------------------------------------------------------


def medusa_run(run_dir: Path, *overrides: str):
    from test_medusa_train import medusa_cfg, tiny_datasets, tiny_target

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    cfg = medusa_cfg(run_dir, "trainer.max_steps=2", *overrides)
    return train(cfg, medusa_method(cfg), target=tiny_target(), datasets=tiny_datasets(8, 4))


def test_a_run_folder_of_the_users_keeps_its_files_and_pruning_touches_only_checkpoints_it_wrote(tmp_path):
    from selfspec.train.checkpoint import list_checkpoints

    run_dir = user_folder(tmp_path / "mydir")
    ckpts = run_dir / "checkpoints"
    user_folder(ckpts / "mine")
    user_folder(ckpts / ".tmp-step-00000007")  # named like a killed save's, made by the user: not deleted
    result = medusa_run(run_dir, "trainer.save_every=1", "trainer.keep_last=1")
    assert result.steps == 2 and (run_dir / "heads" / "config.json").is_file()
    assert kept(run_dir) and kept(ckpts / "mine") and kept(ckpts / ".tmp-step-00000007")
    assert not folders.is_ours(run_dir)  # a user's folder is never marked, so nothing ever replaces it
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]  # step 1, ours, pruned
    assert folders.is_ours(run_dir / "heads", "heads") and folders.is_ours(ckpts / "step-00000002", "checkpoint")


def test_a_fresh_run_folder_is_marked(tmp_path):
    medusa_run(tmp_path / "run")
    assert folders.read_marker(tmp_path / "run")["kind"] == "run"


def test_a_heads_folder_of_the_users_in_the_run_folder_is_refused_or_backed_up(tmp_path):
    run_dir = tmp_path / "run"
    heads = user_folder(run_dir / "heads")
    with pytest.raises(FolderNotOursError) as err:
        medusa_run(run_dir)
    assert one_line_naming(err.value, heads, "trainer.overwrite=true") and kept(heads)
    medusa_run(run_dir, "trainer.overwrite=true")
    [backup] = backups(heads)
    assert kept(backup) and (heads / "config.json").is_file() and not (heads / "precious.txt").exists()


def test_trainer_overwrite_deletes_only_checkpoints_selfspec_wrote(tmp_path):
    from selfspec.train.checkpoint import list_checkpoints

    run_dir = tmp_path / "run"
    medusa_run(run_dir, "trainer.save_every=2")
    theirs = run_dir / "checkpoints" / "step-00000001"  # a checkpoint-looking folder selfspec did not write
    user_folder(theirs)
    (theirs / "trainer_state.json").write_text(json.dumps({"step": 1}))
    medusa_run(run_dir, "trainer.save_every=2", "trainer.overwrite=true")
    [backup] = backups(theirs)
    assert kept(backup) and [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]


# --- the feature store -----------------------------------------------------------------------------------------------


def test_a_users_folder_as_the_feature_store_is_refused_or_backed_up(tmp_path):
    store = user_folder(tmp_path / "mydir")
    with pytest.raises(FolderNotOursError) as err:
        medusa_run(tmp_path / "run", "features=store", f"feature_store.dir={store}")
    assert one_line_naming(err.value, store, "feature_store.overwrite=true") and kept(store)
    assert not (tmp_path / "run" / "heads").exists()  # refused before training
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mydir.tmp")] == []
    medusa_run(tmp_path / "run", "features=store", f"feature_store.dir={store}", "feature_store.overwrite=true")
    [backup] = backups(store)
    assert kept(backup) and (store / "meta.json").is_file() and folders.is_ours(store, "feature-store")
    assert not (store / "precious.txt").exists()


def tiny_splits():
    from test_medusa_train import tiny_datasets

    data = tiny_datasets(12, 4)
    return {"train": data["train"], "eval": data["eval"]}


def counting_extract(calls: list):
    def extract(batch):
        calls.append(1)
        return {"hidden": (batch["input_ids"].float() * 0.5).unsqueeze(-1)}

    return extract


def store_of(path: Path, calls: list, splits=None, **kw):
    import functools

    from selfspec.train.data import collate
    from selfspec.train.feature_store import ensure_feature_store

    return ensure_feature_store(path, splits or tiny_splits(), counting_extract(calls), {"fields": "test"},
                                functools.partial(collate, pad_token_id=0), batch_size=4, examples_per_shard=5, **kw)


def test_two_builds_of_one_store_at_once_end_with_one_complete_store_built_once(tmp_path):
    from selfspec.train.feature_store import read_meta

    path = tmp_path / "shared" / "store"
    splits = tiny_splits()
    calls: list = []
    results, errors = [None, None], []

    def build(i):
        try:
            results[i] = store_of(path, calls, splits)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    batches = sum(-(-min(5, len(ds) - s) // 4) for ds in splits.values() for s in range(0, len(ds), 5))
    assert len(calls) == batches  # one build; the other process waited and reused it
    meta = read_meta(path)
    assert meta is not None and folders.is_ours(path, "feature-store")
    for name in splits:
        a, b = results[0][name], results[1][name]
        assert len(a) == len(b) == len(splits[name])
        for i in range(len(a)):
            assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == ["store"]  # no temporary left


def test_a_half_made_store_is_never_read_and_a_killed_builds_folder_is_cleared(tmp_path):
    from selfspec.train.feature_store import read_meta

    path = tmp_path / "store"
    half = folders.claim(path, "feature-store")  # a store folder without meta.json: not complete
    (half / "train").mkdir()
    (half / "train" / "shard-00000.safetensors").write_text("half")
    stale = folders.temp_dir(path, "feature-store")  # a killed build's temporary folder (ours)
    theirs = user_folder(tmp_path / ".store.tmp-theirs")  # named like one, made by the user
    calls: list = []
    store = store_of(path, calls)
    assert calls and read_meta(path) is not None and len(store["train"]) == 12
    assert not stale.exists() and kept(theirs)
    calls.clear()
    store_of(path, calls)
    assert calls == []  # complete: reused


# --- heads export, the serve check, the benchmark, the stream and the replay ----------------------------------------


@pytest.fixture
def heads_folder(tmp_path):
    from selfspec.core.target import Target, build_tiny
    from selfspec.heads.io import save_heads
    from selfspec.heads.medusa import MedusaConfig, MedusaHeads

    model, tokenizer = build_tiny("llama")
    heads = MedusaHeads(MedusaConfig(64, 320, num_heads=2, num_layers=1, shared_lm_head=False,
                                     draft_vocab_size=None), model.lm_head)
    return save_heads(tmp_path / "heads", heads, "medusa", heads.config.to_dict(),
                      Target(model, tokenizer, "tiny-llama"))


def test_save_heads_refuses_a_users_folder(tmp_path, heads_folder):
    from selfspec.heads.io import load_heads, save_heads

    loaded = load_heads(heads_folder)
    mine = user_folder(tmp_path / "mine")
    from selfspec.core.target import build_tiny

    model, _ = build_tiny("llama")
    with pytest.raises(FolderNotOursError) as err:
        save_heads(mine, loaded.module, "medusa", loaded.config["head_config"], model)
    assert one_line_naming(err.value, mine) and kept(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "mine"]  # no temporary folder left


def test_export_refuses_a_users_folder_or_backs_it_up(tmp_path, heads_folder):
    from selfspec.serve.cli import run_export

    out = user_folder(tmp_path / "out2")
    with pytest.raises(FolderNotOursError) as err:
        run_export(compose("export", [f"heads={heads_folder}", "format=selfspec", f"out={out}"]))
    assert one_line_naming(err.value, out, f"out={out}", "overwrite=true") and kept(out)
    result = run_export(compose("export", [f"heads={heads_folder}", "format=selfspec", f"out={out}",
                                           "overwrite=true"]))
    [backup] = backups(out)
    assert result["out"] == str(out) and kept(backup) and (out / "model.safetensors").is_file()
    assert folders.read_marker(out)["kind"] == "export"
    again = run_export(compose("export", [f"heads={heads_folder}", "format=selfspec", f"out={out}"]))
    assert again["out"] == str(out) and backups(out) == [backup]  # its own export: replaced, no new backup


def test_the_export_script_says_one_line_and_exits_2(tmp_path, heads_folder, monkeypatch, capfd):
    """scripts/export.py run as ``__main__`` in this process (tests/test_cli_errors.py's run_in_process, which gives
    back its exit status and output as a process would; that file also runs script files as real processes)."""
    from test_cli_errors import run_in_process

    out = user_folder(tmp_path / "out2")
    proc = run_in_process("export.py", [f"heads={heads_folder}", "format=selfspec", f"out={out}"], tmp_path / "cwd",
                          monkeypatch, capfd)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and str(out) in lines[0]
    assert kept(out)


def test_the_serve_check_refuses_a_users_folder(tmp_path, monkeypatch):
    import selfspec.serve.serving as serving
    from selfspec.serve.cli import run_check

    monkeypatch.setattr(serving, "vllm_python", lambda venv=None: Path(sys.executable))  # as if vLLM's venv were there
    out = user_folder(tmp_path / "check")
    with pytest.raises(FolderNotOursError) as err:
        run_check(compose("serve_check", ["heads=somewhere", "prompts=humaneval", f"out={out}"]))
    assert one_line_naming(err.value, out, f"out={out}") and kept(out)


def test_the_benchmark_stream_and_replay_refuse_a_users_folder(tmp_path):
    from test_bench import FAST, bench_main

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi."]}) + "\n")
    for name, argv in [("bench", [*FAST, f"prompts={prompts}", "methods=[hf,vanilla]"]),
                       ("stream_bench", ["heads=somewhere", f"prompts={prompts}"]),
                       ("learn_replay", ["heads=somewhere", f"prompts={prompts}", f"record={tmp_path / 'r.pt'}"])]:
        out = user_folder(tmp_path / name)
        main = bench_main() if name == "bench" else load_script(name).main
        with pytest.raises(FolderNotOursError) as err:
            main([*argv, f"out={out}"])
        assert one_line_naming(err.value, out, f"out={out}"), name
        assert kept(out) and sorted(p.name for p in out.iterdir()) == ["precious.txt", "sub"], name


def test_the_benchmark_backs_up_a_users_folder_with_overwrite(tmp_path):
    from test_bench import FAST, bench_main

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi."]}) + "\n")
    out = user_folder(tmp_path / "bench")
    bench_main()([*FAST, f"prompts={prompts}", "methods=[hf,vanilla]", f"out={out}", "overwrite=true"])
    [backup] = backups(out)
    assert kept(backup) and (out / "bench.json").is_file() and not (out / "precious.txt").exists()


# --- regeneration -----------------------------------------------------------------------------------------------------


def test_regeneration_keeps_a_users_folder_and_refuses_a_users_file(tmp_path):
    from selfspec.train.data import DataError
    from selfspec.train.regenerate import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hello"}]}) + "\n")
    common = ["model=tiny", f"prompts={prompts}", "n=1", "max_new_tokens=3"]
    data = user_folder(tmp_path / "data")
    report = run(compose("regenerate", [*common, f"out={data / 'regen.jsonl'}"]))
    assert report.written == 1 and kept(data) and (data / "regen.config.yaml").is_file()
    assert not folders.is_ours(data)

    thesis = data / "thesis.jsonl"
    thesis.write_text("my thesis, no newline at its end")
    with pytest.raises(DataError) as err:
        run(compose("regenerate", [*common, f"out={thesis}"]))
    assert one_line_naming(err.value, thesis) and thesis.read_text() == "my thesis, no newline at its end"
    assert not (data / "thesis.config.yaml").exists()

    (data / "notes.config.yaml").write_text(THESIS)  # a user's file named as a run's config beside its output
    with pytest.raises(FolderNotOursError) as err:
        run(compose("regenerate", [*common, f"out={data / 'notes.jsonl'}"]))
    assert one_line_naming(err.value, data / "notes.config.yaml") and (data / "notes.config.yaml").read_text() == THESIS
    assert not (data / "notes.jsonl").exists()

    fresh = run(compose("regenerate", [*common, f"out={tmp_path / 'new' / 'regen.jsonl'}"]))
    assert fresh.written == 1 and folders.read_marker(tmp_path / "new")["kind"] == "regenerate"


# --- the online learner -----------------------------------------------------------------------------------------------


def test_the_learner_refuses_a_users_folder_or_backs_it_up(tmp_path):
    from test_learn import PROMPTS, learning_session

    mine = user_folder(tmp_path / "learned")
    with pytest.raises(FolderNotOursError) as err:
        learning_session(tmp_path, "eagle3")
    assert one_line_naming(err.value, mine, "learner.overwrite=true") and kept(mine)
    s = learning_session(tmp_path, "eagle3", "learner.overwrite=true")
    s.generate(PROMPTS[0])
    s.close()
    [backup] = backups(mine)
    assert kept(backup) and (mine / "heads" / "config.json").is_file() and not (mine / "precious.txt").exists()
    assert folders.read_marker(mine)["kind"] == "learner"
