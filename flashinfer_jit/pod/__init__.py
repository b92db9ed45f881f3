"""POD: prefill and decode work items in one launch (PODWithPagedKVCacheWrapper,
BatchPODWithPagedKVCacheWrapper, BatchAttention). Not written yet: it will call the
prefill and decode block functions (csrc/prefill/prefill.cuh prefill_block,
csrc/decode/ decode blocks) from one SM-aware kernel, planned by both families' planners
into one shared work buffer (docs/architecture.md)."""
