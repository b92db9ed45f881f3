#!/usr/bin/env python3
"""A diagnostic for a throwaway copy of the tree (the device machine's): adds steady_clock stage
timings to fij_fastcall's pod_rerun and pod_run (csrc/pod/pod_fastcall.cc) and to POD on
Hopper's module (resolve_and_launch, launch), each printed to stderr as "TIMING <name> <µs a
stage> ... total <the last call>" every 2000 calls. EDITS THE CHECKOUT IN PLACE: never run it
in a tree whose changes are committed. Then build (flashinfer_jit aot) and drive it with
scripts/time_pod_rerun.py; docs/pod.md (Host time) has the figures.

  python3 scripts/instrument_pod_rerun.py --edit-in-place    # from the repository root
"""
import sys
from pathlib import Path

if "--edit-in-place" not in sys.argv[1:]:
    sys.exit("instrument_pod_rerun.py edits csrc/ and templates/ in place: pass --edit-in-place (a throwaway copy only)")

HELPER = r'''
#include <chrono>
#include <cstdio>
namespace fij_timing {
inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
struct Acc {
  const char* name;
  double sum[8] = {};
  long n = 0;
  void add(const double* t, int k) {
    for (int i = 0; i + 1 < k; ++i) sum[i] += t[i + 1] - t[i];
    if (++n == 2000) {
      std::fprintf(stderr, "TIMING %s", name);
      for (int i = 0; i + 1 < k; ++i) std::fprintf(stderr, " %.3f", sum[i] / n);
      std::fprintf(stderr, " total %.3f\n", (t[k - 1] - t[0]));
      n = 0;
      for (double& s : sum) s = 0;
    }
  }
};
}  // namespace fij_timing
'''


def edit(path, pairs, helper_after):
    p = Path(path)
    s = p.read_text()
    s = s.replace(helper_after, helper_after + HELPER, 1)
    for old, new in pairs:
        assert s.count(old) == 1, (path, old)
        s = s.replace(old, new)
    p.write_text(s)


edit("csrc/pod/pod_fastcall.cc", [
    # pod_run
    ("""  Launch l;
  void* stream = nullptr;
  try {
    int64_t w[kSigWords];""", """  Launch l;
  void* stream = nullptr;
  double T[6];
  T[0] = fij_timing::now_us();
  try {
    int64_t w[kSigWords];"""),
    ("""      return PyLong_FromLong(-1);
    const at::Tensor& q = THPVariable_Unpack(sides[0].q);
    if (!q.is_cuda()) return PyLong_FromLong(-2);
    if (!side_pointers(sides[0], 0, want_lse, sides[1], l, l.ptr) ||
        !side_pointers(sides[1], 1, want_lse, sides[0], l, l.ptr + 5))
      return PyLong_FromLong(-1);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);""", """      return PyLong_FromLong(-1);
    T[1] = fij_timing::now_us();
    const at::Tensor& q = THPVariable_Unpack(sides[0].q);
    if (!q.is_cuda()) return PyLong_FromLong(-2);
    if (!side_pointers(sides[0], 0, want_lse, sides[1], l, l.ptr) ||
        !side_pointers(sides[1], 1, want_lse, sides[0], l, l.ptr + 5))
      return PyLong_FromLong(-1);
    T[2] = fij_timing::now_us();
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);"""),
    ("""  const int code = reinterpret_cast<fij_pod_fast_fn>(a[0])(a[1], l.ptr, stream, pdl);
  if (code != 0) return PyLong_FromLong(code);""", """  T[3] = fij_timing::now_us();
  const int code = reinterpret_cast<fij_pod_fast_fn>(a[0])(a[1], l.ptr, stream, pdl);
  T[4] = fij_timing::now_us();
  if (code != 0) return PyLong_FromLong(code);
  {
    static fij_timing::Acc acc{"pod_run[sig,outputs,stream,entry]"};
    T[5] = fij_timing::now_us();
    acc.add(T, 5);
  }"""),
    # pod_rerun
    ("""  Launch l;
  int64_t w[kSigWords];
  int code = -1;
  try {""", """  Launch l;
  int64_t w[kSigWords];
  int code = -1;
  double T[7];
  T[0] = fij_timing::now_us();
  try {"""),
    ("""    if (rows[0] == 0 && rows[1] == 0) return PyLong_FromLong(-1);  // (nothing to launch: the op path's case)""",
     """    if (rows[0] == 0 && rows[1] == 0) return PyLong_FromLong(-1);  // (nothing to launch: the op path's case)
    T[1] = fij_timing::now_us();"""),
    ("""      return PyLong_FromLong(-1);
    for (int s = 0; s < 2; ++s) {
      if (s == 1 && sides[1].kv == sides[0].kv) {""", """      return PyLong_FromLong(-1);
    T[2] = fij_timing::now_us();
    for (int s = 0; s < 2; ++s) {
      if (s == 1 && sides[1].kv == sides[0].kv) {"""),
    ("""    code = relaunch(a[0], a[1], q, kv, out, lse, off, rows, p, true);""",
     """    T[3] = fij_timing::now_us();
    code = relaunch(a[0], a[1], q, kv, out, lse, off, rows, p, true);
    T[4] = fij_timing::now_us();"""),
    ("""  PyTuple_SET_ITEM(result, 4, sig);
  return result;""", """  PyTuple_SET_ITEM(result, 4, sig);
  {
    static fij_timing::Acc acc{"pod_rerun[checks,outputs,kv views,views+entry,result]"};
    T[5] = fij_timing::now_us();
    acc.add(T, 6);
  }
  return result;"""),
], '#include "runtime/fastcall_common.h"\n')

