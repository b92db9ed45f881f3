// POD's callers in the fij_fastcall extension (flashinfer_jit/pod/, docs/pod.md "Host time"):
// run()'s fast path and plan()'s per-request arithmetic, on the tensors as they came.
//
//   pod_signature(q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, lse_d, rows_p, rows_d, want_lse)
//       -> bytes, or None where an argument is of another form
//   pod_run(entry, prepared, signature, <pod_signature's arguments>, pdl)
//       -> (out_p, out_d, lse_p, lse_d), or an int: -1 not the signature (or not aligned), -2 not
//          on a CUDA device, FIJ_FAST_CAPTURING (-3) the stream captures a graph, > 0 the
//          entry's cudaError_t
//     A side reads q rows from `rows`; kv: a (k, v) tuple or one [pages, 2, ...] tensor; an
//     out or lse given (a tensor) is written from row `rows`, None is allocated like that
//     side's q (contiguous; for an lse only where bit 0 (prefill) / 1 (decode) of want_lse is
//     set, else none is written): one allocation for both sides where q_p is q_d (a mixed
//     batch's, BatchAttention's). The signature holds each tensor's signature words, the
//     rows, want_lse and which arguments are the same object; pod_run launches
//     <namespace>_pod_fast (csrc/runtime/fast_entry.h) only for the signature the op recorded.
//
//   pod_rerun(relaunch, prepared, signature, plan, bounds, counts, <pod_signature's arguments>)
//   pod_prepare(relaunch, prepared, signature, plan, rows, offsets, counts)
//       the first run() after a plan() that kept the record (POD on Hopper): resolved from the
//       call's tensors and launched, or resolved in the plan() for the rows it implies (below).
//
//   pod_work(qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d, last_page_len_d,
//            qo_indptr_d or None, page_size) -> (sum q k, sum q (2k - q + 1)+, sum k_d, decode ok,
//            max k_d)
//       the prefill side's attention work, non-causal and twice the causal count of visible
//       keys, the decode side's keys, whether qo_indptr_d is arange(batch + 1), and the
//       decode side's longest request in keys; exact
//       integers, the same as flashinfer_jit/pod/wrapper.py's numpy. -1 where a vector is not
//       a contiguous 1-D int32 CPU tensor of its batch's length (a last_page_len may be
//       longer: a CUDA-graph wrapper's buffer).
//
//   batch_split(qo_indptr, kv_indptr, kv_len_arr, page_size, decode_ok) -> tuple, or -1
//       BatchAttention's cut (flashinfer_jit/pod/batch_attention.py cut_batch, the same values):
//       (decodes, prefills, rows, pages, decode_rows, prefill_rows, perm, decode (indptr,
//       last_page_len, pages), prefill (qo_indptr, indptr, last_page_len, pages)); rows (start,
//       end) or None, perm int64 or None, a side's pages (first, end) of kv_indices or their
//       int64 positions. -1 where a vector is not a contiguous 1-D int32 or int64
//       CPU tensor or a value is out of its rule (the numpy path then raises its error).
//   pod_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, kv_indices) -> tuple, or -1
//       batch_split's cut of a POD step of the common form, with both sides' page ids and
//       pod_work's sums (below).
#include <ATen/EmptyTensor.h>  // at::detail::empty_cpu
#include <ATen/ops/empty.h>  // at::empty: not reached through the torch/python headers in every torch (2.11)
#include <c10/core/impl/VirtualGuardImpl.h>

#include <vector>

#include "runtime/fast_entry.h"
#include "runtime/fastcall_common.h"

namespace {

using fij_fastcall::HostIndex;
using fij_fastcall::kTensorWords;

constexpr int kSideArgs = 4;  // q, kv, out, lse of a side
// Words: per side q, k, v, out, lse; then rows_p, rows_d, want_lse, the aliases
constexpr int kSigWords = 2 * 5 * kTensorWords + 4;
constexpr int64_t kNone = -1, kOneTensor = -2;  // a slot's dim word: None; v of a [pages, 2, ...] cache

struct Side {
  PyObject* q;
  PyObject* kv;
  PyObject* out;
  PyObject* lse;
  int64_t rows;
};

void none_words(int64_t* w, int64_t dim) {
  std::memset(w, 0, sizeof(int64_t) * kTensorWords);
  w[0] = dim;
}

// A side's words; false where an argument is of another form.
bool side_words(const Side& s, int64_t* w) {
  if (!fij_fastcall::describe(s.q, w)) return false;
  w += kTensorWords;
  if (PyTuple_CheckExact(s.kv) && PyTuple_GET_SIZE(s.kv) == 2) {
    if (!fij_fastcall::describe(PyTuple_GET_ITEM(s.kv, 0), w) ||
        !fij_fastcall::describe(PyTuple_GET_ITEM(s.kv, 1), w + kTensorWords))
      return false;
  } else {
    if (!fij_fastcall::describe(s.kv, w) || w[0] < 2) return false;
    none_words(w + kTensorWords, kOneTensor);
  }
  w += 2 * kTensorWords;
  for (PyObject* t : {s.out, s.lse}) {
    if (t == Py_None) {
      none_words(w, kNone);
    } else if (!fij_fastcall::describe(t, w)) {
      return false;
    }
    w += kTensorWords;
  }
  return true;
}

// args: q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, lse_d, rows_p, rows_d, want_lse
bool read_sides(PyObject* const* args, Side* sides, int64_t* want_lse) {
  sides[0] = {args[0], args[1], args[4], args[6], PyLong_AsLongLong(args[8])};
  sides[1] = {args[2], args[3], args[5], args[7], PyLong_AsLongLong(args[9])};
  *want_lse = PyLong_AsLongLong(args[10]);
  return !PyErr_Occurred();
}

bool signature_words(const Side* sides, int64_t want_lse, int64_t* w) {
  if (!side_words(sides[0], w) || !side_words(sides[1], w + 5 * kTensorWords)) return false;
  int64_t* tail = w + 10 * kTensorWords;
  tail[0] = sides[0].rows;
  tail[1] = sides[1].rows;
  tail[2] = want_lse;
  tail[3] = (sides[0].q == sides[1].q) | (sides[0].out == sides[1].out) << 1 | (sides[0].lse == sides[1].lse) << 2;
  return true;
}

constexpr Py_ssize_t kSignatureArgs = 11;

PyObject* pod_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_signature", nargs, kSignatureArgs)) return nullptr;
  Side sides[2];
  int64_t want_lse = 0, w[kSigWords];
  if (!read_sides(args, sides, &want_lse)) return nullptr;
  try {
    if (!signature_words(sides, want_lse, w)) Py_RETURN_NONE;
  } catch (const std::exception&) {  // a tensor torch cannot describe here: no fast path
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(w));
}

