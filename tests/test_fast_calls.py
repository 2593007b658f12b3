"""The C per-request calls of hixl.Hixl (``_core.fast_call``; the methods are in hixl/engine.py): an initialized engine
answers ``transfer_async`` with one TransferOpDesc, ``transfer_wait`` and ``get_transfer_status`` in C.
They must answer exactly as the Python methods do (which stay the definition), hand every other form
to them, keep ``last_error`` per thread, and go away with the engine (finalize, fork, a dropped Hixl)."""
from __future__ import annotations

import gc
import inspect
import threading

import numpy as np
import pytest

import hixl
from hixl import FAILED, PARAM_INVALID, READ, SUCCESS, WRITE, TransferOpDesc, TransferStatus

from .test_descriptor_fast_path import SIZE, TRANSPORTS, Pair

FAST = ("transfer_async", "transfer_wait", "get_transfer_status")


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


def _python(name):
    """The Python method itself, past the engine's C call."""
    return getattr(hixl.Hixl, name)


def test_an_initialized_engine_answers_in_c_until_finalize():
    h = hixl.Hixl()
    assert not any(n in vars(h) for n in FAST)  # not initialized: the Python methods
    assert h.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS
    for n in FAST:
        f = vars(h)[n]
        assert type(f).__name__ == "FastCall" and not f.closed
        # what help() and inspect show is the Python method's
        assert inspect.signature(getattr(h, n)) == inspect.signature(getattr(hixl.Hixl, n).__get__(h))
        assert f.__doc__ == getattr(hixl.Hixl, n).__doc__ and f.__name__ == n
    kept = h.transfer_wait
    h.finalize()
    assert not any(n in vars(h) for n in FAST) and kept.closed
    assert h.transfer_async("127.0.0.1:1", WRITE, [TransferOpDesc(1, 1, 1)]) == (FAILED, 0)
    assert kept(5, 0) == (FAILED, TransferStatus.FAILED)  # a kept call goes to the Python method
    assert h.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS  # a fresh engine, fresh calls
    assert all(type(vars(h)[n]).__name__ == "FastCall" for n in FAST)
    h.finalize()


def test_finalize_leaves_what_a_user_put_in_the_instance_alone():
    h = hixl.Hixl()
    assert h.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS
    mine = object()
    h.transfer_wait = mine
    h.finalize()
    assert vars(h)["transfer_wait"] is mine and "transfer_async" not in vars(h)
    assert h._engine.transfer_status(1)[0] == FAILED  # finalized all the way: the C++ engine too
    assert "not initialized" in h._engine.last_error()


def test_a_subclass_that_overrides_a_call_keeps_its_own():
    class Counting(hixl.Hixl):
        waits = 0

        def transfer_wait(self, req, timeout_in_millis=None):
            Counting.waits += 1
            return super().transfer_wait(req, timeout_in_millis)

    h = Counting()
    assert h.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS
    try:
        assert "transfer_wait" not in vars(h) and "transfer_async" in vars(h)
        assert h.transfer_wait(12345, 0) == (PARAM_INVALID, TransferStatus.FAILED)
        assert Counting.waits == 1
    finally:
        h.finalize()


