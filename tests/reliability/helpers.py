"""What the reliability tests share: engines on loopback, a peer engine in its own process
(tests/engine_peer.py), polling with a bound, the control-frame header, and TCP relays between an
engine and its peer (one that records what a client sent, one that injects half a frame)."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hixl
from hixl import SUCCESS

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
REPO = Path(__file__).resolve().parents[2]
PEER = REPO / "tests" / "engine_peer.py"
MiB = 1 << 20

# wire.h / control.h
HDR = struct.Struct("<IHHII")
MAGIC = 0x4C584948
CONNECT, ACCEPT, REFUSE, NOTIFY, ATTACH = 4, 5, 6, 7, 14
AUTH_HELLO, AUTH_CHALLENGE, AUTH_PROOF = 16, 17, 18
TCP_BIT = 1 << 3
LOGS_WARN = os.environ.get("HIXL_LOG_LEVEL", "warn") in ("debug", "info", "warn")


def engine(transport, listen=True, **opts):
    """An initialized hixl.Hixl on 127.0.0.1 (a free port when listen), options as strings."""
    e = hixl.Hixl()
    o = {"HixlTransport": transport}
    o.update({k: str(v) for k, v in opts.items()})
    assert e.initialize("127.0.0.1:0" if listen else "127.0.0.1", o) == SUCCESS, e.last_error()
    return e


def until(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out (%ss) waiting for %s" % (timeout_s, what)
        time.sleep(0.01)


def linked(e, name):
    return e.get_transport(name)[0] == SUCCESS


def listen_port(e) -> int:
    """The port an engine listens on (its local_engine "ip:port")."""
    return int(e.local_engine.rsplit(":", 1)[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


class Peer:
    """tests/engine_peer.py in its own process, serving SIZE bytes (on `port`, else a free one), or
    doing what `mode` says (e.g. ["--write-loop", NAME, ADDR]; then no announcement is read: line() reads
    its JSON lines). stop() / cont(): SIGSTOP / SIGCONT; close(): it finalizes and exits; kill(): SIGKILL."""

    def __init__(self, transport, size, port=None, mode=()):
        args = [sys.executable, str(PEER), transport, str(size)] + (["--port", str(port)] if port else [])
        self.p = subprocess.Popen(args + list(mode), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = {} if mode else self.line()
        self.name = self.info.get("name")

    def line(self):
        """The peer's next JSON line."""
        return json.loads(self.p.stdout.readline())

    def stop(self):
        os.kill(self.p.pid, signal.SIGSTOP)

    def cont(self):
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)

    def close(self):
        self.cont()
        if self.p.poll() is None:
            self.p.stdin.close()  # the peer finalizes and exits
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(20)
        self._close_pipes()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)
        self._close_pipes()

    def _close_pipes(self):
        for f in (self.p.stdin, self.p.stdout):
            f.close()


class Relay:
    """Relays every TCP connection to 127.0.0.1:target_port, each direction on a thread of its own.
    Subclasses decide what happens to the client's bytes (client_to_target)."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.socks, self.threads = [], []
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.lsock.settimeout(0.1)
        self.stop = threading.Event()
        self.port = self.lsock.getsockname()[1]
        self._start(self._serve)

    def _start(self, fn, *args):
        th = threading.Thread(target=fn, args=args, daemon=True)
        th.start()
        self.threads.append(th)

    def _serve(self):
        while not self.stop.is_set():
            try:
                c, _ = self.lsock.accept()
            except (socket.timeout, OSError):
                continue
            u = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks += [c, u]
            self._start(self.client_to_target, c, u)
            self._start(self.pump, u, c)

    @staticmethod
    def pump(src, dst, sink=None):
        """Copies src to dst until src ends (appending each chunk to sink), then ends dst's input."""
        try:
            while True:
                d = src.recv(65536)
                if not d:
                    break
                if sink is not None:
                    sink.append(d)
                dst.sendall(d)
        except OSError:
            pass
        Relay.end_input(dst)

    @staticmethod
    def end_input(dst):
        """Ends dst's input (its peer reads EOF), if it is still connected."""
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def client_to_target(self, c, u):
        self.pump(c, u)

    def close(self):
        self.stop.set()
        self.threads[0].join()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:  # already disconnected
                pass
        for th in self.threads[1:]:
            th.join()
        for s in self.socks + [self.lsock]:
            s.close()


class RecordingRelay(Relay):
    """record[i] collects what the i-th client sent."""

    def __init__(self, target_port):
        self.record = []
        super().__init__(target_port)

    def client_to_target(self, c, u):
        sink = []
        self.record.append(sink)
        self.pump(c, u, sink)


class HalfFrameRelay(Relay):
    """On a control connection (its first frame is a Connect) the client's frames are forwarded whole,
    so inject() lands between two frames; after it, nothing more of that client reaches the target
    (what it sends is read and dropped) until resume()."""

    def __init__(self, target_port):
        self.lock = threading.Lock()
        self.control = None  # the upstream socket of the control connection
        self.frozen = False
        super().__init__(target_port)

    def client_to_target(self, c, u):
        try:
            hdr = recv_exact(c, HDR.size)
            _, _, ftype, plen, _ = HDR.unpack(hdr)
            first = hdr + recv_exact(c, plen)
            if ftype != CONNECT:  # a data connection (tcp): its stream is not made of frames
                u.sendall(first)
                return self.pump(c, u)
            with self.lock:
                self.control = u
                u.sendall(first)
            while True:
                hdr = recv_exact(c, HDR.size)
                frame = hdr + recv_exact(c, HDR.unpack(hdr)[3])
                with self.lock:
                    if not self.frozen:
                        u.sendall(frame)
        except (OSError, EOFError):
            pass
        self.end_input(u)

    def inject(self, data):
        """Writes data to the target; from now on the client's own frames are dropped (see resume())."""
        with self.lock:
            assert self.control is not None
            self.control.sendall(data)
            self.frozen = True

    def mute(self):
        """From now on the client's frames are dropped (its process stays alive and running)."""
        with self.lock:
            assert self.control is not None
            self.frozen = True

    def resume(self):
        with self.lock:
            self.frozen = False
