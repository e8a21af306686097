"""The package layering docs/architecture.md states, read from the imports of every module (top-level and inside
functions): each room imports only the rooms ``MAY_IMPORT`` gives it (``core`` none, ``cpu_kernels`` and ``heads``
only ``core``, ``decode`` never ``train``, ``serve`` and ``bench`` on top of ``decode``); `train` reaches `decode` only
where a training run is judged by decoding; the commands (the modules pyproject.toml's [project.scripts] names) wire
the rooms they run and are imported by none; inside `decode`, the engine and the drafters meet only in `types.py` and
`step.py`; no module reaches itself through its imports, and no room through another's. An import inside a function
says why beside it. The family table (core/families.py) names no code: each room registers its families' code in its
own ``families`` module, with plain imports of that room's modules. The packages are imported as installed: no file
edits sys.path, and no module beside an entry file shadows another module of its name."""

from __future__ import annotations

import ast
import importlib.machinery
import io
import re
import tokenize
from pathlib import Path

import pytest

from selfspec.core.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "cpu_kernels", "heads", "decode", "serve", "bench", "train")  # the rooms, each an installed package
MAY_IMPORT = {  # room -> the rooms its modules may import (its own too); the commands are above them all
    "core": {"core"},
    "cpu_kernels": {"core"},  # the CPU kernels the engine runs with: linears, grouped-query attention, greedy LM head
    "heads": {"core"},
    "decode": {"core", "cpu_kernels", "heads"},  # the engine and the drafters
    "train": {"core", "heads", "decode"},  # decode only where a run is judged by decoding (JUDGED_BY_DECODING)
    "serve": {"core", "cpu_kernels", "heads", "decode"},  # vLLM: the serve check, selfspec's proposers inside vLLM
    "bench": {"core", "cpu_kernels", "heads", "decode", "serve", "train"},  # the benchmarks, learning ones too
}
JUDGED_BY_DECODING = {  # train's modules that decode, and what of decode they use: the end-of-run speed check, and
    # layer-skip's exits ranked by their decode cost
    "train.speed_check": {"decode.prompts", "decode.session", "decode.settings"},
    "train.layerskip_method": {"decode.layerskip", "decode.session"},
}
ROOMS = ("heads", "decode", "train")  # the rooms that register families' code, each in its ``families`` module


def short(name: str) -> str:
    """``selfspec.decode.engine`` -> ``decode.engine``: every project module is installed under ``selfspec``."""
    return name.removeprefix("selfspec.")


def family_modules(room: str) -> set[str]:
    """The modules of ``room`` its ``families`` module registers families' code from (e.g. every family's decode
    drafter module): what ``<room>/families.py`` imports of its own room, as modules."""
    names = imports(room)[f"{room}.families"]
    return {n for n in names if n.count(".") == 1 and n.startswith(room + ".")} - {f"{room}.types", f"{room}.method"}


