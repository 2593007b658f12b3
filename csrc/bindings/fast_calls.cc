// hixl._core.fast_call: the per-request calls of a Python transfer loop written against CANN's API
// (Hixl.transfer_async with one descriptor, transfer_wait, get_transfer_status) as plain CPython
// vectorcall objects, without pybind11's dispatch (~110 ns a call) or a Python frame (~500 ns of
// checks in Hixl.transfer_async).
//
// hixl.Hixl installs one per method on each initialized engine, in the instance's __dict__, so that
// `h.transfer_async(...)` finds it before the class's method. It takes only the common call, with the
// checks of the Python method's own fast path (exact types, a remote already seen to parse, ranges);
// anything else, and every call after close() (finalize, fork), goes to the Python method unchanged.
// The engine call itself runs with the GIL released, as every engine call does.
//
// last_error: the Python method clears `self._tls.last_error` on SUCCESS. Setting a threading.local
// costs ~35 ns, a third of what a call costs here, so the calls clear it only when this thread's
// last_error of that engine may be non-empty: Hixl._set_error marks the thread in the engine's
// ErrorMarks (`Hixl._marks`) whenever it sets a non-empty one, and a SUCCESS here clears the mark.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "bindings/status_pair.h"

namespace py = pybind11;
using hixl::engine::Engine;
using hixl::engine::kFailed;
using hixl::engine::kSuccess;

namespace {

enum Kind : int { kTransferAsync = 0, kTransferWait = 1, kTransferStatus = 2 };
constexpr uint64_t kU64Max = UINT64_MAX;
constexpr long long kInt32Max = 2147483647LL;

}  // namespace

// The threads whose last_error of one Hixl may be non-empty (their PyThread idents). Only touched with
// the GIL held. An ident of a thread that ended stays until a thread with the same ident succeeds (one
// more clear than needed); the marks die with their Hixl.
struct ErrorMarks {
  std::vector<unsigned long> threads;
  void note() {
    const unsigned long me = PyThread_get_thread_ident();
    if (std::find(threads.begin(), threads.end(), me) == threads.end()) threads.push_back(me);
  }
};

namespace {

struct FastCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int kind;
  int closed;
  Engine* engine;
  PyObject* engine_obj;  // keeps *engine alive
  PyObject* good;        // Hixl._good_remotes: remote names already seen to parse
  PyObject* tls;         // Hixl._tls
  PyObject* marks_obj;   // Hixl._marks (keeps *marks alive)
  ErrorMarks* marks;
  PyObject* op_type;     // hixl.TransferOp
  PyObject* statuses;    // tuple of hixl.TransferStatus members, by value
  PyObject* slow;        // the class's Python method, for every other call
  PyObject* selfref;     // weakref to the Hixl
};

PyTypeObject* g_type = nullptr;
PyObject *s_last_error, *s_empty, *s_local_addr, *s_remote_addr, *s_len;

// A non-empty last_error for this thread, as the Python method's `self._done(rc)`.
void set_error(FastCall* f, const std::string& why) {
  PyObject* s = PyUnicode_DecodeUTF8(why.data(), Py_ssize_t(why.size()), "replace");
  if (s == nullptr || PyObject_SetAttr(f->tls, s_last_error, s) != 0) PyErr_Clear();
  Py_XDECREF(s);
  f->marks->note();
}

void clear_error(FastCall* f) {
  auto& t = f->marks->threads;
  if (t.empty()) return;
  auto it = std::find(t.begin(), t.end(), PyThread_get_thread_ident());
  if (it == t.end()) return;
  if (PyObject_SetAttr(f->tls, s_last_error, s_empty) != 0) {
    PyErr_Clear();
    return;  // still marked
  }
  t.erase(it);
}

inline PyObject* pair(int rc, PyObject* second) {  // steals second
  return hixl::py_calls::status_pair(rc, second);
}

