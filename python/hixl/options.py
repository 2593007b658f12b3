"""Engine options and addresses: the option keys (CANN's and this implementation's), their parser
:func:`parse_options` (into :class:`ParsedOptions`) and :func:`parse_engine_address`.

Like everything of the CANN surface they return a status instead of raising. Every public name here
is re-exported by :mod:`hixl.types` and :mod:`hixl`.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import _core
from .status import PARAM_INVALID, SUCCESS

# ------------------------------------------------------------------------ keys
OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"
# Extensions of this implementation (not in CANN).
OPTION_HIXL_TRANSPORT = "HixlTransport"
OPTION_HIXL_DEVICE = "HixlDevice"
OPTION_HIXL_GID_INDEX = "HixlGidIndex"
OPTION_HIXL_AUTH_TOKEN = "HixlAuthToken"
OPTION_HIXL_ASYNC_TIMEOUT_MS = "HixlAsyncTimeoutMs"      # transfer_async deadline (default 60000; 0: none)
OPTION_HIXL_HEARTBEAT_MS = "HixlHeartbeatMs"            # ping interval per link (default 1000; 0: none)
OPTION_HIXL_HEARTBEAT_MISSES = "HixlHeartbeatMisses"    # silent intervals before a link is dead (default 10)
OPTION_HIXL_METRICS_PORT = "HixlMetricsPort"            # serve /metrics on this port (0: a free one; hixl.metrics)
OPTION_HIXL_RDMA_TIMEOUT = "HixlRdmaTimeout"            # QP ACK timeout 4.096 us * 2^n, 1..31 (default 14)
OPTION_HIXL_RDMA_RETRY_COUNT = "HixlRdmaRetryCount"     # QP retransmissions before it fails, 0..7 (default 7)
OPTION_HIXL_RDMA_QPS_PER_LINK = "HixlRdmaQpsPerLink"    # RC QPs a link stripes its bytes over, 1..16 (default 1; 8 on rxe)
OPTION_HIXL_RDMA_MAX_WR_BYTES = "HixlRdmaMaxWrBytes"    # bytes one work request carries at most, 4096..2^30 (default 4 MiB; 16 KiB on rxe)
OPTION_HIXL_RDMA_SEND_WINDOW_BYTES = "HixlRdmaSendWindowBytes"  # bytes in flight per QP, 0..2^30 (default 0: none; 64 KiB on rxe with > 1 QP)
OPTION_HIXL_TRUST_CLAIMED_ADDRESS = "HixlTrustClaimedAddress"  # "1": peers may claim names off their source address (NAT)

TRANSPORTS = ("auto", "rdma", "shm", "tcp")
ENV_TRANSPORT = "HIXL_TRANSPORT"
ENV_AUTH_TOKEN = "HIXL_AUTH_TOKEN"
ENV_METRICS_PORT = "HIXL_METRICS_PORT"
ENV_TRUST_CLAIMED_ADDRESS = "HIXL_TRUST_CLAIMED_ADDRESS"
MAX_AUTH_TOKEN_BYTES = 4096
_REDACTED = "<redacted>"

# CANN's option keys (each also as "adxl.<key>", the ADXL spelling; the plain key wins when both are
# given), and ours. Any other key is refused (PARAM_INVALID, naming it).
CANN_OPTIONS = (OPTION_ENABLE_USE_FABRIC_MEM, OPTION_RDMA_TRAFFIC_CLASS, OPTION_RDMA_SERVICE_LEVEL,
                OPTION_BUFFER_POOL, OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_AUTO_CONNECT, OPTION_LOCAL_COMM_RES)
HIXL_OPTIONS = (OPTION_HIXL_TRANSPORT, OPTION_HIXL_DEVICE, OPTION_HIXL_GID_INDEX, OPTION_HIXL_AUTH_TOKEN,
                OPTION_HIXL_ASYNC_TIMEOUT_MS, OPTION_HIXL_HEARTBEAT_MS, OPTION_HIXL_HEARTBEAT_MISSES,
                OPTION_HIXL_METRICS_PORT, OPTION_HIXL_RDMA_TIMEOUT, OPTION_HIXL_RDMA_RETRY_COUNT,
                OPTION_HIXL_RDMA_QPS_PER_LINK, OPTION_HIXL_RDMA_MAX_WR_BYTES, OPTION_HIXL_RDMA_SEND_WINDOW_BYTES,
                OPTION_HIXL_TRUST_CLAIMED_ADDRESS)
ADXL_PREFIX = "adxl."
# CANN reads the RDMA traffic class and service level from these when the option is absent (as we do).
# Unlike CANN we keep 0/0 when neither is set: its 132/4 fit Ascend fabrics, not a generic RoCE network.
ENV_RDMA_TC = "HCCL_RDMA_TC"
ENV_RDMA_SL = "HCCL_RDMA_SL"
# GlobalResourceConfig: the fields CANN range-checks, as "group.field" (flat, or nested in a "group" object).
# connect_pool.* sizes our async connect pool; the others have no meaning here (accepted, logged once).
GLOBAL_RESOURCE_FIELDS = {
    "connect_pool.thread_num": (1, 64),
    "connect_pool.task_queue_capacity": (1, 65535),
    "comm_resource_config.listen_port": (1, 65535),
    "comm_resource_config.qos": (0, 7),
    "comm_resource_config.max_active_channels": (1, 2 ** 32 - 1),
    "fabric_memory.max_capacity": (1, 1024),
    "fabric_memory.start_address": (0, 1024),
    "fabric_memory.task_stream_num": (1, 8),
}
# comm_resource_config.protocol_desc: "protocol:placement" entries CANN accepts (uboe, ub_rtp: device only).
_PROTOCOLS = ("roce", "hccs", "ub_ctp", "uboe", "ub_rtp")
_PLACEMENTS = ("host", "device")
_DEVICE_ONLY_PROTOCOLS = ("uboe", "ub_rtp")
_MAX_LOCAL_COMM_RES_BYTES = 1024 * 1024  # local_comm_res_path: a regular file of 1 B .. 1 MiB
CONNECT_POOL_THREADS = 2       # default connect_pool.thread_num
CONNECT_POOL_CAPACITY = 128    # default connect_pool.task_queue_capacity

# Accepted, stored raw, but without effect here -> ParsedOptions attribute name.
_NOT_APPLICABLE = {
    OPTION_ENABLE_USE_FABRIC_MEM: "enable_use_fabric_mem",
    OPTION_BUFFER_POOL: "buffer_pool",
    OPTION_GLOBAL_RESOURCE_CONFIG: "global_resource_config",
    OPTION_LOCAL_COMM_RES: "local_comm_res",
}
# Integer options (decimal strings lo..hi) -> (ParsedOptions attribute, lo, hi).
_INT_OPTIONS = {
    OPTION_RDMA_SERVICE_LEVEL: ("rdma_service_level", 0, 7),
    OPTION_HIXL_GID_INDEX: ("gid_index", 0, 255),  # ibv_global_route.sgid_index is u8
    OPTION_HIXL_ASYNC_TIMEOUT_MS: ("async_timeout_ms", 0, 2 ** 31 - 1),
    OPTION_HIXL_HEARTBEAT_MS: ("heartbeat_ms", 0, 3600000),
    OPTION_HIXL_HEARTBEAT_MISSES: ("heartbeat_misses", 0, 1000),  # 0 is refused by initialize()
    OPTION_HIXL_METRICS_PORT: ("metrics_port", 0, 65535),
    OPTION_HIXL_RDMA_TIMEOUT: ("rdma_timeout", 1, 31),  # 0 means "never retransmit": refused
    OPTION_HIXL_RDMA_RETRY_COUNT: ("rdma_retry_count", 0, 7),
    OPTION_HIXL_RDMA_QPS_PER_LINK: ("rdma_qps_per_link", 1, 16),
    OPTION_HIXL_RDMA_MAX_WR_BYTES: ("rdma_max_wr_bytes", 4096, 2 ** 30),
    OPTION_HIXL_RDMA_SEND_WINDOW_BYTES: ("rdma_send_window_bytes", 0, 2 ** 30),
}
_DECIMAL = re.compile(r"[0-9]+")
_BUFFER_POOL = re.compile(r"([0-9]+):([0-9]+)")


# ---------------------------------------------------------------------- parser
@dataclass
class ParsedOptions:
    """Result of :func:`parse_options`.

    ``not_applicable`` lists CANN keys that are accepted but have no effect here (their raw values
    are kept in the matching attributes; the engine logs them once), ``notes`` what else is logged
    once (GlobalResourceConfig fields without meaning here, local_comm_res_path among them: its file
    is read and checked as CANN checks it, into ``local_comm_res``). On failure only ``error`` is meaningful.
    ``auth_token`` (from ``HixlAuthToken``, else env ``HIXL_AUTH_TOKEN``) never appears in the repr,
    in ``raw`` (its value there is ``"<redacted>"``) or in ``error``.
    """
    rdma_traffic_class: Optional[int] = None
    rdma_service_level: Optional[int] = None
    auto_connect: bool = False
    transport: str = "auto"
    device: Optional[str] = None
    gid_index: Optional[int] = None
    async_timeout_ms: Optional[int] = None
    heartbeat_ms: Optional[int] = None
    heartbeat_misses: Optional[int] = None
    metrics_port: Optional[int] = None  # None: no /metrics served
    rdma_timeout: Optional[int] = None
    rdma_retry_count: Optional[int] = None
    rdma_qps_per_link: Optional[int] = None
    rdma_max_wr_bytes: Optional[int] = None
    rdma_send_window_bytes: Optional[int] = None
    enable_use_fabric_mem: Optional[str] = None
    buffer_pool: Optional[str] = None
    global_resource_config: Optional[str] = None
    local_comm_res: Optional[str] = None  # LocalCommRes, else the content of local_comm_res_path
    local_comm_res_path: Optional[str] = None  # GlobalResourceConfig's local_comm_res_path
    connect_pool_threads: int = CONNECT_POOL_THREADS
    connect_pool_capacity: int = CONNECT_POOL_CAPACITY
    auth_token: Optional[str] = field(default=None, repr=False)
    trust_claimed_address: bool = False
    raw: Dict[str, str] = field(default_factory=dict)
    not_applicable: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    error: str = ""


def _dec(value: str, lo: int, hi: int) -> Optional[int]:
    if not _DECIMAL.fullmatch(value):
        return None
    n = int(value)
    return n if lo <= n <= hi else None


def _json_int(v: Any) -> Optional[int]:
    """A JSON number or a numeric string as an int (as CANN's JsonToNumber reads them), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"[+-]?[0-9]+", v.strip()):
        return int(v.strip())
    return None


def _global_resource_config(value: str, p: "ParsedOptions") -> str:
    """Checks a GlobalResourceConfig JSON object; "" or why it is refused."""
    try:
        doc = json.loads(value)
    except ValueError as e:
        return "not JSON (%s)" % e
    if not isinstance(doc, dict):
        return "not a JSON object"
    for name, (lo, hi) in GLOBAL_RESOURCE_FIELDS.items():
        group, fld = name.split(".", 1)
        nested = doc.get(group) if isinstance(doc.get(group), dict) else {}
        for where, v in ((name, doc.get(name)), ("%s.%s (nested)" % (group, fld), nested.get(fld))):
            if v is None:
                continue
            n = _json_int(v)
            if n is None or not lo <= n <= hi:
                return "%s must be an integer in [%d, %d], got %r" % (where, lo, hi, v)
            if name == "connect_pool.thread_num":
                p.connect_pool_threads = n
            elif name == "connect_pool.task_queue_capacity":
                p.connect_pool_capacity = n
            else:
                p.notes.append("GlobalResourceConfig %s=%s has no meaning on this implementation" % (where, v))
    return _task_stream_mode(doc, p) or _protocol_desc(doc, p) or _local_comm_res_path(doc, p)


def _given(doc: Dict[str, Any], name: str) -> List[Tuple[str, Any]]:
    """``(where, value)`` of field ``"group.field"`` as CANN applies them: nested in a "group" object
    first, then flat (which wins)."""
    group, fld = name.split(".", 1)
    nested = doc.get(group) if isinstance(doc.get(group), dict) else {}
    return [(w, d[k]) for w, d, k in (("%s (nested)" % name, nested, fld), (name, doc, name)) if k in d]


def _task_stream_mode(doc: Dict[str, Any], p: "ParsedOptions") -> str:
    """CANN's default mode (fabric_memory.enable_aicpu_unfold true) takes one task stream only."""
    unfold = True
    for where, v in _given(doc, "fabric_memory.enable_aicpu_unfold"):
        if not isinstance(v, bool):
            return "%s must be true or false, got %r" % (where, v)
        unfold = v
        p.notes.append("GlobalResourceConfig %s=%s has no meaning on this implementation" % (where, v))
    streams = _given(doc, "fabric_memory.task_stream_num")
    if unfold and streams and _json_int(streams[-1][1]) != 1:
        return ("%s must be 1 unless fabric_memory.enable_aicpu_unfold is false (as in CANN), got %r"
                % streams[-1])
    return ""


def _protocol_desc(doc: Dict[str, Any], p: "ParsedOptions") -> str:
    """comm_resource_config.protocol_desc: a "protocol:placement" string or a list of them."""
    for where, v in _given(doc, "comm_resource_config.protocol_desc"):
        entries = [v] if isinstance(v, str) else v
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            return "%s must be a string or a list of strings, got %r" % (where, v)
        for e in entries:
            proto, sep, place = e.partition(":")
            if not (sep and proto and place) or ":" in place:
                return "%s: %r is not protocol:placement" % (where, e)
            if proto not in _PROTOCOLS or place not in _PLACEMENTS or \
                    (proto in _DEVICE_ONLY_PROTOCOLS and place != "device"):
                return ("%s: %r is not supported (protocols %s; placements %s; %s on device only)"
                        % (where, e, ", ".join(_PROTOCOLS), ", ".join(_PLACEMENTS), ", ".join(_DEVICE_ONLY_PROTOCOLS)))
        p.notes.append("GlobalResourceConfig %s=%s has no meaning on this implementation" % (where, v))
    return ""


def _local_comm_res_path(doc: Dict[str, Any], p: "ParsedOptions") -> str:
    """local_comm_res_path (read later, see :func:`_resolve_local_comm_res`): a non-empty string."""
    if "local_comm_res_path" not in doc:
        return ""
    path = doc["local_comm_res_path"]
    if not isinstance(path, str) or not path:
        return "local_comm_res_path must be a non-empty file path string, got %r" % (path,)
    p.local_comm_res_path = path
    return ""


def _read_local_comm_res(path: str) -> Tuple[Optional[str], str]:
    """``(content, "")`` of the file at ``path`` (as CANN reads it: a regular file of 1 B .. 1 MiB of UTF-8),
    or ``(None, why)``."""
    real = os.path.realpath(path)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
    try:
        fd = os.open(real, flags)
    except OSError as e:
        return None, "open(%r, O_RDONLY) failed: errno %d (%s)" % (real, e.errno, e.strerror)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "%r is not a regular file (mode %o)" % (real, st.st_mode)
        if not 0 < st.st_size <= _MAX_LOCAL_COMM_RES_BYTES:
            return None, "%r holds %d bytes, expected 1..%d" % (real, st.st_size, _MAX_LOCAL_COMM_RES_BYTES)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_MAX_LOCAL_COMM_RES_BYTES + 1)
    except OSError as e:
        return None, "reading %r failed: errno %d (%s)" % (real, e.errno, e.strerror)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return None, "%r is not UTF-8 (%s)" % (real, e)


