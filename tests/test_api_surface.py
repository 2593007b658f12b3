"""Module-level API surface (hixl.types): values, enums, data classes, validators, parsers."""
from __future__ import annotations

import dataclasses
import enum
import json

import pytest

from hixl import types as T

# ------------------------------------------------------------------ constants

STATUS = {
    "SUCCESS": 0, "PARAM_INVALID": 103900, "TIMEOUT": 103901, "NOT_CONNECTED": 103902,
    "ALREADY_CONNECTED": 103903, "NOTIFY_FAILED": 103904, "UNSUPPORTED": 103905,
    "RESOURCE_EXHAUSTED": 203900, "FAILED": 503900,
}

ENUMS = {
    "MemType": {"MEM_DEVICE": 0, "MEM_HOST": 1},
    "TransferOp": {"READ": 0, "WRITE": 1},
    "TransferStatus": {"WAITING": 0, "COMPLETED": 1, "TIMEOUT": 2, "FAILED": 3},
    "AsyncConnectStatus": {
        "NOT_CONNECT": 0, "CONNECT_PENDING": 1, "CONNECTING": 2, "CONNECTED": 3,
        "CONNECT_FAILED": 4, "DISCONNECT_PENDING": 5, "DISCONNECTING": 6,
    },
    "FeatureType": {"AUTO_CONNECT": 0, "CLIENT_SERVER_COMM": 1},
}
EXPORTED_ENUMS = ("MemType", "TransferOp", "AsyncConnectStatus", "FeatureType")

OPTIONS = {
    "OPTION_ENABLE_USE_FABRIC_MEM": "EnableUseFabricMem",
    "OPTION_RDMA_TRAFFIC_CLASS": "RdmaTrafficClass",
    "OPTION_RDMA_SERVICE_LEVEL": "RdmaServiceLevel",
    "OPTION_BUFFER_POOL": "BufferPool",
    "OPTION_GLOBAL_RESOURCE_CONFIG": "GlobalResourceConfig",
    "OPTION_AUTO_CONNECT": "AutoConnect",
    "OPTION_LOCAL_COMM_RES": "LocalCommRes",
}


@pytest.mark.parametrize("name,value", sorted(STATUS.items()))
def test_status_codes(name, value):
    got = getattr(T, name)
    assert type(got) is int and got == value
    assert T.status_name(value) == name


def test_status_name_unknown_never_raises():
    assert T.status_name(12345) == "UNKNOWN(12345)"
    assert T.status_name(True).startswith("UNKNOWN")  # bool is not a status code
    assert T.status_name("x").startswith("UNKNOWN")
    assert T.status_name(None).startswith("UNKNOWN")


@pytest.mark.parametrize("cls_name", sorted(ENUMS))
def test_enum_members(cls_name):
    cls = getattr(T, cls_name)
    assert issubclass(cls, enum.IntEnum)
    assert {m.name: int(m) for m in cls} == ENUMS[cls_name]
    for name, value in ENUMS[cls_name].items():
        assert cls(value) is cls[name]
        assert cls[name] == value  # int-comparable


@pytest.mark.parametrize("cls_name", EXPORTED_ENUMS)
def test_enum_members_are_module_constants(cls_name):
    cls = getattr(T, cls_name)
    for m in cls:
        assert getattr(T, m.name) is m
        assert m.name in T.__all__


@pytest.mark.parametrize("cls_name", sorted(ENUMS))
def test_enum_members_print_as_canns_pybind11_enums(cls_name):
    cls = getattr(T, cls_name)
    for name, value in ENUMS[cls_name].items():
        m = cls[name]
        assert str(m) == "%s.%s" % (cls_name, name)               # pybind11 enum_: "{type}.{name}"
        assert repr(m) == "<%s.%s: %d>" % (cls_name, name, value)  # and "<{type}.{name}: {value}>"
        assert "%s" % m == f"{m}" == format(m) == str(m)
        assert f"{m:d}" == "%d" % m == str(value) and json.dumps(m) == str(value)