// A row of a [rows, ...] tensor: its address (the signature fixed the stride)
void* row(const at::Tensor& t, int64_t rows) {
  return static_cast<char*>(t.data_ptr()) + rows * t.stride(0) * static_cast<int64_t>(t.element_size());
}

struct Launch {
  void* ptr[10];             // csrc/runtime/fast_entry.h fij_pod_fast_fn's tensors
  PyObject* result[4] = {};  // out_p, out_d, lse_p, lse_d (new references)
  ~Launch() {
    for (PyObject* r : result) Py_XDECREF(r);
  }
};

// A new tuple of `size` items whose first four are l's results (the tuple takes their
// references; the rest are left for the caller); null on failure.
PyObject* results_tuple(Launch& l, Py_ssize_t size) {
  PyObject* result = PyTuple_New(size);
  if (result == nullptr) return nullptr;
  for (int i = 0; i < 4; ++i) {
    PyTuple_SET_ITEM(result, i, l.result[i]);
    l.result[i] = nullptr;
  }
  return result;
}

// An output of a side (a new reference; its address from row `rows` into *ptr): the given
// tensor, or a new one shaped like q (an lse: [rows, heads] float32) where `make`, the other
// side's where `shared` is it, else None (a null address: nothing written).
PyObject* output(PyObject* given, const at::Tensor& q, int64_t rows, bool make, bool lse, PyObject* shared,
                 void** ptr) {
  if (given != Py_None) {
    *ptr = row(THPVariable_Unpack(given), rows);
    Py_INCREF(given);
    return given;
  }
  if (!make) {
    *ptr = nullptr;
    Py_INCREF(Py_None);
    return Py_None;
  }
  if (shared != nullptr) {
    *ptr = row(THPVariable_Unpack(shared), rows);
    Py_INCREF(shared);
    return shared;
  }
  at::Tensor t = lse ? at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat)) : at::empty(q.sizes(), q.options());
  *ptr = row(t, rows);
  return THPVariable_Wrap(std::move(t));
}

// The addresses of a side's q, k, v, out and lse into ptr[0..5); false where one is not
// aligned as the kernels need (16 bytes; an lse 4).
bool side_pointers(const Side& s, int side, int64_t want_lse, const Side& other, Launch& l, void** ptr) {
  const at::Tensor& q = THPVariable_Unpack(s.q);
  ptr[0] = row(q, s.rows);
  if (PyTuple_CheckExact(s.kv)) {
    ptr[1] = THPVariable_Unpack(PyTuple_GET_ITEM(s.kv, 0)).data_ptr();
    ptr[2] = THPVariable_Unpack(PyTuple_GET_ITEM(s.kv, 1)).data_ptr();
  } else {  // [pages, 2, ...]: K at index 0 of dim 1, V at 1
    const at::Tensor& kv = THPVariable_Unpack(s.kv);
    ptr[1] = kv.data_ptr();
    ptr[2] = static_cast<char*>(ptr[1]) + kv.stride(1) * static_cast<int64_t>(kv.element_size());
  }
  const bool same_q = s.q == other.q;
  // (the decode side, second, shares the prefill side's allocation where q is one tensor)
  PyObject* shared_out = side == 1 && same_q && s.out == Py_None && other.out == Py_None ? l.result[0] : nullptr;
  PyObject* shared_lse = side == 1 && same_q && s.lse == Py_None && other.lse == Py_None ? l.result[2] : nullptr;
  l.result[side] = output(s.out, q, s.rows, true, false, shared_out, &ptr[3]);
  l.result[2 + side] = output(s.lse, q, s.rows, (want_lse >> side) & 1, true, shared_lse, &ptr[4]);
  for (int i = 0; i < 4; ++i)
    if (reinterpret_cast<uintptr_t>(ptr[i]) % 16 != 0) return false;
  return reinterpret_cast<uintptr_t>(ptr[4]) % 4 == 0;
}

PyObject* pod_run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_run", nargs, 3 + kSignatureArgs + 1)) return nullptr;
  void* a[2];  // entry, prepared
  if (!fij_fastcall::addresses(args, 2, a)) return nullptr;
  PyObject* signature = args[2];
  if (!PyBytes_Check(signature) || PyBytes_GET_SIZE(signature) != kSigWords * 8) {
    PyErr_SetString(PyExc_TypeError, "fij_fastcall.pod_run(): signature: expected pod_signature()'s bytes");
    return nullptr;
  }
  Side sides[2];
  int64_t want_lse = 0;
  if (!read_sides(args + 3, sides, &want_lse)) return nullptr;
  const int pdl = PyObject_IsTrue(args[3 + kSignatureArgs]);
  if (pdl < 0) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.pod_run(): null entry or prepared launch");
    return nullptr;
  }
  Launch l;
  void* stream = nullptr;
  try {
    int64_t w[kSigWords];
    if (!signature_words(sides, want_lse, w) || std::memcmp(w, PyBytes_AS_STRING(signature), sizeof(w)) != 0)
      return PyLong_FromLong(-1);
    const at::Tensor& q = THPVariable_Unpack(sides[0].q);
    if (!q.is_cuda()) return PyLong_FromLong(-2);
    if (!side_pointers(sides[0], 0, want_lse, sides[1], l, l.ptr) ||
        !side_pointers(sides[1], 1, want_lse, sides[0], l, l.ptr + 5))
      return PyLong_FromLong(-1);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    stream = impl.getStream(q.device()).native_handle();
  } catch (const std::exception&) {  // a tensor torch cannot describe or allocate here: the op decides
    return PyLong_FromLong(-1);
  }
  const int code = reinterpret_cast<fij_pod_fast_fn>(a[0])(a[1], l.ptr, stream, pdl);
  if (code != 0) return PyLong_FromLong(code);
  return results_tuple(l, 4);
}

