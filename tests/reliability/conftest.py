"""Fixtures of the reliability tests (their helpers: helpers.py)."""
import pytest

from .helpers import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param
