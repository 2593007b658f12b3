"""The vLLM tier (marker ``vllm``): needs vLLM, so it runs in the environment ``ci/install-vllm.sh`` makes
(``VENV/bin/python -m pytest -m vllm tests/vllm_tier``). Elsewhere it skips with the reason, or fails with
``HIXL_REQUIRE_VLLM=1`` (CI)."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

# what an instance's or proxy's log says about why a test failed: hixl's own lines, vLLM's errors
_WHY = re.compile(r"hixl|ERROR|Traceback|Error:|error:")


def _reason():
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (bash ci/install-vllm.sh VENV, then VENV/bin/python -m pytest -m vllm)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _reason()
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if reason is not None:
                if os.environ.get("HIXL_REQUIRE_VLLM") == "1":
                    item.add_marker(pytest.mark.usefixtures("_fail_no_vllm"))
                else:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def _fail_no_vllm():
    pytest.fail("HIXL_REQUIRE_VLLM=1 but " + _reason())


def log_marks(node, paths):
    """Remember where the logs at ``paths`` end now: on a failure of ``node``, what they logged since
    goes into its report (``pytest_runtest_makereport`` below)."""
    marks = node.__dict__.setdefault("_hixl_log_marks", {})
    for p in paths:
        try:
            marks.setdefault(p, os.path.getsize(p))
        except OSError:
            marks.setdefault(p, 0)


def _why(path, offset, max_lines=80):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError as e:
        return [f"(cannot read: {e})"]
    lines = [ln for ln in text.splitlines() if _WHY.search(ln)]
    return (["..."] if len(lines) > max_lines else []) + lines[-max_lines:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    marks = item.__dict__.get("_hixl_log_marks")
    if rep.when == "call" and rep.failed and marks:
        parts = []
        for path, offset in marks.items():
            lines = _why(path, offset)
            if lines:
                parts.append(f"--- {path}\n" + "\n".join(lines))
        if parts:
            rep.sections.append(("what the instances and proxies logged (hixl lines, errors)", "\n".join(parts)))
