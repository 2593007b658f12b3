"""Tier 1: wire format through the binding (round trip, malformed frames, bounded fuzz)."""
import random
import struct

import pytest

import hixl
from hixl import _core

HDR = struct.Struct("<IHHII")


def hello(nregions=2):
    return {
        "qpn": 0x11, "psn": 0x22, "lid": 3, "gid": "::ffff:192.168.77.1", "mtu": 1024, "port": 1,
        "regions": [{"addr": 0x1000 * (i + 1), "len": 4096, "rkey": 7 + i, "access": 3} for i in range(nregions)],
    }


def test_round_trip():
    h = hello(5)
    out = _core.wire_parse_hello_frame(_core.wire_encode_hello(h))
    assert out == h


def test_header_layout_is_versioned_and_length_prefixed():
    f = _core.wire_encode_hello(hello(1))
    magic, version, ftype, plen, reserved = HDR.unpack_from(f)
    assert (magic, version, ftype, reserved) == (0x4C584948, _core.WIRE_VERSION, 1, 0)
    assert plen == len(f) - HDR.size


@pytest.mark.parametrize("cut", [0, 1, 15, 16, 17, 40, -1])
def test_truncated_frames_are_refused(cut):
    f = _core.wire_encode_hello(hello(2))
    with pytest.raises(hixl.HixlError, match="truncated|announces"):
        _core.wire_parse_hello_frame(f[:cut] if cut >= 0 else f[:-1])


def test_wrong_version_magic_and_oversize():
    f = bytearray(_core.wire_encode_hello(hello(0)))
    g = bytearray(f); g[4] = 9
    with pytest.raises(hixl.HixlError, match="unsupported protocol version 9"):
        _core.wire_parse_hello_frame(bytes(g))
    g = bytearray(f); g[0] = 0
    with pytest.raises(hixl.HixlError, match="bad magic"):
        _core.wire_parse_hello_frame(bytes(g))
    g = bytearray(f); struct.pack_into("<I", g, 8, _core.WIRE_MAX_PAYLOAD + 1)
    with pytest.raises(hixl.HixlError, match="exceeds the limit"):
        _core.wire_parse_hello_frame(bytes(g))


def test_region_count_lies_are_refused_without_allocation():
    f = bytearray(_core.wire_encode_hello(hello(1)))
    struct.pack_into("<I", f, 16 + 36 - 4, 0x7FFFFFFF)
    with pytest.raises(hixl.HixlError, match="region_count 2147483647"):
        _core.wire_parse_hello_frame(bytes(f))


def test_bad_fields_in_dict_are_clear_errors():
    with pytest.raises(hixl.HixlError, match="missing key 'qpn'"):
        _core.wire_encode_hello({"psn": 1, "gid": "::1"})
    with pytest.raises(hixl.HixlError, match="not an IPv6-format GID"):
        _core.wire_encode_hello({**hello(0), "gid": "nonsense"})
    with pytest.raises(hixl.HixlError, match="'psn'=-1 out of range"):
        _core.wire_encode_hello({**hello(0), "psn": -1})
    with pytest.raises(hixl.HixlError, match="mtu=1000"):
        _core.wire_encode_hello({**hello(0), "mtu": 1000})


def test_random_garbage_never_crashes():
    rng = random.Random(99)
    good = _core.wire_encode_hello(hello(3))
    parsed = refused = 0
    for _ in range(5000):
        f = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            f[rng.randrange(len(f))] = rng.randrange(256)
        f = bytes(f[: rng.randrange(len(f) + 1)])
        try:
            _core.wire_parse_hello_frame(f)
            parsed += 1
        except hixl.HixlError:
            refused += 1
    assert refused > 0 and parsed + refused == 5000


@pytest.mark.parametrize("addr,expect", [
    ("10.0.0.1:26000", ("10.0.0.1", 26000)), ("[::1]:7", ("::1", 7)), ("10.0.0.1", ("10.0.0.1", -1)),
])
def test_split_host_port(addr, expect):
    assert _core.split_host_port(addr) == expect


@pytest.mark.parametrize("addr", ["", "1.2.3.4:", "1.2.3.4:70000", "[::1", "host:x"])
def test_split_host_port_refuses(addr):
    with pytest.raises(hixl.HixlError):
        _core.split_host_port(addr)