def imports(package: str) -> dict[str, set[str]]:
    """module name -> the project modules it imports (``from a.b import c`` gives a.b and a.b.c), both without their
    ``selfspec.`` prefix; an import of a project package by its bare name (``import core``) is an error."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        bare = {name for name in found if name.split(".")[0] in PACKAGES}
        assert not bare, f"{module} imports {sorted(bare)}: the packages are selfspec.core, selfspec.decode, ..."
        out[module] = {short(name) for name in found if short(name).split(".")[0] in PACKAGES and name != short(name)}
    return out


# the families' drafters, and the drafter-side pieces they share (the suffix hybrid, EAGLE's dynamic tree)
DRAFTERS = family_modules("decode") | {"decode.hybrid", "decode.dynamic_tree"}


def commands() -> set[str]:
    """The modules the installed commands run (pyproject.toml's [project.scripts]), without ``selfspec.``."""
    from importlib.metadata import distribution

    scripts = [e for e in distribution("selfspec").entry_points if e.group == "console_scripts"]
    return {short(e.value.partition(":")[0]) for e in scripts}


def entry_file(module: str) -> bool:
    """A file run as ``python train/medusa.py``: it runs a command (``if __name__ == "__main__"``)."""
    path = (ROOT / Path(*module.split("."))).with_suffix(".py")
    return path.is_file() and '__name__ == "__main__"' in path.read_text()


def room(module: str) -> str:
    return module.split(".")[0]


def test_the_import_graph_is_the_documented_layering():
    rooms = {p: imports(p) for p in PACKAGES}
    assert all(len(rooms[p]) > 3 for p in PACKAGES) and len(rooms["decode"]) > 10  # the walk found the packages
    wiring = commands()
    assert {"decode.run", "train.cli", "bench.cli", "serve.cli"} <= wiring  # the table was read
    graph = {m: n for p in PACKAGES for m, n in rooms[p].items()}
    for module, names in graph.items():  # a command is where the rooms meet, at the top: only an entry file runs it
        assert entry_file(module) or not {".".join(n.split(".")[:2]) for n in names} & wiring - {module}, module
        if module not in wiring:
            assert {room(n) for n in names} <= MAY_IMPORT[room(module)] | {room(module)}, module
    assert "train.online" in {".".join(n.split(".")[:2]) for n in graph["decode.run"]}  # learn=true's learner
    for module, names in rooms["train"].items():
        used = {".".join(n.split(".")[:2]) for n in names if room(n) == "decode"}
        assert module in wiring or used <= JUDGED_BY_DECODING.get(module, set()), module
    decode = rooms["decode"]
    assert not {".".join(n.split(".")[:2]) for n in decode["decode.engine"]} & DRAFTERS
    for drafter in DRAFTERS:
        assert "decode.engine" not in decode[drafter], drafter


def test_the_rooms_read_in_one_direction():
    """The table has no circle (a room that may import another is not imported by it, even through a third), and
    every room's own imports, its commands aside, keep to it."""
    table = {r: allowed - {r} for r, allowed in MAY_IMPORT.items()}
    assert set(table) == set(PACKAGES) and import_cycle(table) is None
    wiring = commands()
    used = {r: set() for r in PACKAGES}
    for p in PACKAGES:
        for module, names in imports(p).items():
            if module not in wiring:
                used[p] |= {room(n) for n in names} - {p}
    assert import_cycle(used) is None, " -> ".join(import_cycle(used))
    assert used["bench"] >= {"decode", "serve", "train"} and used["decode"] >= {"cpu_kernels"}  # the walk read them


@pytest.mark.parametrize("module", ["decode.engine", "decode.hybrid"])
def test_the_walk_sees_what_a_module_imports(module):
    """A check on the check: the engine imports types.py and step.py, the hybrid types.py."""
    assert "decode.types" in imports("decode")[module]
    assert "decode.step" in imports("decode")["decode.engine"]


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> the modules it imports), or None."""
    done: set[str] = set()
    for start in graph:
        path, on_path, stack = [], set(), [(start, iter(sorted(graph[start])))]
        if start in done:
            continue
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return path[path.index(child):] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_no_import_circle():
    """No module reaches itself through the imports of the modules it imports (those inside functions and under
    TYPE_CHECKING too): each room reads in one direction."""
    every = {m: n for p in PACKAGES for m, n in imports(p).items()}
    graph = {m: {n for n in names if n in every and n != m and not m.startswith(n + ".")} for m, names in every.items()}
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check on the check
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_each_room_registers_its_families_code_from_its_own_modules():
    """core/families.py imports no room; each room's ``families`` module imports only its own room and core, and
    registers the code of families the table declares (a training-free family has no heads and trains nothing)."""
    from selfspec.decode.families import DRAFTERS as DRAFTING
    from selfspec.heads.families import HEADS
    from selfspec.train.families import METHODS

    assert {"decode.drafters", "decode.eagle_drafter", "decode.dflash_drafter"} <= DRAFTERS  # the walk read them
    assert not {n.split(".")[0] for n in imports("core")["core.families"]} - {"core"}
    for room in ROOMS:
        assert {n.split(".")[0] for n in imports(room)[f"{room}.families"]} <= {"core", room}, room
    assert set(DRAFTING) == set(FAMILIES)
    assert set(METHODS) == {n for n, f in FAMILIES.items() if f.trains}
    assert set(HEADS) == {n for n, f in FAMILIES.items() if f.needs_heads or f.optional_heads}


SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\[[^\]]*\]\s*=(?!=)|\+?=(?!=)|\.(insert|append|extend|remove|pop|clear)\()"
                           r"|del\s+sys\.path")


def test_no_file_edits_sys_path():
    """The packages are installed (``pip install -e .``): entry files, scripts and tests import them as they are."""
    files = [path for folder in (*PACKAGES, "scripts", "tests") for path in (ROOT / folder).rglob("*.py")]
    assert len(files) > 100
    edits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert not edits, edits
    edit = "sys.path"  # the check on the check, split so that it does not find itself
    assert all(SYS_PATH_EDIT.search(edit + e) for e in (".insert(0, root)", "[0] = root", " += [root]", ".append(r)"))
    assert not SYS_PATH_EDIT.search(edit + "[0] == root")


# `python <folder>/<file>.py` puts <folder> first on sys.path; `python -m ...` and `python -c` run in the repository
# put the repository itself there (""), where the rooms are folders: why the kernels' room is cpu_kernels
ENTRY_FOLDERS = ("train", "decode", "scripts", "")
STARTUP_MODULES = {"types"}  # imported by the interpreter before it reads the script's folder (decode/types.py)


def test_no_module_beside_an_entry_file_shadows_another_module():
    """`python decode/run.py` puts decode/ first on sys.path (`python -m pytest`, the repository): a module there named
    like an installed or standard one, or like one that transformers looks for (its ``kernels`` hub package:
    decode/kernels.py broke every model load), would be found in its place."""
    from transformers.utils import import_utils

    probed = set(re.findall(r'_is_package_available\(\s*"(\w+)"', Path(import_utils.__file__).read_text()))
    assert "kernels" in probed  # the check reads them
    import sys

    ours = {ROOT, *(ROOT / folder for folder in ENTRY_FOLDERS)}
    elsewhere = [p for p in sys.path if p and Path(p).resolve() not in ours]
    for folder in ENTRY_FOLDERS:
        beside = {p.stem for p in (ROOT / folder).glob("*.py")} | {
            p.name for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file()}
        for name in sorted(beside - STARTUP_MODULES - {"__init__"}):
            assert name not in probed and name not in sys.builtin_module_names, f"{folder}/{name}"
            assert importlib.machinery.PathFinder.find_spec(name, elsewhere) is None, f"{folder}/{name}"


def unexplained_imports(source: str) -> list[int]:
    """The lines of the imports inside functions of ``source`` that say no reason: a run of consecutive import
    statements in a function's body needs a comment on one of its lines or a comment line just above it."""
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    whole_line = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    unexplained = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            for field in ("body", "orelse", "finalbody", "handlers"):
                runs, run = [], []
                for statement in getattr(node, field, []) if isinstance(getattr(node, field, None), list) else []:
                    if isinstance(statement, (ast.Import, ast.ImportFrom)):
                        run.append(statement)
                    elif run:
                        runs.append(run)
                        run = []
                runs += [run] if run else []
                for run in runs:
                    said = set(range(run[0].lineno, run[-1].end_lineno + 1)) & comments
                    if not said and run[0].lineno - 1 not in whole_line:
                        unexplained += [s.lineno for s in run]
    return sorted(set(unexplained))


def test_an_import_inside_a_function_says_why():
    """Imports are at the top of a file, where the graph can be read; one inside a function of a room or a script
    (vLLM's, only in its own venv; torch, deferred until a command has read its config or a script its arguments; an
    optional or slow package, only where it is used) says why."""
    files = [path for folder in (*PACKAGES, "scripts") for path in sorted((ROOT / folder).rglob("*.py"))]
    found = {f"{path.relative_to(ROOT)}:{n}" for path in files for n in unexplained_imports(path.read_text())}
    assert not found, sorted(found)
    assert unexplained_imports("def f():\n    import os\n    return os\n") == [2]  # the check on the check
    assert unexplained_imports("def f():\n    # why\n    import os\n    import re\n") == []
    assert unexplained_imports("def f():\n    import os  # why\n    import re\n    x = 1\n    import io\n") == [5]
