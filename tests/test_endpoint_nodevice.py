"""Tier 1: argument validation and error messages of the endpoint API that need no device."""
import pytest

import hixl
from hixl import _core


def test_list_devices_is_a_list_of_dicts():
    devs = hixl.list_devices()
    assert isinstance(devs, list)
    for d in devs:
        assert set(d) == {"name", "active_ports"}


def test_unknown_device_is_named_in_the_error():
    with pytest.raises(hixl.HixlError, match=r'no RDMA devices found|RDMA device "hixl-no-such-dev" not found'):
        hixl.Endpoint("hixl-no-such-dev")


@pytest.mark.skipif(hixl.has_active_device(), reason="checks the no-device message")
def test_no_device_error_is_clear():
    with pytest.raises(hixl.HixlError, match="ibv_get_device_list: no RDMA devices found|no RDMA device with an ACTIVE port"):
        hixl.Endpoint()


@pytest.mark.parametrize("kw,msg", [
    ({"port": 0}, "port=0 must be 1..255"),
    ({"service_level": 16}, "service_level must be 0..15"),
    ({"timeout": 40}, "timeout must be 0..31"),
    ({"retry_cnt": 9}, "retry_cnt must be 0..7"),
])
def test_option_ranges_are_checked_before_touching_a_device(kw, msg):
    with pytest.raises(hixl.HixlError, match=msg):
        hixl.Endpoint(**kw)


def test_enums_match_cann_transfer_status():
    assert [int(s) for s in hixl.TransferStatus] == [0, 1, 2, 3]
    assert hixl.Op.READ == 0 and hixl.Op.WRITE == 1 and hixl.Op.WRITE_WITH_IMM == 2


def test_not_supported_is_a_hixl_error():
    assert issubclass(hixl.NotSupportedError, hixl.HixlError)
    assert issubclass(hixl.HixlError, RuntimeError)
