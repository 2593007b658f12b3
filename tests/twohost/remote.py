"""Objects on the other host, used as if they were here: how the two-engine suite runs across the link.

Guest A serves (``Server``, started by tests/twohost/peer.py); guest B's tests hold ``Proxy`` objects for
A's hixl engines and numpy buffers: attribute reads, method calls, ``buf[i:j]`` and ``buf[i:j] = x`` go
over a ``multiprocessing.connection`` (authenticated with a key A writes to the shared state dir), one
connection per calling thread, so a thread blocked in ``wait_flags`` does not hold up the others.

A result that pickles comes back as a value (ints, strings, tuples, dicts, hixl's descriptors, numpy
arrays: a slice is a copy); anything else (a bound engine, ``ndarray.ctypes``) stays on A and comes back
as another Proxy. Every object belongs to a *scope* (the root object it was created as, or derived
from); ``Client.release(root)`` drops a scope's objects on A, so a test's 64 MiB buffers do not pile up.
An exception on A is raised here (pickled, with A's traceback as its cause, or as RemoteError).

Test scaffolding only: it trusts both ends (pickle) once the key is proven.
"""
from __future__ import annotations

import itertools
import pickle
import threading
import traceback
from multiprocessing.connection import Client as _Connect
from multiprocessing.connection import Listener
from typing import Any, Dict, Tuple

import numpy as np


class RemoteError(RuntimeError):
    """An exception on the serving host that could not be pickled: its type, message and traceback."""


class Server:
    """Serves objects to clients: engines made with ``engine()``, buffers with ``zeros()``."""

    def __init__(self, address: Tuple[str, int], authkey: bytes, myip: str):
        self._listener = Listener(address, backlog=16, authkey=authkey)
        self.address = self._listener.address
        self._myip = myip
        self._mu = threading.Lock()
        self._objs: Dict[int, Tuple[Any, int]] = {}  # id -> (object, scope: the root's id)
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._accept, name="remote-accept", daemon=True)

    def start(self) -> "Server":
        self._thread.start()
        return self

    def close(self) -> None:
        self._listener.close()

    # ------------------------------------------------------------------ the objects a client may make
    def _make_engine(self, options: dict, listen: bool):
        import hixl
        e = hixl.Hixl()
        rc = e.initialize("%s:0" % self._myip if listen else self._myip, options)
        if rc != hixl.SUCCESS:
            raise RuntimeError("initialize(%s, %s) = %d: %s" % (self._myip, options, rc, e.last_error()))
        return e

    @staticmethod
    def _make_zeros(n: int):
        return np.zeros(n, np.uint8)

    # ------------------------------------------------------------------ serving
    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            except Exception:  # a client that failed the key: refused, keep serving
                traceback.print_exc()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="remote-conn", daemon=True).start()

    def _keep(self, obj, scope: int) -> int:
        with self._mu:
            oid = next(self._ids)
            self._objs[oid] = (obj, scope or oid)
            return oid

    def _get(self, oid: int):
        with self._mu:
            return self._objs[oid]

    def _reply(self, value, scope: int):
        """("value", v) when v pickles, else ("ref", id) with v kept in the caller's scope."""
        if callable(value) and not isinstance(value, type):
            return ("callable",)
        try:
            return ("value", pickle.dumps(value))
        except Exception:
            return ("ref", self._keep(value, scope))

    def _handle(self, msg):
        op = msg[0]
        if op == "make":
            _, kind, args = msg
            maker = {"engine": self._make_engine, "zeros": self._make_zeros}[kind]
            return ("ref", self._keep(maker(*args), 0))
        if op == "readable":  # select() on a descriptor of the serving host (an engine's flag_fd)
            import select
            return ("value", pickle.dumps(bool(select.select([msg[1]], [], [], msg[2])[0])))
        if op == "release":
            with self._mu:
                gone = [oid for oid, (_, scope) in self._objs.items() if scope == msg[1]]
                for oid in gone:
                    del self._objs[oid]
            return ("value", pickle.dumps(len(gone)))
        obj, scope = self._get(msg[1])
        if op == "getattr":
            return self._reply(getattr(obj, msg[2]), scope)
        if op == "call":
            _, _, name, args, kwargs = msg
            return self._reply(getattr(obj, name)(*args, **kwargs), scope)
        if op == "value":
            return ("value", pickle.dumps(obj))
        raise ValueError("unknown op %r" % (op,))

    def _serve(self, conn) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = self._handle(msg)
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
                    tb = "%s: %s\n%s" % (type(exc).__name__, exc, traceback.format_exc())
                    try:
                        reply = ("raise", pickle.dumps(exc), tb)
                    except Exception:
                        reply = ("raise", pickle.dumps(RemoteError(tb)), tb)
                try:
                    conn.send(reply)
                except OSError:
                    return