def _no_json_constant(name: str) -> Any:
    raise ValueError("%s is not JSON" % name)


def _resolve_local_comm_res(p: "ParsedOptions", key: str) -> str:
    """As CANN: a LocalCommRes option wins over GlobalResourceConfig's local_comm_res_path (then not read);
    what results must be JSON unless EnableUseFabricMem is "1". ``key``: LocalCommRes as given; "" or why."""
    if not p.local_comm_res and p.local_comm_res_path is not None:
        p.local_comm_res, why = _read_local_comm_res(p.local_comm_res_path)
        if why:
            return "%s: local_comm_res_path %r: %s" % (OPTION_GLOBAL_RESOURCE_CONFIG, p.local_comm_res_path, why)
        key = "%s (from local_comm_res_path %r)" % (OPTION_LOCAL_COMM_RES, p.local_comm_res_path)
        p.notes.append("GlobalResourceConfig local_comm_res_path=%s has no meaning on this implementation"
                       % p.local_comm_res_path)
    if p.local_comm_res and p.enable_use_fabric_mem != "1":
        try:
            json.loads(p.local_comm_res, parse_constant=_no_json_constant)
        except ValueError as e:
            return "%s: not JSON (%s)" % (key, e)
    return ""


def _transport(value: str) -> Optional[str]:
    v = value.strip().lower()
    return v if v in TRANSPORTS else None


