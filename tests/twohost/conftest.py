"""The two-host tier: runs inside guest B of ci/two-vm (TV_ST set), against guest A's engines."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TV_ST"):
        return
    for item in items:
        if item.get_closest_marker("twohost"):
            item.add_marker(pytest.mark.skip(reason="runs in guest B of ci/two-vm/two-vm.sh (TV_ST unset)"))