// --- run()'s first call after a plan(): pod_rerun ------------------------------------------------

// Whether the call's words `w` equal the record's `old` but for what a plan() changes: each
// side's q, out and lse rows (dim 0 of each, where given) and the row offsets.
bool same_but_rows(const int64_t* w, const int64_t* old) {
  for (int side = 0; side < 2; ++side) {
    for (int slot = 0; slot < 5; ++slot) {
      const int64_t* a = w + (side * 5 + slot) * kTensorWords;
      const int64_t* b = old + (side * 5 + slot) * kTensorWords;
      const bool rows = slot == 0 || slot >= 3;  // q, out, lse
      for (int i = 0; i < kTensorWords; ++i)
        if (a[i] != b[i] && !(rows && i == 1 && a[0] >= 1)) return false;
    }
  }
  const int64_t* ta = w + 10 * kTensorWords;
  const int64_t* tb = old + 10 * kTensorWords;
  return ta[2] == tb[2] && ta[3] == tb[3];  // want_lse, the aliases
}

// The plan's arguments (flashinfer_jit/pod/wrapper.py _Pod._relaunch_plan): 11 tensors (the
// page table a tuple of them, merge_counters_d a tensor or None), then 4 floats and 5 ints.
constexpr Py_ssize_t kPlanItems = 20;

// A view of t's storage (sizes, strides, an element offset from t's) made without the
// dispatcher: at::select and at::narrow cost ~1-2 us each on the GPU host, and pod_rerun needs up
// to ten (each side's K and V of a [pages, 2, ...] cache, a mixed batch's q, out and lse rows).
// The view only carries the op's shapes and addresses into resolve_and_launch.
at::Tensor view_of(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

// t[off : off + n] along dim 0 (t itself where that is all of it)
at::Tensor rows_view(const at::Tensor& t, int64_t off, int64_t n) {
  if (off == 0 && n == t.size(0)) return t;
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes[0] = n;
  return view_of(t, sizes, t.strides(), off * t.stride(0));
}

// t.select(1, i) of a [pages, 2, ...] cache: K (0) or V (1)
at::Tensor kv_view(const at::Tensor& t, int64_t i) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end());
  sizes.erase(sizes.begin() + 1);
  strides.erase(strides.begin() + 1);
  return view_of(t, sizes, strides, i * t.stride(1));
}

bool plan_tensor(PyObject* obj, const void** slot) {
  if (obj == Py_None) {
    *slot = nullptr;
    return true;
  }
  if (!THPVariable_Check(obj)) return false;
  *slot = &THPVariable_Unpack(obj);
  return true;
}

// The plan's arguments as <namespace>_pod_relaunch takes them (read from the plan tuple).
struct PlanArgs {
  double reals[4];
  long long ints[6];  // _relaunch_plan's five, then the entry's launch flag
  const void* tensors[8];  // the plan's items kPlanSlot: t[10..17] of the entry's array
  const void* tables[8];
  const at::Tensor* empty_lse[2];  // each side's empty lse (an lse not written)
  int n_tables = 0;
};

// false where the plan tuple is not of _relaunch_plan's form (the caller returns -1); a
// Python error set (a value of another type) returns false too, with PyErr_Occurred().
bool read_plan(PyObject* plan, PlanArgs& p) {
  for (int i = 0; i < 4; ++i) p.reals[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(plan, 11 + i));
  for (int i = 0; i < 5; ++i) p.ints[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 15 + i));
  p.ints[5] = 1;
  if (PyErr_Occurred()) return false;
  for (int i : {0, 1, 2, 4, 5, 6, 7, 8, 10})  // (the plan's tensors; 9 may be None)
    if (!THPVariable_Check(PyTuple_GET_ITEM(plan, i))) return false;
  static constexpr int kPlanSlot[8] = {0, 1, 4, 5, 7, 8, 9, 10};  // plan items -> t[10..17]
  for (int i = 0; i < 8; ++i)
    if (!plan_tensor(PyTuple_GET_ITEM(plan, kPlanSlot[i]), &p.tensors[i]) || (p.tensors[i] == nullptr && i != 6))
      return false;
  PyObject* tables = PyTuple_GET_ITEM(plan, 3);
  if (!PyTuple_CheckExact(tables) || PyTuple_GET_SIZE(tables) > 8) return false;
  p.n_tables = static_cast<int>(PyTuple_GET_SIZE(tables));
  for (int i = 0; i < p.n_tables; ++i)
    if (!plan_tensor(PyTuple_GET_ITEM(tables, i), &p.tables[i]) || p.tables[i] == nullptr) return false;
  p.empty_lse[0] = &THPVariable_Unpack(PyTuple_GET_ITEM(plan, 2));
  p.empty_lse[1] = &THPVariable_Unpack(PyTuple_GET_ITEM(plan, 6));
  return true;
}

// Each side's q, k, v, out and lse as the op takes them (q, out and lse: the side's rows
// [off, off + n) of the whole tensors; lse undefined: not written, the plan's empty tensor),
// then <namespace>_pod_relaunch: resolve, record into `prepared`, and launch unless `launch`
// is false. Returns the entry's code.
int relaunch(void* entry, void* prepared, const at::Tensor* q, const at::Tensor (*kv)[2], const at::Tensor* out,
             const at::Tensor* lse, const int64_t* off, const int64_t* n, PlanArgs& p, bool launch) {
  at::Tensor side_t[2][5];
  for (int s = 0; s < 2; ++s) {
    side_t[s][0] = rows_view(q[s], off[s], n[s]);
    side_t[s][1] = kv[s][0];
    side_t[s][2] = kv[s][1];
    side_t[s][3] = rows_view(out[s], off[s], n[s]);
    side_t[s][4] = lse[s].defined() ? rows_view(lse[s], off[s], n[s]) : *p.empty_lse[s];
  }
  const void* t[18 + 8];
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 5; ++i) t[5 * s + i] = &side_t[s][i];
  for (int i = 0; i < 8; ++i) t[10 + i] = p.tensors[i];
  for (int i = 0; i < p.n_tables; ++i) t[18 + i] = p.tables[i];
  p.ints[5] = launch ? 1 : 0;
  return reinterpret_cast<fij_pod_relaunch_fn>(entry)(prepared, t, p.n_tables, p.reals, p.ints);
}