def _auth_token(value: str, what: str) -> Tuple[Optional[str], str]:
    """``(token, "")`` or ``(None, why)``; ``why`` never contains the value."""
    try:
        n = len(value.encode("utf-8"))
    except UnicodeError:
        return None, "%s: not encodable as UTF-8" % what
    if n > MAX_AUTH_TOKEN_BYTES:
        return None, "%s: longer than %d bytes" % (what, MAX_AUTH_TOKEN_BYTES)
    return value, ""


def parse_options(options: Any) -> Tuple[int, ParsedOptions]:
    """Parse an engine options dict into ``(status, ParsedOptions)``; never raises.

    ``None`` means no options.  Keys and values must be ``str``; a key must be one of CANN's
    (:data:`CANN_OPTIONS`, also as ``adxl.<key>``) or ours (:data:`HIXL_OPTIONS`), and values are checked
    as CANN checks them: an empty value of a CANN key counts as absent, except AutoConnect's (refused);
    ``LocalCommRes`` (or the file GlobalResourceConfig's ``local_comm_res_path`` names) must be JSON.  ``RdmaTrafficClass`` /
    ``RdmaServiceLevel`` fall back to env ``HCCL_RDMA_TC`` / ``HCCL_RDMA_SL``.  The transport is
    taken from ``HixlTransport``, else env ``HIXL_TRANSPORT``, else ``"auto"``; the
    auth token from ``HixlAuthToken`` (non-empty), else env ``HIXL_AUTH_TOKEN`` (empty
    or unset: none), at most ``MAX_AUTH_TOKEN_BYTES`` bytes of UTF-8.  ``HixlTrustClaimedAddress``
    (else env ``HIXL_TRUST_CLAIMED_ADDRESS``; ``"0"`` or ``"1"``) lets peers without a token claim
    names off their source address (NAT; docs/options.md says what it exposes).
    """
    def bad(msg: str) -> Tuple[int, ParsedOptions]:
        return PARAM_INVALID, ParsedOptions(error=msg)

    try:
        if options is None:
            options = {}
        if not isinstance(options, dict):
            return bad("options must be a dict, got %s" % type(options).__name__)
        p = ParsedOptions()
        values: Dict[str, Tuple[str, str]] = {}  # canonical key -> (value, key as given); plain wins over adxl.
        for key, value in options.items():
            if not isinstance(key, str) or not isinstance(value, str):
                return bad("option %r: keys and values must be str" % (key,))
            p.raw[key] = _REDACTED if key == OPTION_HIXL_AUTH_TOKEN else value
            canon = key[len(ADXL_PREFIX):] if key.startswith(ADXL_PREFIX) else key
            if canon not in CANN_OPTIONS and (key.startswith(ADXL_PREFIX) or canon not in HIXL_OPTIONS):
                return bad("unknown option %r (known: %s, each also as adxl.<key>, and %s)"
                           % (key, ", ".join(CANN_OPTIONS), ", ".join(HIXL_OPTIONS)))
            if canon in CANN_OPTIONS and value == "":
                if canon == OPTION_AUTO_CONNECT:  # CANN refuses an empty AutoConnect
                    return bad("%s=%r: expected \"0\" or \"1\"" % (key, value))
                continue  # an empty value of the other keys is no value (as in CANN)
            if canon not in values or key == canon:
                values[canon] = (value, key)
        for canon, (value, key) in values.items():
            why = _apply_option(p, canon, value, key)
            if why:
                return bad(why)
        why = _resolve_local_comm_res(p, values.get(OPTION_LOCAL_COMM_RES, ("", OPTION_LOCAL_COMM_RES))[1]) \
            or _apply_env(p)
        return bad(why) if why else (SUCCESS, p)
    except Exception as e:  # e.g. a dict subclass with a broken items()
        return bad("invalid options: %s" % (e,))


