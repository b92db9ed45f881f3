// Parameters of append_paged_kv_cache: one struct, filled by the host binding.
#pragma once
#include "common/page_table_params.h"

namespace fij {

struct AppendParams {
  const void* append_key = nullptr;    // [nnz, num_kv_heads, head_dim], any token/head strides
  const void* append_value = nullptr;
  int64_t key_stride_token = 0, key_stride_head = 0;
  int64_t value_stride_token = 0, value_stride_head = 0;
  const int32_t* batch_indices = nullptr;  // [nnz]; -1 marks a padding token
  const int32_t* positions = nullptr;      // [nnz]; position within its request
  int32_t nnz = 0;
  PagedKVParams kv;
  PageTableParams table;
};

struct BatchIndicesParams {
  const int32_t* append_indptr = nullptr;  // [batch_size + 1]
  const int32_t* seq_lens = nullptr;       // [batch_size]: kv length after the append
  int32_t* batch_indices = nullptr;        // [nnz]
  int32_t* positions = nullptr;            // [nnz]
  int32_t batch_size = 0;
  int32_t nnz = 0;
};

}  // namespace fij