// A side's K and V as the op takes them: the tuple's two tensors, or views of a [pages, 2,
// ...] cache (K at index 0 of dim 1, V at 1)
void kv_pair(const at::Tensor& k_or_cache, const at::Tensor* v, at::Tensor* kv) {
  if (v != nullptr) {
    kv[0] = k_or_cache;
    kv[1] = *v;
  } else {
    kv[0] = kv_view(k_or_cache, 0);
    kv[1] = kv_view(k_or_cache, 1);
  }
}

// pod_rerun(relaunch, prepared, signature, plan, bounds, counts, <pod_signature's arguments>)
//   -> (out_p, out_d, lse_p, lse_d, signature), or an int: -1 not of the record's form but for
//   the rows (or rows outside `bounds`, or refused by the entry: the op decides), -2 not on a
//   CUDA device, FIJ_FAST_CAPTURING (-3) the stream captures a graph, > 0 a cudaError_t.
// The record's `signature` was taken by a call through the op, whose checks all passed; a
// call whose tensors differ from it only in their rows (and whose rows fit the new plan:
// bounds (lo_p, hi_p, lo_d, hi_d) on each side's q rows as given) passes them too. counts: each
// side's rows from its offset (-1: to the end of its q). The entry <namespace>_pod_relaunch
// resolves the launch from the call's tensors and the plan, records it into `prepared` and
// launches it; the returned signature is the call's, which pod_run then takes.
PyObject* pod_rerun(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_rerun", nargs, 6 + kSignatureArgs)) return nullptr;
  void* a[2];  // relaunch entry, prepared
  if (!fij_fastcall::addresses(args, 2, a)) return nullptr;
  PyObject *signature = args[2], *plan = args[3], *bounds = args[4], *counts = args[5];
  if (!PyBytes_Check(signature) || PyBytes_GET_SIZE(signature) != kSigWords * 8 || !PyTuple_CheckExact(plan) ||
      PyTuple_GET_SIZE(plan) != kPlanItems || !PyTuple_CheckExact(bounds) || PyTuple_GET_SIZE(bounds) != 4 ||
      !PyTuple_CheckExact(counts) || PyTuple_GET_SIZE(counts) != 2 || a[0] == nullptr || a[1] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "fij_fastcall.pod_rerun(): expected (relaunch, prepared, signature bytes, "
                                     "plan tuple of 20, bounds tuple of 4, counts tuple of 2, ...)");
    return nullptr;
  }
  Side sides[2];
  int64_t want_lse = 0, lim[4], cnt[2];
  if (!read_sides(args + 6, sides, &want_lse)) return nullptr;
  for (int i = 0; i < 4; ++i) lim[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
  for (int i = 0; i < 2; ++i) cnt[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(counts, i));
  if (PyErr_Occurred()) return nullptr;
  PlanArgs p;
  if (!read_plan(plan, p)) return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
  Launch l;
  int64_t w[kSigWords];
  int code = -1;
  try {
    if (!signature_words(sides, want_lse, w) ||
        !same_but_rows(w, reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(signature))))
      return PyLong_FromLong(-1);
    at::Tensor q[2], kv[2][2], out[2], lse[2];
    int64_t off[2], rows[2];
    for (int s = 0; s < 2; ++s) {
      q[s] = THPVariable_Unpack(sides[s].q);
      off[s] = sides[s].rows;
      rows[s] = cnt[s] >= 0 ? cnt[s] : q[s].size(0) - off[s];
      if (q[s].size(0) < lim[2 * s] || q[s].size(0) > lim[2 * s + 1] || off[s] < 0 || rows[s] < 0 ||
          off[s] + rows[s] > q[s].size(0))
        return PyLong_FromLong(-1);
      for (PyObject* given : {sides[s].out, sides[s].lse})  // (a given output: q's rows, as the op path checks)
        if (given != Py_None && THPVariable_Unpack(given).size(0) != q[s].size(0)) return PyLong_FromLong(-1);
    }
    if (rows[0] == 0 && rows[1] == 0) return PyLong_FromLong(-1);  // (nothing to launch: the op path's case)
    if (!q[0].is_cuda()) return PyLong_FromLong(-2);
    if (!side_pointers(sides[0], 0, want_lse, sides[1], l, l.ptr) ||
        !side_pointers(sides[1], 1, want_lse, sides[0], l, l.ptr + 5))
      return PyLong_FromLong(-1);
    for (int s = 0; s < 2; ++s) {
      if (s == 1 && sides[1].kv == sides[0].kv) {  // one cache for both sides (BatchAttention): its views
        kv[1][0] = kv[0][0];
        kv[1][1] = kv[0][1];
      } else if (PyTuple_CheckExact(sides[s].kv)) {
        const at::Tensor& v = THPVariable_Unpack(PyTuple_GET_ITEM(sides[s].kv, 1));
        kv_pair(THPVariable_Unpack(PyTuple_GET_ITEM(sides[s].kv, 0)), &v, kv[s]);
      } else {
        kv_pair(THPVariable_Unpack(sides[s].kv), nullptr, kv[s]);
      }
      out[s] = THPVariable_Unpack(l.result[s]);
      if (l.result[2 + s] != Py_None) lse[s] = THPVariable_Unpack(l.result[2 + s]);
    }
    code = relaunch(a[0], a[1], q, kv, out, lse, off, rows, p, true);
  } catch (const std::exception&) {  // a tensor torch cannot describe, allocate or view here: the op decides
    return PyLong_FromLong(-1);
  }
  if (code != 0) return PyLong_FromLong(code);
  PyObject* result = results_tuple(l, 5);
  if (result == nullptr) return nullptr;
  PyObject* sig = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(w));
  if (sig == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 4, sig);
  return result;
}

// --- run()'s first call after a plan(), resolved by the plan(): pod_prepare ----------------------