def _apply_option(p: ParsedOptions, canon: str, value: str, key: str) -> str:
    """Sets option ``canon`` (given as ``key``) on ``p``; "" or why its value is refused."""
    if canon == OPTION_HIXL_AUTH_TOKEN:
        if not value:
            return "%s: empty token (leave the option out for none)" % key
        p.auth_token, why = _auth_token(value, key)
        return why
    if canon == OPTION_RDMA_TRAFFIC_CLASS:
        p.rdma_traffic_class = _traffic_class(value)
        if p.rdma_traffic_class is None:
            return "%s=%r: expected an integer 0..255 that is a multiple of 4" % (key, value)
    elif canon in _INT_OPTIONS:
        attr, lo, hi = _INT_OPTIONS[canon]
        n = _dec(value, lo, hi)
        if n is None:
            return "%s=%r: expected an integer %d..%d" % (key, value, lo, hi)
        setattr(p, attr, n)
    elif canon in (OPTION_AUTO_CONNECT, OPTION_ENABLE_USE_FABRIC_MEM, OPTION_HIXL_TRUST_CLAIMED_ADDRESS):
        if value not in ("0", "1"):
            return "%s=%r: expected \"0\" or \"1\"" % (key, value)
        if canon == OPTION_AUTO_CONNECT:
            p.auto_connect = value == "1"
        elif canon == OPTION_HIXL_TRUST_CLAIMED_ADDRESS:
            p.trust_claimed_address = value == "1"
        else:
            p.enable_use_fabric_mem = value
            p.not_applicable.append(canon)
    elif canon == OPTION_BUFFER_POOL:
        m = _BUFFER_POOL.fullmatch(value)
        if not m or (int(m.group(1)) == 0) != (int(m.group(2)) == 0):
            return "%s=%r: expected \"N:S\" (N buffers of S MB, both > 0) or \"0:0\"" % (key, value)
        p.buffer_pool = value
        p.not_applicable.append(canon)
    elif canon == OPTION_GLOBAL_RESOURCE_CONFIG:
        why = _global_resource_config(value, p)
        if why:
            return "%s: %s" % (key, why)
        p.global_resource_config = value
    elif canon == OPTION_LOCAL_COMM_RES:
        p.local_comm_res = value
        p.not_applicable.append(canon)
    elif canon == OPTION_HIXL_TRANSPORT:
        t = _transport(value)
        if t is None:
            return "%s=%r: expected one of %s" % (key, value, ", ".join(TRANSPORTS))
        p.transport = t
    elif canon == OPTION_HIXL_DEVICE:
        if not value.strip():
            return "%s: empty device name" % key
        p.device = value.strip()
    return ""


