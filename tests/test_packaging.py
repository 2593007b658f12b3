"""Packaging says what each part needs and where it lives: the library (``hixl``, python/hixl) is what an
engine imports, the tools (``hixl-tools``, tools/hixl_tools) sit beside it; every third-party import of a
part is numpy or comes with the pip extra declared for that part, a missing one is reported naming the
extra, ``import hixl`` pulls in none of them, and the library neither ships nor imports the tools."""
from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import hixl
import hixl_tools
from hixl import _extras
from hixl_tools import _extras as tools_extras

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "python" / "hixl"
TOOLS = REPO / "tools" / "hixl_tools"
# part (a path under python/hixl) -> the extra of hixl its imports come with
PART_EXTRA = {"proxy": "proxy", "vllm": "vllm", "metrics.py": "metrics"}
# part (a path under tools/hixl_tools) -> (distribution, extra) its imports come with
TOOLS_PART_EXTRA = {"demo": ("hixl-tools", "demo"), "models/smollm2.py": ("hixl-tools", "demo"),
                    "bench": ("hixl-tools", "bench"), "models/export.py": ("hixl", "vllm"),
                    "models/tiny_llama.py": ("hixl", "vllm"), "models/tiny": ("hixl", "vllm")}
# Imported only when the user asks for them (hixl bench --vs mooncake / nixl), installed on their own.
REFERENCE_PEERS = {"mooncake", "nixl", "nixl_cu12"}
OPTIONAL = set(_extras.EXTRA_OF)
# What moved out of the library into hixl-tools (paths under python/hixl before).
MOVED = ("bench", "demo", "models", "vllm/cluster.py")