CANN_BINDING_NAMES = [  # hicann/hixl src/python/hixl_py/hixl/__init__.py: from hixl.hixl import (...)
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED", "NOTIFY_FAILED", "UNSUPPORTED",
    "FAILED", "RESOURCE_EXHAUSTED", "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL", "OPTION_BUFFER_POOL", "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES", "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED", "MemType", "MEM_DEVICE", "MEM_HOST",
    "TransferOp", "READ", "WRITE", "TransferStatus", "AsyncConnectStatus", "NOT_CONNECT", "CONNECT_PENDING",
    "CONNECTING", "CONNECTED", "CONNECT_FAILED", "DISCONNECT_PENDING", "DISCONNECTING", "FeatureType",
    "AUTO_CONNECT", "CLIENT_SERVER_COMM", "MemDesc", "TransferOpDesc", "TransferArgs", "GetTransferStatusArgs",
    "TransferResult", "NotifyDesc", "Hixl", "get_capability",
]


def test_the_binding_is_importable_as_canns_hixl_hixl():
    import importlib

    import hixl
    mod = importlib.import_module("hixl.hixl")
    assert hixl.hixl is mod
    assert sorted(mod.__all__) == sorted(CANN_BINDING_NAMES)
    for name in CANN_BINDING_NAMES:
        assert getattr(mod, name) is getattr(hixl, name), name
    ns = {}
    exec("from hixl.hixl import *", ns)
    assert set(CANN_BINDING_NAMES) <= set(ns)
    exec("from hixl.hixl import (Hixl, MemDesc, MemType, TransferOpDesc, TransferStatus, get_capability, "
         "SUCCESS, PARAM_INVALID, WRITE, READ, MEM_HOST, AUTO_CONNECT, OPTION_LOCAL_COMM_RES)", ns)
    assert ns["Hixl"] is hixl.Hixl and mod.TIMEOUT == T.TIMEOUT  # TIMEOUT: the status code, as in CANN


def test_transfer_status_members_not_exported():
    assert not hasattr(T, "WAITING")
    assert not hasattr(T, "COMPLETED")
    # TIMEOUT / FAILED at module level are the status codes, not TransferStatus members.
    assert T.TIMEOUT == 103901 and not isinstance(T.TIMEOUT, T.TransferStatus)
    assert T.FAILED == 503900 and not isinstance(T.FAILED, T.TransferStatus)
    for name in ("WAITING", "COMPLETED"):
        assert name not in T.__all__


def test_feature_and_limit_constants():
    assert T.FEATURE_SUPPORTED == 1 and T.FEATURE_NOT_SUPPORTED == 0
    assert T.MAX_NOTIFY_LEN == 1024 and T.MAX_UNREAD_NOTIFIES == 4096


@pytest.mark.parametrize("name,value", sorted(OPTIONS.items()))
def test_option_keys(name, value):
    assert getattr(T, name) == value


def test_module_doc_and_all():
    assert T.__doc__ and "CANN" in T.__doc__
    assert len(T.__all__) == len(set(T.__all__))
    for name in T.__all__:
        assert hasattr(T, name), name
    expected = set(STATUS) | set(ENUMS) | set(OPTIONS) | {
        "status_name", "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED", "MAX_NOTIFY_LEN",
        "MAX_UNREAD_NOTIFIES", "MemDesc", "TransferOpDesc", "TransferArgs",
        "GetTransferStatusArgs", "TransferResult", "NotifyDesc", "validate_mem_desc",
        "validate_op_desc", "validate_notify", "ParsedOptions", "parse_options",
        "get_capability", "parse_engine_address",
    }
    assert expected <= set(T.__all__)
    public = {n for n in vars(T) if not n.startswith("_")} - {
        "annotations", "dataclass", "enum", "field", "ipaddress", "json", "operator", "os", "re",
        "Any", "Dict", "List", "Optional", "Tuple",
    }
    assert public <= set(T.__all__), public - set(T.__all__)


# ---------------------------------------------------------------- data classes

DATACLASSES = [
    ("MemDesc", [("addr", 0), ("len", 0)]),
    ("TransferOpDesc", [("local_addr", 0), ("remote_addr", 0), ("len", 0)]),
    ("TransferArgs", [("user_data", 0)]),
    ("GetTransferStatusArgs", [("max_query_count", 2 ** 32 - 1), ("skip_waiting", False)]),
    ("TransferResult", [("req", 0), ("user_data", 0), ("status", T.TransferStatus.WAITING)]),
    ("NotifyDesc", [("name", ""), ("notify_msg", "")]),
]


