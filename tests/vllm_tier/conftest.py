"""The vLLM tier (marker ``vllm``): needs vLLM, so it runs in the environment ``ci/install-vllm.sh`` makes
(``VENV/bin/python -m pytest -m vllm tests/vllm_tier``). Elsewhere it skips with the reason, or fails with
``HIXL_REQUIRE_VLLM=1`` (CI)."""
from __future__ import annotations

import importlib.util
import os

import pytest


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
