// Quantized linear layers with 8-bit dynamic activations for one to a few rows (decode, speculative
// verification) on CPUs with integer dot products: AVX512-VNNI (vpdpbusd), AVX2 (vpmaddubsw) or portable C++.
//
// Activations are quantized per row and per group of `group` input channels (the weight's group): symmetric,
// q = round(x * 127 / absmax), values -127..127, scale absmax / 127. Every group's integer dot product is exact;
// the float work is one multiply-add per group and 16 output rows.
//
// int4_a8_linear(x [M, K] fp32|bf16, weight uint8 [N/16, K/8, 64], scale_min bf16 [N/16, G, 2, 16], group)
//   Weights w = code * scale + min per (row, group), codes 0..15. In a block of 16 output rows, the 64 bytes of
//   chunk c hold, for row r at bytes 4r..4r+3, codes of columns 8c..8c+3 in the low nibbles and 8c+4..8c+7 in
//   the high ones: one 64-byte load feeds 16 rows x 8 columns, and each broadcast of 4 activation bytes serves
//   16 rows (the sharing of activation loads across output rows that integer dot products need).
//   y[m, r] = sum_g sx[m,g] * (scale[r,g] * sum_k code[r,k] q[m,k] + min[r,g] * sum_k q[m,k]).
//
//   Symmetric codes (every Q4_0 block): scale_min may instead be fp16 scales [N/16, G, 16] alone, w = (code - 8) *
//   scale: half the scale bytes (4.5 bits a weight instead of 5) and the file's scales kept exactly;
//   y[m, r] = sum_g scale[r,g] * (sx[m,g] * sum_k code[r,k] q[m,k] - 8 * sxs[m,g]).
//   scale_min may also be fp32 [N/16, G, 2, 16] (any scales exactly), or a GGUF Q4_K file's two-level scales, uint8
//   [N/16, G/8, 320] (group 32): per super-group of 8 groups, the 16 rows' fp16 d then fp16 dmin (64 bytes), then
//   per group the 16 rows' 6-bit sc then m (32 bytes): scale = d * sc, min = -dmin * m, each exact in fp32 and
//   computed per group as the scales are read: 4.625 bits a weight, the file's weights exactly.
//
// int8_a8_linear(x [M, K], weight uint8 [N/16, K/4, 64], scale fp32 [N] | [N/16, Gw, 16], group)
//   Weights w = code * scale[r] (symmetric per row), or code * scale[r, gw] per group of K / Gw input channels (a
//   whole number of activation groups: a GGUF file's Q8_0 and Q6_K blocks), codes -128..127 stored biased, code +
//   128 (the sign bit flipped); chunk c holds row r's columns 4c..4c+3 at bytes 4r..4r+3. vpdpbusd multiplies
//   unsigned by signed bytes: the biased codes are its unsigned operand, and 128 * sum_k q[m,k] (the activation
//   group's sum of codes, known from quantizing it) is subtracted, so no per-weight sums are stored or read.
//   y[m, r] = scale[r] * sum_g sx[m,g] * (sum_k (code[r,k] + 128) q[m,k] - 128 * sum_k q[m,k]), or with group
//   scales sum_g (sx[m,g] * scale[r, g / (Ga / Gw)]) * (...). Group scales come blocked as the weight is, a block's
//   16 rows side by side per group, so each group's are one 64-byte load (a gather from row-major scales, 16 rows
//   apart, ran the 3B head's decode call at 18 GB/s against 26 for per-row scales).
//   Or a GGUF Q6_K file's two-level scales, uint8 [N/16, Gw/16, 288]: per super-group of 16 scale groups, the 16
//   rows' fp16 d (32 bytes), then per group the 16 rows' int8 sc: scale = d * sc, exact in fp32, computed per group
//   as they are read (0.56 bits a weight read instead of 2).
//
// int4_a8_dense_t(weight, scale_min, group, dtype) -> bf16 | fp32 [K, N]; int4_a8_dense_t_out(..., out): into out
//   The same weights dequantized, transposed, for prompts: many rows run faster as one bf16 GEMM (AMX, AVX512-BF16)
//   over a weight dequantized on the fly than through the integer kernel, and nothing needs to stay resident.
//   w = fma(code, scale, min) in fp32 (for bf16 then rounded to nearest, ties to even). Block b, chunk c, row r: the 16
//   rows' 4-byte words are one 64-byte load, and column 8c+j of all 16 rows is one 16-value store into row 8c+j of
//   the [K, N] output; threads split the input columns, so each writes whole output rows.
//
// Work is split over threads by blocks of 16 output rows (contiguous ranges, so each thread streams its part of
// the weight once); rows of x are taken 4 at a time over the same weights.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#ifndef AHEAD
#define AHEAD 2048
#endif

namespace {

constexpr int64_t kRows = 16;  // output rows per weight block
constexpr int64_t kMR = 4;     // activation rows per pass over a block
constexpr int64_t kAheadBytes = AHEAD;  // software prefetch distance in the weight stream
constexpr int64_t kAheadGroups = 4;      // and in the scales
constexpr int64_t kParallelWork = 16384;  // blocks x in_features x rows from which the work is split over threads

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kIsa = "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "portable";
#endif

// ---- activations -----------------------------------------------------------------------------------------------

struct Activations {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> sx;   // [M, G] scale of each group
  std::vector<float> sxs;  // [M, G] scale * sum of the group's codes
  std::vector<int32_t> sum;  // [M, G] sum of the group's codes
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

// one group of one row: codes into dst, returns (scale, sum of codes)
template <typename T>
inline void quantize_group(const T* src, int64_t group, int8_t* dst, float& scale, int32_t& sum) {
#if defined(__AVX512F__)
  if (group % 16 == 0) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < group; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(src + k)));
    const float amax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    __m512i vsum = _mm512_setzero_si512();
    for (int64_t k = 0; k < group; k += 16) {
      // the current rounding mode (to nearest, ties to even), as std::nearbyint
      __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + k), inv));
      r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
      vsum = _mm512_add_epi32(vsum, r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(r));
    }
    scale = amax / 127.f;
    sum = _mm512_reduce_add_epi32(vsum);
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t k = 0; k < group; ++k) amax = std::max(amax, std::fabs(static_cast<float>(src[k])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int64_t k = 0; k < group; ++k) {
    float r = std::nearbyint(static_cast<float>(src[k]) * inv);
    r = std::min(127.f, std::max(-127.f, r));
    dst[k] = static_cast<int8_t>(r);
    s += dst[k];
  }
  scale = amax / 127.f;
  sum = s;
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t group, Activations& a) {
  const int64_t G = K / group;
  // buffers only grow: a decode step's calls allocate nothing
  if (static_cast<int64_t>(a.q.size()) < M * K) a.q.resize(M * K);
  if (static_cast<int64_t>(a.sx.size()) < M * G) {
    a.sx.resize(M * G);
    a.sxs.resize(M * G);
    a.sum.resize(M * G);
  }
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        float scale;
        int32_t s;
        quantize_group(x + m * K + g * group, group, a.q.data() + m * K + g * group, scale, s);
        a.sx[m * G + g] = scale;
        a.sum[m * G + g] = s;
        a.sxs[m * G + g] = scale * static_cast<float>(s);
      }
    }
  };
  if (M >= 16) at::parallel_for(0, M, 8, body);
  else body(0, M);
}

// ---- output ------------------------------------------------------------------------------------------------------

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX2__)
inline __m256 load_bf16x8(const c10::BFloat16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load_bf16x8(const float* p) { return _mm256_loadu_ps(p); }  // fp32 scales
inline __m256 load_bf16x8(const c10::Half* p) {  // fp16 scales (the symmetric layout)
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}
#endif

#if defined(__AVX2__)
// the AVX2 paths' accumulators: rows 0-7 and 8-15 of the block per activation row
template <int MR>
inline void store_halves(const __m256 (&out)[MR][2], float* acc) {
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(acc + m * kRows, out[m][0]);
    _mm256_storeu_ps(acc + m * kRows + 8, out[m][1]);
  }
}
#endif

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- GGUF two-level scales (Q4_K, Q6_K) ---------------------------------------------------------------------------
constexpr int64_t kSuper = 8;                                    // groups of 32 per Q4_K super-block
constexpr int64_t kSuperBytes = 4 * kRows + kSuper * 2 * kRows;  // d, dmin (fp16) then sc, m per group (uint8)
constexpr int64_t kSuper6 = 16;                                  // scale groups (of 16 inputs) per Q6_K super-block
constexpr int64_t kSuper6Bytes = 2 * kRows + kSuper6 * kRows;    // d (fp16) then sc per group (int8)

