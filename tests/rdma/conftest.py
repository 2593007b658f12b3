"""Fixtures for the `rdma` tier: two endpoints on the same device, connected over loopback."""
from __future__ import annotations

import numpy as np
import pytest

import hixl


def connected_pair(**kw):
    a = hixl.Endpoint(**kw)
    b = hixl.Endpoint(**kw)
    a.connect(b.info())
    b.connect(a.info())
    return a, b


@pytest.fixture
def pair():
    a, b = connected_pair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)