def _apply_env(p: ParsedOptions) -> str:
    """The environment's values for what the options left unset; "" or why one is refused."""
    for attr, env, parse, want in (("rdma_traffic_class", ENV_RDMA_TC, _traffic_class,
                                    "an integer 0..255 that is a multiple of 4"),
                                   ("rdma_service_level", ENV_RDMA_SL, lambda v: _dec(v, 0, 7),
                                    "an integer 0..7")):
        v = os.environ.get(env, "")
        if getattr(p, attr) is None and v:
            n = parse(v)
            if n is None:
                return "%s=%r: expected %s" % (env, v, want)
            setattr(p, attr, n)
    env = os.environ.get(ENV_TRANSPORT, "")
    if OPTION_HIXL_TRANSPORT not in p.raw and env.strip():
        p.transport = t = _transport(env) or ""
        if not t:
            return "%s=%r: expected one of %s" % (ENV_TRANSPORT, env, ", ".join(TRANSPORTS))
    env = os.environ.get(ENV_METRICS_PORT, "").strip()
    if p.metrics_port is None and env:
        p.metrics_port = _dec(env, 0, 65535)
        if p.metrics_port is None:
            return "%s=%r: expected an integer 0..65535" % (ENV_METRICS_PORT, env)
    env = os.environ.get(ENV_TRUST_CLAIMED_ADDRESS, "").strip()
    if OPTION_HIXL_TRUST_CLAIMED_ADDRESS not in p.raw and env:
        if env not in ("0", "1"):
            return "%s=%r: expected \"0\" or \"1\"" % (ENV_TRUST_CLAIMED_ADDRESS, env)
        p.trust_claimed_address = env == "1"
    env_token = os.environ.get(ENV_AUTH_TOKEN, "")
    if p.auth_token is None and env_token:
        p.auth_token, why = _auth_token(env_token, ENV_AUTH_TOKEN)
        return why
    return ""