// A tensor of a signature's words at `address` (nothing is allocated, and nothing reads it: it
// carries a shape, strides, a dtype and a device into the entry's resolution, whose addresses
// pod_run replaces)
at::Tensor described(const int64_t* w, uintptr_t address) {
  const int64_t dim = w[0];
  const auto dtype = static_cast<at::ScalarType>(w[1 + 2 * fij_fastcall::kMaxDims]);
  const c10::Device device(static_cast<c10::DeviceType>(w[2 + 2 * fij_fastcall::kMaxDims]),
                           static_cast<c10::DeviceIndex>(w[3 + 2 * fij_fastcall::kMaxDims]));
  const c10::IntArrayRef sizes(w + 1, dim), strides(w + 1 + fij_fastcall::kMaxDims, dim);
  int64_t span = 1;  // (elements from the first to one past the last)
  for (int64_t i = 0; i < dim; ++i) span += sizes[i] > 0 ? (sizes[i] - 1) * strides[i] : 0;
  const int64_t bytes = span * static_cast<int64_t>(c10::elementSize(dtype));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes,
                       c10::DataPtr(reinterpret_cast<void*>(address), device), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::computeDispatchKey(dtype, at::kStrided,
                                                                                               device),
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_sizes_and_strides(sizes, strides);
  return at::Tensor(std::move(impl));
}

// pod_prepare(relaunch, prepared, signature, plan, rows, offsets, counts) -> bytes, or -1
//   After a plan() that kept run()'s record: the launch of the next run() resolved now, for a
//   call of the record's form whose q tensors hold rows = (rows_p, rows_d) rows (outputs
//   given: as many), each side read from offsets (off_p, off_d), counts (each side's rows
//   from its offset, -1: to the end) as pod_rerun takes them: the entry resolves it from
//   tensors described by the signature and the plan, without launching, into `prepared`, and
//   the returned signature is that call's, which pod_run takes (its addresses replace the
//   described ones). -1 where the signature or the plan is of another form or the entry
//   refuses (the record is then unchanged, and the run() takes pod_rerun).
PyObject* pod_prepare(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_prepare", nargs, 7)) return nullptr;
  void* a[2];  // relaunch entry, prepared
  if (!fij_fastcall::addresses(args, 2, a)) return nullptr;
  PyObject *signature = args[2], *plan = args[3];
  int64_t v[6];
  for (int i = 0; i < 3; ++i) {
    PyObject* pair = args[4 + i];
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
      PyErr_SetString(PyExc_TypeError, "fij_fastcall.pod_prepare(): rows, offsets, counts: expected pairs");
      return nullptr;
    }
    v[2 * i] = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
    v[2 * i + 1] = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
  }
  if (PyErr_Occurred()) return nullptr;
  if (!PyBytes_Check(signature) || PyBytes_GET_SIZE(signature) != kSigWords * 8 || !PyTuple_CheckExact(plan) ||
      PyTuple_GET_SIZE(plan) != kPlanItems || a[0] == nullptr || a[1] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "fij_fastcall.pod_prepare(): expected (relaunch, prepared, signature bytes, "
                                     "plan tuple of 20, rows, offsets, counts)");
    return nullptr;
  }
  PlanArgs p;
  if (!read_plan(plan, p)) return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
  int64_t w[kSigWords];
  std::memcpy(w, PyBytes_AS_STRING(signature), sizeof(w));
  const int64_t* tail = w + 10 * kTensorWords;
  const int64_t want_lse = tail[2], aliases = tail[3];
  int64_t off[2], rows[2];
  for (int s = 0; s < 2; ++s) {
    off[s] = v[2 + s];
    rows[s] = v[4 + s] >= 0 ? v[4 + s] : v[s] - off[s];
    if (v[s] < 1 || off[s] < 0 || rows[s] < 0 || off[s] + rows[s] > v[s]) return PyLong_FromLong(-1);
  }
  if (rows[0] == 0 && rows[1] == 0) return PyLong_FromLong(-1);
  // the call's words: the record's with each side's q, out and lse rows and the offsets
  for (int s = 0; s < 2; ++s) {
    for (int slot : {0, 3, 4}) {
      int64_t* t = w + (s * 5 + slot) * kTensorWords;
      if (t[0] >= 1) t[1] = v[s];
      else if (slot == 0) return PyLong_FromLong(-1);
    }
    w[10 * kTensorWords + s] = off[s];
  }
  if ((aliases & 1) && v[0] != v[1]) return PyLong_FromLong(-1);  // (one q for both sides: one row count)
  int code = -1;
  try {
    // described tensors at distinct 256-byte aligned addresses (the entry checks alignment)
    uintptr_t next = uintptr_t(1) << 32;
    const auto at_next = [&next](const int64_t* words) {
      at::Tensor t = described(words, next);
      next += (static_cast<uintptr_t>(t.storage().nbytes()) + 511) & ~uintptr_t(255);
      return t;
    };
    at::Tensor q[2], kv[2][2], out[2], lse[2];
    for (int s = 0; s < 2; ++s) {
      const int64_t* ws = w + s * 5 * kTensorWords;
      q[s] = s == 1 && (aliases & 1) ? q[0] : at_next(ws);
      const int64_t* wk = ws + kTensorWords;
      if (s == 1 && std::memcmp(wk, w + kTensorWords, 2 * kTensorWords * sizeof(int64_t)) == 0) {
        kv[1][0] = kv[0][0];  // (one cache for both sides, as far as the words tell: its views)
        kv[1][1] = kv[0][1];
      } else if (wk[kTensorWords] == kOneTensor) {
        kv_pair(at_next(wk), nullptr, kv[s]);
      } else {
        const at::Tensor v_t = at_next(wk + kTensorWords);
        kv_pair(at_next(wk), &v_t, kv[s]);
      }
      // outputs: given (their words), else allocated like q (shared where q is one tensor)
      const bool shared_out = s == 1 && (aliases & 1) && ws[3 * kTensorWords] == kNone &&
                              w[3 * kTensorWords] == kNone;
      const bool shared_lse = s == 1 && (aliases & 1) && ws[4 * kTensorWords] == kNone &&
                              w[4 * kTensorWords] == kNone;
      if (ws[3 * kTensorWords] != kNone) {
        out[s] = (s == 1 && (aliases & 2)) ? out[0] : at_next(ws + 3 * kTensorWords);
      } else if (shared_out) {
        out[s] = out[0];
      } else {
        int64_t ow[kTensorWords];
        std::memcpy(ow, ws, sizeof(ow));
        for (int64_t i = ow[0] - 1, stride = 1; i >= 0; --i) {  // (contiguous, as pod_run allocates it)
          ow[1 + fij_fastcall::kMaxDims + i] = stride;
          stride *= ow[1 + i];
        }
        out[s] = at_next(ow);
      }
      if (ws[4 * kTensorWords] != kNone) {
        lse[s] = (s == 1 && (aliases & 4)) ? lse[0] : at_next(ws + 4 * kTensorWords);
      } else if (shared_lse && lse[0].defined()) {
        lse[s] = lse[0];
      } else if ((want_lse >> s) & 1) {
        int64_t lw[kTensorWords];
        std::memcpy(lw, ws, sizeof(lw));
        lw[0] = 2;
        lw[1 + fij_fastcall::kMaxDims] = lw[2];  // [rows, heads] float32, contiguous
        lw[2 + fij_fastcall::kMaxDims] = 1;
        lw[1 + 2 * fij_fastcall::kMaxDims] = static_cast<int64_t>(at::kFloat);
        lse[s] = at_next(lw);
      }
    }
    code = relaunch(a[0], a[1], q, kv, out, lse, off, rows, p, false);
  } catch (const std::exception&) {
    return PyLong_FromLong(-1);
  }
  if (code != 0) return PyLong_FromLong(-1);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(w));
}