class Client:
    """B's end: one connection per thread to A's Server."""

    def __init__(self, address: Tuple[str, int], authkey: bytes):
        self._address, self._authkey = tuple(address), authkey
        self._local = threading.local()

    def _conn(self):
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = _Connect(self._address, authkey=self._authkey)
        return c

    def request(self, *msg):
        c = self._conn()
        c.send(msg)
        reply = c.recv()
        kind = reply[0]
        if kind == "value":
            return pickle.loads(reply[1])
        if kind == "ref":
            return Proxy(self, reply[1])
        if kind == "raise":  # the exception as raised there (if it unpickles), A's traceback as its cause
            try:
                exc = pickle.loads(reply[1])
            except Exception:
                exc = RemoteError(reply[2])
            raise exc from RemoteError(reply[2])
        return reply  # ("callable",)

    def engine(self, options: dict, listen: bool = True) -> "Proxy":
        """A hixl.Hixl on the serving host, initialized on its address (port 0 when listening)."""
        return self.request("make", "engine", (options, listen))

    def zeros(self, n: int) -> "RemoteArray":
        """np.zeros(n, np.uint8) on the serving host."""
        p = self.request("make", "zeros", (n,))
        return RemoteArray(self, p._oid, p.ctypes.data, n)

    def readable(self, fd: int, timeout_s: float) -> bool:
        """Whether descriptor fd of the serving host becomes readable within timeout_s."""
        return self.request("readable", fd, timeout_s)

    def release(self, root: "Proxy") -> int:
        """Drops root and every object derived from it on the serving host."""
        return self.request("release", root._oid)


class _Method:
    __slots__ = ("_proxy", "_name")

    def __init__(self, proxy: "Proxy", name: str):
        self._proxy, self._name = proxy, name

    def __call__(self, *args, **kwargs):
        return self._proxy._client.request("call", self._proxy._oid, self._name, args, kwargs)


class Proxy:
    """An object on the serving host: attributes, methods, indexing, len() and np.asarray() reach it."""

    def __init__(self, client: Client, oid: int):
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_oid", oid)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        got = self._client.request("getattr", self._oid, name)
        return _Method(self, name) if got == ("callable",) else got

    def __getitem__(self, key):
        return self._client.request("call", self._oid, "__getitem__", (key,), {})

    def __setitem__(self, key, value) -> None:
        self._client.request("call", self._oid, "__setitem__", (key, value), {})

    def __len__(self) -> int:
        return self._client.request("call", self._oid, "__len__", (), {})

    def __array__(self, dtype=None, copy=None):
        a = self._client.request("value", self._oid)
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return "<remote object %d>" % self._oid


class RemoteArray(Proxy):
    """A uint8 buffer on the serving host whose address and size are known here (no round trip for
    ``a.ctypes.data`` or ``a.size``: a test building 40,000 descriptors asks 80,000 times)."""

    class _CTypes:
        __slots__ = ("data",)

        def __init__(self, data: int):
            self.data = data

    def __init__(self, client: Client, oid: int, addr: int, size: int):
        super().__init__(client, oid)
        object.__setattr__(self, "ctypes", RemoteArray._CTypes(addr))
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "nbytes", size)