// The 16 rows' fp32 scales and minimums of group g from a block's Q4_K bytes: d * sc and -dmin * m, exact. (The
// decode kernels' SIMD paths compute the same in registers.)
inline void k4_group_scales(const uint8_t* kblock, int64_t g, float* scale, float* mn) {
  const uint8_t* kb = kblock + (g / kSuper) * kSuperBytes;
  const uint8_t* sc = kb + 4 * kRows + (g % kSuper) * 2 * kRows;
  const c10::Half* dd = reinterpret_cast<const c10::Half*>(kb);
#if defined(__AVX512F__)
  _mm512_storeu_ps(scale, _mm512_mul_ps(load16(dd), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))))));
  _mm512_storeu_ps(mn, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), load16(dd + kRows)),
                                     _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kRows))))));
#else
  for (int64_t r = 0; r < kRows; ++r) {
    scale[r] = static_cast<float>(dd[r]) * static_cast<float>(sc[r]);
    mn[r] = -static_cast<float>(dd[kRows + r]) * static_cast<float>(sc[kRows + r]);
  }
#endif
}

// The 16 rows' fp32 scales of scale group gi from a block's Q6_K scale bytes: d * sc, exact
inline void k6_group_scales(const uint8_t* kblock, int64_t gi, float* scale) {
  const uint8_t* kb = kblock + (gi / kSuper6) * kSuper6Bytes;
  const c10::Half* dd = reinterpret_cast<const c10::Half*>(kb);
  const int8_t* sc = reinterpret_cast<const int8_t*>(kb + 2 * kRows + (gi % kSuper6) * kRows);
  for (int64_t r = 0; r < kRows; ++r) scale[r] = static_cast<float>(dd[r]) * static_cast<float>(sc[r]);
}

// ---- int4 weights ------------------------------------------------------------------------------------------------
// One block of 16 output rows against MR activation rows; acc [MR][16] fp32.

// S = c10::BFloat16 or float: scale_min [G, 2, 16] per block (scales then minimums); S = c10::Half: scales [G, 16]
// of symmetric codes (minimum -8 x scale); S = uint8_t: Q4_K's two-level scales [G/8, 320] (group 32)
template <int MR, typename S>
void int4_block(const uint8_t* w, const S* sm, const Activations& a, int64_t m0, int64_t K,
                int64_t group, float* acc) {
  constexpr bool kSym = std::is_same_v<S, c10::Half>;
  constexpr bool kK = std::is_same_v<S, uint8_t>;
  constexpr int64_t kPer = kK ? kSuperBytes / kSuper : kSym ? kRows : 2 * kRows;  // scale values (bytes) per group
  const int64_t G = K / group;
  const int64_t chunks = group / 8;
  const int8_t* xq = a.q.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * G;
  const float* sxs = a.sxs.data() + m0 * G;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 out[MR];
  for (int m = 0; m < MR; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i lo_acc[MR], hi_acc[MR];
    for (int m = 0; m < MR; ++m) lo_acc[m] = hi_acc[m] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * group;
    _mm_prefetch(reinterpret_cast<const char*>(sm + (g + kAheadGroups) * kPer), _MM_HINT_T0);
    for (int64_t c = 0; c < chunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadBytes), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w);
      w += 64;
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xm = xg + m * K + 8 * c;
        lo_acc[m] = _mm512_dpbusd_epi32(lo_acc[m], lo, _mm512_set1_epi32(load4(xm)));
        hi_acc[m] = _mm512_dpbusd_epi32(hi_acc[m], hi, _mm512_set1_epi32(load4(xm + 4)));
      }
    }
    __m512 scale, mn;
    if constexpr (kK) {  // d * sc and -dmin * m, exact in fp32
      const uint8_t* kb = sm + (g / kSuper) * kSuperBytes;
      const uint8_t* sc = kb + 4 * kRows + (g % kSuper) * 2 * kRows;
      const __m512 d = load16(reinterpret_cast<const c10::Half*>(kb));
      const __m512 dm = load16(reinterpret_cast<const c10::Half*>(kb) + kRows);
      scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(sc)))));
      mn = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dm), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kRows)))));
    } else {
      scale = load16(sm + g * kPer);
      mn = kSym ? scale : load16(sm + g * kPer + kRows);
    }
    if constexpr (kSym) {
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[m], hi_acc[m]));
        const __m512 t = _mm512_fmsub_ps(d, _mm512_set1_ps(sx[m * G + g]), _mm512_set1_ps(8.f * sxs[m * G + g]));
        out[m] = _mm512_fmadd_ps(scale, t, out[m]);
      }
    } else {
      for (int m = 0; m < MR; ++m) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[m], hi_acc[m]));
        out[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sxs[m * G + g]), out[m]);
        out[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(scale, _mm512_set1_ps(sx[m * G + g])), out[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc + m * kRows, out[m]);
#elif defined(__AVX2__) && defined(__FMA__)
  // the 64-byte chunk as two halves of 8 rows; u8 x s8 pairs summed in 16 bits (at most 2 * 15 * 127) then 32
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[MR][2];
  for (int m = 0; m < MR; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i iacc[MR][2];
    for (int m = 0; m < MR; ++m) iacc[m][0] = iacc[m][1] = _mm256_setzero_si256();
    const int8_t* xg = xq + g * group;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xm = xg + m * K + 8 * c;
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xm))),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xm + 4))));
          iacc[m][h] = _mm256_add_epi32(iacc[m][h], _mm256_madd_epi16(p, ones));
        }
      }
      w += 64;
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, mn;
      if constexpr (kK) {  // d * sc and -dmin * m, exact in fp32
        const uint8_t* kb = sm + (g / kSuper) * kSuperBytes;
        const uint8_t* sc = kb + 4 * kRows + (g % kSuper) * 2 * kRows + 8 * h;
        const c10::Half* dd = reinterpret_cast<const c10::Half*>(kb) + 8 * h;
        scale = _mm256_mul_ps(load_bf16x8(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))));
        mn = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), load_bf16x8(dd + kRows)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + kRows)))));
      } else {
        scale = load_bf16x8(sm + g * kPer + 8 * h);
        mn = kSym ? scale : load_bf16x8(sm + g * kPer + kRows + 8 * h);
      }
      if constexpr (kSym) {
        for (int m = 0; m < MR; ++m) {
          const __m256 d = _mm256_cvtepi32_ps(iacc[m][h]);
          const __m256 t = _mm256_fmsub_ps(d, _mm256_set1_ps(sx[m * G + g]), _mm256_set1_ps(8.f * sxs[m * G + g]));
          out[m][h] = _mm256_fmadd_ps(scale, t, out[m][h]);
        }
      } else {
        for (int m = 0; m < MR; ++m) {
          const __m256 d = _mm256_cvtepi32_ps(iacc[m][h]);
          out[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sxs[m * G + g]), out[m][h]);
          out[m][h] = _mm256_fmadd_ps(d, _mm256_mul_ps(scale, _mm256_set1_ps(sx[m * G + g])), out[m][h]);
        }
      }
    }
  }
  store_halves<MR>(out, acc);