@pytest.mark.parametrize("cls_name,fields", DATACLASSES)
def test_dataclass_defaults_and_field_order(cls_name, fields):
    cls = getattr(T, cls_name)
    assert [f.name for f in dataclasses.fields(cls)] == [n for n, _ in fields]
    obj = cls()
    for name, default in fields:
        got = getattr(obj, name)
        assert got == default and type(got) is type(default)


@pytest.mark.parametrize("cls_name,fields", DATACLASSES)
def test_dataclass_kwargs_positional_mutation_equality(cls_name, fields):
    cls = getattr(T, cls_name)
    values = ["v%d" % i for i in range(len(fields))]
    kw = cls(**{n: v for (n, _), v in zip(fields, values)})
    pos = cls(*values)
    assert kw == pos
    assert kw != cls()
    r = repr(kw)
    assert r.startswith(cls_name + "(")
    for (name, _), v in zip(fields, values):
        assert "%s=%r" % (name, v) in r
    first = fields[0][0]
    setattr(pos, first, "changed")
    assert getattr(pos, first) == "changed" and pos != kw
    with pytest.raises(TypeError):
        cls(*values, "one too many")


def test_dataclass_cann_style_usage():
    d = T.MemDesc(0x1000, 4096)
    assert (d.addr, d.len) == (0x1000, 4096)
    op = T.TransferOpDesc(1, 2, 3)
    assert (op.local_addr, op.remote_addr, op.len) == (1, 2, 3)
    res = T.TransferResult(req=7, status=T.TransferStatus.COMPLETED)
    assert res.user_data == 0 and res.status == 1
    assert T.MemDesc(1, 2) != T.TransferOpDesc(1, 2)  # different classes never equal


def test_dataclass_defaults_not_shared():
    a, b = T.GetTransferStatusArgs(), T.GetTransferStatusArgs()
    a.max_query_count = 1
    assert b.max_query_count == 2 ** 32 - 1


# ----------------------------------------------------------------- validation

U64 = 2 ** 64


@pytest.mark.parametrize("addr,length,ok", [
    (0x1000, 1, True),
    (0, 1, True),
    (U64 - 1, 1, True),            # ends exactly at 2**64
    (0, U64 - 1, True),
    (U64 - 4096, 4096, True),
    (U64 - 4096, 4097, False),     # wraps
    (U64 - 1, 2, False),
    (1, U64 - 1, True),            # also ends exactly at 2**64
    (2, U64 - 1, False),
    (0x1000, 0, False),            # empty
    (-1, 16, False),
    (16, -1, False),
    (U64, 1, False),
    (0, U64, False),
    (True, 16, False),             # bools rejected
    (16, True, False),
    (False, 16, False),
    (1.0, 16, False),
    (16, 1.5, False),
    ("16", 16, False),
    (None, 16, False),
])
def test_validate_mem_desc(addr, length, ok):
    want = T.SUCCESS if ok else T.PARAM_INVALID
    assert T.validate_mem_desc(T.MemDesc(addr, length)) == want


def test_validate_mem_desc_odd_inputs():
    assert T.validate_mem_desc(None) == T.PARAM_INVALID
    assert T.validate_mem_desc(object()) == T.PARAM_INVALID
    assert T.validate_mem_desc(T.MemDesc()) == T.PARAM_INVALID  # len 0
    assert T.validate_mem_desc(T.MemDesc(addr=T.MemType.MEM_HOST, len=8)) == T.SUCCESS  # IntEnum is int


def test_validate_accepts_numpy_ints_rejects_numpy_bool():
    np = pytest.importorskip("numpy")
    assert T.validate_mem_desc(T.MemDesc(np.uint64(4096), np.int64(8))) == T.SUCCESS
    assert T.validate_mem_desc(T.MemDesc(np.bool_(True), 8)) == T.PARAM_INVALID
    assert T.validate_mem_desc(T.MemDesc(np.int64(-1), 8)) == T.PARAM_INVALID


