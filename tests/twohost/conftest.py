"""The two-host tier: runs inside guest B of ci/two-vm (TV_ST set), against guest A's engines."""
from __future__ import annotations

import os

import pytest


# Of the suite's rdma4 variant (links striped over 4 queue pairs) the two-host copy runs what depends on
# the order of bytes and flags across queue pairs, and on ending every stripe: the rest is as on rdma.
STRIPED_ACROSS_THE_LINK = ("test_write_then_read_back", "test_a_link_gets_the_smaller", "test_many_descriptors",
                           "test_flag", "test_notify_is_seen_only_after", "test_sync_timeout", "test_async_deadline",
                           "test_requests_in_flight_when_the_peer_disconnects")


def _suite_copy_left_out(item, in_guest: bool) -> bool:
    """test_engine_suite.py collects tests/test_hixl_engine.py once more: that copy runs only in guest B,
    without shm (it cannot cross hosts), without the tests that make engines of their own on one host,
    and with a part of the rdma4 variant (STRIPED_ACROSS_THE_LINK)."""
    if item.path.name != "test_engine_suite.py":
        return False
    if not in_guest:
        return True  # the single-host tiers run the original
    spec = getattr(item, "callspec", None)
    transport = spec.params.get("transport") if spec is not None else None
    if transport == "rdma4" and not item.name.startswith(STRIPED_ACROSS_THE_LINK):
        return True
    return item.get_closest_marker("onehost") is not None or transport == "shm"


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
