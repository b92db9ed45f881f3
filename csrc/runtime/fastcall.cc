// fij_fastcall: run()'s C launch entries (and prefill plan()'s planner) called from Python
// without ctypes.
//
// A ctypes call converts each argument through its argtypes and libffi: ~1.1 us for the
// prefill entry's 13 arguments on the CPU machine, against ~0.1 us for these METH_FASTCALL
// functions, which read Python ints and floats straight into the entry's C types
// (csrc/runtime/fast_entry.h) and call it by address. Built once per Python, torch and compiler by
// flashinfer_jit/runtime/fastcall.py; ctypes stays the fallback.
//
//   decode(entry, prepared, q, k, v, out, lse, logit_scale, v_scale, window_left, stream, pdl)
//   prefill(entry, prepared, q, k, v, out, lse, sinks, logit_scale, soft_cap_log2, v_scale,
//           window_left, stream, pdl)
//   order_pages(entry, params, stream, device)   plan()'s page order (page_order.cuh)
//   order_pages_pair(entry, first, second, stream, device)   two of them in one launch (POD)
//   ship(entry, dst, src, bytes, stream, device, event)   plan()'s copy of its packed buffer
//                                            (runtime/plan_buffer.py), event recorded after it
// Addresses are Python ints (0: null); each returns the entry's cudaError_t as an int.
//
// prefill's run() of the common form (no lse, sinks or per-call scales) goes further: the
// tensors themselves come in, and the checks that the signature the op recorded still
// holds run here, on torch's C++ tensors, with the stream taken from torch as the ops do:
//
//   tensor_signature(q, k, v, out) -> bytes   each tensor's dims, sizes, strides, dtype
//                                            and device (exact torch.Tensor only)
//   prefill_run(entry, prepared, signature, q, k, v, out, logit_scale, soft_cap_log2,
//               v_scale, window_left, pdl) -> int
//     -1 where the tensors are not of `signature` or not 16-byte aligned, -2 where they are
//     not on a CUDA device (the caller then checks them in full), else the entry's
//     cudaError_t.
//
// POD's run() and plan() have their callers in csrc/pod/pod_fastcall.cc (pod_signature,
// pod_run, pod_work, batch_split), added to this module at its import; what the two
// translation units share is csrc/runtime/fastcall_common.h.
//
// prefill's plan() calls its C++ planner (csrc/runtime/plan_entry.h) here with the index vectors as
// they came, where they are of the common form, so that it neither converts nor checks
// them in Python nor pays ctypes' conversions (~2 us of plan() on the CPU machine):
//
//   prefill_plan(planner, config, side, qo_indptr, kv_a, kv_b, host, host_size, result) -> int
//     side as csrc/prefill/prefill_plan.h PrefillKVSide: 0 csr (kv_a: indptr [B + 1], kv_b:
//     last_page_len [B]), 1 seq_lens (kv_a [B]), 2 ragged (kv_a: indptr [B + 1]); kv_b is
//     read for csr only. qo_indptr [B + 1] and those, each a contiguous 1-D int32 CPU
//     tensor (exact torch.Tensor): the planner's status (0, or its error for the caller to
//     raise); -1 where one is of another form or length, and nothing is called (the caller
//     converts and checks them, raising its errors, and calls the planner itself).
//
//   decode_plan(planner, config, indptr, last_page_len, indices, capacity, host, host_size, result)
//     -> int or None
//     batch decode's planner (csrc/decode/decode_plan.h) on a CSR page table: indptr [B + 1]
//     and last_page_len [B] contiguous 1-D int32 CPU tensors, indices a 1-D int32 tensor on
//     any device (its length the planner's limit): the planner's status; None where one is of
//     another form, and nothing is called.
#include <c10/core/impl/VirtualGuardImpl.h>

#include "hopper/prefill_sm90_plan.h"
#include "runtime/fast_entry.h"
#include "runtime/fastcall_common.h"
#include "runtime/plan_entry.h"