@pytest.mark.parametrize("local,remote,length,ok", [
    (0x1000, 0x2000, 64, True),
    (0, 0, 1, True),
    (U64 - 64, U64 - 64, 64, True),
    (U64 - 64, 0, 65, False),      # local wraps
    (0, U64 - 64, 65, False),      # remote wraps
    (0x1000, 0x2000, 0, False),
    (-1, 0, 1, False),
    (0, -1, 1, False),
    (0, 0, -1, False),
    (U64, 0, 1, False),
    (0, U64, 1, False),
    (True, 0, 1, False),
    (0, True, 1, False),
    (0, 0, True, False),
    (0, 0, 1.0, False),
])
def test_validate_op_desc(local, remote, length, ok):
    want = T.SUCCESS if ok else T.PARAM_INVALID
    assert T.validate_op_desc(T.TransferOpDesc(local, remote, length)) == want


def test_validate_op_desc_odd_inputs():
    assert T.validate_op_desc(None) == T.PARAM_INVALID
    assert T.validate_op_desc(T.MemDesc(1, 1)) == T.PARAM_INVALID  # lacks local/remote
    assert T.validate_op_desc(T.TransferOpDesc()) == T.PARAM_INVALID


@pytest.mark.parametrize("name,msg,ok", [
    ("", "", True),
    ("peer", "hello", True),
    ("n" * 1024, "m" * 1024, True),
    ("é" * 512, "字" * 341, True),  # bytes of UTF-8, as in CANN: 1024 and 1023
    ("é" * 513, "", False),         # 1026 bytes
    ("", "字" * 400, False),        # 1200 bytes
    ("\ud800", "", False),          # not encodable
    ("n" * 1025, "", False),
    ("", "m" * 1025, False),
    (b"peer", "x", False),
    ("peer", b"x", False),
    (None, "x", False),
    ("peer", 5, False),
])
def test_validate_notify(name, msg, ok):
    want = T.SUCCESS if ok else T.PARAM_INVALID
    assert T.validate_notify(T.NotifyDesc(name, msg)) == want


def test_validate_notify_odd_inputs():
    assert T.validate_notify(None) == T.PARAM_INVALID
    assert T.validate_notify(object()) == T.PARAM_INVALID


# -------------------------------------------------------------------- options

@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)


def ok(options):
    ret, p = T.parse_options(options)
    assert ret == T.SUCCESS, p.error
    assert p.error == ""
    return p


def bad(options):
    ret, p = T.parse_options(options)
    assert ret == T.PARAM_INVALID
    assert isinstance(p, T.ParsedOptions) and p.error
    return p


def test_parse_options_defaults(no_env):
    for options in ({}, None):
        p = ok(options)
        assert p.transport == "auto"
        assert p.rdma_traffic_class is None and p.rdma_service_level is None
        assert p.auto_connect is False and p.device is None and p.gid_index is None
        assert p.not_applicable == [] and p.raw == {} and p.notes == []
        assert (p.connect_pool_threads, p.connect_pool_capacity) == (2, 128)


def test_parse_options_full(no_env):
    opts = {
        T.OPTION_RDMA_TRAFFIC_CLASS: "252", T.OPTION_RDMA_SERVICE_LEVEL: "7",
        T.OPTION_AUTO_CONNECT: "1", "HixlTransport": "shm", "HixlDevice": "mlx5_0",
        "HixlGidIndex": "3", "HixlRdmaTimeout": "10", "HixlRdmaRetryCount": "0", "HixlRdmaQpsPerLink": "16",
        "HixlRdmaMaxWrBytes": "16384", "HixlRdmaSendWindowBytes": "0",
    }
    p = ok(opts)
    assert (p.rdma_timeout, p.rdma_retry_count, p.rdma_qps_per_link, p.rdma_max_wr_bytes) == (10, 0, 16, 16384)
    assert p.rdma_send_window_bytes == 0
    assert ok({"HixlRdmaSendWindowBytes": str(2 ** 30)}).rdma_send_window_bytes == 2 ** 30
    assert (p.rdma_traffic_class, p.rdma_service_level) == (252, 7)
    assert p.auto_connect is True
    assert (p.transport, p.device, p.gid_index) == ("shm", "mlx5_0", 3)
    assert p.raw == opts and p.not_applicable == []
    assert ok({T.OPTION_AUTO_CONNECT: "0", T.OPTION_RDMA_TRAFFIC_CLASS: "0",
               T.OPTION_RDMA_SERVICE_LEVEL: "0"}).auto_connect is False