// The Python method, with the Hixl as its first argument.
PyObject* slow_call(FastCall* f, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  PyObject* self = PyWeakref_GetObject(f->selfref);  // borrowed
  if (self == nullptr) return nullptr;
  if (self == Py_None) {  // the Hixl is gone (only this call was kept): FAILED, as after finalize
    if (f->kind == kTransferAsync) return pair(kFailed, PyLong_FromLong(0));
    PyObject* failed = PyTuple_GET_ITEM(f->statuses, PyTuple_GET_SIZE(f->statuses) - 1);
    Py_INCREF(failed);
    return pair(kFailed, failed);
  }
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject* small[8];  // every signature here has at most 7 arguments; more is the method's TypeError
  std::vector<PyObject*> big;
  PyObject** stack = small;
  if (nargs + nkw + 1 > 8) {
    big.resize(size_t(nargs + nkw + 1));
    stack = big.data();
  }
  stack[0] = self;
  std::copy(args, args + nargs + nkw, stack + 1);
  Py_INCREF(self);
  PyObject* r = PyObject_Vectorcall(f->slow, stack, size_t(nargs + 1), kwnames);
  Py_DECREF(self);
  return r;
}

// An exact int in [lo, hi], else false (and no Python error left set).
// (PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray for any int past 2**30, as addresses are:
// ~50 instructions more than the signed conversion, which reads the digits directly.)
bool exact_u64(PyObject* o, uint64_t lo, uint64_t hi, uint64_t* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long s = PyLong_AsLongLongAndOverflow(o, &overflow);
  unsigned long long v = (unsigned long long)s;
  if (overflow != 0 || s < 0) {
    if (overflow <= 0) return false;  // negative
    v = PyLong_AsUnsignedLongLong(o);  // 2**63 .. 2**64-1, or past it
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool desc_field(PyObject* d, PyObject* name, uint64_t* out) {
  PyObject* v = PyObject_GetAttr(d, name);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool ok = exact_u64(v, 1, kU64Max, out);
  Py_DECREF(v);
  return ok;
}

// transfer_async(remote_engine, op, [TransferOpDesc]): the fast path's conditions are the Python
// method's (engine.py, "The common call").
PyObject* transfer_async(FastCall* f, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (f->closed || kwnames != nullptr || PyVectorcall_NARGS(nargsf) != 3) return slow_call(f, args, nargsf, kwnames);
  PyObject *remote = args[0], *op = args[1], *descs = args[2];
  if (!PyUnicode_CheckExact(remote) || Py_TYPE(op) != (PyTypeObject*)f->op_type || !PyList_CheckExact(descs) ||
      PyList_GET_SIZE(descs) != 1)
    return slow_call(f, args, nargsf, kwnames);
  const int known = PySet_Contains(f->good, remote);
  if (known != 1) {
    if (known < 0) PyErr_Clear();
    return slow_call(f, args, nargsf, kwnames);
  }
  const long o = PyLong_AsLong(op);
  if (o != 0 && o != 1) {
    PyErr_Clear();
    return slow_call(f, args, nargsf, kwnames);
  }
  PyObject* d = PyList_GET_ITEM(descs, 0);
  Py_INCREF(d);  // a property of it may empty the list
  uint64_t la = 0, ra = 0, n = 0;
  const bool ok = desc_field(d, s_local_addr, &la) && desc_field(d, s_remote_addr, &ra) && desc_field(d, s_len, &n) &&
                  n - 1 <= kU64Max - la && n - 1 <= kU64Max - ra;  // la + n <= 2**64, ra + n <= 2**64
  Py_DECREF(d);
  if (!ok) return slow_call(f, args, nargsf, kwnames);
  Py_ssize_t len = 0;
  const char* name = PyUnicode_AsUTF8AndSize(remote, &len);
  if (name == nullptr) {
    PyErr_Clear();
    return slow_call(f, args, nargsf, kwnames);
  }
  std::pair<int, uint64_t> r{kFailed, 0};
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  try {
    const std::string peer(name, size_t(len));
    const hixl::engine::OpDesc one{la, ra, n};
    r = f->engine->transfer_async(peer, hixl::engine::TransferOp(o), &one, 1, 0);
    if (r.first != kSuccess) why = f->engine->last_error();
  } catch (const std::exception& e) {  // std::bad_alloc of the name: nothing was posted
    r = {kFailed, 0};
    why = std::string("FAILED: transfer_async: ") + e.what();
  }
  Py_END_ALLOW_THREADS
  if (r.first == kSuccess)
    clear_error(f);
  else
    set_error(f, why);
  return pair(r.first, PyLong_FromUnsignedLongLong(r.second));
}

PyObject* status_pair(FastCall* f, int rc, int st, const std::string& why) {
  if (rc == kSuccess)
    clear_error(f);
  else
    set_error(f, why);
  if (st < 0 || st >= PyTuple_GET_SIZE(f->statuses)) {  // not an engine status: as the Python method's KeyError
    set_error(f, "FAILED: transfer status " + std::to_string(st) + " from the engine is not a TransferStatus");
    rc = kFailed;
    st = int(PyTuple_GET_SIZE(f->statuses)) - 1;  // FAILED
  }
  PyObject* s = PyTuple_GET_ITEM(f->statuses, st);
  Py_INCREF(s);
  return pair(rc, s);
}

// transfer_wait(req, timeout_in_millis) with an int timeout; get_transfer_status(req).
PyObject* wait_or_status(FastCall* f, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t want = f->kind == kTransferWait ? 2 : 1;
  if (f->closed || kwnames != nullptr || PyVectorcall_NARGS(nargsf) != want) return slow_call(f, args, nargsf, kwnames);
  uint64_t req = 0, timeout = 0;
  if (!exact_u64(args[0], 1, kU64Max, &req) || (want == 2 && !exact_u64(args[1], 0, uint64_t(kInt32Max), &timeout)))
    return slow_call(f, args, nargsf, kwnames);
  std::pair<int, int> r;
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  try {
    r = f->kind == kTransferWait ? f->engine->transfer_wait(req, int(timeout)) : f->engine->transfer_status(req);
    if (r.first != kSuccess) why = f->engine->last_error();
  } catch (const std::exception& e) {  // std::bad_alloc of the error's copy
    r = {kFailed, 3};
    why = std::string("FAILED: ") + (f->kind == kTransferWait ? "transfer_wait: " : "get_transfer_status: ") + e.what();
  }
  Py_END_ALLOW_THREADS
  return status_pair(f, r.first, r.second, why);
}

PyObject* fast_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<FastCall*>(self);
  switch (f->kind) {
    case kTransferAsync: return transfer_async(f, args, nargsf, kwnames);
    default: return wait_or_status(f, args, nargsf, kwnames);
  }
}

void fast_dealloc(PyObject* self) {
  auto* f = reinterpret_cast<FastCall*>(self);
  PyTypeObject* tp = Py_TYPE(self);
  Py_XDECREF(f->engine_obj);
  Py_XDECREF(f->good);
  Py_XDECREF(f->tls);
  Py_XDECREF(f->marks_obj);
  Py_XDECREF(f->op_type);
  Py_XDECREF(f->statuses);
  Py_XDECREF(f->slow);
  Py_XDECREF(f->selfref);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyObject* fast_close(PyObject* self, PyObject*) {
  reinterpret_cast<FastCall*>(self)->closed = 1;
  Py_RETURN_NONE;
}

// inspect.signature() and help() of `h.transfer_async` show the Python method's.
PyObject* get_wrapped(PyObject* self, void*) {
  auto* f = reinterpret_cast<FastCall*>(self);
  PyObject* h = PyWeakref_GetObject(f->selfref);
  if (h == nullptr) return nullptr;
  if (h == Py_None) {
    Py_INCREF(f->slow);
    return f->slow;
  }
  return PyMethod_New(f->slow, h);
}

PyObject* get_slow_attr(PyObject* self, void* name) {
  auto* f = reinterpret_cast<FastCall*>(self);
  return PyObject_GetAttrString(f->slow, static_cast<const char*>(name));
}

PyObject* get_closed(PyObject* self, void*) { return PyBool_FromLong(reinterpret_cast<FastCall*>(self)->closed); }

PyMethodDef fast_methods[] = {
    {"close", fast_close, METH_NOARGS, "Send every later call to the Python method (finalize, fork)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef fast_getset[] = {
    {"__wrapped__", get_wrapped, nullptr, nullptr, nullptr},
    {"__doc__", get_slow_attr, nullptr, nullptr, const_cast<char*>("__doc__")},
    {"__name__", get_slow_attr, nullptr, nullptr, const_cast<char*>("__name__")},
    {"__qualname__", get_slow_attr, nullptr, nullptr, const_cast<char*>("__qualname__")},
    {"closed", get_closed, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMemberDef fast_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, Py_ssize_t(offsetof(FastCall, vectorcall)), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot fast_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(fast_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_methods, fast_methods},
    {Py_tp_getset, fast_getset},
    {Py_tp_members, fast_members},
    {0, nullptr}};

PyType_Spec fast_spec = {"hixl._core.FastCall", sizeof(FastCall), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, fast_slots};

// A FastCall of `kind` with every reference null (dealloc drops only those set), or nullptr with a
// Python error.
FastCall* new_fast_call(int kind) {
  auto* f = PyObject_New(FastCall, g_type);
  if (f == nullptr) return nullptr;
  f->vectorcall = fast_vectorcall;
  f->kind = kind;
  f->closed = 0;
  f->engine = nullptr;
  f->marks = nullptr;
  f->engine_obj = f->good = f->tls = f->marks_obj = f->op_type = f->statuses = f->slow = f->selfref = nullptr;
  return f;
}

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // held for the life of the process
}

}  // namespace

void hixl_bind_fast_calls(py::module_& m) {
  s_last_error = intern("last_error");
  s_empty = intern("");
  s_local_addr = intern("local_addr");
  s_remote_addr = intern("remote_addr");
  s_len = intern("len");
  g_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&fast_spec));
  if (g_type == nullptr) throw py::error_already_set();
  m.attr("FastCall") = py::handle(reinterpret_cast<PyObject*>(g_type));  // the module holds a reference too

  m.def(
      "fast_call",
      [](int kind, py::object engine, py::object good, py::object tls, py::object marks, py::object op_type,
         py::tuple statuses, py::object slow, py::object self) {
        if (kind < kTransferAsync || kind > kTransferStatus) throw py::value_error("fast_call: kind must be 0, 1 or 2");
        if (!PySet_CheckExact(good.ptr())) throw py::type_error("fast_call: good must be a set");
        if (!PyType_Check(op_type.ptr())) throw py::type_error("fast_call: op_type must be a type");
        if (statuses.size() != 4) throw py::value_error("fast_call: statuses must hold the 4 TransferStatus values");
        Engine* e = engine.cast<Engine*>();
        ErrorMarks* mk = marks.cast<ErrorMarks*>();
        PyObject* ref = PyWeakref_NewRef(self.ptr(), nullptr);
        if (ref == nullptr) throw py::error_already_set();
        FastCall* f = new_fast_call(kind);
        if (f == nullptr) {
          Py_DECREF(ref);
          throw py::error_already_set();
        }
        f->engine = e;
        f->engine_obj = engine.release().ptr();
        f->good = good.release().ptr();
        f->tls = tls.release().ptr();
        f->marks = mk;
        f->marks_obj = marks.release().ptr();
        f->op_type = op_type.release().ptr();
        f->statuses = statuses.release().ptr();
        f->slow = slow.release().ptr();
        f->selfref = ref;
        return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
      },
      py::arg("kind"), py::arg("engine"), py::arg("good"), py::arg("tls"), py::arg("marks"), py::arg("op_type"),
      py::arg("statuses"), py::arg("slow"), py::arg("self"),
      "A FastCall for Hixl method `slow` of `self` (kind 0 transfer_async, 1 transfer_wait, 2 get_transfer_status).");

  py::class_<ErrorMarks>(m, "ErrorMarks",
                         "The threads whose last_error of one hixl.Hixl may be non-empty (see FastCall).")
      .def(py::init<>())
      .def("note", &ErrorMarks::note, "This thread's last_error is now non-empty.")
      .def_property_readonly("threads", [](const ErrorMarks& m) { return m.threads.size(); });
}
