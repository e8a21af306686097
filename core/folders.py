"""Folders selfspec writes, and the rule that keeps a user's files safe: never delete or overwrite what selfspec did
not make.

Every folder the project makes (a training run, a feature store, a heads folder, an export, a checkpoint, the
serve check's, the benchmark's and the learner's output) gets a marker file, ``.selfspec``: JSON
``{"kind": ..., "created": <iso time>}``, and for a folder written whole and then renamed into place
(:func:`replace_dir`) ``"entries"``, the names it was written with. A folder is *ours* when it carries the marker.

- :func:`claim` makes a folder to write into: a missing or empty folder is made ours, one of ours is used as it is; a
  folder holding files and no marker is refused with :class:`FolderNotOursError` (one line: the folder, and the fix:
  another folder, or the writer's ``overwrite=true``, which first moves it to ``<name>.bak-<YYYYmmdd-HHMMSS>``).
- :func:`replace_dir` puts a finished folder in place of another: only a missing or empty one, or one of ours of the
  same kind holding nothing but what selfspec wrote into it; anything else is refused, or backed up with overwrite.
- :func:`enter` is for a folder a user may name on purpose to hold other files (``run_dir=``): it is made and marked
  when missing or empty, and a user's folder is used as it is, unmarked, so that nothing ever treats it as ours.
- :func:`remove` deletes a folder only when it is ours.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from filelock import FileLock

from selfspec.core.errors import SelfspecError

MARKER = ".selfspec"
TOOL_ENTRIES = frozenset({".hydra"})  # what Hydra writes into a run folder before the run starts: not a user's file


class FolderNotOursError(SelfspecError, ValueError):
    """A folder selfspec would write or replace holds files it did not make; the message names it and the fix."""


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of folder ``path`` (its kind, when it was made, ...), or None where it has none."""
    file = Path(path) / MARKER
    if not file.is_file():
        return None
    try:
        marker = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"kind": None}  # a damaged marker still says selfspec made the folder
    return marker if isinstance(marker, dict) else {"kind": None}


def is_ours(path: str | os.PathLike, kind: str | None = None) -> bool:
    """Whether ``path`` is a folder selfspec made (of ``kind``, when given)."""
    marker = read_marker(path) if Path(path).is_dir() else None
    return marker is not None and (kind is None or marker.get("kind") in (kind, None))


def mark(path: str | os.PathLike, kind: str, entries: bool = False) -> Path:
    """Write the marker into the existing folder ``path`` (atomically); with ``entries``, the names the folder holds
    now are recorded as selfspec's (for a folder that is complete, before :func:`replace_dir` moves it)."""
    path = Path(path)
    created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    marker: dict[str, Any] = {"kind": kind, "created": created}
    if entries:
        marker["entries"] = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    tmp = path / f"{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(marker) + "\n")
    os.replace(tmp, path / MARKER)
    return path


def foreign_entries(path: str | os.PathLike) -> list[str]:
    """What folder ``path`` holds that selfspec did not write: everything, without a marker; with one that records
    its entries, the names beyond them; none for a marker without entries (a folder written into as it goes)."""
    path = Path(path)
    names = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    marker = read_marker(path)
    if marker is None:
        return names
    if "entries" not in marker:
        return []
    ours = set(marker["entries"])
    return [n for n in names if n not in ours]


def backup_path(path: str | os.PathLike) -> Path:
    """``<name>.bak-<YYYYmmdd-HHMMSS>`` beside ``path`` (with ``-2``, ``-3``, ... when that name is taken)."""
    path = Path(path)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate, n = path.with_name(f"{path.name}.bak-{stamp}"), 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}.bak-{stamp}-{n}")
    return candidate


def back_up(path: str | os.PathLike, key: str = "overwrite") -> Path:
    """Move ``path`` to :func:`backup_path` (nothing inside it changes) and say so; returns the backup."""
    path = Path(path)
    backup = backup_path(path)
    os.rename(path, backup)
    print(f"[selfspec] {key}=true: moved {path} to {backup}, with everything in it", file=sys.stderr)
    return backup


