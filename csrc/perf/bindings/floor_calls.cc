// hixl_tools._perf.perf_fast_floor: the floor of a Python loop over hixl.Hixl's per-request calls
// (hixl bench --desc-sweep). Its objects are called as hixl._core's FastCall is (csrc/bindings/fast_calls.cc):
// a plain CPython vectorcall object, dispatched on its kind, that takes any arguments, releases the GIL
// and takes it back as the engine's calls do (or keeps it: kFloorHoldingGil, to tell what the two
// handovers cost), and returns the pair (0, 0). A loop over it costs what the interpreter and the call
// add to each request, with no engine work: the ceiling of a Python loop over FastCall.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include "bindings/status_pair.h"

namespace py = pybind11;

namespace {

enum Kind : int { kFloor = 3, kFloorHoldingGil = 4 };  // FastCall's kinds 0..2 are the engine's calls

struct FloorCall {  // FastCall's head: the vectorcall slot, then the kind
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int kind;
};

PyTypeObject* g_type = nullptr;

inline PyObject* pair(int rc, PyObject* second) {  // steals second
  return hixl::py_calls::status_pair(rc, second);
}

// What any call of this kind costs at least: the call, the GIL released and taken back, a (0, 0) tuple.
PyObject* floor_call(bool release_gil) {
  if (release_gil) {
    Py_BEGIN_ALLOW_THREADS
    Py_END_ALLOW_THREADS
  }
  PyObject* zero = PyLong_FromLong(0);
  return pair(0, zero);
}

PyObject* floor_vectorcall(PyObject* self, PyObject* const*, size_t, PyObject*) {
  switch (reinterpret_cast<FloorCall*>(self)->kind) {
    case kFloor: return floor_call(true);
    default: return floor_call(false);
  }
}

void floor_dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyMemberDef floor_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, Py_ssize_t(offsetof(FloorCall, vectorcall)), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot floor_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(floor_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, floor_members},
    {0, nullptr}};

PyType_Spec floor_spec = {"hixl_tools._perf.FastCall", sizeof(FloorCall), 0,
                          Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, floor_slots};

}  // namespace

void hixl_bind_floor_calls(py::module_& m) {
  g_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&floor_spec));
  if (g_type == nullptr) throw py::error_already_set();
  m.attr("FastCall") = py::handle(reinterpret_cast<PyObject*>(g_type));  // the module holds a reference too

  m.def(
      "perf_fast_floor",
      [](bool release_gil) {
        auto* f = PyObject_New(FloorCall, g_type);
        if (f == nullptr) throw py::error_already_set();
        f->vectorcall = floor_vectorcall;
        f->kind = release_gil ? kFloor : kFloorHoldingGil;
        return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
      },
      py::arg("release_gil") = true,
      "A call of hixl._core.FastCall's kind that does nothing but release the GIL (unless release_gil is "
      "False) and return (0, 0): the floor of a Python loop over the per-request calls of hixl.Hixl "
      "(hixl bench --desc-sweep).");
}
