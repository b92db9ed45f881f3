// What the translation units of the fij_fastcall extension share (csrc/runtime/fastcall.cc, the
// module and the families' callers; csrc/pod/pod_fastcall.cc, POD's): reading Python ints as
// addresses, the argument count, a tensor's signature words and plan()'s host index vectors.
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

namespace fij_fastcall {

// An address from a Python int (0: null); nullptr with a Python error set for a negative
// or too large int, or not an int.
inline void* address(PyObject* arg) {
  const unsigned long long value = PyLong_AsUnsignedLongLong(arg);
  return value == static_cast<unsigned long long>(-1) && PyErr_Occurred() ? nullptr
                                                                          : reinterpret_cast<void*>(value);
}

// args[0 .. n) as addresses; false with a Python error set
inline bool addresses(PyObject* const* args, int n, void** out) {
  for (int i = 0; i < n; ++i) {
    out[i] = address(args[i]);
    if (out[i] == nullptr && PyErr_Occurred()) return false;
  }
  return true;
}

inline bool arity(const char* name, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "fij_fastcall.%s(): expected %zd arguments, got %zd", name, want, got);
  return false;
}

// A tensor's signature words: dim, sizes, strides, dtype, device type and index. At most
// kMaxDims dims; false for anything else (not an exact torch.Tensor, more dims).
constexpr int kMaxDims = 6, kTensorWords = 4 + 2 * kMaxDims;

inline bool describe(PyObject* obj, int64_t* w) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  const int64_t dim = t.dim();
  if (dim > kMaxDims) return false;
  std::memset(w, 0, sizeof(int64_t) * kTensorWords);
  w[0] = dim;
  const auto sizes = t.sizes(), strides = t.strides();
  for (int64_t i = 0; i < dim; ++i) {
    w[1 + i] = sizes[i];
    w[1 + kMaxDims + i] = strides[i];
  }
  w[1 + 2 * kMaxDims] = static_cast<int64_t>(t.scalar_type());
  w[2 + 2 * kMaxDims] = static_cast<int64_t>(t.device().type());
  w[3 + 2 * kMaxDims] = t.device().index();
  return true;
}

// A 1-D contiguous integer CPU tensor of plan()'s index vectors, read as int64 whether it
// holds int32 or int64 (exact torch.Tensor only; `wide` says which).
struct HostIndex {
  const void* data = nullptr;
  int64_t size = 0;
  bool wide = false;
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// false for anything else; int64 only where `wide_ok`
inline bool host_index(PyObject* obj, bool wide_ok, HostIndex& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  const auto type = t.scalar_type();
  if (t.dim() != 1 || !t.is_cpu() || !t.is_contiguous() ||
      !(type == at::ScalarType::Int || (wide_ok && type == at::ScalarType::Long)))
    return false;
  out.data = t.data_ptr();
  out.size = t.size(0);
  out.wide = type == at::ScalarType::Long;
  return true;
}

// Each request's keys of a CSR page table: (pages - 1) x page_size + the last page's, 0 without
// pages (flashinfer_jit/runtime/page_table.py csr_kv_lens_host)
inline int64_t csr_len(const HostIndex& indptr, const HostIndex& last, int64_t r, int64_t page_size) {
  const int64_t pages = indptr[r + 1] - indptr[r];
  return pages > 0 ? (pages - 1) * page_size + last[r] : 0;
}

// POD's callers (csrc/pod/pod_fastcall.cc), added to the module at its import
extern PyMethodDef pod_methods[];

}  // namespace fij_fastcall
