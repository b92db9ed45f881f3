// The C signatures of the families' fast launch entries: <namespace>_decode_fast,
// <namespace>_prefill_fast and <namespace>_pod_fast (and the page order's <namespace>_order_pages), exported by each generated module (the templates check their
// definitions against these types) and called by csrc/runtime/fastcall.cc, the CPython caller that
// run() uses instead of ctypes. Plain C: included by nvcc, the host C++ compiler and the
// Python extension alike. `prepared` is the launch the torch op recorded at the signature's
// first run(); the rest is what changes from call to call. They return a cudaError_t.
#pragma once

#ifndef FIJ_EXPORT
#define FIJ_EXPORT extern "C" __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*fij_decode_fast_fn)(const void* prepared, const void* q, void* k, void* v, void* out, float* lse,
                                  float logit_scale, float v_scale, int window_left, void* stream, int pdl);

typedef int (*fij_prefill_fast_fn)(const void* prepared, const void* q, void* k, void* v, void* out, float* lse,
                                   const float* sinks, float logit_scale, float soft_cap_log2, float v_scale,
                                   int window_left, void* stream, int pdl);

// POD's (csrc/pod/pod_fastcall.cc pod_run): `tensors` holds the ten addresses q_p, k_p, v_p,
// out_p, lse_p, q_d, k_d, v_d, out_d, lse_d (an lse null where none is written). Returns a
// cudaError_t, or FIJ_FAST_CAPTURING without launching where `stream` is capturing a CUDA
// graph: the caller then runs the op, which the graph records as it records every op.
typedef int (*fij_pod_fast_fn)(const void* prepared, void* const* tensors, void* stream, int pdl);
enum { FIJ_FAST_CAPTURING = -3 };

// POD on Hopper's <namespace>_pod_relaunch (csrc/pod/pod_fastcall.cc pod_rerun): the first run()
// after a plan(), which its recorded launch cannot take (the plan's buffers, split and rows are
// new). The op's work, resolve, record into `prepared` and launch, without the dispatcher.
// `tensors` are `const at::Tensor*` (C++ callers only): 0-9 the call's q_p, k_p, v_p, out_p,
// lse_p, q_d, k_d, v_d, out_d, lse_d (each side's rows; an lse not written: an empty tensor),
// then the plan's 10 work_p, 11 page_ids_p, 12 work_d, 13 merge_indptr_d, 14 partial_o_d,
// 15 partial_lse_d, 16 merge_counters_d (null: none), 17 POD's counters, 18.. the decode
// side's `tables` page-table tensors; reals: scale_log2_p, v_scale_p, logit_scale_d, v_scale_d;
// ints: window_left_p, window_left_d, grid_items_d, merge_rows_d, prefill_blocks, launch (0:
// resolve and record only, pod_prepare's: the tensors are described, not allocated). Returns 0,
// FIJ_FAST_CAPTURING without launching, or -1 where the op would raise (the caller runs it).
typedef int (*fij_pod_relaunch_fn)(void* prepared, const void* const* tensors, int tables, const double* reals,
                                   const long long* ints);

// The page-order module's <namespace>_order_pages (csrc/runtime/page_order.cuh PageOrderParams),
// called by plan() of decode and prefill
typedef int (*fij_order_pages_fn)(const void* params, void* stream, int device);
// ... and <namespace>_order_pages_pair: two params' sorts in one launch (POD's two sides)
typedef int (*fij_order_pages_pair_fn)(const void* first, const void* second, void* stream, int device);

// The same module's <namespace>_ship: plan()'s one host-to-device copy of its packed buffer
// (runtime/plan_buffer.py), `bytes` from pinned `src` to `dst` on `stream` of `device`, then
// `event` (a cudaEvent_t; null: none) recorded after it. ~2 us of host time on the GPU host
// against ~8 for torch's copy_ and Event.record.
typedef int (*fij_ship_fn)(void* dst, const void* src, long long bytes, void* stream, int device, void* event);

#ifdef __cplusplus
}
#endif
