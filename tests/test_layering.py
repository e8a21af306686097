"""The package layering docs/architecture.md states, read from the imports of every module (top-level and inside
functions): `core` imports none of the other packages; `heads` imports only `core`; `decode` never imports `train`
(a session that learns is handed its learner by the command that asks for it); `train` reaches `decode` only where
a training run is judged by decoding; the commands (the modules pyproject.toml's [project.scripts] names) wire the
rooms they run and are imported by none; inside `decode`, the engine and the
drafters meet only in `types.py` and `step.py`. The family table (core/families.py) names no code: each room
registers its families' code in its own ``families`` module, with plain imports of that room's modules. The packages are imported as installed: no file edits sys.path, and no module beside an entry
file shadows another module of its name."""

from __future__ import annotations

import ast
import importlib.machinery
import re
from pathlib import Path

import pytest

from selfspec.core.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "heads", "decode", "train")
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


def test_the_import_graph_is_the_documented_layering():
    core, heads, decode, train = (imports(p) for p in PACKAGES)
    assert len(core) > 5 and len(heads) > 5 and len(decode) > 10 and len(train) > 10  # the walk found the packages
    for module, names in core.items():
        assert {n.split(".")[0] for n in names} <= {"core"}, module
    for module, names in heads.items():
        assert {n.split(".")[0] for n in names} <= {"core", "heads"}, module
    wiring = commands()
    assert {"decode.run", "decode.cli", "train.cli"} <= wiring  # the table was read
    graph = {**core, **heads, **decode, **train}
    for module, names in graph.items():  # a command is where the rooms meet, at the top: only an entry file runs it
        assert entry_file(module) or not {".".join(n.split(".")[:2]) for n in names} & wiring - {module}, module
    for module, names in decode.items():
        if module not in wiring:
            assert not [n for n in names if n.split(".")[0] == "train"], module
    assert "train.online" in {".".join(n.split(".")[:2]) for n in decode["decode.run"]}  # learn=true's learner
    judged_by_decoding = {  # the end-of-run speed check, layer-skip's exits ranked by their decode cost, and the
        # benchmarks of learning while decoding
        "train.speed_check": {"decode.prompts", "decode.session", "decode.settings"},
        "train.layerskip_method": {"decode.layerskip", "decode.session"},
        "train.stream_bench": {"decode.bench", "decode.session", "decode.settings", "decode.types"},
        "train.learn_replay": {"decode.bench", "decode.session", "decode.settings", "decode.types"},
    }
    for module, names in train.items():
        used = {".".join(n.split(".")[:2]) for n in names if n.startswith("decode")}
        assert module in wiring or used <= judged_by_decoding.get(module, set()), module
    assert not {".".join(n.split(".")[:2]) for n in decode["decode.engine"]} & DRAFTERS
    for drafter in DRAFTERS:
        assert "decode.engine" not in decode[drafter], drafter


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


ENTRY_FOLDERS = ("train", "decode", "scripts")  # `python <folder>/<file>.py` puts <folder> first on sys.path
STARTUP_MODULES = {"types"}  # imported by the interpreter before it reads the script's folder (decode/types.py)


def test_no_module_beside_an_entry_file_shadows_another_module():
    """`python decode/run.py` puts decode/ first on sys.path: a module there named like an installed or standard one,
    or like one that transformers looks for (its ``kernels`` hub package: decode/kernels.py broke every model load),
    would be found in its place."""
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