@pytest.mark.parametrize("key,value", [
    ("RdmaTrafficClass", "256"), ("RdmaTrafficClass", "-1"), ("RdmaTrafficClass", "abc"),
    ("RdmaTrafficClass", "1.5"), ("RdmaTrafficClass", "0x10"), ("RdmaTrafficClass", "5"),
    ("RdmaTrafficClass", "130"), ("adxl.RdmaTrafficClass", "6"),
    ("RdmaTrafficClass", " 4"), ("RdmaTrafficClass", "+4"), ("RdmaTrafficClass", "\u0664"),
    ("RdmaServiceLevel", "8"), ("RdmaServiceLevel", "-0"), ("RdmaServiceLevel", "x"),
    ("AutoConnect", "2"), ("AutoConnect", "true"), ("AutoConnect", " 1"),
    ("EnableUseFabricMem", "2"), ("EnableUseFabricMem", "yes"), ("adxl.EnableUseFabricMem", "10"),
    ("BufferPool", "4"), ("BufferPool", "4:0"), ("BufferPool", "0:8"), ("BufferPool", "a:b"),
    ("BufferPool", "4:8:1"), ("BufferPool", "-4:8"), ("BufferPool", " 4:8"),
    ("GlobalResourceConfig", "[]"), ("GlobalResourceConfig", "{"), ("GlobalResourceConfig", "3"),
    ("GlobalResourceConfig", '{"connect_pool.thread_num": 0}'),
    ("GlobalResourceConfig", '{"connect_pool": {"thread_num": 65}}'),
    ("GlobalResourceConfig", '{"connect_pool.task_queue_capacity": 65536}'),
    ("GlobalResourceConfig", '{"comm_resource_config.qos": "8"}'),
    ("GlobalResourceConfig", '{"comm_resource_config.listen_port": 0}'),
    ("GlobalResourceConfig", '{"comm_resource_config.max_active_channels": 4294967296}'),
    ("GlobalResourceConfig", '{"fabric_memory.max_capacity": 1025}'),
    ("GlobalResourceConfig", '{"fabric_memory.task_stream_num": true}'),
    ("GlobalResourceConfig", '{"fabric_memory": {"task_stream_num": 9}}'),
    ("GlobalResourceConfig", '{"connect_pool.thread_num": "two"}'),
    ("HixlTransport", "ib"), ("HixlTransport", ""), ("HixlDevice", ""), ("HixlDevice", "  "),
    ("HixlGidIndex", "256"), ("HixlGidIndex", "-1"), ("HixlGidIndex", "one"),
    ("HixlRdmaTimeout", "0"), ("HixlRdmaTimeout", "32"), ("HixlRdmaRetryCount", "8"), ("HixlRdmaRetryCount", "-1"),
    ("HixlRdmaQpsPerLink", "0"), ("HixlRdmaQpsPerLink", "17"),
    ("HixlRdmaMaxWrBytes", "0"), ("HixlRdmaMaxWrBytes", "4095"), ("HixlRdmaMaxWrBytes", str(2 ** 30 + 1)),
    ("HixlRdmaSendWindowBytes", "-1"), ("HixlRdmaSendWindowBytes", str(2 ** 30 + 1)), ("HixlRdmaSendWindowBytes", "64K"),
])
def test_parse_options_bad_values(no_env, key, value):
    p = bad({key: value})
    assert key in p.error


@pytest.mark.parametrize("kw", [{"rdma_timeout": 0}, {"rdma_timeout": 32}, {"rdma_qps_per_link": 17},
                                {"rdma_max_wr_bytes": 4095}, {"rdma_max_wr_bytes": 2 ** 30 + 1},
                                {"rdma_send_window_bytes": -2}, {"rdma_send_window_bytes": 2 ** 30 + 1}])
def test_the_core_engine_refuses_rdma_settings_out_of_range(kw):
    """The C++ engine checks what parse_options() checks, for callers of _core (and naming the setting)."""
    from hixl import PARAM_INVALID, _core
    e = _core.Engine()
    assert e.initialize("127.0.0.1:0", transport="shm", **kw) == PARAM_INVALID
    assert list(kw)[0] in e.last_error(), e.last_error()


@pytest.mark.parametrize("options", [
    {"RdmaTrafficClass": 5},          # value not str
    {"AutoConnect": 1},
    {"AutoConnect": True},
    {"Unknown": None},
    {5: "1"},                         # key not str
    {b"AutoConnect": "1"},
    [("AutoConnect", "1")],           # not a dict
    "AutoConnect=1",
    42,
])
def test_parse_options_bad_types(no_env, options):
    bad(options)