def test_c_calls_move_the_bytes_and_answer_as_the_python_methods(pair):
    ini, peer = pair.ini, pair.peer
    assert type(vars(ini)["transfer_async"]).__name__ == "FastCall"
    reqs = []
    for k in range(64):  # WRITE block k to block 63-k, one descriptor per request
        rc, req = ini.transfer_async(peer, WRITE, [TransferOpDesc(pair.ia + 4096 * k, pair.ta + 4096 * (63 - k), 4096)])
        assert rc == SUCCESS and req > 0 and ini.last_error() == ""
        reqs.append(req)
    for req in reqs[:32]:
        assert ini.transfer_wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED)
    for req in reqs[32:]:
        while True:
            rc, st = ini.get_transfer_status(req)
            assert rc == SUCCESS and type(st) is TransferStatus
            if st != TransferStatus.WAITING:
                break
        assert st is TransferStatus.COMPLETED
    for k in (0, 31, 63):
        assert np.array_equal(pair.tbuf[4096 * (63 - k):4096 * (64 - k)], pair.ibuf[4096 * k:4096 * (k + 1)])
    pair.ibuf[:] = 0
    rc, req = ini.transfer_async(peer, READ, [TransferOpDesc(pair.ia, pair.ta, 4096 * 64)])
    assert rc == SUCCESS and ini.transfer_wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED)
    assert np.array_equal(pair.ibuf[:4096 * 64], pair.tbuf[:4096 * 64])

    # the same answers, code and message, from the C call and from the Python method
    cases = [
        ("transfer_async", (peer, WRITE, [TransferOpDesc(pair.ia, pair.ta + SIZE, 64)])),  # outside the region
        ("transfer_async", (peer, READ, [TransferOpDesc(pair.ia, 8, 64)])),
        ("transfer_async", (peer, WRITE, [TransferOpDesc(pair.ia, pair.ta, 0)])),  # the Python method refuses
        ("transfer_async", (peer, WRITE, [TransferOpDesc(pair.ia, pair.ta, True)])),
        ("transfer_async", (peer, WRITE, [TransferOpDesc(pair.ia, 2 ** 64 - 8, 64)])),
        ("transfer_async", (peer, WRITE, [TransferOpDesc(pair.ia, pair.ta, 2 ** 64)])),
        ("transfer_async", (peer, 7, [TransferOpDesc(pair.ia, pair.ta, 64)])),
        ("transfer_async", ("not an address", WRITE, [TransferOpDesc(pair.ia, pair.ta, 64)])),
        ("transfer_wait", (2 ** 60, 0)),
        ("transfer_wait", (0, 0)),
        ("transfer_wait", (-1, 0)),
        ("transfer_wait", (1, -5)),
        ("transfer_wait", (2 ** 64, 0)),
        ("get_transfer_status", (2 ** 60,)),
        ("get_transfer_status", (0,)),
        ("get_transfer_status", ("1",)),
    ]
    for name, args in cases:
        got = getattr(ini, name)(*args)
        got_why = ini.last_error()
        want = _python(name)(ini, *args)
        assert got == want and got[0] != SUCCESS, (name, args, got, want)
        assert got_why == ini.last_error() != "", (name, args, got_why)
        ok = ini.transfer_async(peer, WRITE, [TransferOpDesc(pair.ia, pair.ta, 8)])  # SUCCESS clears it
        assert ok[0] == SUCCESS and ini.last_error() == ""
        assert ini.transfer_wait(ok[1], 60000) == (SUCCESS, TransferStatus.COMPLETED)


def test_other_forms_go_to_the_python_method(pair):
    """Keywords, options, tuples, numpy integers and several descriptors take the Python method, as
    before; each moves its bytes."""
    ini, peer = pair.ini, pair.peer
    d = [TransferOpDesc(pair.ia, pair.ta, 256)]
    for args, kw in (((peer, WRITE, d), {"flag": 5}), ((peer, WRITE, tuple(d)), {}),
                     ((peer, WRITE, d, hixl.TransferArgs(user_data=9)), {}),
                     ((peer, WRITE, [TransferOpDesc(np.uint64(pair.ia), pair.ta, 256)]), {}),
                     ((peer, int(WRITE), d), {}), ((peer, WRITE, d * 2), {}),
                     ((), {"remote_engine": peer, "op": WRITE, "op_descs": d}),
                     ((peer, WRITE, d), {"timeout_in_millis": 30000})):
        pair.tbuf[:256] = 0
        rc, req = ini.transfer_async(*args, **kw)
        assert rc == SUCCESS, (args, kw, ini.last_error())
        assert ini.transfer_wait(req, timeout_in_millis=60000) == (SUCCESS, TransferStatus.COMPLETED)
        assert np.array_equal(pair.tbuf[:256], pair.ibuf[:256])
    assert pair.tgt.wait_flags(10000) == (SUCCESS, [(ini.local_engine, 5)])  # flag=5 took the Python method
    rc, req = ini.transfer_async(peer, WRITE, d)
    assert rc == SUCCESS and ini.transfer_wait(req) == (SUCCESS, TransferStatus.COMPLETED)  # no timeout: Python