namespace {

using fij_fastcall::address;
using fij_fastcall::addresses;
using fij_fastcall::arity;
using fij_fastcall::describe;
using fij_fastcall::kTensorWords;

// The arguments after the addresses: `floats` scales (as float), window_left, the stream
// (with_stream) and pdl; false with a Python error set, also for a null entry.
struct Tail {
  float scale[3];
  int window_left;
  void* stream;
  int pdl;
};

bool read_tail(const char* name, PyObject* const* args, int floats, bool with_stream, const void* entry, Tail& t) {
  for (int i = 0; i < floats; ++i) t.scale[i] = static_cast<float>(PyFloat_AsDouble(args[i]));
  t.window_left = static_cast<int>(PyLong_AsLong(args[floats]));
  t.stream = with_stream ? address(args[floats + 1]) : nullptr;
  t.pdl = PyObject_IsTrue(args[floats + 1 + (with_stream ? 1 : 0)]);
  if (PyErr_Occurred()) return false;
  if (entry == nullptr) {
    PyErr_Format(PyExc_ValueError, "fij_fastcall.%s(): null entry", name);
    return false;
  }
  return true;
}

PyObject* decode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("decode", nargs, 12)) return nullptr;
  void* a[7];  // entry, prepared, q, k, v, out, lse
  Tail t;
  if (!addresses(args, 7, a) || !read_tail("decode", args + 7, 2, true, a[0], t)) return nullptr;
  return PyLong_FromLong(reinterpret_cast<fij_decode_fast_fn>(a[0])(
      a[1], a[2], a[3], a[4], a[5], static_cast<float*>(a[6]), t.scale[0], t.scale[1], t.window_left, t.stream,
      t.pdl));
}

PyObject* prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("prefill", nargs, 14)) return nullptr;
  void* a[8];  // entry, prepared, q, k, v, out, lse, sinks
  Tail t;
  if (!addresses(args, 8, a) || !read_tail("prefill", args + 8, 3, true, a[0], t)) return nullptr;
  return PyLong_FromLong(reinterpret_cast<fij_prefill_fast_fn>(a[0])(
      a[1], a[2], a[3], a[4], a[5], static_cast<float*>(a[6]), static_cast<const float*>(a[7]), t.scale[0],
      t.scale[1], t.scale[2], t.window_left, t.stream, t.pdl));
}

constexpr int kRunTensors = 4;

// The signature words of q, k, v, out into w; false where one is not describable.
bool describe_run(PyObject* const* tensors, int64_t* w) {
  for (int i = 0; i < kRunTensors; ++i)
    if (!describe(tensors[i], w + i * kTensorWords)) return false;
  return true;
}

PyObject* tensor_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("tensor_signature", nargs, kRunTensors)) return nullptr;
  int64_t w[kRunTensors * kTensorWords];
  try {
    if (!describe_run(args, w)) {
      PyErr_SetString(PyExc_TypeError, "fij_fastcall.tensor_signature(): expected plain torch.Tensor arguments "
                                       "of at most 6 dims");
      return nullptr;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(w));
}

PyObject* prefill_run(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("prefill_run", nargs, 12)) return nullptr;
  void* a[2];  // entry, prepared
  if (!addresses(args, 2, a)) return nullptr;
  PyObject* signature = args[2];
  if (!PyBytes_Check(signature) || PyBytes_GET_SIZE(signature) != kRunTensors * kTensorWords * 8) {
    PyErr_SetString(PyExc_TypeError, "fij_fastcall.prefill_run(): signature: expected tensor_signature()'s bytes");
    return nullptr;
  }
  Tail t;  // (the stream is torch's, below)
  if (!read_tail("prefill_run", args + 7, 3, false, a[0], t)) return nullptr;
  void* ptr[kRunTensors];
  void* stream = nullptr;
  try {
    int64_t w[kRunTensors * kTensorWords];
    if (!describe_run(args + 3, w) || std::memcmp(w, PyBytes_AS_STRING(signature), sizeof(w)) != 0)
      return PyLong_FromLong(-1);
    for (int i = 0; i < kRunTensors; ++i) {
      ptr[i] = THPVariable_Unpack(args[3 + i]).data_ptr();
      if (reinterpret_cast<uintptr_t>(ptr[i]) % 16 != 0) return PyLong_FromLong(-1);
    }
    const at::Tensor& q = THPVariable_Unpack(args[3]);
    if (!q.is_cuda()) return PyLong_FromLong(-2);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    stream = impl.getStream(q.device()).native_handle();
  } catch (const std::exception&) {  // a tensor torch cannot describe here: the full checks decide
    return PyLong_FromLong(-1);
  }
  return PyLong_FromLong(reinterpret_cast<fij_prefill_fast_fn>(a[0])(
      a[1], ptr[0], ptr[1], ptr[2], ptr[3], nullptr, nullptr, t.scale[0], t.scale[1], t.scale[2], t.window_left,
      stream, t.pdl));
}