#else
  float out[MR][kRows] = {};
  for (int64_t g = 0; g < G; ++g) {
    int32_t iacc[MR][kRows] = {};
    const int8_t* xg = xq + g * group;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int r = 0; r < kRows; ++r) {
        for (int j = 0; j < 4; ++j) {
          const int32_t lo = w[4 * r + j] & 0x0F, hi = w[4 * r + j] >> 4;
          for (int m = 0; m < MR; ++m) iacc[m][r] += lo * xg[m * K + 8 * c + j] + hi * xg[m * K + 8 * c + 4 + j];
        }
      }
      w += 64;
    }
    float ks[kRows], kmn[kRows];
    if constexpr (kK) k4_group_scales(sm, g, ks, kmn);
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < kRows; ++r) {
        float scale, mn;
        if constexpr (kK) {
          scale = ks[r];
          mn = kmn[r];
        } else {
          scale = static_cast<float>(sm[g * kPer + r]);
          mn = kSym ? 0.f : static_cast<float>(sm[g * kPer + kRows + r]);
        }
        if constexpr (kSym) {
          const float t = std::fma(static_cast<float>(iacc[m][r]), sx[m * G + g], -8.f * sxs[m * G + g]);
          out[m][r] = std::fma(scale, t, out[m][r]);
        } else {
          out[m][r] = std::fma(mn, sxs[m * G + g], out[m][r]);
          out[m][r] = std::fma(static_cast<float>(iacc[m][r]), scale * sx[m * G + g], out[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(acc + m * kRows, out[m], sizeof(out[m]));
#endif
}

// ---- int8 weights ------------------------------------------------------------------------------------------------

// gs: with group scales, the block's [Gw, 16] scales, and per_scale activation groups per scale group; nullptr:
// per-row scales, applied by the caller. K6: k6, the block's Q6_K two-level scales [Gw/16, 288], instead of gs.
template <int MR, bool K6 = false>
void int8_block(const uint8_t* w, const Activations& a, int64_t m0, int64_t K, int64_t group, float* acc,
                const float* gs = nullptr, int64_t per_scale = 1, const uint8_t* k6 = nullptr) {
  const int64_t G = K / group;
  const int64_t chunks = group / 4;
  const int8_t* xq = a.q.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * G;
  const int32_t* qsum = a.sum.data() + m0 * G;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 out[MR];
  for (int m = 0; m < MR; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ia[MR], ib[MR];
    for (int m = 0; m < MR; ++m) ia[m] = ib[m] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * group;
    int64_t c = 0;
    for (; c + 1 < chunks; c += 2) {
      const __m512i v0 = _mm512_loadu_si512(w);
      const __m512i v1 = _mm512_loadu_si512(w + 64);
      w += 128;
      for (int m = 0; m < MR; ++m) {
        const int8_t* xm = xg + m * K + 4 * c;
        ia[m] = _mm512_dpbusd_epi32(ia[m], v0, _mm512_set1_epi32(load4(xm)));
        ib[m] = _mm512_dpbusd_epi32(ib[m], v1, _mm512_set1_epi32(load4(xm + 4)));
      }
    }
    for (; c < chunks; ++c) {
      const __m512i v0 = _mm512_loadu_si512(w);
      w += 64;
      for (int m = 0; m < MR; ++m)
        ia[m] = _mm512_dpbusd_epi32(ia[m], v0, _mm512_set1_epi32(load4(xg + m * K + 4 * c)));
    }
    // per-row scales: 1 here (sx * 1 is sx, bit for bit), applied by the caller
    __m512 sw;
    if constexpr (K6) {  // d * sc, exact in fp32
      const int64_t gi = g / per_scale;
      const uint8_t* kb = k6 + (gi / kSuper6) * kSuper6Bytes;
      sw = _mm512_mul_ps(load16(reinterpret_cast<const c10::Half*>(kb)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                             reinterpret_cast<const __m128i*>(kb + 2 * kRows + (gi % kSuper6) * kRows)))));
    } else {
      sw = gs != nullptr ? _mm512_loadu_ps(gs + (g / per_scale) * kRows) : _mm512_set1_ps(1.f);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i bias = _mm512_set1_epi32(qsum[m * G + g] * 128);  // the codes' + 128, times the activations
      const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(ia[m], ib[m]), bias));
      out[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_set1_ps(sx[m * G + g]), sw), out[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(acc + m * kRows, out[m]);
#elif defined(__AVX2__) && defined(__FMA__)
  // u8 x s8 pairs in 16 bits can saturate (2 * 255 * 127 > 32767), so AVX2 takes the signed codes back (the sign bit
  // flipped again) and widens them to 16 bits: vpmaddwd of int16 pairs is exact
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 out[MR][2];
  for (int m = 0; m < MR; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i iacc[MR][2];
    for (int m = 0; m < MR; ++m) iacc[m][0] = iacc[m][1] = _mm256_setzero_si256();
    const int8_t* xg = xq + g * group;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h)), sign);
        // 8 rows x 4 bytes: widen pairs (k, k+1) and (k+2, k+3) of each row to int16
        const __m256i w01 = _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);  // byte 0 of each row
        const __m256i w1 = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24);
        const __m256i w2 = _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24);
        const __m256i w3 = _mm256_srai_epi32(v, 24);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xm = xg + m * K + 4 * c;
          __m256i s = _mm256_mullo_epi32(w01, _mm256_set1_epi32(xm[0]));
          s = _mm256_add_epi32(s, _mm256_mullo_epi32(w1, _mm256_set1_epi32(xm[1])));
          s = _mm256_add_epi32(s, _mm256_mullo_epi32(w2, _mm256_set1_epi32(xm[2])));
          s = _mm256_add_epi32(s, _mm256_mullo_epi32(w3, _mm256_set1_epi32(xm[3])));
          iacc[m][h] = _mm256_add_epi32(iacc[m][h], s);
        }
      }
      w += 64;
    }
    for (int h = 0; h < 2; ++h) {
      __m256 sw;
      if constexpr (K6) {  // d * sc, exact in fp32
        const int64_t gi = g / per_scale;
        const uint8_t* kb = k6 + (gi / kSuper6) * kSuper6Bytes;
        sw = _mm256_mul_ps(load_bf16x8(reinterpret_cast<const c10::Half*>(kb) + 8 * h),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i*>(kb + 2 * kRows + (gi % kSuper6) * kRows + 8 * h)))));
      } else {
        sw = gs != nullptr ? _mm256_loadu_ps(gs + (g / per_scale) * kRows + 8 * h) : _mm256_set1_ps(1.f);
      }
      for (int m = 0; m < MR; ++m)
        out[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][h]), _mm256_mul_ps(_mm256_set1_ps(sx[m * G + g]), sw),
                                    out[m][h]);
    }
  }
  (void)qsum;
  store_halves<MR>(out, acc);
#else
  float out[MR][kRows] = {};
  for (int64_t g = 0; g < G; ++g) {
    int32_t iacc[MR][kRows] = {};
    const int8_t* xg = xq + g * group;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < 4; ++j)
          for (int m = 0; m < MR; ++m)
            iacc[m][r] += static_cast<int32_t>(static_cast<int8_t>(w[4 * r + j] ^ 0x80u)) * xg[m * K + 4 * c + j];
      w += 64;
    }
    float sw[kRows];
    if constexpr (K6) k6_group_scales(k6, g / per_scale, sw);
    else
      for (int r = 0; r < kRows; ++r) sw[r] = gs != nullptr ? gs[(g / per_scale) * kRows + r] : 1.f;
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < kRows; ++r)
        out[m][r] = std::fma(static_cast<float>(iacc[m][r]), sx[m * G + g] * sw[r], out[m][r]);
  }
  (void)qsum;
  for (int m = 0; m < MR; ++m) std::memcpy(acc + m * kRows, out[m], sizeof(out[m]));
#endif
}

// ---- dequantized copies (prompts) ----------------------------------------------------------------------------------

inline uint16_t bf16_bits(float f) {  // to nearest, ties to even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// chunk c (input columns 8c..8c+7) of every block into rows 8c..8c+7 of out [K, N] (fp32, or bf16 bits): each
// thread writes whole output rows, in order
template <typename O, typename S>
void dense_chunk(const uint8_t* w, const S* sm, int64_t K, int64_t group, int64_t NB, int64_t c, O* out) {
  constexpr bool kBf16 = std::is_same_v<O, uint16_t>;
  constexpr bool kSym = std::is_same_v<S, c10::Half>;  // scales alone, minimum -8 x scale (exact in fp32)
  constexpr bool kK = std::is_same_v<S, uint8_t>;       // Q4_K's two levels (group 32): d * sc, -dmin * m
  constexpr int64_t kPer = kSym ? kRows : 2 * kRows;
  const int64_t G = K / group, N = NB * kRows;
  for (int64_t b = 0; b < NB; ++b) {
    alignas(64) float kbuf[2 * kRows];
    const auto* sg = [&] {
      if constexpr (kK) {
        k4_group_scales(sm + b * (G / kSuper) * kSuperBytes, 8 * c / group, kbuf, kbuf + kRows);
        return static_cast<const float*>(kbuf);
      } else {
        return sm + (b * G + 8 * c / group) * kPer;
      }
    }();
    const uint8_t* wc = w + (b * (K / 8) + c) * 64;
    O* o = out + 8 * c * N + b * kRows;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 s = load16(sg);
    const __m512 mn = kSym ? _mm512_mul_ps(s, _mm512_set1_ps(-8.f)) : load16(sg + kRows);
    const __m512i u = _mm512_loadu_si512(wc), nib = _mm512_set1_epi32(0x0F);
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int j = 0; j < 8; ++j) {  // column 8c+j: low nibbles (j < 4) then high ones, of byte j % 4
      const int shift = 8 * (j % 4) + 4 * (j / 4);
      const __m512i code = _mm512_and_si512(_mm512_srli_epi32(u, shift), nib);
      const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), s, mn);
      if constexpr (kBf16) {
        __m512i bits = _mm512_castps_si512(f);
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j * N),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
      } else {
        _mm512_storeu_ps(o + j * N, f);
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 s[2] = {load_bf16x8(sg), load_bf16x8(sg + 8)};
    const __m256 m8 = _mm256_set1_ps(-8.f);
    const __m256 mn[2] = {kSym ? _mm256_mul_ps(s[0], m8) : load_bf16x8(sg + kRows),
                          kSym ? _mm256_mul_ps(s[1], m8) : load_bf16x8(sg + kRows + 8)};
    const __m256i u[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32))};
    const __m256i nib = _mm256_set1_epi32(0x0F), bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    for (int j = 0; j < 8; ++j) {
      const int shift = 8 * (j % 4) + 4 * (j / 4);
      __m256i bits[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i code = _mm256_and_si256(_mm256_srli_epi32(u[h], shift), nib);
        const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), s[h], mn[h]);
        if constexpr (kBf16) {
          bits[h] = _mm256_castps_si256(f);
          bits[h] = _mm256_srli_epi32(
              _mm256_add_epi32(bits[h], _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(bits[h], 16), one))),
              16);
        } else {
          _mm256_storeu_ps(o + j * N + 8 * h, f);
        }
      }
      if constexpr (kBf16)  // packus interleaves 128-bit lanes: put rows 0-7 then 8-15 back in order
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j * N),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[0], bits[1]), 0xD8));
    }