def _extras_declared(dist: str = "hixl"):
    with open(REPO / ("pyproject.toml" if dist == "hixl" else "tools/pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _dist_name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip().lower().replace("_", "-")


def _imports(path: Path):
    """Top-level names of the absolute imports in a file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out.update(n.split(".")[0] for n in names)
    return out


def _third_party_imports(path: Path):
    return {top for top in _imports(path)
            if top not in sys.stdlib_module_names and top not in ("hixl", "hixl_tools", "numpy", "__future__")}


def _part_of(path: Path, root: Path, parts):
    rel = path.relative_to(root).as_posix()
    for part, extra in parts.items():
        if rel == part or rel.startswith(part + "/"):
            return extra
    return None  # numpy only


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: p.relative_to(PKG).as_posix())
def test_every_third_party_import_comes_with_the_part_s_extra(path):
    declared = _extras_declared()
    extra = _part_of(path, PKG, PART_EXTRA)
    for top in _third_party_imports(path):
        assert extra is not None, "%s (the core: numpy only) imports %s" % (path, top)
        assert top in OPTIONAL, "%s imports %s, which _extras.EXTRA_OF does not know" % (path, top)
        dists = {_dist_name(r) for r in declared[_extras.EXTRA_OF[top]]}
        assert top.replace("_", "-") in dists, "%s is not in the [%s] extra" % (top, _extras.EXTRA_OF[top])
        assert top.replace("_", "-") in {_dist_name(r) for r in declared[extra]}, \
            "%s imports %s, which its extra [%s] does not declare" % (path, top, extra)


@pytest.mark.parametrize("path", sorted(TOOLS.rglob("*.py")), ids=lambda p: p.relative_to(TOOLS).as_posix())
def test_every_third_party_import_of_the_tools_comes_with_the_part_s_extra(path):
    part = _part_of(path, TOOLS, TOOLS_PART_EXTRA)
    for top in _third_party_imports(path) - REFERENCE_PEERS:
        assert part is not None, "%s (hixl and numpy only) imports %s" % (path, top)
        assert top in tools_extras.EXTRA_OF, "%s imports %s, which hixl_tools._extras.EXTRA_OF does not know" % (
            path, top)
        dist, extra = tools_extras.EXTRA_OF[top]
        assert top.replace("_", "-") in {_dist_name(r) for r in _extras_declared(dist)[extra]}, \
            "%s is not in %s[%s]" % (top, dist, extra)
        assert top.replace("_", "-") in {_dist_name(r) for r in _extras_declared(part[0])[part[1]]}, \
            "%s imports %s, which its extra %s[%s] does not declare" % (path, top, *part)


def test_the_extras_users_install():
    declared, tools = _extras_declared(), _extras_declared("hixl-tools")
    assert {"proxy", "metrics", "vllm", "test"} <= set(declared)
    assert not {"demo", "bench"} & set(declared), "the tools' extras are hixl-tools'"
    assert {"demo", "bench"} <= set(tools)
    test = {_dist_name(r) for r in declared["test"]}
    for extras, extra in ((tools, "demo"), (tools, "bench"), (declared, "proxy")):  # tier 1 tests them
        assert {_dist_name(r) for r in extras[extra]} <= test, extra
    with open(REPO / "tools/pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert {_dist_name(r) for r in project["dependencies"]} == {"hixl", "numpy"}
    assert set(project["entry-points"]["hixl.commands"]) == {"bench", "demo", "model"}


def test_a_missing_dependency_names_its_extra(monkeypatch):
    from hixl_tools.models import smollm2
    monkeypatch.setitem(sys.modules, "gguf", None)  # "import gguf" raises ImportError
    with pytest.raises(ImportError, match=r"SmolLM2 model \(hixl demo\) needs gguf .*pip install 'hixl-tools\[demo\]'"):
        smollm2._as_reader("/nonexistent.gguf")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"needs tokenizers .*'hixl-tools\[demo\]'"):
        smollm2.Tokenizer.from_json("{}", 1, 2)
    assert tools_extras.hint("matplotlib.pyplot") == "pip install 'hixl-tools[bench]'"
    assert tools_extras.hint("torch") == "pip install 'hixl[vllm]'"
    assert _extras.hint("aiohttp") == "pip install 'hixl[proxy]'"


def test_import_hixl_needs_numpy_only():
    code = ("import sys, hixl, hixl.kv, hixl.acl; "
            "print(sorted(m for m in %r if m in sys.modules))" % (sorted(OPTIONAL | set(tools_extras.EXTRA_OF)),))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert hixl.Hixl  # the core API is there


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: p.relative_to(PKG).as_posix())
def test_the_library_never_imports_the_tools(path):
    """No module of python/hixl imports hixl_tools, at its top or in a function (the console script finds
    the tools' commands through entry points)."""
    tree = ast.parse(path.read_text())
    assert "hixl_tools" not in _imports(path), path
    for node in ast.walk(tree):  # importlib.import_module("hixl_tools...") / __import__ as well
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert not node.value.startswith("hixl_tools"), "%s names %r" % (path, node.value)


def test_loading_the_library_loads_no_tools():
    code = ("import sys, hixl, hixl.kv, hixl.acl, hixl.proxy, hixl.metrics, hixl.cli, hixl.endpoint; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hixl_tools'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_library_wheel_holds_no_tools():
    """What pip installed for hixl (its wheel's RECORD): the library only, and _core without the loops."""
    files = [f.as_posix() for f in importlib.metadata.files("hixl") or []]
    assert any(f.startswith("hixl/_core") for f in files), files
    moved = tuple("hixl/" + m for m in MOVED)
    assert not [f for f in files if f.startswith(moved) or f.startswith("hixl_tools")], files
    for name in ("perf_write_stream", "perf_engine_stream", "perf_fast_floor", "perf_call_floor_async"):
        assert not hasattr(hixl._core, name), name
    tools = [f.as_posix() for f in importlib.metadata.files("hixl-tools") or []]
    assert not [f for f in tools if f.startswith("hixl/")], tools  # and the tools' wheel holds no library
    assert any(f.startswith("hixl_tools/_perf") for f in tools), tools


def test_the_tools_find_the_library_s_objects():
    """hixl_tools._perf takes hixl._core's objects: built from the same core (checked at its import)."""
    from hixl_tools import _perf
    assert _perf.CORE_BUILD_ID == hixl._core.CORE_BUILD_ID
    assert hixl_tools.__doc__
