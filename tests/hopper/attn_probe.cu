// The Hopper attention kernel's schedules, standalone (issue 64; the library's kernel is
// csrc/hopper/prefill_sm90.cuh, whose consumer blocks this probe calls): bf16, head_dim
// 128, ragged requests of equal length (q and K/V [tokens, heads, 128]), causal
// (bottom-right) or not, GQA. A block runs three warpgroups: a TMA producer (24 registers)
// and two consumers (240 registers, 64 query rows each). What varies is the loop around the
// blocks (`variant` in run()):
//   0: one block an item, the plain loop (S, softmax, P V, one after the other);
//   1: one block an item, FA3's overlap (tile n's S before tile n - 1's P V, the softmax
//      under it) and ping-pong (the two consumers take turns to issue their wgmmas);
//   2: that, persistent (one block an SM), items heaviest first in snake order;
//   3: persistent, items from an atomic counter (the library's schedule);
//   4, 5: 2 and 3 with three K/V stages.
// Each is checked against a double reference (tails and masks included, output and LSE
// NaN-poisoned), then timed. Prints "name value" lines; exit 0 when every check passes.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "hopper/prefill_sm90.cuh"
#include "hopper/sm90.cuh"
#include "hopper/tma_host.h"
#include "probe_common.cuh"

using bf16 = __nv_bfloat16;
namespace h = fij::sm90;

constexpr int kD = 128, kBlockM = 128, kBlockN = 128, kStages = 2;
constexpr int kTileBytes = kBlockN * kD * 2;  // one K or V tile (and the Q tile): 32 KB
constexpr int kSmem = kTileBytes * (1 + 2 * kStages) + 1024;

struct Params {
  bf16* out;             // [tokens, heads_q, 128]
  float* lse;            // [tokens, heads_q], base 2
  int seq_len;           // every request: qo_len = kv_len = seq_len
  int heads_q, group;    // group: query heads per KV head
  int batch, q_tiles;    // requests; 128-row query tiles a request
  int num_items;         // q_tiles * heads_q * batch
  int* counters;         // dynamic scheduling: [next item past the first round, blocks done], zeros
  float scale_log2;      // sm_scale * log2(e)
};

// The consumers' blocks are the library kernel's (csrc/hopper/prefill_sm90.cuh): Q K^T and
// P V issued by wgmma, the online softmax with its masks, P packed for P V, O rescaled. This
// probe varies only what the loop around them does.
template <bool kCausal>
using Blocks = fij::sm90_prefill::Sm90Kernel<bf16, kD, kCausal, kBlockN>;

// One unit of work: 128 query rows of one head of one request. Items are numbered with the
// heaviest first (for causal, the last query tiles see the most keys): index idx is query
// tile q_tiles - 1 - idx / (heads * batch) of head idx % heads of request idx / heads % batch.
struct Work {
  int q_start, head, req;
};

FIJ_SM90 Work work_of(int idx, const Params& p) {
  const int hb = p.heads_q * p.batch, rest = idx % hb;
  return {(p.q_tiles - 1 - idx / hb) * kBlockM, rest % p.heads_q, rest / p.heads_q};
}

// The k-th item of this block. One block an item (kPersistent false: the grid is the item
// list), or one block an SM walking the list in rounds of gridDim.x items, in snake order
// (even rounds left to right, odd rounds right to left) so that, heaviest first, every SM's
// sum stays close to the others'. Past the list: num_items or more.
template <bool kPersistent>
FIJ_SM90 int item_index(int k) {
  if constexpr (!kPersistent) return k == 0 ? int(blockIdx.x) : INT_MAX;
  const int g = gridDim.x;
  return k * g + ((k & 1) ? g - 1 - int(blockIdx.x) : int(blockIdx.x));
}