def in_the_way(path: str | os.PathLike, kind: str, overwrite: bool = False, key: str = "overwrite",
               setting: str | None = None) -> bool:
    """Whether something at ``path`` stops selfspec from writing its ``kind`` folder there: True when it is to be
    backed up first (``overwrite``), False when nothing is in the way (missing, empty, or ours of ``kind`` holding
    only what selfspec wrote). Without ``overwrite``, a folder in the way raises :class:`FolderNotOursError`.
    ``key``: the setting that allows the backup (``feature_store.overwrite``); ``setting``: the one that named
    ``path`` (``out``), for the message. Reads only: every process of a run may call it."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return False
    if path.is_dir() and not path.is_symlink():
        names = [p.name for p in path.iterdir()]
        if not names:
            return False
        marker = read_marker(path)
        foreign = foreign_entries(path)
        if marker is not None and marker.get("kind") in (kind, None) and not foreign:
            return False
        if marker is None:
            what = f"holds files selfspec did not make ({_some(foreign)})"
        elif marker.get("kind") not in (kind, None):
            what = f"holds a selfspec {marker.get('kind')} folder, not a {kind} one"
        else:
            what = f"holds files selfspec did not write ({_some(foreign)})"
    else:
        what = "is a link" if path.is_symlink() else "is a file, not a folder"
    if overwrite:
        return True
    named = f"{setting}={path}" if setting else str(path)
    raise FolderNotOursError(
        f"{named} {what}: nothing was changed. Choose another folder, or give {key}=true to move it to "
        f"{path.name}.bak-<date-time> first.")


def make_way(path: str | os.PathLike, kind: str, overwrite: bool = False, key: str = "overwrite",
             setting: str | None = None) -> Path | None:
    """:func:`in_the_way`, and with ``overwrite`` the folder in the way moved to its backup (returned)."""
    if in_the_way(path, kind, overwrite, key, setting):
        return back_up(path, key)
    return None


def claim(path: str | os.PathLike, kind: str, overwrite: bool = False, key: str = "overwrite",
          setting: str | None = None) -> Path:
    """The folder ``path``, made and marked as selfspec's ``kind`` to write into: a missing or empty folder, or one of
    ours (of any kind: files are added, nothing is removed). A folder with files and no marker is refused
    (:class:`FolderNotOursError`), or with ``overwrite`` moved to a backup first."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink() and read_marker(path) is not None:
        return path
    make_way(path, kind, overwrite, key, setting)
    path.mkdir(parents=True, exist_ok=True)
    mark(path, kind)
    return path


def enter(path: str | os.PathLike, kind: str) -> bool:
    """Make the folder ``path`` (a run folder) and mark it as selfspec's ``kind`` when it is new or empty (Hydra's
    ``.hydra`` aside); a folder holding a user's files is used as it is and stays unmarked, so no writer ever treats
    it as ours. Returns whether the folder is ours. A file at ``path`` is refused."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FolderNotOursError(f"{path} is a file, not a folder: nothing was changed. Choose another folder.")
    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is not None:
        return True
    if all(p.name in TOOL_ENTRIES for p in path.iterdir()):
        mark(path, kind)
        return True
    return False


def temp_dir(dst: str | os.PathLike, kind: str) -> Path:
    """A new folder beside ``dst`` (``.<name>.tmp-XXXXXXXX``: unique to this call), marked as selfspec's ``kind``,
    to write a folder into before :func:`replace_dir` moves it to ``dst``."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    while True:  # mkdir, not mkdtemp: the folder gets the permissions of any other (the umask's), not 0700
        tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    mark(tmp, kind)
    return tmp


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike, overwrite: bool = False, *, kind: str,
                key: str = "overwrite", setting: str | None = None) -> Path | None:
    """Move the finished folder ``src`` to ``dst``, marked as selfspec's ``kind`` with the entries it holds.

    ``dst`` is replaced only when it is missing, empty, or ours of ``kind`` holding nothing beyond what selfspec
    wrote (then the old folder is moved aside and deleted). Anything else is refused with
    :class:`FolderNotOursError` (``src`` is left for the caller to delete), or with ``overwrite`` moved to
    ``<name>.bak-<YYYYmmdd-HHMMSS>`` first (returned)."""
    src, dst = Path(src), Path(dst)
    mark(src, kind, entries=True)
    backup = make_way(dst, kind, overwrite, key, setting)
    old = None
    if dst.is_dir() and any(dst.iterdir()):  # ours (make_way let it through): aside, then deleted
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    try:
        os.replace(src, dst)  # over a missing or empty folder
    except BaseException:
        if old is not None:  # the old folder back in place
            os.replace(old / dst.name, dst)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return backup


def remove(path: str | os.PathLike, kind: str | None = None) -> None:
    """Delete the folder ``path`` when it is ours (of ``kind``, when given); anything else raises
    :class:`FolderNotOursError` and stays as it is. A missing ``path`` is fine."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not is_ours(path, kind):
        raise FolderNotOursError(f"{path} was not made by selfspec (it has no {MARKER} marker): it was not deleted.")
    shutil.rmtree(path)


def discard(path: str | os.PathLike, kind: str) -> bool:
    """Delete the folder ``path`` when it is ours of ``kind`` holding nothing beyond what selfspec wrote (a stale
    temporary folder, an old checkpoint); anything else stays as it is. Returns whether it was deleted."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or not is_ours(path, kind) or foreign_entries(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _some(names: list[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


__all__ = ["FolderNotOursError", "MARKER", "back_up", "backup_path", "claim", "discard", "enter", "foreign_entries",
           "in_the_way", "is_ours", "make_way", "mark", "read_marker", "remove", "replace_dir", "temp_dir"]


# --- the selfspec cache ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted models and tokenized datasets are cached (``SELFSPEC_CACHE`` overrides)."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "selfspec"


def cache_lock(folder: Path):
    """A lock file beside ``folder`` of a shared cache, held while one process makes it and others wait for it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder.parent / f".{folder.name}.lock"))
