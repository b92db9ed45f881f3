// Tensor-core building blocks shared by the attention kernels (decode_mma.cuh,
// prefill.cuh): the mma.sync instructions, ldmatrix and shared-memory loads, fp8 widening
// and packing of 16-bit pairs. sm_80 and later.
#pragma once
#include "common/common.cuh"

namespace fij {

template <typename TKV>
struct MmaTypeOf {  // 16-bit caches run in their own type; fp8 runs in fp16
  using type = __half;
};
template <>
struct MmaTypeOf<__nv_bfloat16> {
  using type = __nv_bfloat16;
};

namespace mma_detail {

FIJ_DEVICE uint4 lds128(const void* smem) {
  uint4 v;
  const unsigned a = smem_u32(smem);
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
FIJ_DEVICE uint2 lds64(const void* smem) {
  uint2 v;
  const unsigned a = smem_u32(smem);
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
// Four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give the row addresses of
// matrix i (shared-state addresses, smem_u32); register i of lane (g = lane / 4,
// c = lane % 4) gets row g, columns 2c, 2c + 1.
FIJ_DEVICE void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The same, transposed: register i gets column g, rows 2c, 2c + 1.
FIJ_DEVICE void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FIJ_DEVICE void ldmatrix_x4(const void* smem, uint32_t (&r)[4]) { ldmatrix_x4(smem_u32(smem), r); }
FIJ_DEVICE void ldmatrix_x4_trans(const void* smem, uint32_t (&r)[4]) { ldmatrix_x4_trans(smem_u32(smem), r); }

// D += A B, m16n8k16 / m16n8k8, fp32 accumulators.
template <typename T>
FIJ_DEVICE void mma_k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two n8 tiles of one k16 step on one A fragment: d0 += a (b[0], b[1]), d1 += a (b[2], b[3]),
// b the four registers of an ldmatrix.x4 over two 8-column tiles (ptxas keeps the order).
template <typename T>
FIJ_DEVICE void mma_k16_pair(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma_k16<T>(d0, a, b[0], b[1]);
  mma_k16<T>(d1, a, b[2], b[3]);
}
template <typename T>
FIJ_DEVICE void mma_k8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  }
}

// a x b as 64 bits from 32-bit operands (one IMAD.WIDE).
FIJ_DEVICE int64_t mul_wide(int a, int b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;\n" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

FIJ_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Four fp8 values (bytes 0..3 of x) as two fp16x2, exactly: (byte 0, byte 1) -> lo,
// (byte 2, byte 3) -> hi, first byte in the low half. sm_89+: one cvt per pair. Before
// that, bit operations: e5m2 is the top byte of the fp16 of the same value; e4m3 (bias 7)
// shifted right by one under its sign is the fp16 (bias 15) of the value times 2^-8,
// subnormals included, scaled back by an exact multiply.
template <typename TKV>
FIJ_DEVICE void fp8x4_to_half2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (std::is_same_v<TKV, __nv_fp8_e5m2>) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e5m2x2 %0, l;\n cvt.rn.f16x2.e5m2x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(x));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(x));
  }
#else
  const uint32_t a = prmt(x, 0, 0x1100), b = prmt(x, 0, 0x3322);  // bytes to positions 1 and 3
  if constexpr (std::is_same_v<TKV, __nv_fp8_e5m2>) {
    lo = a & 0xff00ff00u;
    hi = b & 0xff00ff00u;
  } else {
    const __half2 k = __floats2half2_rn(256.f, 256.f);
    uint32_t wa = (a & 0x80008000u) | ((a >> 1) & 0x3f803f80u), wb = (b & 0x80008000u) | ((b >> 1) & 0x3f803f80u);
    const __half2 ha = __hmul2(*reinterpret_cast<const __half2*>(&wa), k);
    const __half2 hb = __hmul2(*reinterpret_cast<const __half2*>(&wb), k);
    lo = *reinterpret_cast<const uint32_t*>(&ha);
    hi = *reinterpret_cast<const uint32_t*>(&hb);
  }
#endif
}

template <typename T>
FIJ_DEVICE uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Two 16-bit q values (one 32-bit word) in the mma's type.
template <typename TQ, typename TM>
FIJ_DEVICE uint32_t q_word(uint32_t w) {
  if constexpr (std::is_same_v<TQ, TM>) {
    return w;
  } else {
    const TQ* v = reinterpret_cast<const TQ*>(&w);
    return pack2<TM>(static_cast<float>(v[0]), static_cast<float>(v[1]));
  }
}

}  // namespace mma_detail
}  // namespace fij