#else
    float s[kRows], mn[kRows];
    uint32_t u[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      s[r] = static_cast<float>(sg[r]);
      mn[r] = kSym ? -8.f * s[r] : static_cast<float>(sg[kRows + r]);
      std::memcpy(&u[r], wc + 4 * r, 4);
    }
    for (int j = 0; j < 8; ++j) {
      const int shift = 8 * (j % 4) + 4 * (j / 4);
      for (int64_t r = 0; r < kRows; ++r) {
        const float f = std::fma(static_cast<float>((u[r] >> shift) & 0x0Fu), s[r], mn[r]);
        if constexpr (kBf16) o[j * N + r] = bf16_bits(f);
        else o[j * N + r] = f;
      }
    }
#endif
  }
}

// ---- operators ---------------------------------------------------------------------------------------------------

void check_x(const at::Tensor& x, int64_t K, int64_t group, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " input features, the weight ", K);
  TORCH_CHECK(group > 0 && K % group == 0 && (32 % group == 0 || group % 32 == 0) && group % 4 == 0, op, ": group ",
              group, " must divide in_features ", K, " and be 4, 8, 16 or a multiple of 32");
}

const Activations& quantize(const at::Tensor& x, int64_t group) {
  thread_local Activations a;
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) quantize_rows(x.data_ptr<float>(), M, K, group, a);
  else quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, group, a);
  return a;
}

// run block(i, nb, m0, mr, acc) for every block of 16 output rows of every output i and every pass of up to 4 rows
// of x; output i is [M, Ns[i]]. All outputs' blocks share one parallel region (a fused q/k/v or gate/up call).
template <typename Block>
std::vector<at::Tensor> run_blocks(const at::Tensor& x, const std::vector<int64_t>& Ns,
                                   const std::vector<const float*>& row_scale, Block block) {
  const int64_t M = x.size(0), n_out = static_cast<int64_t>(Ns.size());
  std::vector<at::Tensor> ys;
  std::vector<int64_t> first(n_out + 1, 0);  // first block of each output in the joint block range
  for (int64_t i = 0; i < n_out; ++i) {
    ys.push_back(at::empty({M, Ns[i]}, x.options()));
    first[i + 1] = first[i] + Ns[i] / kRows;
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t NB = first[n_out];
  // below about 16K (block x input x row) units a second thread's start costs more than it saves (~2 us)
  const int64_t grain = NB * x.size(1) * M >= kParallelWork ? 1 : std::max<int64_t>(NB, 1);
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    float acc[kMR * kRows];
    int64_t i = 0;
    for (int64_t b = b0; b < b1; ++b) {
      while (b >= first[i + 1]) ++i;
      const int64_t nb = b - first[i], N = Ns[i];
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t mr = std::min(kMR, M - m0);
        block(i, nb, m0, mr, acc);
        for (int64_t m = 0; m < mr; ++m) {
          float* row = acc + m * kRows;
          if (row_scale[i] != nullptr)
            for (int64_t r = 0; r < kRows; ++r) row[r] *= row_scale[i][nb * kRows + r];
          if (bf16) store_row(ys[i].data_ptr<c10::BFloat16>() + (m0 + m) * N + nb * kRows, row, kRows);
          else store_row(ys[i].data_ptr<float>() + (m0 + m) * N + nb * kRows, row, kRows);
        }
      }
    }
  });
  return ys;
}

// bf16 or fp32 [NB, G, 2, 16] (scales, minimums), fp16 [NB, G, 16] (scales of symmetric codes), or uint8
// [NB, G/8, 320] (Q4_K's two-level scales, where `k_form` allows them)
void check_scale_min(const at::Tensor& scale_min, int64_t NB, int64_t G, const char* op, bool k_form = false) {
  const auto t = scale_min.scalar_type();
  const bool sym = t == at::kHalf && scale_min.sizes() == at::IntArrayRef({NB, G, kRows});
  const bool asym = (t == at::kBFloat16 || t == at::kFloat) && scale_min.sizes() == at::IntArrayRef({NB, G, 2, kRows});
  const bool k = k_form && t == at::kByte && G % kSuper == 0 &&
                 scale_min.sizes() == at::IntArrayRef({NB, G / kSuper, kSuperBytes});
  TORCH_CHECK((sym || asym || k) && scale_min.is_contiguous() && scale_min.device().is_cpu(), op,
              ": scale_min must be contiguous bfloat16 or float32 [", NB, ", ", G, ", 2, 16], float16 [", NB, ", ", G,
              ", 16] (symmetric codes)", k_form ? " or uint8 [NB, G/8, 320] (Q4_K scales, G a multiple of 8)" : "",
              " on the CPU, got ", scale_min.scalar_type(), " ", scale_min.sizes(), " on ", scale_min.device());
}

std::vector<at::Tensor> int4_a8_linear_n(const at::Tensor& x_, at::TensorList weights, at::TensorList scale_mins,
                                         int64_t group) {
  const char* op = "int4_a8_linear";
  TORCH_CHECK(!weights.empty() && weights.size() == scale_mins.size(), op,
              ": give one scale_min per weight (got ", weights.size(), " weights, ", scale_mins.size(), " scale_min)");
  TORCH_CHECK(group % 8 == 0, op, ": group ", group, " must be a multiple of 8");
  const int64_t K = weights[0].dim() == 3 ? weights[0].size(1) * 8 : -1;
  at::Tensor x = x_.contiguous();
  check_x(x, K, group, op);
  const int64_t G = K / group;
  std::vector<int64_t> Ns;
  std::vector<const uint8_t*> ws;
  std::vector<const void*> sms;
  std::vector<at::ScalarType> kinds;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& weight = weights[i];
    const at::Tensor& scale_min = scale_mins[i];
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(1) * 8 == K &&
                    weight.size(2) == 64 && weight.is_contiguous() && weight.device().is_cpu(),
                op, ": weight must be contiguous uint8 [out/16, ", K / 8, ", 64] on the CPU, got ",
                weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
    const int64_t NB = weight.size(0);
    check_scale_min(scale_min, NB, G, op, /*k_form=*/group == 32);
    Ns.push_back(NB * kRows);
    ws.push_back(weight.data_ptr<uint8_t>());
    sms.push_back(scale_min.data_ptr());
    kinds.push_back(scale_min.scalar_type());
  }
  const Activations& a = quantize(x, group);
  const std::vector<const float*> no_scale(weights.size(), nullptr);
  return run_blocks(x, Ns, no_scale, [&](int64_t i, int64_t nb, int64_t m0, int64_t mr, float* acc) {
    const uint8_t* wb = ws[i] + nb * (K / 8) * 64;
    auto blocks = [&](const auto* sb) {
      switch (mr) {
        case 1: int4_block<1>(wb, sb, a, m0, K, group, acc); break;
        case 2: int4_block<2>(wb, sb, a, m0, K, group, acc); break;
        case 3: int4_block<3>(wb, sb, a, m0, K, group, acc); break;
        default: int4_block<4>(wb, sb, a, m0, K, group, acc); break;
      }
    };
    switch (kinds[i]) {
      case at::kHalf: blocks(static_cast<const c10::Half*>(sms[i]) + nb * G * kRows); break;
      case at::kBFloat16: blocks(static_cast<const c10::BFloat16*>(sms[i]) + nb * G * 2 * kRows); break;
      case at::kFloat: blocks(static_cast<const float*>(sms[i]) + nb * G * 2 * kRows); break;
      default: {  // Q4_K's two levels: computed per group in one pass; over several, once per block, at the first
        const uint8_t* kb = static_cast<const uint8_t*>(sms[i]) + nb * (G / kSuper) * kSuperBytes;
        if (x.size(0) <= kMR) {
          blocks(kb);
          break;
        }
        thread_local std::vector<float> buf;
        if (m0 == 0) {
          buf.resize(G * 2 * kRows);
          for (int64_t g = 0; g < G; ++g) k4_group_scales(kb, g, &buf[2 * g * kRows], &buf[(2 * g + 1) * kRows]);
        }
        blocks(static_cast<const float*>(buf.data()));
      }
    }
  });
}

at::Tensor int4_a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale_min, int64_t group) {
  return int4_a8_linear_n(x, {weight}, {scale_min}, group)[0];
}