using fij_fastcall::csr_len;

// A prefill request's terms of pod_work's sums: q x k, and q x (2k - q + 1) where positive
// (twice the keys a causal row sees on average). Unsigned: values a planner rejects may wrap,
// never overflow; every valid batch is far below 2^63.
inline void add_prefill_work(int64_t q, int64_t k, uint64_t& full, uint64_t& causal2) {
  const int64_t seen2 = 2 * k - q + 1;
  full += static_cast<uint64_t>(q * k);
  causal2 += seen2 > 0 ? static_cast<uint64_t>(q * seen2) : 0;
}

PyObject* pod_work(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_work", nargs, 7)) return nullptr;
  const int64_t page_size = PyLong_AsLongLong(args[6]);
  if (PyErr_Occurred()) return nullptr;
  HostIndex qo_p, kv_p, last_p, kv_d, last_d, qo_d;
  const bool given_d = args[5] != Py_None;
  try {
    if (!fij_fastcall::host_index(args[0], false, qo_p) || !fij_fastcall::host_index(args[1], false, kv_p) ||
        !fij_fastcall::host_index(args[2], false, last_p) || !fij_fastcall::host_index(args[3], false, kv_d) ||
        !fij_fastcall::host_index(args[4], false, last_d) ||
        (given_d && !fij_fastcall::host_index(args[5], false, qo_d)))
      return PyLong_FromLong(-1);
  } catch (const std::exception&) {
    return PyLong_FromLong(-1);
  }
  const int64_t batch_p = qo_p.size - 1, batch_d = kv_d.size - 1;
  if (batch_p < 0 || batch_d < 0 || kv_p.size != batch_p + 1 || last_p.size < batch_p || last_d.size < batch_d)
    return PyLong_FromLong(-1);
  uint64_t full = 0, causal2 = 0, keys_d = 0;
  for (int64_t r = 0; r < batch_p; ++r)
    add_prefill_work(qo_p[r + 1] - qo_p[r], csr_len(kv_p, last_p, r, page_size), full, causal2);
  int64_t longest_d = 0;
  for (int64_t r = 0; r < batch_d; ++r) {
    const int64_t k = csr_len(kv_d, last_d, r, page_size);
    keys_d += static_cast<uint64_t>(k);
    longest_d = k > longest_d ? k : longest_d;
  }
  bool decode_ok = true;
  if (given_d) {
    for (int64_t i = 1; i < qo_d.size && decode_ok; ++i) decode_ok = qo_d[i] - qo_d[i - 1] == 1;
  }
  return Py_BuildValue("(KKKOL)", static_cast<unsigned long long>(full), static_cast<unsigned long long>(causal2),
                       static_cast<unsigned long long>(keys_d), decode_ok ? Py_True : Py_False,
                       static_cast<long long>(longest_d));
}

// A new 1-D CPU tensor of `n` int32 (int64 with `wide`) values (at::detail::empty_cpu: no
// dispatch, about half of at::empty's host time; BatchAttention.plan() makes five a call)
at::Tensor host_vector(int64_t n, bool wide) {
  return at::Tensor(at::detail::empty_cpu({n}, wide ? at::kLong : at::kInt));
}

// A side's CSR table cut from the batch's (_side_table): (indptr, last_page_len, pages) with
// pages (first, end) of kv_indices where the side's pages are one run of them, else their
// positions (int64); qo: its qo_indptr too (the prefill side).
// A side's CSR vectors into ip[n + 1], lp[n] and (where qp is given) qp[n + 1]; whether its
// pages are one run of kv_indices, [*first, *end).
bool fill_side(const std::vector<int64_t>& requests, const HostIndex& qo, const HostIndex& kv, const HostIndex& lens,
               int64_t page_size, int32_t* ip, int32_t* lp, int32_t* qp, int64_t* first, int64_t* end) {
  const int64_t n = static_cast<int64_t>(requests.size());
  ip[0] = 0;
  if (qp != nullptr) qp[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = requests[i], pages = kv[r + 1] - kv[r];
    ip[i + 1] = static_cast<int32_t>(ip[i] + pages);
    if (qp != nullptr) qp[i + 1] = static_cast<int32_t>(qp[i] + qo[r + 1] - qo[r]);
    lp[i] = static_cast<int32_t>(pages > 0 ? lens[r] - (pages - 1) * page_size : 0);
  }
  *first = n ? kv[requests[0]] : 0;
  *end = n ? kv[requests[n - 1] + 1] : 0;
  return *end - *first == ip[n];
}

