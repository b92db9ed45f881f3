// fij_fastcall: run()'s C launch entries called from Python without ctypes.
//
// A ctypes call converts each argument through its argtypes and libffi: ~1.1 us for the
// prefill entry's 13 arguments on the CPU machine, against ~0.1 us for this METH_FASTCALL
// function, which reads Python ints and floats straight into the entry's C types
// (csrc/fast_entry.h) and calls it by address. Built once per Python and compiler by
// flashinfer_jit/fastcall.py (CPython's headers only, no torch); ctypes stays the fallback.
//
//   decode(entry, prepared, q, k, v, out, lse, logit_scale, v_scale, window_left, stream, pdl)
//   prefill(entry, prepared, q, k, v, out, lse, sinks, logit_scale, soft_cap_log2, v_scale,
//           window_left, stream, pdl)
// Addresses are Python ints (0: null); each returns the entry's cudaError_t as an int.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fast_entry.h"

namespace {

// An address from a Python int (0: null); nullptr with a Python error set for a negative
// or too large int, or not an int.
void* address(PyObject* arg) {
  const unsigned long long value = PyLong_AsUnsignedLongLong(arg);
  return value == static_cast<unsigned long long>(-1) && PyErr_Occurred() ? nullptr
                                                                          : reinterpret_cast<void*>(value);
}

// args[0 .. n) as addresses; false with a Python error set
bool addresses(PyObject* const* args, int n, void** out) {
  for (int i = 0; i < n; ++i) {
    out[i] = address(args[i]);
    if (out[i] == nullptr && PyErr_Occurred()) return false;
  }
  return true;
}

bool arity(const char* name, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "fij_fastcall.%s(): expected %zd arguments, got %zd", name, want, got);
  return false;
}

PyObject* decode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("decode", nargs, 12)) return nullptr;
  void* a[7];  // entry, prepared, q, k, v, out, lse
  if (!addresses(args, 7, a)) return nullptr;
  const double logit_scale = PyFloat_AsDouble(args[7]), v_scale = PyFloat_AsDouble(args[8]);
  const long window_left = PyLong_AsLong(args[9]);
  void* stream = address(args[10]);
  const int pdl = PyObject_IsTrue(args[11]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.decode(): null entry");
    return nullptr;
  }
  const int code = reinterpret_cast<fij_decode_fast_fn>(a[0])(
      a[1], a[2], a[3], a[4], a[5], static_cast<float*>(a[6]), static_cast<float>(logit_scale),
      static_cast<float>(v_scale), static_cast<int>(window_left), stream, pdl);
  return PyLong_FromLong(code);
}

PyObject* prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("prefill", nargs, 14)) return nullptr;
  void* a[8];  // entry, prepared, q, k, v, out, lse, sinks
  if (!addresses(args, 8, a)) return nullptr;
  const double logit_scale = PyFloat_AsDouble(args[8]), soft_cap_log2 = PyFloat_AsDouble(args[9]);
  const double v_scale = PyFloat_AsDouble(args[10]);
  const long window_left = PyLong_AsLong(args[11]);
  void* stream = address(args[12]);
  const int pdl = PyObject_IsTrue(args[13]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.prefill(): null entry");
    return nullptr;
  }
  const int code = reinterpret_cast<fij_prefill_fast_fn>(a[0])(
      a[1], a[2], a[3], a[4], a[5], static_cast<float*>(a[6]), static_cast<const float*>(a[7]),
      static_cast<float>(logit_scale), static_cast<float>(soft_cap_log2), static_cast<float>(v_scale),
      static_cast<int>(window_left), stream, pdl);
  return PyLong_FromLong(code);
}

PyMethodDef methods[] = {
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(decode)), METH_FASTCALL,
     "decode(entry, prepared, q, k, v, out, lse, logit_scale, v_scale, window_left, stream, pdl) -> int"},
    {"prefill", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prefill)), METH_FASTCALL,
     "prefill(entry, prepared, q, k, v, out, lse, sinks, logit_scale, soft_cap_log2, v_scale, window_left, stream, "
     "pdl) -> int"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fij_fastcall", "run()'s C launch entries, called without ctypes", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit_fij_fastcall(void) { return PyModule_Create(&module); }