at::Tensor int8_a8_linear(const at::Tensor& x_, const at::Tensor& weight, const at::Tensor& scale, int64_t group) {
  const char* op = "int8_a8_linear";
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(2) == 64 && weight.is_contiguous(),
              op, ": weight must be contiguous uint8 [out/16, in/4, 64] (codes + 128), got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t NB = weight.size(0), K = weight.size(1) * 4, N = NB * kRows;
  TORCH_CHECK(group % 4 == 0, op, ": group ", group, " must be a multiple of 4");
  at::Tensor x = x_.contiguous();
  check_x(x, K, group, op);
  const int64_t G = K / group;
  const bool k6 = scale.scalar_type() == at::kByte;  // Q6_K's two-level scales
  TORCH_CHECK(scale.is_contiguous() &&
                  ((!k6 && scale.scalar_type() == at::kFloat &&
                    ((scale.dim() == 1 && scale.size(0) == N) ||
                     (scale.dim() == 3 && scale.size(0) == NB && scale.size(2) == kRows))) ||
                   (k6 && scale.dim() == 3 && scale.size(0) == NB && scale.size(2) == kSuper6Bytes)),
              op, ": scale must be contiguous float32 [", N, "] or blocked [", NB, ", groups, 16], or uint8 [", NB,
              ", groups/16, 288] (Q6_K scales), got ", scale.scalar_type(), " ", scale.sizes());
  const int64_t Gw = k6 ? scale.size(1) * kSuper6 : scale.dim() == 3 ? scale.size(1) : 0;  // 0: one scale per row
  TORCH_CHECK(Gw == 0 || (Gw > 0 && G % Gw == 0), op, ": scale's ", Gw, " groups per row must each span a whole "
              "number of the ", G, " activation groups of ", group, " input channels");
  TORCH_CHECK(weight.device().is_cpu() && scale.device().is_cpu(), op, ": weights must be on the CPU");
  const Activations& a = quantize(x, group);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float* sp = k6 ? nullptr : scale.data_ptr<float>();
  const uint8_t* kp = k6 ? scale.data_ptr<uint8_t>() : nullptr;
  const int64_t per_scale = Gw ? G / Gw : 1;
  return run_blocks(x, {N}, {Gw ? nullptr : sp}, [&](int64_t, int64_t nb, int64_t m0, int64_t mr, float* acc) {
    const uint8_t* wb = w + nb * (K / 4) * 64;
    const float* gs = Gw && !k6 ? sp + nb * Gw * kRows : nullptr;
    const uint8_t* kb = k6 ? kp + nb * (Gw / kSuper6) * kSuper6Bytes : nullptr;
    if (kb != nullptr && x.size(0) > kMR) {  // several passes over this block: its fp32 scales once, at the first
      thread_local std::vector<float> buf;
      if (m0 == 0) {
        buf.resize(Gw * kRows);
        for (int64_t gi = 0; gi < Gw; ++gi) k6_group_scales(kb, gi, &buf[gi * kRows]);
      }
      gs = buf.data();
      kb = nullptr;
    }
    auto blocks = [&](auto k6_tag) {
      constexpr bool kK6 = decltype(k6_tag)::value;
      switch (mr) {
        case 1: int8_block<1, kK6>(wb, a, m0, K, group, acc, gs, per_scale, kb); break;
        case 2: int8_block<2, kK6>(wb, a, m0, K, group, acc, gs, per_scale, kb); break;
        case 3: int8_block<3, kK6>(wb, a, m0, K, group, acc, gs, per_scale, kb); break;
        default: int8_block<4, kK6>(wb, a, m0, K, group, acc, gs, per_scale, kb); break;
      }
    };
    if (kb != nullptr) blocks(std::true_type{});
    else blocks(std::false_type{});
  })[0];
}

// the checks and the fill of int4_a8_dense_t into out [K, N] (bf16 or fp32, contiguous)
void dense_t_into(const at::Tensor& weight, const at::Tensor& scale_min, int64_t group, const at::Tensor& out,
                  const char* op) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3 && weight.size(2) == 64 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              op, ": weight must be contiguous uint8 [out/16, in/8, 64] on the CPU, got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t NB = weight.size(0), K = weight.size(1) * 8, N = NB * kRows;
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 8 that divides in_features ", K);
  const int64_t G = K / group;
  check_scale_min(scale_min, NB, G, op, /*k_form=*/group == 32);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": dtype must be bfloat16 or float32, got ", dtype);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == K && out.size(1) == N && out.is_contiguous() && out.device().is_cpu(),
              op, ": out must be contiguous [", K, ", ", N, "] on the CPU, got ", out.sizes());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  auto run = [&](const auto* sm) {
    at::parallel_for(0, K / 8, 4, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        if (dtype == at::kFloat) dense_chunk(w, sm, K, group, NB, c, out.data_ptr<float>());
        else dense_chunk(w, sm, K, group, NB, c, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
      }
    });
  };
  if (scale_min.scalar_type() == at::kHalf) run(scale_min.data_ptr<c10::Half>());
  else if (scale_min.scalar_type() == at::kFloat) run(scale_min.data_ptr<float>());
  else if (scale_min.scalar_type() == at::kByte) run(scale_min.data_ptr<uint8_t>());
  else run(scale_min.data_ptr<c10::BFloat16>());
}

at::Tensor int4_a8_dense_t(const at::Tensor& weight, const at::Tensor& scale_min, int64_t group,
                           at::ScalarType dtype) {
  const char* op = "int4_a8_dense_t";
  TORCH_CHECK(weight.dim() == 3, op, ": weight must be uint8 [out/16, in/8, 64], got ", weight.sizes());
  at::Tensor out = at::empty({weight.size(1) * 8, weight.size(0) * kRows}, weight.options().dtype(dtype));
  dense_t_into(weight, scale_min, group, out, op);
  return out;
}

// int4_a8_dense_t_out: the same into a buffer the caller keeps (fresh pages cost more than the dequantization on
// some machines: a [4096, 14336] bf16 copy took 35 ms into a new buffer, 4 ms into a reused one)
void int4_a8_dense_t_out(const at::Tensor& weight, const at::Tensor& scale_min, int64_t group, const at::Tensor& out) {
  dense_t_into(weight, scale_min, group, out, "int4_a8_dense_t_out");
}

// ---- W8A8: int8 weights x per-token int8 activations through oneDNN's int8 GEMM ----------------------------------
// w8a8_linear(x [M, K] fp32|bf16, weight int8 [N, K], weight_scale fp32 [N], bias [N] in x's dtype or None)
//   The per-token quantization of infopt.quantize.formats.w8a8.quantize_per_token (scale = max(absmax, 1e-12) / 127,
//   q = round(x / scale), ties to even, clamped to -127..127), the product in at::_int_mm (exact int32), and
//   y = (acc * scale_x[m]) * weight_scale[n] rounded to x's dtype, plus the bias in that dtype: the torch
//   reference's operations in its order, so the results are bit-identical. One call instead of a dozen small ops
//   per layer: what makes int8 GEMMs pay at the row counts of batched steps.

template <typename T>
void quantize_token_rows(const T* x, int64_t M, int64_t K, int8_t* q, float* scales) {
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* src = x + m * K;
      int8_t* dst = q + m * K;
      float amax = 0.f;
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(src + k)));
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(src[k])));
      const float scale = std::max(amax, 1e-12f) / 127.f;
      scales[m] = scale;
      k = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(scale);
      const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
      for (; k + 16 <= K; k += 16) {
        __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(load16(src + k), vs));  // to nearest, ties to even
        r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(r));
      }
#endif
      for (; k < K; ++k) {
        const float r = std::nearbyint(static_cast<float>(src[k]) / scale);
        dst[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
      }
    }
  };
  if (M >= 8) at::parallel_for(0, M, 4, body);
  else body(0, M);
}

#if defined(__AVX512F__)
// fp32 -> bf16, to nearest, ties to even, NaN kept quiet: c10::BFloat16's conversion, 16 lanes at a time
inline __m256i round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

// (acc * sx) * sw, rounded, then + bias: no fused multiply-add, or the bits would differ from torch's
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
template <typename T>
void rescale_rows(const int32_t* acc, const float* sx, const float* sw, const T* bias, int64_t M, int64_t N, T* y) {
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float s = sx[m];
      const int32_t* a = acc + m * N;
      T* out = y + m * N;
      int64_t n = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(s);
      for (; n + 16 <= N; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + n)), vs), _mm512_loadu_ps(sw + n));
        if constexpr (std::is_same_v<T, float>) {
          if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
          _mm512_storeu_ps(out + n, v);
        } else {
          __m256i r = round_bf16(v);
          if (bias) r = round_bf16(_mm512_add_ps(widen_bf16(r), load16(bias + n)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + n), r);
        }
      }