// An index vector of plan()'s common form (a contiguous 1-D int32 CPU tensor): its data and
// length; false for anything else.
bool host_int32_vector(PyObject* obj, const int32_t** data, int64_t* size) {
  fij_fastcall::HostIndex index;
  if (!fij_fastcall::host_index(obj, false, index)) return false;
  *data = static_cast<const int32_t*>(index.data);
  *size = index.size;
  return true;
}

PyObject* prefill_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("prefill_plan", nargs, 9)) return nullptr;
  void* a[2];  // planner, config
  if (!addresses(args, 2, a)) return nullptr;
  const long side = PyLong_AsLong(args[2]);
  void* host = address(args[6]);
  const long long host_size = PyLong_AsLongLong(args[7]);
  void* result = address(args[8]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr || host == nullptr || result == nullptr || side < 0 || side > 2) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.prefill_plan(): null planner, config, host or result, or a side "
                                      "other than 0, 1, 2");
    return nullptr;
  }
  const bool csr = side == 0, indptr = side != 1;  // kv_b read; kv_a an indptr (B + 1 entries)
  const int32_t *qo = nullptr, *kv_a = nullptr, *kv_b = nullptr;
  int64_t qo_size = 0, a_size = 0, b_size = 0;
  try {
    if (!host_int32_vector(args[3], &qo, &qo_size) || !host_int32_vector(args[4], &kv_a, &a_size) ||
        (csr && !host_int32_vector(args[5], &kv_b, &b_size)))
      return PyLong_FromLong(-1);
  } catch (const std::exception&) {  // a tensor torch cannot describe here: the caller's checks decide
    return PyLong_FromLong(-1);
  }
  const int64_t batch = qo_size - 1;
  if (batch < 0 || a_size != batch + (indptr ? 1 : 0) || (csr && b_size != batch)) return PyLong_FromLong(-1);
  return PyLong_FromLongLong(reinterpret_cast<fij_prefill_plan_fn>(a[0])(
      a[1], qo, kv_a, kv_b, batch, static_cast<int32_t*>(host), host_size, static_cast<long long*>(result)));
}

PyObject* decode_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("decode_plan", nargs, 9)) return nullptr;
  void* a[2];  // planner, config
  if (!addresses(args, 2, a)) return nullptr;
  const long long capacity = PyLong_AsLongLong(args[5]);
  void* host = address(args[6]);
  const long long host_size = PyLong_AsLongLong(args[7]);
  void* result = address(args[8]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr || host == nullptr || result == nullptr || capacity < 0) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.decode_plan(): null planner, config, host or result, or a "
                                      "negative capacity");
    return nullptr;
  }
  const int32_t *indptr = nullptr, *last = nullptr;
  int64_t indptr_size = 0, last_size = 0, limit = 0;
  try {
    if (!host_int32_vector(args[2], &indptr, &indptr_size) || !host_int32_vector(args[3], &last, &last_size) ||
        !THPVariable_CheckExact(args[4]))
      Py_RETURN_NONE;
    const at::Tensor& ids = THPVariable_Unpack(args[4]);
    if (ids.dim() != 1 || ids.scalar_type() != at::ScalarType::Int) Py_RETURN_NONE;
    limit = ids.size(0);
  } catch (const std::exception&) {  // a tensor torch cannot describe here: the caller's checks decide
    Py_RETURN_NONE;
  }
  const int64_t batch = indptr_size - 1;
  if (batch < 0 || last_size != batch) Py_RETURN_NONE;
  return PyLong_FromLongLong(reinterpret_cast<fij_decode_plan_fn>(a[0])(
      a[1], indptr, last, nullptr, batch, limit, capacity, static_cast<int32_t*>(host), host_size,
      static_cast<long long*>(result)));
}

