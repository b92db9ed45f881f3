// The C signature of batch prefill's host planner, <namespace>_prefill_plan of the
// PrefillPlanSpec module (csrc/prefill/prefill_plan.h prefill_plan; `config` a PrefillPlanConfig):
// its template checks its definition against this type, and csrc/runtime/fastcall.cc calls it by
// address for plan(). Apart from csrc/runtime/fast_entry.h so that a change to one rebuilds only
// the modules that use it. Returns the planner's status.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef long long (*fij_prefill_plan_fn)(const void* config, const int32_t* qo_indptr, const int32_t* kv_a,
                                         const int32_t* kv_b, long long batch, int32_t* host, long long host_size,
                                         long long* result);

#ifdef __cplusplus
}
#endif