#endif
      for (; n < N; ++n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
        const T v = static_cast<T>(static_cast<float>(a[n]) * s * sw[n]);
        out[n] = bias ? static_cast<T>(static_cast<float>(v) + static_cast<float>(bias[n])) : v;
      }
    }
  };
  if (M * N >= 16384) at::parallel_for(0, M, 1, body);
  else body(0, M);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

at::Tensor w8a8_linear(const at::Tensor& x_, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& bias) {
  const char* op = "w8a8_linear";
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              op, ": weight must be contiguous int8 [out, in] on the CPU, got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) == K && x_.device().is_cpu() &&
                  (x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16),
              op, ": x must be float32 or bfloat16 [rows, ", K, "] on the CPU, got ", x_.scalar_type(), " ", x_.sizes());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() && weight_scale.numel() == N,
              op, ": weight_scale must be contiguous float32 [", N, "], got ", weight_scale.scalar_type(), " ",
              weight_scale.sizes());
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x_.scalar_type() && b.numel() == N, op, ": bias must be ", x_.scalar_type(), " [", N,
                "], got ", b.scalar_type(), " ", b.sizes());
  }
  at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  std::vector<float> sx(M);
  if (x.scalar_type() == at::kFloat) quantize_token_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), sx.data());
  else quantize_token_rows(x.data_ptr<c10::BFloat16>(), M, K, q.data_ptr<int8_t>(), sx.data());
  const at::Tensor acc = at::_int_mm(q, weight.t()).contiguous();
  if (x.scalar_type() == at::kFloat)
    rescale_rows(acc.data_ptr<int32_t>(), sx.data(), weight_scale.data_ptr<float>(),
                 b.defined() ? b.data_ptr<float>() : nullptr, M, N, out.data_ptr<float>());
  else
    rescale_rows(acc.data_ptr<int32_t>(), sx.data(), weight_scale.data_ptr<float>(),
                 b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, M, N, out.data_ptr<c10::BFloat16>());
  return out;
}

// ---- int8 weights, fp32 activations -------------------------------------------------------------------------------
// int8_f32_linear(x [M, K] fp32, weight int8 [N, K] (row-major, as Int8Linear holds it), scale fp32 [N] or [N, G])
//   -> [M, N]
//   Per row (scale [N]): y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]. Per group of K / G input channels (scale
//   [N, G]): y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k]. Accumulated in fp32: only the weights are
//   rounded, so this is the fp32 matmul of the dequantized weight up to the order of the sums (the bf16 activation
//   cast of torch._weight_int8pack_mm is what costs that kernel's accuracy). For one to a few rows (decode): one
//   activation row takes 8 output rows per pass (AVX-512: eight independent 16-lane sums, enough loads in flight to
//   stream the weight near the memory's bandwidth); two to four rows take 4 output rows per pass, converting each 16
//   weights to fp32 once for all of them. Threads split the output rows in contiguous ranges, so each streams its
//   part of the weight once. A group that is not a multiple of the vector width runs in plain C++.

#if defined(__AVX512F__)
constexpr int64_t kF32Lanes = 16;
constexpr int kF32Rows1 = 8;  // output rows per pass for one activation row
#elif defined(__AVX2__)
constexpr int64_t kF32Lanes = 8;
constexpr int kF32Rows1 = 4;
#else
constexpr int64_t kF32Lanes = 1;
constexpr int kF32Rows1 = 4;
#endif

#if defined(__AVX512F__)
using F32V = __m512;
inline F32V f32_zero() { return _mm512_setzero_ps(); }
inline F32V f32_load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F32V f32_load_x(const float* p) { return _mm512_loadu_ps(p); }
inline F32V f32_fma(F32V a, F32V b, F32V c) { return _mm512_fmadd_ps(a, b, c); }
inline F32V f32_bcast(float v) { return _mm512_set1_ps(v); }
inline float f32_hsum(F32V v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
using F32V = __m256;
inline F32V f32_zero() { return _mm256_setzero_ps(); }
inline F32V f32_load_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F32V f32_load_x(const float* p) { return _mm256_loadu_ps(p); }
inline F32V f32_fma(F32V a, F32V b, F32V c) { return _mm256_fmadd_ps(a, b, c); }
inline F32V f32_bcast(float v) { return _mm256_set1_ps(v); }
inline float f32_hsum(F32V v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// a[m][j] += sum over columns [k0, k1) (a multiple of the lane count) of x[m, k] * w[j, k]
template <int R, int MR>
__attribute__((always_inline)) inline void int8_f32_sums(const float* x, int64_t K, const int8_t* w, int64_t k0,
                                                         int64_t k1, F32V (&a)[MR][R]) {
  if constexpr (MR == 1) {  // each weight load next to its multiply-add: faster than loading the R rows' vectors
                            // first (0.41 against 0.57-0.71 ms on one 49152 x 576 head called repeatedly, partly
                            // from the L3; over the default model's distinct matrices the whole 8-row pass took
                            // a token's weights from 7.5-7.8 ms to 5.5-6.2, AVX-512)
    for (int64_t k = k0; k < k1; k += kF32Lanes) {
      const F32V xv = f32_load_x(x + k);
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) a[0][j] = f32_fma(xv, f32_load_w(w + j * K + k), a[0][j]);
    }
    return;
  }
  for (int64_t k = k0; k < k1; k += kF32Lanes) {
    F32V wv[R];
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) wv[j] = f32_load_w(w + j * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const F32V xv = f32_load_x(x + m * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) a[m][j] = f32_fma(xv, wv[j], a[m][j]);
    }
  }
}
#endif

// R output rows starting at w (stride K) times MR rows of x (stride K) -> out[m * R + j]. Per-row scales (G == 0):
// the raw sums, the caller scales them; groups (G > 0): scaled per group here, s pointing at row 0's G scales
// (stride G). Fixed trip counts, so the accumulators stay in registers.
template <int R, int MR>
void int8_f32_rows(const float* x, int64_t K, const int8_t* w, const float* s, int64_t G, int64_t group,
                   float* out) {
  float part[MR][R] = {};
  int64_t k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  F32V acc[MR][R];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) acc[m][j] = f32_zero();
  if (G == 0) {
    k = K - K % kF32Lanes;
    int8_f32_sums<R, MR>(x, K, w, 0, k, acc);
  } else if (group % kF32Lanes == 0) {
    for (int64_t g = 0; g < G; ++g) {
      F32V ga[MR][R];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) ga[m][j] = f32_zero();
      int8_f32_sums<R, MR>(x, K, w, g * group, (g + 1) * group, ga);
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) {
        const F32V sv = f32_bcast(s[j * G + g]);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) acc[m][j] = f32_fma(ga[m][j], sv, acc[m][j]);
      }
    }
    k = K;
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) part[m][j] = f32_hsum(acc[m][j]);
#endif
  if (G == 0) {
    for (; k < K; ++k)
      for (int j = 0; j < R; ++j)
        for (int m = 0; m < MR; ++m) part[m][j] += x[m * K + k] * static_cast<float>(w[j * K + k]);
  } else if (k < K) {  // groups in plain C++
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < R; ++j)
        for (int m = 0; m < MR; ++m) {
          float t = 0.f;
          for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) t += x[m * K + kk] * static_cast<float>(w[j * K + kk]);
          part[m][j] += t * s[j * G + g];
        }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < R; ++j) out[m * R + j] = part[m][j];
}

// rows [n0, n0 + R) of y for x rows [m0, m0 + MR)
template <int R, int MR>
void int8_f32_pass(const float* xp, const int8_t* wp, const float* sp, int64_t N, int64_t K, int64_t G,
                   int64_t group, int64_t n0, int64_t m0, float* yp) {
  float acc[MR * R];
  int8_f32_rows<R, MR>(xp + m0 * K, K, wp + n0 * K, sp + n0 * std::max<int64_t>(G, 1), G, group, acc);
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t j = 0; j < R; ++j)
      yp[(m0 + m) * N + n0 + j] = G == 0 ? acc[m * R + j] * sp[n0 + j] : acc[m * R + j];
}