// ship(entry, dst, src, bytes, stream, device, event) -> int: plan()'s host-to-device copy
// (fij_ship_fn; torch's copy_ and Event.record cost ~6 us more a plan buffer on the GPU host)
PyObject* ship(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("ship", nargs, 7)) return nullptr;
  void* a[3];  // entry, dst, src
  if (!addresses(args, 3, a)) return nullptr;
  const long long bytes = PyLong_AsLongLong(args[3]);
  void* stream = address(args[4]);
  const long device = PyLong_AsLong(args[5]);
  void* event = address(args[6]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr || a[2] == nullptr || bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.ship(): null entry, dst or src, or negative bytes");
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<fij_ship_fn>(a[0])(a[1], a[2], bytes, stream, static_cast<int>(device),
                                                             event));
}

// sm90_tiles(side, qo_indptr, kv_a, kv_b, page_size, row_stride, causal, keys_a_tile, window_left,
//            tile_rows, out, capacity, heads) -> (tiles, active, keys_sum, batch, qo_first, qo_last, kv_last)
//            or -1
// The Hopper path's tiles (csrc/hopper/prefill_sm90_plan.h) into `out` (an int32 host address,
// room for `capacity` tiles; nothing is written where they do not fit: the caller grows it and
// calls again). heads > 0: `out` is the whole work list, its header (kSm90WorkHeader int32: items,
// active items, 0, 0) first, then the tiles (capacity counts the tiles' room after it); 0: the
// tiles alone. side: 0 csr (kv_a: page indptr [B + 1], kv_b: last_page_len [B]; a tile's
// kv_row0 is the request's indptr), 1 seq_lens (kv_a [B]; kv_row0 b x row_stride), 2 ragged
// (kv_a: K/V row indptr [B + 1]). Each vector a contiguous 1-D int32 CPU tensor (exact
// torch.Tensor) of its batch's length (last_page_len may be longer), every length >= 0; -1
// otherwise, and nothing is written (plan() then takes numpy's plan_tiles, which raises the
// errors). The batch's scalars come back with the counts: qo_indptr's first and last entries,
// kv_a's last (csr and ragged; 0 for seq_lens).
std::vector<int64_t> g_sm90_scratch;

PyObject* sm90_tiles(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("sm90_tiles", nargs, 13)) return nullptr;
  const long side = PyLong_AsLong(args[0]);
  const long long page_size = PyLong_AsLongLong(args[4]), stride = PyLong_AsLongLong(args[5]);
  const int causal = PyObject_IsTrue(args[6]);
  const long long keys_a_tile = PyLong_AsLongLong(args[7]), window_left = PyLong_AsLongLong(args[8]);
  const long long tile_rows = PyLong_AsLongLong(args[9]), capacity = PyLong_AsLongLong(args[11]);
  const long long heads = PyLong_AsLongLong(args[12]);
  void* out = address(args[10]);
  if (PyErr_Occurred()) return nullptr;
  if (side < 0 || side > 2 || keys_a_tile <= 0 || tile_rows <= 0 || out == nullptr || capacity < 0 || heads < 0) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.sm90_tiles(): bad side, tile sizes, out, capacity or heads");
    return nullptr;
  }
  fij_fastcall::HostIndex qo, kv_a, kv_b;
  if (!fij_fastcall::host_index(args[1], false, qo) || !fij_fastcall::host_index(args[2], false, kv_a) ||
      (side == 0 && !fij_fastcall::host_index(args[3], false, kv_b)))
    return PyLong_FromLong(-1);
  const int64_t batch = qo.size - 1;
  if (batch < 0 || kv_a.size != (side == 1 ? batch : batch + 1) || (side == 0 && kv_b.size < batch))
    return PyLong_FromLong(-1);
  const int32_t* q = static_cast<const int32_t*>(qo.data);
  auto kv_len = [&](int64_t b) -> int64_t {
    return side == 0 ? fij_fastcall::csr_len(kv_a, kv_b, b, page_size) : side == 1 ? kv_a[b] : kv_a[b + 1] - kv_a[b];
  };
  auto row0 = [&](int64_t b) -> int64_t { return side == 1 ? b * stride : kv_a[b]; };
  for (int64_t b = 0; b < batch; ++b)
    if (q[b + 1] < q[b] || kv_len(b) < 0) return PyLong_FromLong(-1);
  int32_t* work = static_cast<int32_t*>(out);
  int32_t* tiles = heads > 0 ? work + fij::kSm90WorkHeader : work;
  const fij::sm90_plan::TileStats s =
      fij::sm90_plan::plan_tiles(batch, q, row0, kv_len, causal != 0, keys_a_tile, window_left, tile_rows, tiles,
                                 capacity, g_sm90_scratch);
  if (heads > 0 && s.tiles <= capacity) {  // (items past int32: plan() raises on the count returned)
    work[0] = static_cast<int32_t>(s.tiles * heads);
    work[1] = static_cast<int32_t>(s.active * heads);
    for (int i = 2; i < fij::kSm90WorkHeader; ++i) work[i] = 0;
  }
  const long long kv_last = side == 1 ? 0 : static_cast<long long>(kv_a[batch]);
  return Py_BuildValue("(LLLLLLL)", static_cast<long long>(s.tiles), static_cast<long long>(s.active),
                       static_cast<long long>(s.keys_sum), static_cast<long long>(batch),
                       static_cast<long long>(q[0]), static_cast<long long>(q[batch]), kv_last);
}