def test_parse_options_refuses_an_unknown_key_naming_it(no_env):
    for key in ("SomethingNew", "llm.Other", "adxl.HixlTransport", "adxl.", "rdmatrafficclass"):
        p = bad({key: "1"})
        assert repr(key) in p.error


def test_parse_options_cann_keys_their_adxl_aliases_and_no_effect_ones(no_env):
    opts = {
        T.OPTION_ENABLE_USE_FABRIC_MEM: "1", T.OPTION_BUFFER_POOL: "4:8",
        T.OPTION_GLOBAL_RESOURCE_CONFIG: '{"comm_resource_config.qos": 3}', T.OPTION_LOCAL_COMM_RES: "{}",
        "adxl.RdmaTrafficClass": "104", "adxl.AutoConnect": "1",
    }
    p = ok(opts)
    assert p.not_applicable == ["EnableUseFabricMem", "BufferPool", "LocalCommRes"]
    assert p.enable_use_fabric_mem == "1" and p.buffer_pool == "4:8" and p.local_comm_res == "{}"
    assert p.rdma_traffic_class == 104 and p.auto_connect is True
    assert p.raw == opts and any("comm_resource_config.qos" in n for n in p.notes)
    # the plain key wins over its adxl. alias; an empty value is no value
    p = ok({"RdmaServiceLevel": "3", "adxl.RdmaServiceLevel": "5", "BufferPool": ""})
    assert p.rdma_service_level == 3 and p.buffer_pool is None and p.auto_connect is False
    assert ok({"BufferPool": "0:0"}).buffer_pool == "0:0"


def test_parse_options_global_resource_config_sizes_the_connect_pool(no_env):
    p = ok({"GlobalResourceConfig": '{"connect_pool.thread_num": "4", "connect_pool.task_queue_capacity": 9}'})
    assert (p.connect_pool_threads, p.connect_pool_capacity) == (4, 9)  # a numeric string counts (as in CANN)
    p = ok({"adxl.GlobalResourceConfig": '{"connect_pool": {"thread_num": 64, "task_queue_capacity": 65535}, '
                                         '"fabric_memory.task_stream_num": 8, "fabric_memory.enable_aicpu_unfold": false, '
                                         '"unknown_field": 1}'})
    assert (p.connect_pool_threads, p.connect_pool_capacity) == (64, 65535)


def test_parse_options_rdma_tc_and_sl_from_the_hccl_environment(monkeypatch):
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)
    monkeypatch.setenv("HCCL_RDMA_TC", "132")
    monkeypatch.setenv("HCCL_RDMA_SL", "4")
    p = ok({})
    assert (p.rdma_traffic_class, p.rdma_service_level) == (132, 4)
    p = ok({"RdmaTrafficClass": "8", "RdmaServiceLevel": ""})  # the option wins; an empty one is absent
    assert (p.rdma_traffic_class, p.rdma_service_level) == (8, 4)
    monkeypatch.setenv("HCCL_RDMA_TC", "133")
    assert "HCCL_RDMA_TC" in bad({}).error
    monkeypatch.setenv("HCCL_RDMA_TC", "")
    monkeypatch.setenv("HCCL_RDMA_SL", "9")
    assert "HCCL_RDMA_SL" in bad({}).error


@pytest.mark.parametrize("value,want", [
    ("auto", "auto"), ("rdma", "rdma"), ("shm", "shm"), ("tcp", "tcp"), ("RDMA", "rdma"),
])
def test_parse_options_transport_values(no_env, value, want):
    assert ok({"HixlTransport": value}).transport == want


def test_parse_options_transport_env_default(monkeypatch):
    monkeypatch.setenv("HIXL_TRANSPORT", "tcp")
    assert ok({}).transport == "tcp"
    assert ok({"HixlTransport": "shm"}).transport == "shm"  # explicit option wins
    monkeypatch.setenv("HIXL_TRANSPORT", "")
    assert ok({}).transport == "auto"
    monkeypatch.setenv("HIXL_TRANSPORT", "bogus")
    p = bad({})
    assert "HIXL_TRANSPORT" in p.error
    assert ok({"HixlTransport": "rdma"}).transport == "rdma"  # env not consulted