// Key tiles item w visits (bottom-right causal with qo_len == kv_len: row i sees keys <= i).
template <bool kCausal>
FIJ_SM90 int kv_tiles(const Work& w, const Params& p) {
  const int kv_end = kCausal ? min(p.seq_len, w.q_start + kBlockM) : p.seq_len;
  return (kv_end + kBlockN - 1) / kBlockN;
}

// kSt: K/V stages; kDyn (persistent only): after the first round (item blockIdx.x), each
// block's producer takes the next item from an atomic counter (the heaviest left: a greedy
// longest-first schedule) and hands its index to the consumers in shared memory with the
// Q tile's barrier; the last block to find none left resets the counters.
template <bool kCausal, int kLoop, bool kPersistent, int kSt = kStages, bool kDyn = false>
__global__ void __launch_bounds__(384, 1) attn_kernel(const __grid_constant__ CUtensorMap q_map,
                                                      const __grid_constant__ CUtensorMap k_map,
                                                      const __grid_constant__ CUtensorMap v_map, Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = h::align_1024(smem_raw);
  unsigned char* sq = smem;
  unsigned char* sk = smem + kTileBytes;                   // stage s at sk + s * kTileBytes
  unsigned char* sv = smem + kTileBytes * (1 + kSt);  // the same for V
  // q_empty: both consumer warpgroups are done reading the Q tile (their last Q K^T complete)
  __shared__ uint64_t q_full, q_empty, k_full[kSt], v_full[kSt], k_empty[kSt], v_empty[kSt];
  __shared__ int item_slot[2];  // kDyn: item k's index in slot k % 2 (-1: none left)

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    h::mbar_init(&q_full, 1);
    h::mbar_init(&q_empty, 2);  // thread 0 of each consumer warpgroup
    for (int s = 0; s < kSt; ++s) {
      h::mbar_init(&k_full[s], 1);
      h::mbar_init(&v_full[s], 1);
      h::mbar_init(&k_empty[s], 8);  // lane 0 of each consumer warp
      h::mbar_init(&v_empty[s], 8);
    }
    h::fence_barrier_init();
  }
  __syncthreads();

  // Both roles walk the same items; `it` counts key tiles over all of them (the stages'
  // phases run on across items).
  if (wg == 0) {  // producer
    h::regs_dealloc<24>();
    if (threadIdx.x == 0) {
      int it = 0;
      for (int k = 0;; ++k) {
        int idx;
        if constexpr (kDyn) {
          idx = k == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(&p.counters[0], 1);
          if (k > 0) h::mbar_wait(&q_empty, (k - 1) & 1);
          item_slot[k & 1] = idx < p.num_items ? idx : -1;
          if (idx >= p.num_items) {
            h::mbar_arrive(&q_full);  // the consumers read -1: done
            if (atomicAdd(&p.counters[1], 1) == int(gridDim.x) - 1) p.counters[0] = p.counters[1] = 0;
            break;
          }
        } else {
          idx = item_index<kPersistent>(k);
          if (idx >= p.num_items) break;
          if (k > 0) h::mbar_wait(&q_empty, (k - 1) & 1);
        }
        const Work w = work_of(idx, p);
        const int kv_head = w.head / p.group, tok0 = w.req * p.seq_len, n_tiles = kv_tiles<kCausal>(w, p);
        h::mbar_expect_tx(&q_full, kTileBytes);
        for (int a = 0; a < 2; ++a)
          h::tma_load_3d(sq + a * kTileBytes / 2, &q_map, &q_full, 64 * a, w.head, tok0 + w.q_start);
        for (int n = 0; n < n_tiles; ++n, ++it) {
          const int s = it % kSt, u = it / kSt;
          h::mbar_wait(&k_empty[s], (u & 1) ^ 1);
          h::mbar_expect_tx(&k_full[s], kTileBytes);
          for (int a = 0; a < 2; ++a)
            h::tma_load_3d(sk + s * kTileBytes + a * kTileBytes / 2, &k_map, &k_full[s], 64 * a, kv_head,
                           tok0 + n * kBlockN);
          h::mbar_wait(&v_empty[s], (u & 1) ^ 1);
          h::mbar_expect_tx(&v_full[s], kTileBytes);
          for (int a = 0; a < 2; ++a)
            h::tma_load_3d(sv + s * kTileBytes + a * kTileBytes / 2, &v_map, &v_full[s], 64 * a, kv_head,
                           tok0 + n * kBlockN);
        }
      }
    }
    return;
  }

  // consumers
  h::regs_alloc<240>();
  const int wi = wg - 1, t = threadIdx.x % 128, lane = t % 32;
  const int cq = 2 * (lane % 4);
  const uint32_t q_base = h::smem_addr(sq) + wi * 64 * 128;  // this warpgroup's 64 rows in each atom
  const uint32_t k0 = h::smem_addr(sk), v0 = h::smem_addr(sv);
  // Ping-pong (kLoop 2): each round's issue (prologue, n_tiles - 1 loop trips, epilogue of
  // every item) waits for this warpgroup's turn and passes it on; warpgroup 0 starts, and
  // warpgroup 1 passes no turn after its last round of its last item (no one waits for it).
  constexpr bool kPingPong = kLoop == 2;
  const auto my_turn = [&] {
    if constexpr (kPingPong) h::named_sync(1 + wi, 256);
  };
  const auto pass_turn = [&](bool last) {
    if constexpr (kPingPong)
      if (kDyn || !(last && wi == 1)) h::named_arrive(2 - wi, 256);
  };
  if constexpr (kPingPong)
    if (wi == 1) h::named_arrive(1, 256);

  int it = 0;
  for (int k = 0;; ++k) {
    int idx;
    bool last_item = false;
    if constexpr (kDyn) {
      // (kDyn: warpgroup 1 passes every turn, and warpgroup 0 takes the last one after the loop)
      h::mbar_wait(&q_full, k & 1);
      idx = item_slot[k & 1];
      if (idx < 0) break;
    } else {
      idx = item_index<kPersistent>(k);
      if (idx >= p.num_items) break;
      last_item = item_index<kPersistent>(k + 1) >= p.num_items;
    }
    const Work w = work_of(idx, p);
    const int tok0 = w.req * p.seq_len, n_tiles = kv_tiles<kCausal>(w, p);
    const int r0 = 64 * wi + 16 * (t / 32) + lane / 4, row0 = w.q_start + r0;  // rows row0 and row0 + 8
    // (qo_len == kv_len: the tile's first row sees keys up to its own position, q_start)
    const fij::sm90_prefill::Rows rows{r0, cq, 64 * wi, p.seq_len, w.q_start, -1, p.scale_log2, 0.f, 0.f};
    using K = Blocks<kCausal>;
    float o[64], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    if constexpr (!kDyn) h::mbar_wait(&q_full, k & 1);

    uint32_t pa[kBlockN / 16][4];
    float sacc[64], corr[2];
    if constexpr (kLoop == 0) {
      for (int n = 0; n < n_tiles; ++n) {
        const int s = (it + n) % kSt, u = (it + n) / kSt;
        h::mbar_wait(&k_full[s], u & 1);
        K::issue_qk(sacc, q_base, k0 + s * kTileBytes);
        h::wgmma_wait<0>();
        h::fence_regs(sacc);
        if (lane == 0) h::mbar_arrive(&k_empty[s]);
        K::softmax(sacc, n, rows, m, l, corr);
        K::pack_p(sacc, pa);
        K::rescale(o, corr);
        h::mbar_wait(&v_full[s], u & 1);
        K::issue_pv(o, pa, v0 + s * kTileBytes);
        h::wgmma_wait<0>();
        h::fence_regs(o);
        h::fence_regs(pa);
        if (lane == 0) h::mbar_arrive(&v_empty[s]);
      }
      if (t == 0) h::mbar_arrive(&q_empty);
    } else {
      // Tile n's S = Q K^T is issued before tile n - 1's O += P V, and its softmax runs while
      // that P V is on the tensor cores; O is rescaled once the P V is done.
      const int s0 = it % kSt, u0 = it / kSt;
      h::mbar_wait(&k_full[s0], u0 & 1);
      my_turn();
      K::issue_qk(sacc, q_base, k0 + s0 * kTileBytes);
      pass_turn(false);
      h::wgmma_wait<0>();
      h::fence_regs(sacc);
      if (lane == 0) h::mbar_arrive(&k_empty[s0]);
      K::softmax(sacc, 0, rows, m, l, corr);  // O is 0: nothing to rescale
      K::pack_p(sacc, pa);
      for (int n = 1; n < n_tiles; ++n) {
        const int s = (it + n) % kSt, u = (it + n) / kSt;
        const int sp = (it + n - 1) % kSt, up = (it + n - 1) / kSt;
        h::mbar_wait(&k_full[s], u & 1);
        h::mbar_wait(&v_full[sp], up & 1);
        my_turn();
        K::issue_qk(sacc, q_base, k0 + s * kTileBytes);
        K::issue_pv(o, pa, v0 + sp * kTileBytes);
        pass_turn(false);
        h::wgmma_wait<1>();  // S of tile n (committed first)
        h::fence_regs(sacc);
        if (lane == 0) h::mbar_arrive(&k_empty[s]);
        K::softmax(sacc, n, rows, m, l, corr);
        h::wgmma_wait<0>();  // P V of tile n - 1
        h::fence_regs(o);
        h::fence_regs(pa);
        if (lane == 0) h::mbar_arrive(&v_empty[sp]);
        K::rescale(o, corr);
        K::pack_p(sacc, pa);
      }
      if (t == 0) h::mbar_arrive(&q_empty);  // every Q K^T of this item is complete
      const int sl = (it + n_tiles - 1) % kSt, ul = (it + n_tiles - 1) / kSt;
      h::mbar_wait(&v_full[sl], ul & 1);
      my_turn();
      K::issue_pv(o, pa, v0 + sl * kTileBytes);
      pass_turn(last_item);
      h::wgmma_wait<0>();
      h::fence_regs(o);
      h::fence_regs(pa);
      if (lane == 0) h::mbar_arrive(&v_empty[sl]);
    }
    it += n_tiles;

    // the rows' sums over the quad, then O / l and the LSE (base 2, of the scaled logits)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (row >= p.seq_len) continue;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      bf16* out = p.out + (int64_t(tok0 + row) * p.heads_q + w.head) * kD;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * j + cq) =
            __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      if (cq == 0)
        p.lse[int64_t(tok0 + row) * p.heads_q + w.head] =
            l[r] > 0.f ? m[r] * p.scale_log2 + log2f(l[r]) : -INFINITY;
    }
  }
  if constexpr (kDyn && kPingPong)
    if (wi == 0) h::named_sync(1, 256);  // warpgroup 1's last pass
}