at::Tensor int8_f32_linear(const at::Tensor& x_, const at::Tensor& weight, const at::Tensor& scale) {
  const char* op = "int8_f32_linear";
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              op, ": weight must be contiguous int8 [out, in] on the CPU, got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.device().is_cpu() &&
                  scale.dim() >= 1 && scale.dim() <= 2 && scale.size(0) == N,
              op, ": scale must be contiguous float32 [", N, "] or [", N, ", groups] on the CPU, got ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t G = scale.dim() == 2 ? scale.size(1) : 0;  // 0: one scale per row
  TORCH_CHECK(G == 0 || (G > 0 && K % G == 0), op, ": scale has ", G, " groups per row, which does not divide the ",
              K, " input features");
  const int64_t group = G == 0 ? K : K / G;
  TORCH_CHECK(x_.device().is_cpu() && x_.dim() == 2 && x_.scalar_type() == at::kFloat, op,
              ": x must be float32 [rows, in_features] on the CPU, got ", x_.scalar_type(), " ", x_.sizes(), " on ",
              x_.device());
  TORCH_CHECK(x_.size(1) == K, op, ": x has ", x_.size(1), " input features, the weight ", K);
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t R = M == 1 ? kF32Rows1 : 4;  // output rows per pass
  const int64_t NB = N / R;  // whole passes; the last N % R rows run in plain C++ below
  const int64_t grain = NB * R * K * M >= kParallelWork ? 1 : std::max<int64_t>(NB, 1);
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * R;
      if (M == 1) {
        int8_f32_pass<kF32Rows1, 1>(xp, wp, sp, N, K, G, group, n0, 0, yp);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        switch (std::min(kMR, M - m0)) {
          case 1: int8_f32_pass<4, 1>(xp, wp, sp, N, K, G, group, n0, m0, yp); break;
          case 2: int8_f32_pass<4, 2>(xp, wp, sp, N, K, G, group, n0, m0, yp); break;
          case 3: int8_f32_pass<4, 3>(xp, wp, sp, N, K, G, group, n0, m0, yp); break;
          default: int8_f32_pass<4, 4>(xp, wp, sp, N, K, G, group, n0, m0, yp); break;
        }
      }
    }
  });
  for (int64_t n = NB * R; n < N; ++n)  // the last rows: plain sums (the same fp32 products, in order)
    for (int64_t m = 0; m < M; ++m) {
      float t = 0.f;
      for (int64_t g = 0; g < std::max<int64_t>(G, 1); ++g) {
        float tg = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) tg += xp[m * K + k] * static_cast<float>(wp[n * K + k]);
        t += G == 0 ? tg : tg * sp[n * G + g];
      }
      yp[m * N + n] = G == 0 ? t * sp[n] : t;
    }
  return y;
}

// ---- ggml blocks into the a8 layouts, at load time --------------------------------------------------------------
// int4_a8_from_ggml(raw uint8 [N, bytes], kind 0 (Q4_0, 18-byte blocks of 32) | 1 (Q4_1, 20 of 32) | 2 (Q4_K, 144 of
//   256) | 3 (Q4_0 into the symmetric layout) | 4 (Q4_K into the a8_k layout), perm int64 [N]?) -> (weight uint8
//   [N/16, K/8, 64], scale_min bf16 [N/16, K/32, 2, 16]; kind 3: the blocks' fp16 scales as they are, [N/16, K/32,
//   16]; kind 4: the blocks' two levels of scales as they are, uint8 [N/16, K/256, 320])
// int8_a8_from_ggml(raw uint8 [N, K/32 * 34] (kind 0, Q8_0) | [N, K/256 * 210] (kind 1, Q6_K), perm int64 [N]?,
//   kind) -> weight uint8 [N/16, K/4, 64] (codes + 128)
//   A GGUF file's blocks straight into the a8 layouts (row n of the result is row perm[n] of the file), with the
//   numbers of infopt.quantize.community.gguf_blocks.decode_int4 / decode_int8 followed by
//   infopt.quantize.formats.a8.pack_blocked_int4 / pack_blocked_int8, bit for bit (the tests compare them), in one
//   pass over the file's bytes instead of a dozen over its decoded copies. A ggml block of 32 codes is 16 bytes whose
//   low nibbles are codes 0..15 and high nibbles 16..31; the four 8-column chunks it fills are whole 32-bit words of
//   those bytes, masked and shifted. Q4_0 is w = d * (q - 8): scale d, zero 8; Q4_1 is w = d * q + m: scale d, zero
//   -m / d; Q4_K's sub-block j is w = d * sc_j * q - dmin * m_j: scale d * sc_j, zero dmin * m_j / scale. A group whose
//   scale is 0 holds one value: codes 0, scale 1 (where that value is 0) or |value| / 8, zero -value / scale.
//   Scales round to bf16 (nearest, ties to even) and the minimum is bf16(-zero * scale16), computed in fp32. Q6_K's
//   codes are q - 32 (its scales d * sc_j, per 16, are the caller's: a strided read of the blocks' tails).

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// c10::BFloat16's rounding: bf16_bits, and NaN to 0x7FC0, without a branch, so loops over it vectorize
inline uint16_t bf16_round(float f) { return f != f ? uint16_t(0x7FC0) : bf16_bits(f); }

inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t word_at(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

const int64_t* checked_perm(const std::optional<at::Tensor>& perm, int64_t N, const char* op) {
  if (!perm.has_value()) return nullptr;
  const at::Tensor& p = *perm;
  TORCH_CHECK(p.scalar_type() == at::kLong && p.dim() == 1 && p.size(0) == N && p.is_contiguous() && p.device().is_cpu(),
              op, ": perm must be contiguous int64 [", N, "] on the CPU, got ", p.scalar_type(), " ", p.sizes());
  const int64_t* pp = p.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(pp[n] >= 0 && pp[n] < N, op, ": perm[", n, "] = ", pp[n], " is not a row of the ", N, " rows");
  return pp;
}

void check_raw(const at::Tensor& raw, int64_t block_bytes, const char* op) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.device().is_cpu(), op,
              ": raw must be contiguous uint8 [rows, bytes] on the CPU, got ", raw.scalar_type(), " ", raw.sizes());
  TORCH_CHECK(raw.size(0) % kRows == 0, op, ": the a8 layout needs rows divisible by ", kRows, ", got ", raw.size(0));
  TORCH_CHECK(raw.size(1) > 0 && raw.size(1) % block_bytes == 0, op, ": a row of ", raw.size(1),
              " bytes is not a whole number of ", block_bytes, "-byte blocks");
}

// Q4_K's 6-bit scale and minimum of sub-block j (0..7) from the 12 bytes after d and dmin (ggml's
// get_scale_min_k4): bytes 0..3 hold the low 6 bits of scales 0..3 (their top 2 bits: scales 4..7's high bits),
// 4..7 the same for the minimums, 8..11 the low 4 bits of scales 4..7 (low nibble) and minimums 4..7 (high nibble)
inline void k4_scale_min(const uint8_t* s, int64_t j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
  }
}