edit("templates/pod/pod_sm90_binding.cc.j2", [
    ("""  const c10::DeviceGuard guard(q_p.device());
  static constexpr fij::Sm90Module kPrefill""", """  double T[6];
  T[0] = fij_timing::now_us();
  const c10::DeviceGuard guard(q_p.device());
  static constexpr fij::Sm90Module kPrefill"""),
    ("""                                                           window_left_p, v_scale_p, 0);
  const fij::DecodeLaunch ld""", """                                                           window_left_p, v_scale_p, 0);
  T[1] = fij_timing::now_us();
  const fij::DecodeLaunch ld"""),
    ("""      merge_counters_d, 1, 1, 4);
  auto* const counters""", """      merge_counters_d, 1, 1, 4);
  T[2] = fij_timing::now_us();
  auto* const counters"""),
    ("""    std::memcpy(prepared, &l, sizeof(l));
  }
  if (!launch_it) return;
  fij::check_launch(""", """    std::memcpy(prepared, &l, sizeof(l));
  }
  if (!launch_it) return;
  T[3] = fij_timing::now_us();
  fij::check_launch("""),
    ("""                    "{{ module_name }}", "pod_sm90");
}""", """                    "{{ module_name }}", "pod_sm90");
  T[4] = fij_timing::now_us();
  static fij_timing::Acc acc{"resolve_and_launch[guard+prefill,decode,record,launch]"};
  acc.add(T, 5);
}"""),
], '#include "pod/pod_params.h"\n')

edit("templates/pod/pod_sm90.cu.j2", [
    ("""  fij::PrefillSm90Params p;
  if (const int err = fij::sm90_prefill::make_params<DType, kHeadDim, kKeyTile, kPaged, false, Kernel::kBlockM>(a, p))
    return err;
  return fij::launch_pod_sm90""", """  fij::PrefillSm90Params p;
  double T[3];
  T[0] = fij_timing::now_us();
  if (const int err = fij::sm90_prefill::make_params<DType, kHeadDim, kKeyTile, kPaged, false, Kernel::kBlockM>(a, p))
    return err;
  T[1] = fij_timing::now_us();
  const int r = fij::launch_pod_sm90"""),
    ("""      p, ld, counters, prefill_blocks, static_cast<cudaStream_t>(stream));
}""", """      p, ld, counters, prefill_blocks, static_cast<cudaStream_t>(stream));
  T[2] = fij_timing::now_us();
  static fij_timing::Acc acc{"module launch[make_params (3 TMA maps),launch_pod_sm90]"};
  acc.add(T, 3);
  return r;
}"""),
], '#include "runtime/launch_error.cuh"\n')
print("instrumented")
