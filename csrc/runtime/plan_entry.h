// The C signatures of the host planners: batch prefill's, <namespace>_prefill_plan of the
// PrefillPlanSpec module (csrc/prefill/prefill_plan.h prefill_plan; `config` a PrefillPlanConfig),
// and batch decode's, below. Their templates check their definitions against these types, and
// csrc/runtime/fastcall.cc calls them by address for plan(). Apart from csrc/runtime/fast_entry.h so that a change to one rebuilds only
// the modules that use it. Returns the planner's status.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// batch decode's, <namespace>_decode_plan of the DecodePlanSpec module (csrc/decode/decode_plan.h
// decode_plan; `config` a DecodePlanConfig)
typedef long long (*fij_decode_plan_fn)(const void* config, const int32_t* indptr, const int32_t* last,
                                        const int32_t* seq_lens, long long batch, long long limit,
                                        long long capacity, int32_t* host, long long host_size, long long* result);

typedef long long (*fij_prefill_plan_fn)(const void* config, const int32_t* qo_indptr, const int32_t* kv_a,
                                         const int32_t* kv_b, long long batch, int32_t* host, long long host_size,
                                         long long* result);

#ifdef __cplusplus
}
#endif