def test_parse_options_does_not_mutate_input(no_env):
    opts = {"AutoConnect": "1", "adxl.BufferPool": "2:4"}
    ok(opts)
    assert opts == {"AutoConnect": "1", "adxl.BufferPool": "2:4"}


def test_parse_options_never_raises_on_broken_mapping(no_env):
    class Broken(dict):
        def items(self):
            raise RuntimeError("boom")

    p = bad(Broken(a="b"))
    assert "boom" in p.error


# CANN's own checks (hicann/hixl hixl_options.cc, engine_factory.cc, endpoint_generator.cc), one test each.

def _grc(**fields):
    return {"GlobalResourceConfig": json.dumps(fields)}


def test_parse_options_refuses_an_empty_auto_connect_as_cann(no_env):
    for key in ("AutoConnect", "adxl.AutoConnect"):
        assert key in bad({key: ""}).error
    # CANN's other keys: an empty value counts as absent
    p = ok({"RdmaTrafficClass": "", "RdmaServiceLevel": "", "EnableUseFabricMem": "", "BufferPool": "",
            "GlobalResourceConfig": "", "LocalCommRes": ""})
    assert p.rdma_traffic_class is None and p.buffer_pool is None and p.local_comm_res is None


def test_parse_options_protocol_desc_entries_are_protocol_colon_placement(no_env):
    good = ["roce:host", "roce:device", "hccs:host", "hccs:device", "ub_ctp:host", "ub_ctp:device",
            "uboe:device", "ub_rtp:device"]
    p = ok(_grc(**{"comm_resource_config.protocol_desc": good}))
    assert any("protocol_desc" in n for n in p.notes)
    ok(_grc(**{"comm_resource_config.protocol_desc": "roce:device"}))  # one string is one entry
    ok(_grc(**{"comm_resource_config.protocol_desc": []}))
    for v in ("roce", "roce:", ":host", "roce:host:x", "rdma:host", "roce:nic", "ROCE:host", "roce:Host",
              "uboe:host", "ub_rtp:host", ["roce:host", "tcp:host"], [1], 5, {"roce": "host"}):
        assert "comm_resource_config.protocol_desc" in bad(_grc(**{"comm_resource_config.protocol_desc": v})).error
    assert "protocol_desc" in bad(_grc(comm_resource_config={"protocol_desc": "roce"})).error


def test_parse_options_max_active_channels_takes_any_u32_but_0(no_env):
    for n in (1, 8192, 8193, 2 ** 32 - 1, str(2 ** 32 - 1)):
        ok(_grc(**{"comm_resource_config.max_active_channels": n}))
    for n in (0, 2 ** 32, -1):
        assert "max_active_channels" in bad(_grc(**{"comm_resource_config.max_active_channels": n})).error


def test_parse_options_task_stream_num_is_1_in_canns_default_mode(no_env):
    ok(_grc(**{"fabric_memory.task_stream_num": 1}))
    for n in (2, 8, "8"):
        assert "fabric_memory.task_stream_num" in bad(_grc(**{"fabric_memory.task_stream_num": n})).error
        assert "task_stream_num" in bad(_grc(fabric_memory={"task_stream_num": n})).error
        assert "task_stream_num" in bad(_grc(**{"fabric_memory.task_stream_num": n,
                                                "fabric_memory.enable_aicpu_unfold": True})).error
        # with the aicpu unfold mode off, 1..8 (flat wins over nested, as in CANN)
        ok(_grc(**{"fabric_memory.task_stream_num": n, "fabric_memory.enable_aicpu_unfold": False}))
        ok(_grc(fabric_memory={"task_stream_num": n, "enable_aicpu_unfold": False}))
        bad(_grc(fabric_memory={"task_stream_num": n, "enable_aicpu_unfold": False},
                 **{"fabric_memory.enable_aicpu_unfold": True}))
    assert "enable_aicpu_unfold" in bad(_grc(**{"fabric_memory.enable_aicpu_unfold": "false"})).error
    assert "task_stream_num" in bad(_grc(**{"fabric_memory.task_stream_num": 9,
                                            "fabric_memory.enable_aicpu_unfold": False})).error


