"""Low-level RDMA endpoint: one RC queue pair, registered buffers, one-sided operations.

This layer raises :class:`HixlError` on bad input or failed verbs calls (the CANN-compatible
``hixl.Hixl`` API built on top returns status codes instead).

Typical use::

    a, b = Endpoint(), Endpoint()
    a.connect(b.info()); b.connect(a.info())
    src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, np.uint8)
    ms, md = a.register(src), b.register(dst)
    req = a.write([(ms.addr, md.addr, 4096)], rkey=md.rkey)
    assert a.wait(req, 1000) == TransferStatus.COMPLETED
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Tuple, Union

from . import _core
from .types import ENV_AUTH_TOKEN, TransferStatus

HixlError = _core.HixlError
NotSupportedError = _core.NotSupportedError

ACCESS_LOCAL_WRITE = _core.ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = _core.ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = _core.ACCESS_REMOTE_READ
ACCESS_RW = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ
ACCESS_RO = ACCESS_REMOTE_READ  # peers may read, never write


class Op(enum.IntEnum):
    READ = 0
    WRITE = 1
    WRITE_WITH_IMM = 2




@dataclass(frozen=True)
class MemoryRegion:
    """A registered range. Keeps the Python object it came from alive while registered."""

    handle: int
    addr: int
    length: int
    lkey: int
    rkey: int
    owner: Any = None
    # The buffer export held while registered: the owner cannot be resized or freed under the NIC.
    export: Optional[memoryview] = field(default=None, repr=False, compare=False)

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


class RequestFailed(HixlError):
    """Raised by :meth:`Endpoint.wait_ok` when a request ends FAILED or TIMEOUT."""


def list_devices() -> list:
    """RDMA devices the kernel exposes: ``[{'name': 'rxe0', 'active_ports': 1}, ...]``."""
    return _core.list_devices()


def has_active_device() -> bool:
    try:
        return any(d["active_ports"] > 0 for d in _core.list_devices())
    except Exception:  # noqa: BLE001 - no verbs provider at all
        return False


DescLike = Tuple[int, int, int]


class Endpoint:
    """One RC connection on an RDMA device (``device=None``: ``$HIXL_DEVICE`` or the first active one).

    ``auth_token`` (``None``: ``$HIXL_AUTH_TOKEN``, else none): the shared secret of the out-of-band
    handshake (``listen``/``accept``/``connect_tcp``), the same HMAC-SHA-256 challenge/response as
    ``hixl.Hixl``'s ``HixlAuthToken``. With one, nothing of this endpoint (QPN, GID, regions) is sent
    before the peer proved the token; ``accept`` raises for a peer that cannot (and may be called
    again), ``connect_tcp`` raises for a listener that has no token or cannot prove it."""

    def __init__(self, device: Optional[str] = None, *, port: int = 1, gid_index: Optional[int] = None,
                 sq_depth: int = 256, rq_depth: int = 256, max_inline: int = 64,
                 slice_bytes: int = 4 << 20, max_chain: int = 64, busy_poll_us: int = 20,
                 traffic_class: int = 0, service_level: int = 0, timeout: int = 14, retry_cnt: int = 7,
                 auth_token: Optional[str] = None, window_bytes: int = 0):
        if auth_token is None:
            auth_token = os.environ.get(ENV_AUTH_TOKEN, "")
        if not isinstance(auth_token, str):
            raise HixlError(f"Endpoint: auth_token must be a str, got {type(auth_token).__name__}")
        self._ep = _core.Endpoint(device or "", port, -1 if gid_index is None else gid_index, sq_depth,
                                  rq_depth, max_inline, slice_bytes, max_chain, busy_poll_us, traffic_class,
                                  service_level, timeout, retry_cnt, auth_token, window_bytes)
        self._regions: dict[int, MemoryRegion] = {}

    # -- connection -------------------------------------------------------------------------
    def info(self) -> dict:
        """Plain connection info: qpn, psn, lid, gid, mtu, port, device, gid_index, regions."""
        return self._ep.info()

    def connect(self, peer_info: dict) -> None:
        """Moves the QP to RTS against a peer's plain info dict (qpn, psn, lid, gid, mtu)."""
        if not isinstance(peer_info, dict):
            raise HixlError(f"connect: peer_info must be a dict, got {type(peer_info).__name__}")
        self._ep.connect(peer_info)

    def listen(self, host: str, port: int = 0) -> int:
        return self._ep.listen(host, port)

    def accept(self, timeout_ms: int = 10000) -> dict:
        return self._ep.accept(timeout_ms)

    def connect_tcp(self, host: str, port: int, timeout_ms: int = 10000) -> dict:
        return self._ep.connect_tcp(host, port, timeout_ms)

    # -- memory -----------------------------------------------------------------------------
    def register(self, buf: Union[int, Any], length: Optional[int] = None, *, access: int = ACCESS_RW) -> MemoryRegion:
        """Registers a buffer-protocol object (numpy array, bytearray, memoryview, mmap) or a raw
        integer address with ``length``."""
        if isinstance(buf, bool):
            raise HixlError("register: a bool is not a buffer or an address")
        if isinstance(buf, int):
            if length is None:
                raise HixlError("register(addr=int): length is required for a raw address")
            if buf <= 0 or length <= 0:
                raise HixlError(f"register(addr={buf:#x}, length={length}): address and length must be > 0")
            h, addr, ln, lkey, rkey = self._ep.register_addr(buf, length, access)
            owner = export = None
        else:
            if length is not None:
                raise HixlError("register(buffer): length is taken from the buffer; slice it instead")
            try:
                export = memoryview(buf)
            except TypeError as e:
                raise HixlError(f"register: {type(buf).__name__} does not support the buffer protocol") from e
            try:
                h, addr, ln, lkey, rkey = self._ep.register_buffer(export, access)
            except BaseException:
                export.release()
                raise
            owner = buf
        mr = MemoryRegion(h, addr, ln, lkey, rkey, owner, export)
        self._regions[h] = mr
        return mr

    def deregister(self, mr: Union[MemoryRegion, int]) -> None:
        h = mr.handle if isinstance(mr, MemoryRegion) else int(mr)
        self._ep.deregister(h)
        self._forget(h)

    def _forget(self, handle: int) -> None:
        """Drops our record of a region and lets its owner be resized or freed again."""
        mr = self._regions.pop(handle, None)
        if mr is not None and mr.export is not None:
            mr.export.release()

    # -- data path --------------------------------------------------------------------------
    @staticmethod
    def _descs(descs: Iterable[DescLike], rkey: int) -> list:
        return [(int(l), int(r), int(n), rkey) for (l, r, n) in descs]

    def write(self, descs: Sequence[DescLike], rkey: int, *, timeout_ms: int = -1) -> int:
        """Posts RDMA WRITEs of ``[(local_addr, remote_addr, length), ...]`` with one doorbell per
        chain; waits only for send-queue room. Returns a request id."""
        return self._ep.submit(int(Op.WRITE), self._descs(descs, rkey), 0, timeout_ms)

    def read(self, descs: Sequence[DescLike], rkey: int, *, timeout_ms: int = -1) -> int:
        return self._ep.submit(int(Op.READ), self._descs(descs, rkey), 0, timeout_ms)

    def write_imm(self, descs: Sequence[DescLike], rkey: int, imm: int, *, timeout_ms: int = -1) -> int:
        """WRITEs whose last work request carries a 32-bit immediate (one receive completion on the peer)."""
        if not 0 <= int(imm) <= 0xFFFFFFFF:
            raise HixlError(f"write_imm: imm={imm} does not fit in 32 bits")
        return self._ep.submit(int(Op.WRITE_WITH_IMM), self._descs(descs, rkey), int(imm), timeout_ms)

    def submit(self, op: Op, descs: Sequence[Tuple[int, int, int, int]], imm: int = 0, timeout_ms: int = -1) -> int:
        """Raw form: ``descs`` are ``(local_addr, remote_addr, length, rkey)``."""
        return self._ep.submit(int(op), list(descs), imm, timeout_ms)

    def status(self, req: int) -> TransferStatus:
        return TransferStatus(self._ep.status(req)[0])

    def wait(self, req: int, timeout_ms: int) -> TransferStatus:
        """Blocks (GIL released) until the request ends or timeout_ms passes (then WAITING)."""
        return TransferStatus(self._ep.wait(req, timeout_ms)[0])

    def wait_result(self, req: int, timeout_ms: int) -> Tuple[TransferStatus, str]:
        st, err = self._ep.wait(req, timeout_ms)
        return TransferStatus(st), err

    def wait_ok(self, req: int, timeout_ms: int = 30000) -> None:
        st, err = self.wait_result(req, timeout_ms)
        if st != TransferStatus.COMPLETED:
            raise RequestFailed(f"request {req}: {st.name}: {err or 'no completion within ' + str(timeout_ms) + ' ms'}")

    def progress(self, budget: int = 64) -> int:
        return self._ep.progress(budget)

    def poll_imm(self, max_count: int = 64) -> list:
        return self._ep.poll_imm(max_count)

    def wait_imm(self, timeout_ms: int) -> Optional[int]:
        """Blocks on the completion channel (GIL released) for the next immediate; None on timeout."""
        return self._ep.wait_imm(timeout_ms)

    # -- state ------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self._ep.stats()

    @property
    def dead(self) -> bool:
        return self._ep.dead

    @property
    def dead_reason(self) -> str:
        return self._ep.dead_reason

    @property
    def path_mtu(self) -> int:
        """Bytes; min(local active MTU, peer's advertised MTU); 0 before connect()."""
        return self._ep.path_mtu

    @property
    def sq_depth(self) -> int:
        return self._ep.sq_depth

    @property
    def outstanding(self) -> int:
        return self._ep.outstanding

    @property
    def max_inline(self) -> int:
        return self._ep.max_inline

    @property
    def slice_bytes(self) -> int:
        return self._ep.slice_bytes

    @property
    def window_bytes(self) -> int:
        """Bytes of work requests in flight at most (0: the send queue bounds them). What does not fit
        waits in the endpoint and is posted as completions come back, by whoever polls or waits."""
        return self._ep.window_bytes

    @property
    def raw(self) -> "_core.Endpoint":
        return self._ep

    def close(self) -> None:
        self._ep.close()
        for h in list(self._regions):
            self._forget(h)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