std::tuple<at::Tensor, at::Tensor> int4_a8_from_ggml(const at::Tensor& raw, int64_t kind,
                                                     const std::optional<at::Tensor>& perm) {
  const char* op = "int4_a8_from_ggml";
  TORCH_CHECK(kind >= 0 && kind <= 4, op, ": kind must be 0 (Q4_0), 1 (Q4_1), 2 (Q4_K), 3 (Q4_0, symmetric) or 4 "
              "(Q4_K, two-level scales), got ", kind);
  const bool sym = kind == 3, two_level = kind == 4;
  if (sym) kind = 0;  // the same blocks; only the scales are written differently
  if (two_level) kind = 2;
  const int64_t B = kind == 0 ? 18 : kind == 1 ? 20 : 144, per_block = kind == 2 ? 8 : 1;  // bytes, groups
  check_raw(raw, B, op);
  const int64_t N = raw.size(0), G = raw.size(1) / B * per_block, K = G * 32, NB = N / kRows, row_bytes = raw.size(1);
  const int64_t* pp = checked_perm(perm, N, op);
  at::Tensor weight = at::empty({NB, K / 8, 64}, raw.options());
  at::Tensor scale_min = sym         ? at::empty({NB, G, kRows}, raw.options().dtype(at::kHalf))
                         : two_level ? at::empty({NB, G / kSuper, kSuperBytes}, raw.options())
                                     : at::empty({NB, G, 2, kRows}, raw.options().dtype(at::kBFloat16));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* wp = weight.data_ptr<uint8_t>();
  uint16_t* sm = reinterpret_cast<uint16_t*>(scale_min.data_ptr());
  constexpr uint32_t kLow = 0x0F0F0F0Fu, kHigh = 0xF0F0F0F0u;
  // one group of a block's 16 rows at a time: its four 64-byte chunks are written whole, and the scales' arithmetic
  // runs over the 16 rows as one vector loop
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    const uint8_t* rows[kRows];
    alignas(64) uint32_t chunks[4][kRows];
    alignas(64) float scale_raw[kRows], offset[kRows];
    alignas(64) uint16_t d16[kRows], dmin16[kRows];  // kinds 3 and 4: the blocks' fp16 scales
    alignas(16) uint8_t sc6[kRows], mn6[kRows];        // kind 4: the sub-block's 6-bit scales and minimums
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t n = b * kRows + r;
        rows[r] = src + (pp ? pp[n] : n) * row_bytes;
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < kRows; ++r) {
          const uint8_t* blk = rows[r] + (g / per_block) * B;
          uint32_t c[4];
          if (kind == 2) {
            // w = d * sc_j * q - dmin * m_j; the 128 code bytes are 4 runs of 32: the low nibbles of run i are
            // sub-block 2i, the high ones 2i + 1
            const int64_t j = g % 8;
            int sc, mn;
            k4_scale_min(blk + 4, j, sc, mn);
            std::memcpy(&d16[r], blk, 2);
            std::memcpy(&dmin16[r], blk + 2, 2);
            sc6[r] = static_cast<uint8_t>(sc);
            mn6[r] = static_cast<uint8_t>(mn);
            scale_raw[r] = half_at(blk) * static_cast<float>(sc);
            offset[r] = -(half_at(blk + 2) * static_cast<float>(mn));
            const uint8_t* q = blk + 16 + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int i = 0; i < 4; ++i) {
              const uint32_t lo = (word_at(q + 8 * i) >> shift) & kLow, hi = (word_at(q + 8 * i + 4) >> shift) & kLow;
              c[i] = lo | (hi << 4);
            }
          } else {
            // Q4_0: w = d * (q - 8); Q4_1: w = d * q + m. 16 code bytes: low nibbles are weights 0..15, high 16..31
            const float d = half_at(blk);
            std::memcpy(&d16[r], blk, 2);
            scale_raw[r] = d;
            offset[r] = kind == 0 ? -8.f * d : half_at(blk + 2);
            const uint8_t* qs = blk + (kind == 0 ? 2 : 4);
            const uint32_t w0 = word_at(qs), w1 = word_at(qs + 4), w2 = word_at(qs + 8), w3 = word_at(qs + 12);
            c[0] = (w0 & kLow) | ((w1 & kLow) << 4);
            c[1] = (w2 & kLow) | ((w3 & kLow) << 4);
            c[2] = ((w0 >> 4) & kLow) | (w1 & kHigh);
            c[3] = ((w2 >> 4) & kLow) | (w3 & kHigh);
          }
          const bool dead = scale_raw[r] == 0.f;  // one value whatever the codes: codes 0
          for (int i = 0; i < 4; ++i) chunks[i][r] = dead ? 0u : c[i];
        }
        uint8_t* dst = wp + (b * (K / 8) + 4 * g) * 64;
        std::memcpy(dst, chunks, sizeof(chunks));
        if (sym) {  // w = (code - 8) * d exactly as the file has it (a dead group: every weight 0)
          std::memcpy(sm + (b * G + g) * kRows, d16, sizeof(d16));
          continue;
        }
        if (two_level) {  // d, dmin once per super-block, then this group's sc and m, as the file has them
          uint8_t* kb = reinterpret_cast<uint8_t*>(sm) + (b * (G / kSuper) + g / kSuper) * kSuperBytes;
          if (g % kSuper == 0) {
            std::memcpy(kb, d16, sizeof(d16));
            std::memcpy(kb + 2 * kRows, dmin16, sizeof(dmin16));
          }
          std::memcpy(kb + 4 * kRows + (g % kSuper) * 2 * kRows, sc6, kRows);
          std::memcpy(kb + 4 * kRows + (g % kSuper) * 2 * kRows + kRows, mn6, kRows);
          continue;
        }
        // decode_int4's _affine, branch-free over the 16 rows: w = scale * code + offset; a dead group (scale 0) gets
        // scale |offset| / 8 (1 where offset is 0) and offset 0 where it was 0
        alignas(64) uint16_t s16[kRows], mn16[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          const bool dead = scale_raw[r] == 0.f;
          const float scale = dead ? (offset[r] == 0.f ? 1.f : std::fabs(offset[r]) / 8.f) : scale_raw[r];
          const float zero = -(dead && offset[r] == 0.f ? 0.f : offset[r]) / scale;
          s16[r] = bf16_round(scale);
          mn16[r] = bf16_round(-zero * bf16_value(s16[r]));
        }
        uint16_t* smg = sm + (b * G + g) * 2 * kRows;
        std::memcpy(smg, s16, sizeof(s16));
        std::memcpy(smg + kRows, mn16, sizeof(mn16));
      }
    }
  });
  return {weight, scale_min};
}

// One Q6_K block's 256 codes as the a8 layout holds them, q - 32 + 128 = q + 96, into out [256]: half h of 128
// weights reads ql bytes 64h..64h+63 (low nibbles: weights 0..63 of the half, high: 64..127) and qh bytes
// 32h..32h+31 (bit pairs 0, 2, 4, 6: the high two bits of weights 0..31, 32..63, 64..95, 96..127)
inline void q6_k_biased(const uint8_t* b, uint8_t* out) {
  for (int64_t h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    uint8_t* o = out + 128 * h;
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t l = 0; l < 32; ++l)
        o[32 * i + l] = static_cast<uint8_t>(
            (((ql[(i % 2) * 32 + l] >> (4 * (i / 2))) & 0x0F) | (((qh[l] >> (2 * i)) & 3) << 4)) + 96);
  }
}

at::Tensor int8_a8_from_ggml(const at::Tensor& raw, const std::optional<at::Tensor>& perm, int64_t kind) {
  const char* op = "int8_a8_from_ggml";
  TORCH_CHECK(kind == 0 || kind == 1, op, ": kind must be 0 (Q8_0) or 1 (Q6_K), got ", kind);
  const int64_t B = kind == 0 ? 34 : 210, W = kind == 0 ? 32 : 256;  // bytes and weights per block
  check_raw(raw, B, op);
  const int64_t N = raw.size(0), K = raw.size(1) / B * W, NB = N / kRows, row_bytes = raw.size(1);
  const int64_t* pp = checked_perm(perm, N, op);
  at::Tensor weight = at::empty({NB, K / 4, 64}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* wp = weight.data_ptr<uint8_t>();
  // one ggml block of the 16 rows at a time: each row's codes (+ 128) into a buffer, then the buffer's 4-byte words
  // transposed into the block's whole 64-byte chunks (16 rows x 4 inputs each)
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t buf[kRows][256];
    const uint8_t* rows[kRows];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t n = b * kRows + r;
        rows[r] = src + (pp ? pp[n] : n) * row_bytes;
      }
      uint8_t* dst = wp + b * (K / 4) * 64;
      for (int64_t blk = 0; blk < K / W; ++blk) {
        for (int64_t r = 0; r < kRows; ++r) {
          const uint8_t* q = rows[r] + blk * B;
          if (kind == 1) {
            q6_k_biased(q, buf[r]);
          } else {
            for (int64_t l = 0; l < 32; ++l) buf[r][l] = static_cast<uint8_t>(q[2 + l] ^ 0x80u);  // int8 + 128
          }
        }
        alignas(64) uint32_t line[kRows];
        for (int64_t c = 0; c < W / 4; ++c) {
          for (int64_t r = 0; r < kRows; ++r) std::memcpy(&line[r], &buf[r][4 * c], 4);
          std::memcpy(dst + (blk * (W / 4) + c) * 64, line, 64);
        }
      }
    }
  });
  return weight;
}

std::string quant_linear_isa() { return kIsa; }

}  // namespace

// Fails on purpose: see paged_attention_error_probe in paged_attention.cpp.
static int64_t quant_linear_error_probe() {
  TORCH_CHECK(false, "infopt error-path probe");
  return 0;
}

TORCH_LIBRARY_FRAGMENT(infopt, m) {
  m.def("quant_linear_error_probe() -> int", &quant_linear_error_probe);
  m.def("int4_a8_linear(Tensor x, Tensor weight, Tensor scale_min, int group) -> Tensor");
  m.def("int4_a8_linear_n(Tensor x, Tensor[] weights, Tensor[] scale_mins, int group) -> Tensor[]");
  m.def("int8_a8_linear(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.def("int4_a8_dense_t(Tensor weight, Tensor scale_min, int group, ScalarType dtype) -> Tensor");
  m.def("int4_a8_dense_t_out(Tensor weight, Tensor scale_min, int group, Tensor(a!) out) -> ()");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor");
  m.def("int8_f32_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("int4_a8_from_ggml(Tensor raw, int kind, Tensor? perm) -> (Tensor, Tensor)");
  m.def("int8_a8_from_ggml(Tensor raw, Tensor? perm, int kind=0) -> Tensor");
  m.def("quant_linear_isa() -> str", &quant_linear_isa);
}

TORCH_LIBRARY_IMPL(infopt, CPU, m) {
  m.impl("int4_a8_linear", &int4_a8_linear);
  m.impl("int4_a8_linear_n", &int4_a8_linear_n);
  m.impl("int8_a8_linear", &int8_a8_linear);
  m.impl("int4_a8_dense_t", &int4_a8_dense_t);
  m.impl("int4_a8_dense_t_out", &int4_a8_dense_t_out);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("int8_f32_linear", &int8_f32_linear);
  m.impl("int4_a8_from_ggml", &int4_a8_from_ggml);
  m.impl("int8_a8_from_ggml", &int8_a8_from_ggml);
}