def test_parse_options_local_comm_res_path_names_a_readable_file(no_env, tmp_path):
    f = tmp_path / "lcr.json"
    f.write_text('{"version": "1.3"}')
    p = ok(_grc(local_comm_res_path=str(f)))
    assert p.local_comm_res == '{"version": "1.3"}' and p.local_comm_res_path == str(f)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    assert ok(_grc(local_comm_res_path=str(link))).local_comm_res == '{"version": "1.3"}'
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "big.json").write_text(" " * (1024 * 1024) + "{}")
    (tmp_path / "bad.json").write_text("{version: 1.3}")
    for path in (tmp_path / "missing.json", tmp_path, tmp_path / "empty.json", tmp_path / "big.json",
                 tmp_path / "bad.json", "", 3, None, ["x"]):
        p = bad(_grc(local_comm_res_path=path if path in ("", 3, None, ["x"]) else str(path)))
        assert "local_comm_res_path" in p.error
    # a LocalCommRes option wins: the file is then not read (as in CANN)
    assert ok(dict(_grc(local_comm_res_path=str(tmp_path / "missing.json")), LocalCommRes="{}")).local_comm_res == "{}"
    # an empty LocalCommRes is none: the file is read
    assert ok(dict(_grc(local_comm_res_path=str(f)), LocalCommRes="")).local_comm_res == '{"version": "1.3"}'


def test_parse_options_local_comm_res_must_be_json(no_env):
    for v in ("{}", '{"version": "1.3", "server_list": []}', "[1, 2]", "3", '"x"'):
        assert ok({"LocalCommRes": v}).local_comm_res == v
    for key, v in (("LocalCommRes", "x"), ("LocalCommRes", "{"), ("adxl.LocalCommRes", "{'a': 1}"),
                   ("LocalCommRes", "NaN"), ("LocalCommRes", '{"a": Infinity}')):
        assert key in bad({key: v}).error
    # CANN parses it only when it builds no fabric-memory engine
    assert ok({"LocalCommRes": "x", "EnableUseFabricMem": "1"}).local_comm_res == "x"
    assert "LocalCommRes" in bad({"LocalCommRes": "x", "EnableUseFabricMem": "0"}).error


# ----------------------------------------------------------------- capability

@pytest.mark.parametrize("feature", [T.AUTO_CONNECT, T.CLIENT_SERVER_COMM, 0, 1,
                                     T.FeatureType.CLIENT_SERVER_COMM])
def test_get_capability_supported(feature):
    assert T.get_capability(feature) == (T.SUCCESS, T.FEATURE_SUPPORTED)


@pytest.mark.parametrize("feature", [2, -1, 99, True, False, None, "AUTO_CONNECT", 0.0, [0]])
def test_get_capability_invalid(feature):
    assert T.get_capability(feature) == (T.PARAM_INVALID, T.FEATURE_NOT_SUPPORTED)


# -------------------------------------------------------------------- address

@pytest.mark.parametrize("s,host,port", [
    ("127.0.0.1:26000", "127.0.0.1", 26000),
    ("10.0.0.1:0", "10.0.0.1", 0),
    ("10.0.0.1:65535", "10.0.0.1", 65535),
    ("10.0.0.1", "10.0.0.1", None),
    ("[::1]:0", "::1", 0),
    ("[::1]:8080", "::1", 8080),
    ("[::1]", "::1", None),
    ("::1", "::1", None),
    ("[2001:DB8::1]:1", "2001:db8::1", 1),
    ("[fe80::1%eth0]:5", "fe80::1%eth0", 5),
    ("0.0.0.0:80", "0.0.0.0", 80),
])
def test_parse_engine_address_good(s, host, port):
    assert T.parse_engine_address(s) == (T.SUCCESS, host, port)


@pytest.mark.parametrize("s", [
    "", "1.2.3.4:65536", "1.2.3.4:-1", "1.2.3.4:", "1.2.3.4:abc", "host:abc", "host:80",
    "localhost", "[::1", "[::1]:", "[::1]:x", "[::1]8080", "[1.2.3.4]:80", "[]:80", ":80",
    "1.2.3.4:80:90", "1.2.3:80", "256.1.1.1:80", " 1.2.3.4:80", "1.2.3.4: 80", "1.2.3.4:+80",
    "::1:80:", None, 80, b"1.2.3.4:80",
])
def test_parse_engine_address_bad(s):
    assert T.parse_engine_address(s) == (T.PARAM_INVALID, None, None)
