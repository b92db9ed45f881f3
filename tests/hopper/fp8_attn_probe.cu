// FP8 attention on Hopper, standalone: the library's prefill kernel (csrc/hopper/prefill_sm90.cuh,
// its kFp8 form: q, K and V in e4m3, the output in bf16) launched on a hand-made work list and
// the host code's TMA maps (prefill_sm90_host.cuh make_params), beside its bf16 form on the
// same values (e4m3 values are exact in bf16). Ragged requests of equal length (q and K/V
// [tokens, heads, 128]), GQA, causal (bottom-right) or not, q / k / v scales.
//   - check_*: small batches (lengths not multiples of the tiles) against a double reference
//     of every row; big_*: the timed cases, a sample of their rows against it. Outputs
//     NaN-poisoned first. The error is max |got - ref| / max |ref| over the rows checked.
//   - time_*: the median of 20 launches (CUDA events) in TFLOP/s, causal counting the visible
//     (query, key) pairs.
// The fp8 tolerance: P is rounded to e4m3 (3 mantissa bits) before P V and the e4m3 MMA adds in
// ~13-14 bits (tests/hopper/fp8_probe.cu), so the output is a few percent off the exact one; a
// wrong layout or a missed tile is off by O(1). Prints "name value" lines; exit 0 when every
// check passes.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hopper/prefill_sm90_host.cuh"
#include "probe_common.cuh"

using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;
namespace sp = fij::sm90_prefill;

constexpr int kD = 128, kTile = 128;
constexpr double kFp8Tol = 6e-2, kBf16Tol = 1e-2;

struct Case {
  const char* name;
  int batch, len, heads_q, heads_kv;
  bool causal;
  int sample_rows;  // rows checked a (request, head): 0 all
};

// The work list of `batch` requests of `len` tokens (qo = kv): one tile a 128 query rows,
// heaviest first (prefill_sm90_params.h).
static std::vector<int32_t> work_list(int batch, int len, int heads_q, bool causal) {
  std::vector<fij::Sm90Tile> tiles;
  for (int b = 0; b < batch; ++b)
    for (int r = 0; r < len; r += kTile) {
      fij::Sm90Tile t{};
      t.q_row0 = b * len + r;
      t.rows = std::min(kTile, len - r);
      t.kv_row0 = b * len;
      t.kv_len = len;
      t.diag = r;  // qo_len = kv_len: row r sees keys <= r
      const int last_key = causal ? std::min(len, r + t.rows) - 1 : len - 1;
      t.kv_tiles = last_key / kTile + 1;
      t.keys = last_key + 1;
      t.first_tile = 0;
      tiles.push_back(t);
    }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const fij::Sm90Tile& a, const fij::Sm90Tile& b) { return a.kv_tiles > b.kv_tiles; });
  std::vector<int32_t> w(fij::kSm90WorkHeader + fij::kSm90TileInts * tiles.size());
  w[0] = int32_t(tiles.size()) * heads_q;
  w[1] = w[0];
  for (size_t i = 0; i < tiles.size(); ++i)
    std::memcpy(&w[fij::kSm90WorkHeader + fij::kSm90TileInts * i], &tiles[i], sizeof(fij::Sm90Tile));
  return w;
}

template <bool kFp8, bool kCausal>
static int launch(const fij::PrefillSm90Args& a, int sms) {
  fij::PrefillSm90Params p;
  const int err = sp::make_params<bf16, kD, kTile, false, false, 128, kFp8>(a, p);
  if (err != 0) return err;
  return fij::launch_prefill_sm90<bf16, kD, kCausal, kTile, false, false, 128, false, false, kFp8>(p, sms, 0);
}

static int launch_any(bool fp8_in, bool causal, const fij::PrefillSm90Args& a, int sms) {
  if (fp8_in) return causal ? launch<true, true>(a, sms) : launch<true, false>(a, sms);
  return causal ? launch<false, true>(a, sms) : launch<false, false>(a, sms);
}

