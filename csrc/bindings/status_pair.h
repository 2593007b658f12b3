// The (status, value) tuple the C calls return (hixl._core's FastCall, hixl_tools._perf's floor calls).
#pragma once

#include <Python.h>

namespace hixl::py_calls {

// (rc, second) as a new tuple; steals `second`. nullptr with a Python error set when `second` is
// nullptr or an allocation fails.
inline PyObject* status_pair(int rc, PyObject* second) {
  if (second == nullptr) return nullptr;
  PyObject* r = PyLong_FromLong(rc);
  if (r == nullptr) {
    Py_DECREF(second);
    return nullptr;
  }
  PyObject* t = PyTuple_New(2);
  if (t == nullptr) {
    Py_DECREF(r);
    Py_DECREF(second);
    return nullptr;
  }
  PyTuple_SET_ITEM(t, 0, r);
  PyTuple_SET_ITEM(t, 1, second);
  return t;
}

}  // namespace hixl::py_calls