// order_pages(entry, params, stream, device) -> int: plan()'s page order
// (fij_order_pages_fn; ~1 us of ctypes' conversions less a plan)
PyObject* order_pages(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("order_pages", nargs, 4)) return nullptr;
  void* a[3];  // entry, params, stream (0: the default stream)
  if (!addresses(args, 3, a)) return nullptr;
  const long device = PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.order_pages(): null entry or params");
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<fij_order_pages_fn>(a[0])(a[1], a[2], static_cast<int>(device)));
}

// order_pages_pair(entry, first, second, stream, device) -> int: POD plan()'s two page orders
PyObject* order_pages_pair(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("order_pages_pair", nargs, 5)) return nullptr;
  void* a[4];  // entry, first, second, stream (0: the default stream)
  if (!addresses(args, 4, a)) return nullptr;
  const long device = PyLong_AsLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (a[0] == nullptr || a[1] == nullptr || a[2] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "fij_fastcall.order_pages_pair(): null entry or params");
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<fij_order_pages_pair_fn>(a[0])(a[1], a[2], a[3], static_cast<int>(device)));
}

PyMethodDef methods[] = {
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(decode)), METH_FASTCALL,
     "decode(entry, prepared, q, k, v, out, lse, logit_scale, v_scale, window_left, stream, pdl) -> int"},
    {"prefill", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prefill)), METH_FASTCALL,
     "prefill(entry, prepared, q, k, v, out, lse, sinks, logit_scale, soft_cap_log2, v_scale, window_left, stream, "
     "pdl) -> int"},
    {"tensor_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(tensor_signature)),
     METH_FASTCALL, "tensor_signature(q, k, v, out) -> bytes"},
    {"order_pages", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(order_pages)), METH_FASTCALL,
     "order_pages(entry, params, stream, device) -> int"},
    {"order_pages_pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(order_pages_pair)),
     METH_FASTCALL, "order_pages_pair(entry, first, second, stream, device) -> int"},
    {"prefill_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prefill_run)), METH_FASTCALL,
     "prefill_run(entry, prepared, signature, q, k, v, out, logit_scale, soft_cap_log2, v_scale, window_left, pdl) "
     "-> int (-1: not the signature)"},
    {"decode_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(decode_plan)), METH_FASTCALL,
     "decode_plan(planner, config, indptr, last_page_len, indices, capacity, host, host_size, result) -> int (None: "
     "not the common form)"},
    {"sm90_tiles", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(sm90_tiles)), METH_FASTCALL,
     "sm90_tiles(side, qo_indptr, kv_a, kv_b, page_size, row_stride, causal, keys_a_tile, window_left, tile_rows, "
     "out, capacity, heads) -> (tiles, active, keys_sum, batch, qo_first, qo_last, kv_last) | -1"},
    {"ship", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ship)), METH_FASTCALL,
     "ship(entry, dst, src, bytes, stream, device, event) -> int"},
    {"prefill_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prefill_plan)), METH_FASTCALL,
     "prefill_plan(planner, config, side, qo_indptr, kv_a, kv_b, host, host_size, result) -> int (-1: not the "
     "common form)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fij_fastcall", "run()'s C launch entries and plan()'s planner, "
                      "called without ctypes", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit_fij_fastcall(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddFunctions(m, fij_fastcall::pod_methods) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