def _traffic_class(value: str) -> Optional[int]:
    n = _dec(value, 0, 255)
    return n if n is not None and n % 4 == 0 else None


# ------------------------------------------------------------------- addresses
def _ip(text: str, version: Optional[int] = None) -> Optional[str]:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return str(ip) if version is None or ip.version == version else None


def parse_engine_address(s: Any) -> Tuple[int, Optional[str], Optional[int]]:
    """Parse ``"ip:port"``, ``"[ipv6]:port"`` or ``"ip"`` into ``(status, host, port)``.

    ``port`` is None for a bare IP (client-only engine); port 0 means "pick a free
    port".  The host comes back in canonical form without brackets.  Never raises.
    Splitting is the C++ core's (the same parser the handshake uses); the host must be an IP.
    """
    fail = (PARAM_INVALID, None, None)
    if not isinstance(s, str) or not s or s != s.strip():
        return fail
    try:
        host, port = _core.split_host_port(s)
    except _core.HixlError:
        return fail
    bracketed = s.startswith("[")
    host = _ip(host, 6 if bracketed else None)
    if host is None or (not bracketed and port >= 0 and ":" in host):
        return fail  # "[v4]:p" and "v6:p" (ambiguous without brackets) are refused
    return SUCCESS, host, (None if port < 0 else port)


