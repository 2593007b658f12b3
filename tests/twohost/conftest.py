"""The two-host tier: runs inside guest B of ci/two-vm (TV_ST set), against guest A's engines."""
from __future__ import annotations

import os

import pytest


def _suite_copy_left_out(item, in_guest: bool) -> bool:
    """test_engine_suite.py collects tests/test_hixl_engine.py once more: that copy runs only in guest B,
    without shm (it cannot cross hosts) and without the tests that make engines of their own on one host."""
    if item.path.name != "test_engine_suite.py":
        return False
    if not in_guest:
        return True  # the single-host tiers run the original
    spec = getattr(item, "callspec", None)
    return item.get_closest_marker("onehost") is not None or (spec is not None and spec.params.get("transport") == "shm")


def pytest_collection_modifyitems(config, items):
    in_guest = bool(os.environ.get("TV_ST"))
    left_out = [item for item in items if _suite_copy_left_out(item, in_guest)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        gone = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in gone]
    if in_guest:
        return
    for item in items:
        if item.get_closest_marker("twohost"):
            item.add_marker(pytest.mark.skip(reason="runs in guest B of ci/two-vm/two-vm.sh (TV_ST unset)"))