PyObject* side_table(const std::vector<int64_t>& requests, const HostIndex& qo, const HostIndex& kv,
                     const HostIndex& lens, int64_t page_size, bool with_qo) {
  const int64_t n = static_cast<int64_t>(requests.size());
  at::Tensor indptr = host_vector(n + 1, false), last = host_vector(n, false);
  at::Tensor qo_side = with_qo ? host_vector(n + 1, false) : at::Tensor();  // (the decode side's: none)
  int64_t first, end;
  const bool run = fill_side(requests, qo, kv, lens, page_size, indptr.data_ptr<int32_t>(),
                             last.data_ptr<int32_t>(), with_qo ? qo_side.data_ptr<int32_t>() : nullptr, &first, &end);
  PyObject* pages;
  if (run) {
    pages = Py_BuildValue("(LL)", static_cast<long long>(first), static_cast<long long>(end));
  } else {
    at::Tensor where = host_vector(indptr.data_ptr<int32_t>()[n], true);
    int64_t* wp = where.data_ptr<int64_t>();
    for (const int64_t r : requests)
      for (int64_t j = kv[r]; j < kv[r + 1]; ++j) *wp++ = j;
    pages = THPVariable_Wrap(std::move(where));
  }
  if (pages == nullptr) return nullptr;
  if (with_qo)
    return Py_BuildValue("(NNNN)", THPVariable_Wrap(std::move(qo_side)), THPVariable_Wrap(std::move(indptr)),
                         THPVariable_Wrap(std::move(last)), pages);
  return Py_BuildValue("(NNN)", THPVariable_Wrap(std::move(indptr)), THPVariable_Wrap(std::move(last)), pages);
}

// false where a value breaks BatchAttention.plan()'s rules (its numpy checks raise then)
bool valid_batch(const HostIndex& qo, const HostIndex& kv, const HostIndex& lens, int64_t page_size) {
  if (qo[0] != 0 || kv[0] != 0) return false;
  for (int64_t r = 0; r < lens.size; ++r) {
    const int64_t pages = kv[r + 1] - kv[r], len = lens[r];
    if (qo[r + 1] < qo[r] || pages < 0 || len > pages * page_size || (pages > 0 && len <= (pages - 1) * page_size) ||
        (pages == 0 && len != 0))
      return false;
  }
  return true;
}

PyObject* rows_or_none(bool some, int64_t start, int64_t end) {
  if (!some) Py_RETURN_NONE;
  return Py_BuildValue("(LL)", static_cast<long long>(start), static_cast<long long>(end));
}

// A batch's requests by side: one-token requests (decode_ok) and the rest, in the batch's
// order; changes: how often the side changes between requests with rows; first_label: the
// side of the first request with rows (1: decode, 0: prefill, -1: none).
struct Split {
  std::vector<int64_t> decode, prefill;
  int changes = 0, first_label = -1;
};

Split split_requests(const HostIndex& qo, int64_t batch, bool decode_ok) {
  Split split;
  int label = -1;  // the side of the rows so far (-1: no row yet)
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t len = qo[r + 1] - qo[r];
    const bool is_decode = decode_ok && len == 1;
    (is_decode ? split.decode : split.prefill).push_back(r);
    if (len > 0) {
      split.changes += label >= 0 && label != static_cast<int>(is_decode);
      label = static_cast<int>(is_decode);
      if (split.first_label < 0) split.first_label = label;
    }
  }
  return split;
}

PyObject* batch_split(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("batch_split", nargs, 5)) return nullptr;
  const int64_t page_size = PyLong_AsLongLong(args[3]);
  const int decode_ok = PyObject_IsTrue(args[4]);
  if (PyErr_Occurred() || decode_ok < 0) return nullptr;
  HostIndex qo, kv, lens;
  try {
    if (!fij_fastcall::host_index(args[0], true, qo) || !fij_fastcall::host_index(args[1], true, kv) ||
        !fij_fastcall::host_index(args[2], true, lens))
      return PyLong_FromLong(-1);
  } catch (const std::exception&) {
    return PyLong_FromLong(-1);
  }
  const int64_t batch = lens.size;
  if (qo.size != batch + 1 || kv.size != batch + 1 || !valid_batch(qo, kv, lens, page_size))
    return PyLong_FromLong(-1);
  const Split split = split_requests(qo, batch, decode_ok);
  const std::vector<int64_t>&decode = split.decode, &prefill = split.prefill;
  const int changes = split.changes, first_label = split.first_label;
  const int64_t nd = static_cast<int64_t>(decode.size()), total = qo[batch];
  PyObject *decode_rows, *prefill_rows, *perm;
  try {
    if (nd == 0 || nd == total) {
      decode_rows = rows_or_none(nd > 0, 0, nd);
      prefill_rows = rows_or_none(!prefill.empty(), nd, total);
      perm = (Py_INCREF(Py_None), Py_None);
    } else if (changes == 1) {
      const bool first = first_label == 1;
      decode_rows = rows_or_none(true, first ? 0 : total - nd, first ? nd : total);
      prefill_rows = rows_or_none(true, first ? nd : 0, first ? total : total - nd);
      perm = (Py_INCREF(Py_None), Py_None);
    } else {
      decode_rows = (Py_INCREF(Py_None), Py_None);
      prefill_rows = (Py_INCREF(Py_None), Py_None);
      at::Tensor order = host_vector(total, true);
      int64_t* op = order.data_ptr<int64_t>();
      for (const auto* side : {&decode, &prefill})
        for (const int64_t r : *side)
          for (int64_t j = qo[r]; j < qo[r + 1]; ++j) *op++ = j;
      perm = THPVariable_Wrap(std::move(order));
    }
    PyObject* d = side_table(decode, qo, kv, lens, page_size, false);
    PyObject* p = side_table(prefill, qo, kv, lens, page_size, true);
    if (d == nullptr || p == nullptr) {
      for (PyObject* o : {decode_rows, prefill_rows, perm, d, p}) Py_XDECREF(o);
      return nullptr;
    }
    return Py_BuildValue("(LLLLNNNNN)", static_cast<long long>(nd), static_cast<long long>(prefill.size()),
                         static_cast<long long>(total), static_cast<long long>(kv[batch]), decode_rows, prefill_rows,
                         perm, d, p);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}