struct Problem {
  int batch, seq_len, heads_q, heads_kv;
  bool causal;
};

static CUtensorMap map_of(const bf16* base, int heads, int tokens) {
  const uint64_t dims[3] = {kD, uint64_t(heads), uint64_t(tokens)};
  const uint64_t strides[2] = {kD * 2, uint64_t(heads) * kD * 2};
  const uint32_t box[3] = {64, 1, kBlockN};
  return h::tensor_map_16bit(base, 3, dims, strides, box, true, CU_TENSOR_MAP_SWIZZLE_128B);
}

// Runs one problem; check: compare with the double reference; reps > 0: time it.
static int run(const Problem& pr, int variant, bool check, int reps, std::mt19937& gen) {
  const int tokens = pr.batch * pr.seq_len;
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rand_bf16 = [&](size_t n) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(nd(gen));
    return v;
  };
  const std::vector<bf16> q = rand_bf16(size_t(tokens) * pr.heads_q * kD), k = rand_bf16(size_t(tokens) * pr.heads_kv * kD),
                          v = rand_bf16(size_t(tokens) * pr.heads_kv * kD);
  bf16 *dq, *dk, *dv, *dout;
  float* dlse;
  CHECK_CUDA(cudaMalloc(&dq, q.size() * 2));
  CHECK_CUDA(cudaMalloc(&dk, k.size() * 2));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * 2));
  CHECK_CUDA(cudaMalloc(&dout, q.size() * 2));
  CHECK_CUDA(cudaMalloc(&dlse, size_t(tokens) * pr.heads_q * 4));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xff, q.size() * 2));  // NaN
  CHECK_CUDA(cudaMemset(dlse, 0xff, size_t(tokens) * pr.heads_q * 4));
  CUtensorMap q_map = map_of(dq, pr.heads_q, tokens), k_map = map_of(dk, pr.heads_kv, tokens),
              v_map = map_of(dv, pr.heads_kv, tokens);
  const float sm_scale = 1.f / std::sqrt(float(kD));
  const int q_tiles = (pr.seq_len + kBlockM - 1) / kBlockM, num_items = q_tiles * pr.heads_q * pr.batch;
  Params p{dout, dlse, pr.seq_len, pr.heads_q, pr.heads_q / pr.heads_kv, pr.batch, q_tiles, num_items, nullptr,
           sm_scale * 1.4426950408889634f};
  // variant 0: the plain loop; 1: overlap + ping-pong, one block an item; 2: that, persistent
  // (snake order); 3: persistent, dynamic (atomic counter); 4: snake, 3 stages; 5: dynamic, 3 stages
  using Kernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, Params);
  const Kernel kernels[6][2] = {{attn_kernel<false, 0, false>, attn_kernel<true, 0, false>},
                                {attn_kernel<false, 2, false>, attn_kernel<true, 2, false>},
                                {attn_kernel<false, 2, true>, attn_kernel<true, 2, true>},
                                {attn_kernel<false, 2, true, 2, true>, attn_kernel<true, 2, true, 2, true>},
                                {attn_kernel<false, 2, true, 3>, attn_kernel<true, 2, true, 3>},
                                {attn_kernel<false, 2, true, 3, true>, attn_kernel<true, 2, true, 3, true>}};
  const Kernel kernel = kernels[variant][pr.causal];
  const int smem_bytes = variant >= 4 ? kTileBytes * 7 + 1024 : kSmem;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  int* counters = nullptr;
  CHECK_CUDA(cudaMalloc(&counters, 8));
  CHECK_CUDA(cudaMemset(counters, 0, 8));
  p.counters = counters;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // the checks run the persistent kernel on 5 blocks, so that each walks several items
  const int grid = variant >= 2 ? std::min(num_items, check ? 5 : sms) : num_items;
  kernel<<<grid, 384, smem_bytes>>>(q_map, k_map, v_map, p);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  static const char* const kNames[6][2] = {{"full", "causal"}, {"pingpong_full", "pingpong_causal"},
                                           {"persistent_full", "persistent_causal"},
                                           {"dynamic_full", "dynamic_causal"},
                                           {"stages3_full", "stages3_causal"},
                                           {"dynamic3_full", "dynamic3_causal"}};
  const char* name = kNames[variant][pr.causal];
  int bad = 0;
  if (check) {
    std::vector<bf16> out(q.size());
    std::vector<float> lse(size_t(tokens) * pr.heads_q);
    CHECK_CUDA(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_ref = 0, lse_err = 0;
    std::vector<double> srow(pr.seq_len);
    for (int b = 0; b < pr.batch; ++b)
      for (int hq = 0; hq < pr.heads_q; ++hq) {
        const int hk = hq / (pr.heads_q / pr.heads_kv);
        for (int i = 0; i < pr.seq_len; ++i) {
          const int last = pr.causal ? i : pr.seq_len - 1;
          double mx = -1e300;
          for (int j = 0; j <= last; ++j) {
            double acc = 0;
            for (int c = 0; c < kD; ++c)
              acc += double(__bfloat162float(q[((size_t(b) * pr.seq_len + i) * pr.heads_q + hq) * kD + c])) *
                     __bfloat162float(k[((size_t(b) * pr.seq_len + j) * pr.heads_kv + hk) * kD + c]);
            srow[j] = acc * sm_scale;
            mx = std::max(mx, srow[j]);
          }
          double sum = 0;
          for (int j = 0; j <= last; ++j) sum += (srow[j] = std::exp(srow[j] - mx));
          const double lse_ref = (mx + std::log(sum)) / std::log(2.0);  // base 2
          const float lse_got = lse[(size_t(b) * pr.seq_len + i) * pr.heads_q + hq];
          lse_err = std::max(lse_err, std::isfinite(lse_got) ? std::fabs(lse_got - lse_ref) : INFINITY);
          for (int c = 0; c < kD; ++c) {
            double acc = 0;
            for (int j = 0; j <= last; ++j)
              acc += srow[j] * __bfloat162float(v[((size_t(b) * pr.seq_len + j) * pr.heads_kv + hk) * kD + c]);
            const double ref = acc / sum;
            const float got = __bfloat162float(out[((size_t(b) * pr.seq_len + i) * pr.heads_q + hq) * kD + c]);
            const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
            max_err = std::max(max_err, err);
            max_ref = std::max(max_ref, std::fabs(ref));
          }
        }
      }
    std::printf("check_%s_b%d_s%d_h%d_%d_max_abs_err %.3g\n", name, pr.batch, pr.seq_len, pr.heads_q, pr.heads_kv,
                max_err);
    std::printf("lse_%s_b%d_s%d_h%d_%d_max_abs_err %.3g\n", name, pr.batch, pr.seq_len, pr.heads_q, pr.heads_kv,
                lse_err);
    bad = !(max_err < 2e-2) || !(lse_err < 1e-3);
  }
  if (reps > 0) {
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int r = 0; r < reps + 3; ++r) {
      CHECK_CUDA(cudaEventRecord(e0));
      kernel<<<grid, 384, smem_bytes>>>(q_map, k_map, v_map, p);
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    const double us = times[times.size() / 2] * 1e3;
    const double pairs = pr.causal ? double(pr.seq_len) * (pr.seq_len + 1) / 2 : double(pr.seq_len) * pr.seq_len;
    const double flops = 4.0 * kD * pairs * pr.heads_q * pr.batch;
    std::printf("time_%s_b%d_s%d_h%d_%d_us %.1f\n", name, pr.batch, pr.seq_len, pr.heads_q, pr.heads_kv, us);
    std::printf("tflops_%s_b%d_s%d_h%d_%d %.1f\n", name, pr.batch, pr.seq_len, pr.heads_q, pr.heads_kv,
                flops / us / 1e6);
  }
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(dlse);
  cudaFree(counters);
  return bad;
}

int main() {
  std::mt19937 gen(11);
  int bad = 0;
  try {
    for (const int variant : {0, 1, 2, 3, 4, 5}) {
      bad |= run({2, 300, 4, 2, true}, variant, true, 0, gen);
      bad |= run({2, 300, 4, 2, false}, variant, true, 0, gen);
      bad |= run({1, 257, 8, 1, true}, variant, true, 0, gen);
      bad |= run({1, 1000, 4, 4, true}, variant, true, 0, gen);
    }
    if (bad) {
      std::printf("checks_failed 1\n");
      return 1;
    }
    for (const int variant : {0, 1, 2, 3, 4, 5}) {
      run({1, 16384, 32, 8, true}, variant, false, 10, gen);
      run({4, 4096, 32, 8, false}, variant, false, 10, gen);
      run({16, 1024, 32, 8, true}, variant, false, 10, gen);
    }
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    return 2;
  }
  return 0;
}
