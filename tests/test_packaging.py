"""Packaging says what each part needs: every third-party import of a part is numpy or comes with
the pip extra declared for that part, a missing one is reported naming the extra, and ``import hixl``
pulls in none of them."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hixl
from hixl import _extras

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "python" / "hixl"
# part (a path under python/hixl) -> the extra its imports come with
PART_EXTRA = {"demo": "demo", "models/smollm2.py": "demo", "bench": "bench", "proxy": "proxy", "vllm": "vllm",
              "models/export.py": "vllm", "metrics.py": "metrics"}
# Imported only when the user asks for them (hixl bench --vs mooncake / nixl), installed on their own.
REFERENCE_PEERS = {"mooncake", "nixl", "nixl_cu12"}
OPTIONAL = set(_extras.EXTRA_OF)


def _extras_declared():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _dist_name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip().lower().replace("_", "-")


def _third_party_imports(path: Path):
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for n in names:
            top = n.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("hixl", "numpy", "__future__"):
                out.add(top)
    return out


def _part_of(path: Path):
    rel = path.relative_to(PKG).as_posix()
    for part, extra in PART_EXTRA.items():
        if rel == part or rel.startswith(part + "/"):
            return extra
    return None  # the core: numpy only


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: p.relative_to(PKG).as_posix())
def test_every_third_party_import_comes_with_the_part_s_extra(path):
    declared = _extras_declared()
    extra = _part_of(path)
    for top in _third_party_imports(path) - REFERENCE_PEERS:
        assert extra is not None, "%s (the core: numpy only) imports %s" % (path, top)
        assert top in OPTIONAL, "%s imports %s, which _extras.EXTRA_OF does not know" % (path, top)
        dists = {_dist_name(r) for r in declared[_extras.EXTRA_OF[top]]}
        assert top.replace("_", "-") in dists, "%s is not in the [%s] extra" % (top, _extras.EXTRA_OF[top])
        assert top.replace("_", "-") in {_dist_name(r) for r in declared[extra]}, \
            "%s imports %s, which its extra [%s] does not declare" % (path, top, extra)


def test_the_extras_users_install():
    declared = _extras_declared()
    assert {"demo", "bench", "proxy", "vllm", "test"} <= set(declared)
    test = {_dist_name(r) for r in declared["test"]}
    for extra in ("demo", "bench", "proxy"):  # tier 1 tests them
        assert {_dist_name(r) for r in declared[extra]} <= test, extra


def test_a_missing_dependency_names_its_extra(monkeypatch):
    from hixl.models import smollm2
    monkeypatch.setitem(sys.modules, "gguf", None)  # "import gguf" raises ImportError
    with pytest.raises(ImportError, match=r"SmolLM2 model \(hixl demo\) needs gguf .*pip install 'hixl\[demo\]'"):
        smollm2._as_reader("/nonexistent.gguf")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"needs tokenizers .*'hixl\[demo\]'"):
        smollm2.Tokenizer.from_json("{}", 1, 2)
    assert _extras.hint("matplotlib.pyplot") == "pip install 'hixl[bench]'"
    assert _extras.hint("aiohttp") == "pip install 'hixl[proxy]'"


def test_import_hixl_needs_numpy_only():
    code = ("import sys, hixl, hixl.kv, hixl.acl; "
            "print(sorted(m for m in %r if m in sys.modules))" % (sorted(OPTIONAL),))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert hixl.Hixl  # the core API is there