def test_a_property_that_empties_the_list_or_raises(pair):
    ini, peer = pair.ini, pair.peer
    victims: list = []

    class Evil:
        remote_addr, len = pair.ta, 64

        @property
        def local_addr(self):
            victims.clear()
            return pair.ia

    class Raises:
        remote_addr, len = pair.ta, 64

        @property
        def local_addr(self):
            raise RuntimeError("boom")

    victims.append(Evil())
    rc, req = ini.transfer_async(peer, WRITE, victims)  # the element was held while read: moved
    assert rc == SUCCESS and ini.transfer_wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED)
    want = _python("transfer_async")(ini, peer, WRITE, [Raises()])  # the Python method decides
    assert ini.transfer_async(peer, WRITE, [Raises()]) == want == (FAILED, 0) and "boom" in ini.last_error()


def test_last_error_stays_per_thread():
    """A failure in one thread is that thread's last_error until its own next SUCCESS; another thread's
    SUCCESS (a C call) does not clear it, nor does a failure there leak here."""
    p = Pair("tcp")
    try:
        ini, peer = p.ini, p.peer
        good = [TransferOpDesc(p.ia, p.ta, 8)]
        assert ini.transfer_wait(2 ** 60, 0)[0] == PARAM_INVALID  # a C call's failure
        mine = ini.last_error()
        assert "unknown request" in mine and ini._marks.threads == 1  # this thread is marked
        seen = {}

        def other():
            seen["before"] = ini.last_error()
            rc, req = ini.transfer_async(peer, WRITE, good)
            seen["ok"] = rc == SUCCESS and ini.transfer_wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED)
            seen["after"] = ini.last_error()
            ini.get_transfer_status(0)  # a failure of its own
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == {"before": "", "ok": True, "after": ""}
        assert ini.last_error() == mine and ini._marks.threads == 2  # the other thread's failure marked it

        assert ini.transfer_async("bad", WRITE, good)[0] == PARAM_INVALID  # a Python method's refusal
        assert "bad remote_engine" in ini.last_error()
        rc, req = ini.transfer_async(peer, WRITE, good)  # then a C call's SUCCESS clears it, and the mark
        assert rc == SUCCESS and ini.last_error() == "" and ini._marks.threads == 1
        assert ini.transfer_wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED) and ini.last_error() == ""
    finally:
        p.close()


def test_a_call_kept_after_its_engine_was_dropped_fails_cleanly():
    p = Pair("tcp")
    peer, ia, ta = p.peer, p.ia, p.ta
    ini = p.ini
    send, wait, status = ini.transfer_async, ini.transfer_wait, ini.get_transfer_status
    rc, req = send(peer, WRITE, [TransferOpDesc(ia, ta, 8)])
    assert rc == SUCCESS and wait(req, 60000) == (SUCCESS, TransferStatus.COMPLETED)
    del ini, p.ini
    gc.collect()
    try:
        # the Hixl is gone but never finalized: its engine lives while these calls do; they still work
        # on the fast path, and hand the rest (the Python method would need the Hixl) back as FAILED
        assert send(peer, WRITE, [TransferOpDesc(ia, ta, 8)], flag=1) == (FAILED, 0)
        assert wait(0, 0) == (FAILED, TransferStatus.FAILED)
        assert status("x") == (FAILED, TransferStatus.FAILED)
    finally:
        del send, wait, status
        gc.collect()
        p.tgt.finalize()


@pytest.mark.parametrize("release_gil", [True, False])
def test_the_benchmarks_no_op_floor_answers_zero_to_anything(release_gil):
    """hixl bench --desc-sweep's floors (GIL released, or kept; hixl_tools._perf): calls of any form answer (0, 0)."""
    from hixl_tools import _perf
    f = _perf.perf_fast_floor(release_gil=release_gil)
    assert isinstance(f, _perf.FastCall)
    assert f() == (0, 0)
    assert f("peer", WRITE, [TransferOpDesc(1, 2, 8)]) == (0, 0)
    assert f(1, 60000) == (0, 0)
    assert f(x=1) == (0, 0)
    done = []  # from another thread as well
    t = threading.Thread(target=lambda: done.append(sum(f(k, k)[0] for k in range(1000))))
    t.start()
    t.join(30)
    assert done == [0]
    assert _perf.perf_fast_floor() is not _perf.perf_fast_floor()
