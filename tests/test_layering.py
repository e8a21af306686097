"""The package layering docs/architecture.md states, read from the imports of every module (top-level and inside
functions): `core` imports none of the other packages; `heads` imports only `core`; `decode` never imports `train`;
`train` reaches `decode` only where a training run is judged by decoding; inside `decode`, the engine and the
drafters meet only in `types.py` and `step.py`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "heads", "decode", "train")
DRAFTERS = {"decode.drafters", "decode.eagle_drafter", "decode.suffix", "decode.layerskip", "decode.hybrid",
            "decode.dynamic_tree", "decode.dflash_drafter"}


def imports(package: str) -> dict[str, set[str]]:
    """module name -> the project modules it imports (``from a.b import c`` gives a.b and a.b.c)."""
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
        out[module] = {name for name in found if name.split(".")[0] in PACKAGES}
    return out


def test_the_import_graph_is_the_documented_layering():
    core, heads, decode, train = (imports(p) for p in PACKAGES)
    assert len(core) > 5 and len(heads) > 5 and len(decode) > 10 and len(train) > 10  # the walk found the packages
    for module, names in core.items():
        assert {n.split(".")[0] for n in names} <= {"core"}, module
    for module, names in heads.items():
        assert {n.split(".")[0] for n in names} <= {"core", "heads"}, module
    for module, names in decode.items():
        assert "train" not in {n.split(".")[0] for n in names}, module
    judged_by_decoding = {  # the end-of-run speed check, and layer-skip's exits ranked by their decode cost
        "train.speed_check": {"decode.prompts", "decode.session", "decode.settings"},
        "train.layerskip_method": {"decode.layerskip", "decode.session"},
    }
    for module, names in train.items():
        used = {".".join(n.split(".")[:2]) for n in names if n.startswith("decode")}
        assert used <= judged_by_decoding.get(module, set()), module
    assert not {".".join(n.split(".")[:2]) for n in decode["decode.engine"]} & DRAFTERS
    for drafter in DRAFTERS:
        assert "decode.engine" not in decode[drafter], drafter


@pytest.mark.parametrize("module", ["decode.engine", "decode.hybrid"])
def test_the_walk_sees_what_a_module_imports(module):
    """A check on the check: the engine and the hybrid do import types.py and step.py."""
    assert {"decode.types", "decode.step"} <= imports("decode")[module]