// pod_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, kv_indices) -> tuple, or -1
//   BatchAttention.plan()'s repeated POD step (flashinfer_jit/pod/batch_attention.py
//   _plan_pod_again): batch_split's tuple, with each side's pages (first, end), then each side's
//   page ids (a view of kv_indices: decode, prefill) and pod_work's tuple of the two sides. Only
//   for POD's common form: decodes taken, the decode requests and the chunks each one run of
//   the batch's rows (no perm) and of kv_indices' pages, both sides with rows, kv_indices a 1-D
//   int32 tensor holding the batch's pages; the five host vectors are views of one allocation.
//   -1 otherwise (the caller takes batch_split's path, which decides and raises).
PyObject* pod_cut(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!fij_fastcall::arity("pod_cut", nargs, 5)) return nullptr;
  const int64_t page_size = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  HostIndex qo, kv, lens;
  try {
    if (!fij_fastcall::host_index(args[0], true, qo) || !fij_fastcall::host_index(args[1], true, kv) ||
        !fij_fastcall::host_index(args[2], true, lens) || !THPVariable_CheckExact(args[4]))
      return PyLong_FromLong(-1);
  } catch (const std::exception&) {
    return PyLong_FromLong(-1);
  }
  const at::Tensor& ids = THPVariable_Unpack(args[4]);
  const int64_t batch = lens.size;
  if (ids.dim() != 1 || ids.scalar_type() != at::kInt || qo.size != batch + 1 || kv.size != batch + 1 ||
      !valid_batch(qo, kv, lens, page_size) || ids.size(0) < kv[batch])
    return PyLong_FromLong(-1);
  // the sides' requests: each one run of rows (one change of side between rows), both with rows
  const Split split = split_requests(qo, batch, true);
  const int64_t nd = static_cast<int64_t>(split.decode.size()), np = static_cast<int64_t>(split.prefill.size());
  const int64_t total = qo[batch];
  if (nd == 0 || nd == total || split.changes != 1) return PyLong_FromLong(-1);
  const bool decodes_first = split.first_label == 1;
  const int64_t d0 = decodes_first ? 0 : total - nd, p0 = decodes_first ? nd : 0;
  try {
    // [decode indptr nd + 1 | decode last nd | prefill qo np + 1 | prefill indptr np + 1 | prefill last np]
    at::Tensor buf = host_vector(3 * nd + 3 * np + 3, false);
    int32_t* const base = buf.data_ptr<int32_t>();
    int32_t *dip = base, *dlp = dip + nd + 1, *pqp = dlp + nd, *pip = pqp + np + 1, *plp = pip + np + 1;
    int64_t dfirst, dend, pfirst, pend;  // each side's pages one run of kv_indices
    if (!fill_side(split.decode, qo, kv, lens, page_size, dip, dlp, nullptr, &dfirst, &dend) ||
        !fill_side(split.prefill, qo, kv, lens, page_size, pip, plp, pqp, &pfirst, &pend))
      return PyLong_FromLong(-1);
    uint64_t full = 0, causal2 = 0, keys_d = 0;  // pod_work's sums of the two sides
    int64_t longest_d = 0;
    for (const int64_t r : split.decode) {
      keys_d += static_cast<uint64_t>(lens[r]);
      longest_d = lens[r] > longest_d ? lens[r] : longest_d;
    }
    for (const int64_t r : split.prefill) add_prefill_work(qo[r + 1] - qo[r], lens[r], full, causal2);
    const auto vec = [&buf, base](const int32_t* at, int64_t n) {
      return THPVariable_Wrap(view_of(buf, {n}, {1}, at - base));
    };
    const int64_t stride = ids.stride(0);
    const auto ids_view = [&ids, stride](int64_t first, int64_t end) {
      return THPVariable_Wrap(view_of(ids, {end - first}, {stride}, first * stride));
    };
    return Py_BuildValue("(LLLL(LL)(LL)N(NN(LL))(NNN(LL))NN(KKKOL))", static_cast<long long>(nd),
                         static_cast<long long>(np), static_cast<long long>(total), static_cast<long long>(kv[batch]),
                         static_cast<long long>(d0), static_cast<long long>(d0 + nd), static_cast<long long>(p0),
                         static_cast<long long>(p0 + total - nd), (Py_INCREF(Py_None), Py_None),
                         vec(dip, nd + 1), vec(dlp, nd), static_cast<long long>(dfirst),
                         static_cast<long long>(dend), vec(pqp, np + 1), vec(pip, np + 1), vec(plp, np),
                         static_cast<long long>(pfirst), static_cast<long long>(pend), ids_view(dfirst, dend),
                         ids_view(pfirst, pend), static_cast<unsigned long long>(full),
                         static_cast<unsigned long long>(causal2), static_cast<unsigned long long>(keys_d), Py_True,
                         static_cast<long long>(longest_d));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}  // namespace

namespace fij_fastcall {

PyMethodDef pod_methods[] = {
    {"pod_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_signature)),
     METH_FASTCALL,
     "pod_signature(q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, lse_d, rows_p, rows_d, want_lse) -> bytes | None"},
    {"pod_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_run)), METH_FASTCALL,
     "pod_run(entry, prepared, signature, q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, lse_d, rows_p, rows_d, "
     "want_lse, pdl) -> (out_p, out_d, lse_p, lse_d) | int"},
    {"pod_rerun", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_rerun)), METH_FASTCALL,
     "pod_rerun(relaunch, prepared, signature, plan, bounds, counts, q_p, kv_p, q_d, kv_d, out_p, out_d, lse_p, "
     "lse_d, rows_p, rows_d, want_lse) -> (out_p, out_d, lse_p, lse_d, signature) | int"},
    {"pod_prepare", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_prepare)), METH_FASTCALL,
     "pod_prepare(relaunch, prepared, signature, plan, rows, offsets, counts) -> bytes | -1"},
    {"pod_work", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_work)), METH_FASTCALL,
     "pod_work(qo_indptr_p, kv_indptr_p, last_page_len_p, kv_indptr_d, last_page_len_d, qo_indptr_d, page_size) "
     "-> (sum q k, sum q (2k - q + 1)+, decode keys, decode ok, longest decode) | -1"},
    {"batch_split", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(batch_split)), METH_FASTCALL,
     "batch_split(qo_indptr, kv_indptr, kv_len_arr, page_size, decode_ok) -> tuple | -1"},
    {"pod_cut", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pod_cut)), METH_FASTCALL,
     "pod_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, kv_indices) -> tuple | -1"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace fij_fastcall