// Runs one case in both forms; prints the errors (and with `timed`, the rates). 0: both checks
// passed, 1: one failed, 2: a CUDA error.
static int run_case(const Case& c, bool timed, int sms, std::mt19937& gen) {
  const int tokens = c.batch * c.len, group = c.heads_q / c.heads_kv;
  const double q_scale = 0.7, k_scale = 1.3, v_scale = 0.9, sm_scale = 1.0 / std::sqrt(double(kD));
  std::normal_distribution<float> normal(0.f, 1.f);
  // e4m3 values x (their dequantized values x times the scale), and the same in bf16 (exact)
  auto make = [&](size_t n, float spread, std::vector<fp8>& e, std::vector<bf16>& b) {
    e.resize(n);
    b.resize(n);
    for (size_t i = 0; i < n; ++i) {
      e[i] = fp8(spread * normal(gen));
      b[i] = bf16(float(e[i]));
    }
  };
  std::vector<fp8> q8, k8, v8;
  std::vector<bf16> qb, kb, vb;
  make(size_t(tokens) * c.heads_q * kD, 2.0f, q8, qb);
  make(size_t(tokens) * c.heads_kv * kD, 1.0f, k8, kb);
  make(size_t(tokens) * c.heads_kv * kD, 1.0f, v8, vb);
  const std::vector<int32_t> work = work_list(c.batch, c.len, c.heads_q, c.causal);

  void *dq8, *dk8, *dv8, *dqb, *dkb, *dvb, *dout;
  int32_t *dwork, *dcounters;
  const size_t out_elems = size_t(tokens) * c.heads_q * kD;
  CHECK_CUDA(cudaMalloc(&dq8, q8.size()));
  CHECK_CUDA(cudaMalloc(&dk8, k8.size()));
  CHECK_CUDA(cudaMalloc(&dv8, v8.size()));
  CHECK_CUDA(cudaMalloc(&dqb, qb.size() * 2));
  CHECK_CUDA(cudaMalloc(&dkb, kb.size() * 2));
  CHECK_CUDA(cudaMalloc(&dvb, vb.size() * 2));
  CHECK_CUDA(cudaMalloc(&dout, out_elems * 2));
  CHECK_CUDA(cudaMalloc(&dwork, work.size() * 4));
  CHECK_CUDA(cudaMalloc(&dcounters, 2 * 4));
  CHECK_CUDA(cudaMemcpy(dq8, q8.data(), q8.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk8, k8.data(), k8.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv8, v8.data(), v8.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dqb, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkb, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dvb, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dwork, work.data(), work.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dcounters, 0, 2 * 4));

  // the reference rows: every row, or sample_rows spread over each (request, head)
  std::vector<int> rows;
  if (c.sample_rows == 0) {
    for (int r = 0; r < c.len; ++r) rows.push_back(r);
  } else {
    for (int i = 0; i < c.sample_rows; ++i) rows.push_back(int((int64_t(i) * 7919) % c.len));
    rows.push_back(c.len - 1);
  }
  std::vector<double> ref;  // [b][h][row in rows][kD]
  for (int b = 0; b < c.batch; ++b)
    for (int hq = 0; hq < c.heads_q; ++hq) {
      const int hk = hq / group;
      for (int r : rows) {
        const int keys = c.causal ? r + 1 : c.len;
        std::vector<double> logit(keys);
        double mx = -INFINITY;
        const size_t qo = (size_t(b * c.len + r) * c.heads_q + hq) * kD;
        for (int j = 0; j < keys; ++j) {
          const size_t ko = (size_t(b * c.len + j) * c.heads_kv + hk) * kD;
          double acc = 0;
          for (int d = 0; d < kD; ++d) acc += double(float(q8[qo + d])) * double(float(k8[ko + d]));
          logit[j] = acc * q_scale * k_scale * sm_scale;
          mx = std::max(mx, logit[j]);
        }
        std::vector<double> o(kD, 0.0);
        double l = 0;
        for (int j = 0; j < keys; ++j) {
          const double pj = std::exp(logit[j] - mx);
          l += pj;
          const size_t vo = (size_t(b * c.len + j) * c.heads_kv + hk) * kD;
          for (int d = 0; d < kD; ++d) o[d] += pj * double(float(v8[vo + d]));
        }
        for (int d = 0; d < kD; ++d) ref.push_back(o[d] / l * v_scale);
      }
    }

  int failed = 0;
  for (int form = 0; form < 2; ++form) {  // 0: fp8, 1: bf16 on the same values
    const bool fp8_in = form == 0;
    fij::PrefillSm90Args a;
    a.q = fp8_in ? dq8 : dqb;
    a.k = fp8_in ? dk8 : dkb;
    a.v = fp8_in ? dv8 : dvb;
    a.q_tokens = tokens;
    a.q_stride_n = int64_t(c.heads_q) * kD;
    a.q_stride_h = kD;
    a.kv_tokens = tokens;
    a.k_stride_n = a.v_stride_n = int64_t(c.heads_kv) * kD;
    a.k_stride_h = a.v_stride_h = kD;
    a.num_qo_heads = c.heads_q;
    a.num_kv_heads = c.heads_kv;
    a.out = dout;
    a.out_stride_n = int64_t(c.heads_q) * kD;
    a.out_stride_h = kD;
    a.work = dwork;
    a.counters = dcounters;
    a.scale_log2 = float(q_scale * k_scale * sm_scale * 1.4426950408889634);
    a.v_scale = float(v_scale);
    CHECK_CUDA(cudaMemset(dout, 0xff, out_elems * 2));  // NaN: unwritten rows fail
    int err = launch_any(fp8_in, c.causal, a, sms);
    if (err != 0) {
      std::printf("cuda_error %s (%s launch)\n", cudaGetErrorString(cudaError_t(err)), c.name);
      return 2;
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<bf16> out(out_elems);
    CHECK_CUDA(cudaMemcpy(out.data(), dout, out_elems * 2, cudaMemcpyDeviceToHost));
    std::vector<float> got;
    got.reserve(ref.size());
    for (int b = 0; b < c.batch; ++b)
      for (int hq = 0; hq < c.heads_q; ++hq)
        for (int r : rows)
          for (int d = 0; d < kD; ++d) got.push_back(float(out[(size_t(b * c.len + r) * c.heads_q + hq) * kD + d]));
    const double e = max_rel_err(got, ref);
    std::printf("%s_%s_rel_err %.3g\n", c.name, fp8_in ? "fp8" : "bf16", e);
    failed += !(e < (fp8_in ? kFp8Tol : kBf16Tol));
    if (timed) {
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      std::vector<float> ms;
      for (int i = 0; i < 25; ++i) {
        CHECK_CUDA(cudaEventRecord(e0));
        launch_any(fp8_in, c.causal, a, sms);
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 5) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double pairs = c.causal ? double(c.len) * (c.len + 1) / 2 : double(c.len) * c.len;
      const double flops = 4.0 * kD * pairs * c.batch * c.heads_q;
      std::printf("%s_%s_us %.1f\n", c.name, fp8_in ? "fp8" : "bf16", ms[ms.size() / 2] * 1e3);
      std::printf("%s_%s_tflops %.1f\n", c.name, fp8_in ? "fp8" : "bf16", flops / (ms[ms.size() / 2] * 1e-3) / 1e12);
      CHECK_CUDA(cudaEventDestroy(e0));
      CHECK_CUDA(cudaEventDestroy(e1));
    }
  }
  for (void* ptr : {dq8, dk8, dv8, dqb, dkb, dvb, dout}) CHECK_CUDA(cudaFree(ptr));
  CHECK_CUDA(cudaFree(dwork));
  CHECK_CUDA(cudaFree(dcounters));
  return failed ? 1 : 0;
}

int main(int argc, char** argv) {
  // argument "checks": the small cases only (for compute-sanitizer)
  const bool checks_only = argc > 1 && std::string(argv[1]) == "checks";
  int major = 0, sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (major != 9) {
    std::printf("skip: needs an sm_90 device\n");
    return 0;
  }
  std::mt19937 gen(1234);
  const Case checks[] = {
      {"check_causal", 3, 300, 8, 2, true, 0},
      {"check_full", 3, 300, 8, 2, false, 0},
      {"check_causal_odd", 2, 77, 4, 4, true, 0},
  };
  const Case big[] = {
      {"big_causal_4x4k", 4, 4096, 32, 8, true, 6},
      {"big_full_4x4k", 4, 4096, 32, 8, false, 6},
      {"big_causal_1x16k", 1, 16384, 32, 8, true, 4},
  };
  int status = 0;
  for (const Case& c : checks) status = std::max(status, run_case(c, false, sms, gen));
  if (!checks_only)
    for (const Case& c : big) status = std::max(status, run_case(c, true, sms, gen));
  return status;
}
