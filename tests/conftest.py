"""Test tiers: plain (no device), `rdma` (needs an ACTIVE RDMA device), `interop` (pyverbs peer).

Outside a machine with RDMA the device tiers skip with the reason "no RDMA device". With
HIXL_REQUIRE_RDMA=1 (set by CI inside the rxe VM) a missing device is a failure, not a skip.
"""
from __future__ import annotations

import os

import pytest

# the two-engine suite's scaffolding asserts too: pytest's messages for them as for a test's own
pytest.register_assert_rewrite("tests.engine_pair")

import hixl  # noqa: E402


def _device_reason():
    if hixl.has_active_device():
        return None
    return "no RDMA device"


def pytest_collection_modifyitems(config, items):
    reason = _device_reason()
    if reason is None:
        return
    require = os.environ.get("HIXL_REQUIRE_RDMA") == "1"
    for item in items:
        if item.get_closest_marker("rdma") or item.get_closest_marker("interop"):
            if require:
                item.add_marker(pytest.mark.usefixtures("_fail_no_device"))
            else:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def _fail_no_device():
    pytest.fail("HIXL_REQUIRE_RDMA=1 but no ACTIVE RDMA device is visible (is rxe0 up?)")