__all__ = [
    "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL", "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES", "OPTION_HIXL_TRANSPORT", "OPTION_HIXL_DEVICE",
    "OPTION_HIXL_GID_INDEX", "OPTION_HIXL_AUTH_TOKEN", "OPTION_HIXL_ASYNC_TIMEOUT_MS", "OPTION_HIXL_HEARTBEAT_MS",
    "OPTION_HIXL_HEARTBEAT_MISSES", "OPTION_HIXL_METRICS_PORT", "OPTION_HIXL_RDMA_TIMEOUT",
    "OPTION_HIXL_RDMA_RETRY_COUNT", "OPTION_HIXL_RDMA_QPS_PER_LINK", "OPTION_HIXL_RDMA_MAX_WR_BYTES",
    "OPTION_HIXL_RDMA_SEND_WINDOW_BYTES", "OPTION_HIXL_TRUST_CLAIMED_ADDRESS", "TRANSPORTS", "ENV_TRANSPORT",
    "ENV_AUTH_TOKEN", "ENV_METRICS_PORT", "ENV_TRUST_CLAIMED_ADDRESS",
    "MAX_AUTH_TOKEN_BYTES", "ParsedOptions", "parse_options", "CANN_OPTIONS", "HIXL_OPTIONS", "ENV_RDMA_TC",
    "ENV_RDMA_SL", "GLOBAL_RESOURCE_FIELDS", "ADXL_PREFIX", "CONNECT_POOL_THREADS", "CONNECT_POOL_CAPACITY",
    "parse_engine_address",
]
