// CPU paged attention: every query attends to its own sequence's keys and values, read in place from the block
// pools through the sequence's block table (no gather into a contiguous copy, no repeat of K/V heads).
//
// Layout (the layout of infopt.kvcache.KVBlockPool and the packed engine step):
//   query        [N, H, D]        the step's tokens, each sequence's new tokens contiguous, in position order
//   key_pool     [NB, BS, Hkv, D]
//   value_pool   [NB, BS, Hkv, Dv]
//   block_table  [S, MB] int32 or int64: the blocks of sequence s, in order
//   query_start  [S + 1] int64: sequence s owns query rows [query_start[s], query_start[s + 1])
//   kv_lens      [S] int64: keys sequence s holds after this step's writes (its new tokens are the last ones)
// Query i of the n new tokens of a sequence sits at position kv_len - n + i and sees keys 0 .. kv_len - n + i
// (causal), which covers a decode token (n = 1), a prefill chunk after earlier chunks and a fresh prefill.
// With a sliding window W > 0 (Gemma 3's local layers, Mistral) it sees only the last W of those keys: from
// kv_len - n + i - W + 1; keys before the window of a work item's first query are never read.
//
// Work items are (sequence, KV head, chunk of up to QCHUNK queries): the query heads that share a KV head (GQA
// group) are processed together, so each key and value row is loaded once for its whole group. When there are
// too few items to keep every thread busy (few sequences decoding long contexts), each item's keys are split
// into parts processed independently and merged (flash-decoding). Items are dealt to threads longest first.
// Softmax is online (running max and sum per query row) in fp32; K/V may be fp32, bf16 or fp16 (converted in
// registers). A decode step (one query per sequence) with a head size of 64 or 128 takes three passes instead:
// every score of the item's keys, one softmax per row, then the values (no running rescale per tile).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QCHUNK = 16;        // queries of one sequence per work item
constexpr int64_t MIN_SPLIT_KEYS = 128;  // keys per part at least when an item's keys are split
constexpr int64_t PREFETCH_BLOCKS = 1;  // how many blocks ahead rows are requested
constexpr int64_t TILE = 64;           // keys scored together (a block, or a slice of a larger block)
#if defined(__AVX512F__)
constexpr bool DECODE_WHOLE = true;  // one query per row: scores, softmax, values in three passes (run_item)
#else
constexpr bool DECODE_WHOLE = false;
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline void store(float* dst, float x) { *dst = x; }
inline void store(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }

// exp(x) for x <= 0 (scores minus their running max), vectorizable: x = n ln2 + r with |r| <= ln2 / 2, then
// exp(r) by its Taylor series to degree 7 (relative error below 1e-8) and 2^n through the exponent bits
#pragma omp declare simd
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : x;  // below this exp underflows; the row's max key keeps exp(0) = 1 in every sum
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit left shift of the bits
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// q . k over n values (k fp32 or bf16, converted in registers). The sum is a tree of vector lanes: a dependent
// chain of scalar adds (what a compiler emits for a float reduction it may not reorder) costs more than the
// products themselves.
template <typename KV>
inline float dot(const float* q, const KV* k, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), v);
  s = _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<KV, float>) {
    __m256 v = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), v);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    s = _mm_cvtss_f32(h);
  }
#else
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; d + 8 <= n; d += 8)
    for (int i = 0; i < 8; ++i) part[i] += q[d + i] * to_float(k[d + i]);
  s = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
#endif
  for (; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// out[j] = q . krow[j][off:off + n] for the cnt <= TILE keys of a tile. With AVX-512 the keys go 16 at a time:
// 16 vector accumulators, then one transpose-and-add tree sums all 16 at once (45 shuffles and adds instead of
// 16 separate horizontal sums of about 10 each).
#if defined(__AVX512F__)
inline __m512 sum16(__m512* v) {
  __m512 w[4];
  for (int k = 0; k < 4; ++k) {
    __m512* x = v + 4 * k;
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    // per 128-bit lane: partial sums of x[0], x[1], x[2], x[3]
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

template <int64_t DH, typename KV>
inline void score_tile(const float* q, const KV* const* krow, int64_t off, int64_t cnt, int64_t n, float* out) {
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 16 == 0 && DH <= 128) {
    constexpr int NV = static_cast<int>(DH / 16);
    __m512 qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
    for (int64_t j0 = 0; j0 < cnt; j0 += 16) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) {
        v[j] = _mm512_setzero_ps();
        if (j0 + j < cnt) {
          const KV* k = krow[j0 + j] + off;
          for (int i = 0; i < NV; ++i) v[j] = _mm512_fmadd_ps(qv[i], load16(k + 16 * i), v[j]);
        }
      }
      const __m512 sums = sum16(v);
      if (j0 + 16 <= cnt) _mm512_storeu_ps(out + j0, sums);
      else _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << (cnt - j0)) - 1), sums);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < cnt; ++j) out[j] = dot(q, krow[j] + off, n);
}

#if defined(__AVX512BF16__)
// bf16 keys: q (the query's own bf16 values, unscaled) . k by the CPU's bf16 dot-product instruction (pairs of
// bf16 products summed in fp32), no conversion of K; the scores are scaled afterwards
template <int64_t DH>
inline void score_tile_bf16(const c10::BFloat16* qb, const c10::BFloat16* const* krow, int64_t off, int64_t cnt,
                            float scale, float* out) {
  constexpr int NV = static_cast<int>(DH / 32);
  __m512bh qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qb + 32 * i);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < cnt; j0 += 16) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      v[j] = _mm512_setzero_ps();
      if (j0 + j < cnt) {
        const c10::BFloat16* k = krow[j0 + j] + off;
        for (int i = 0; i < NV; ++i) v[j] = _mm512_dpbf16_ps(v[j], qv[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
      }
    }
    const __m512 sums = _mm512_mul_ps(sum16(v), sv);
    if (j0 + 16 <= cnt) _mm512_storeu_ps(out + j0, sums);
    else _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << (cnt - j0)) - 1), sums);
  }
}
#endif

#if defined(__AVX512F__)
// exp_approx on 16 lanes (the same range reduction and polynomial)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// Online softmax over one row's scores of a tile: updates the running max m and sum l, turns srow[0:cnt] into
// exp(score - new max) and returns the factor the row's accumulator must be rescaled by.
inline float softmax_tile(float* srow, int64_t cnt, float& m, float& l) {
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(m);
  for (int64_t j = 0; j < cnt; j += 16) {
    const __mmask16 k = cnt - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cnt - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, srow + j));
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < cnt; j += 16) {
    const __mmask16 k = cnt - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cnt - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, srow + j), vm));
    _mm512_mask_storeu_ps(srow + j, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#else
  float mx = m;
  for (int64_t j = 0; j < cnt; ++j) mx = std::max(mx, srow[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < cnt; ++j) {
    const float e = exp_approx(srow[j] - mx);
    srow[j] = e;
    sum += e;
  }
#endif
  const float corr = m == mx ? 1.f : std::exp(m - mx);  // exp(-inf) = 0 on the first tile
  l = l * corr + sum;
  m = mx;
  return corr;
}

#if defined(__AVX512F__)
// NR rows that read the same KV head: acc_r = acc_r * corr_r + sum_j p_r[j] * v_j, each value row loaded once for
// all NR rows, the NR accumulators held in registers over the tile
template <int64_t DH, int NR, typename KV>
inline void accumulate_rows(float* acc, int64_t acc_stride, const float* corr, const float* p, int64_t p_stride,
                            const KV* const* vrow, int64_t off, int64_t cnt) {
  constexpr int NV = static_cast<int>(DH / 16);
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * acc_stride + 16 * i), c);
  }
  for (int64_t j = 0; j < cnt; ++j) {
    const KV* v = vrow[j] + off;
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(v + 16 * i);
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * p_stride + j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pj, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * acc_stride + 16 * i, a[r][i]);
}

// accumulate_rows for a group of nr (1 to 4) rows, the count known at run time
template <int64_t DH, typename KV>
inline void accumulate_group(int nr, float* acc, int64_t acc_stride, const float* corr, const float* p, int64_t p_stride,
                             const KV* const* vrow, int64_t off, int64_t cnt) {
  if (nr == 1) accumulate_rows<DH, 1, KV>(acc, acc_stride, corr, p, p_stride, vrow, off, cnt);
  else if (nr == 2) accumulate_rows<DH, 2, KV>(acc, acc_stride, corr, p, p_stride, vrow, off, cnt);
  else if (nr == 3) accumulate_rows<DH, 3, KV>(acc, acc_stride, corr, p, p_stride, vrow, off, cnt);
  else accumulate_rows<DH, 4, KV>(acc, acc_stride, corr, p, p_stride, vrow, off, cnt);
}
#endif

// o = o * corr + sum_j p[j] * vrow[j][off:off + n]: the portable path (accumulate_rows unrolls AVX-512 head sizes)
template <int64_t DH, typename KV>
inline void accumulate(float* o, float corr, const float* p, const KV* const* vrow, int64_t off, int64_t cnt,
                       int64_t n) {
  if (corr != 1.f)
    for (int64_t d = 0; d < n; ++d) o[d] *= corr;
  for (int64_t j = 0; j < cnt; ++j) {
    const float pj = p[j];
    const KV* v = vrow[j] + off;
    for (int64_t d = 0; d < n; ++d) o[d] += pj * to_float(v[d]);
  }
}

// Ask for the cache lines of `rows` token rows (nh heads of n values each) before they are read, into L2 (hint T1):
// a whole block's lines asked into L1 at once (T0) took its fill buffers from the loads of the block being scored;
// T1 read the engine's scattered blocks 1.15-1.4x faster (64 sequences decoding over 250-420 keys, fp32 and bf16,
// 9x3x64 and 12x2x128 heads; 24x8x128 level).
template <typename KV>
inline void prefetch_rows(const KV* base, int64_t rows, int64_t row_stride, int64_t nh, int64_t head_stride,
                          int64_t n) {
  constexpr int64_t LINE = 64 / sizeof(KV);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      const KV* p = base + t * row_stride + h * head_stride;
      for (int64_t i = 0; i < n; i += LINE) __builtin_prefetch(p + i, 0, 2);
    }
}

struct Item {
  int64_t seq, h0, h1, q0, q1;  // KV heads [h0, h1) and query rows [q0, q1) of the sequence (from its first new token)
  int64_t k0, k1;               // keys [k0, k1) this item reads
  int64_t part, parts;          // split index and count (1: the item writes the output directly)
  int64_t merge_slot;           // first slot of this (seq, heads, chunk)'s partial results when parts > 1
  int64_t cost;
};

struct Args {
  int64_t H, Hkv, G, D, Dv, BS, MB;
  int64_t kb, kt, kh, vb, vt, vh;  // pool strides: block, token, head
  int64_t qn, qh, on, oh;          // query / output strides: token, head
  const int64_t* qstart;
  const int64_t* kvlen;
  const void* table;
  bool table32;
  float scale;
  int64_t slot;    // floats per partial-result slot: QCHUNK * H rows of (max, sum, accumulator)
  int64_t window;  // keys a query sees, itself included (0: all earlier keys)
  bool any_order;  // decode rows may take the three-pass path (split_keys; false: one summation order for every row)
};

inline int64_t block_id(const Args& a, int64_t s, int64_t b) {
  return a.table32 ? static_cast<const int32_t*>(a.table)[s * a.MB + b] : static_cast<const int64_t*>(a.table)[s * a.MB + b];
}

// One item. Its rows are r = (qi * nh + hh) * G + g: query qi of the chunk, query head (h0 + hh) * G + g, which
// reads KV head h0 + hh. Each tile of keys is loaded once (all the item's KV heads of a token are adjacent in the
// pool) and scored against every row. Writes the normalized output or, for a split item, the partial (max, sum,
// unnormalized accumulator) into `partial`.
// DH > 0: the head size as a compile-time constant, so the row loops unroll into whole vector registers;
// DH = 0: any head sizes, read at run time.
template <typename Q, typename KV, int64_t DH>
void run_item(const Args& a, const Item& it, const Q* query, const KV* kpool, const KV* vpool, Q* out,
              float* partial, std::vector<float>& scratch) {
  const int64_t n = a.qstart[it.seq + 1] - a.qstart[it.seq];
  const int64_t L = a.kvlen[it.seq];
  const int64_t first = a.qstart[it.seq];
  const int64_t nh = it.h1 - it.h0, G = a.G, HG = nh * G;  // rows per query
  const int64_t nq = it.q1 - it.q0, R = nq * HG, BS = a.BS;
  const int64_t D = DH > 0 ? DH : a.D, Dv = DH > 0 ? DH : a.Dv;
  const int64_t ksh = a.kh, vsh = a.vh;  // head stride inside a token's row of the pool
  const int64_t pos0 = L - n + it.q0;               // position of the chunk's first query
  const int64_t kend = std::min(it.k1, pos0 + nq);  // keys past the chunk's last query are never seen
  // one query per row (a decode step) with a head size the vector paths unroll: every score of the item's keys
  // first, one softmax per row, then the values (decode_item); room for those scores after the tile's
  const bool whole = DECODE_WHOLE && a.any_order && nq == 1 && DH > 0 && DH % 16 == 0 && DH <= 128 && kend > it.k0;
  const int64_t nk = whole ? kend - it.k0 : 0;
  scratch.resize(R * D + R * Dv + 2 * R + R * TILE + R * nk + (whole && !std::is_same_v<KV, float> ? TILE * nh * D : 0));
  float* qf = scratch.data();
  float* acc = qf + R * D;
  float* m = acc + R * Dv;
  float* l = m + R;
  float* sc = l + R;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qi = r / HG, head = it.h0 * G + r % HG;
    const Q* src = query + (first + it.q0 + qi) * a.qn + head * a.qh;
    float* dst = qf + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * a.scale;
  }
  std::fill(acc, acc + R * Dv, 0.f);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  const KV* krow[TILE];  // each key's row (its token's K for the item's first KV head), read in place
  const KV* vrow[TILE];
  // scores of row r against a tile's keys
  auto score = [&](int64_t r, const KV* const* kr, int64_t off, int64_t cnt, float* dst) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16> && DH > 0 && DH % 32 == 0 &&
                  DH <= 128) {
      const int64_t qi = r / HG, head = it.h0 * G + r % HG;
      score_tile_bf16<DH>(query + (first + it.q0 + qi) * a.qn + head * a.qh, kr, off, cnt, a.scale, dst);
      return;
    }
#endif
    score_tile<DH, KV>(qf + r * D, kr, off, cnt, D, dst);
  };
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 16 == 0 && DH <= 128) {
    if (whole) {
      float* S = sc + R * TILE;  // S[r * nk + (j - k0)]: row r's score of key j
      const int64_t k0 = it.k0;
      // the item's keys in runs of at most TILE that sit in one block: fn(first key, count) with krow / vrow set;
      // the next block's rows of the pass's pool (K for the scores, V for the values) are asked for ahead (blocks
      // sit anywhere in a paged pool)
      auto runs = [&](bool keys, auto&& fn) {
        for (int64_t lo = k0; lo < kend;) {
          const int64_t j0 = lo / BS * BS, hi = std::min({lo + TILE, j0 + BS, kend});
          const int64_t blk = block_id(a, it.seq, j0 / BS);
          const KV* kb = kpool + blk * a.kb + it.h0 * a.kh;
          const KV* vb = vpool + blk * a.vb + it.h0 * a.vh;
          for (int64_t j = lo; j < hi; ++j) {
            krow[j - lo] = kb + (j - j0) * a.kt;
            vrow[j - lo] = vb + (j - j0) * a.vt;
          }
          // the next block's rows, also where it follows this one in the pool: the CPU's own prefetcher, left to
          // a contiguous run, read the engine's real block tables (runs of a few blocks) slower
          if (hi == j0 + BS && hi < kend) {
            const int64_t nxt = block_id(a, it.seq, hi / BS);
            const int64_t rows = std::min(BS, kend - hi);
            if (keys) prefetch_rows(kpool + nxt * a.kb + it.h0 * a.kh, rows, a.kt, nh, a.kh, D);
            else prefetch_rows(vpool + nxt * a.vb + it.h0 * a.vh, rows, a.vt, nh, a.vh, Dv);
          }
          fn(lo, hi - lo);
          lo = hi;
        }
      };
      constexpr bool dot_bf16 = std::is_same_v<Q, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>;
      const bool convert_keys = !std::is_same_v<KV, float> && !dot_bf16 && G > 1;
      if constexpr (!std::is_same_v<KV, float> && !dot_bf16) {
        if (convert_keys) {  // 16-bit keys read by several rows: each key converted to fp32 once, then scored per row
          float* kf = S + R * nk;
          const float* kfrow[TILE];
          runs(true, [&](int64_t lo, int64_t cnt) {
            for (int64_t j = 0; j < cnt; ++j) {
              float* dst = kf + j * nh * D;
              kfrow[j] = dst;
              for (int64_t hh = 0; hh < nh; ++hh)
                for (int64_t d = 0; d < D; d += 16)
                  _mm512_storeu_ps(dst + hh * D + d, load16(krow[j] + hh * ksh + d));
            }
            for (int64_t r = 0; r < R; ++r) score_tile<DH, float>(qf + r * D, kfrow, (r / G) * D, cnt, D, S + r * nk + (lo - k0));
          });
        }
      }
      if (!convert_keys)
        runs(true, [&](int64_t lo, int64_t cnt) {
          for (int64_t r = 0; r < R; ++r) score(r, krow, (r / G) * ksh, cnt, S + r * nk + (lo - k0));
        });
      // one softmax over each row's nk scores (from m = -inf, l = 0): S becomes exp(score - max)
      for (int64_t r = 0; r < R; ++r) softmax_tile(S + r * nk, nk, m[r], l[r]);
      const float ones[4] = {1.f, 1.f, 1.f, 1.f};
      runs(false, [&](int64_t lo, int64_t cnt) {
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t r0 = hh * G, rend = r0 + G; r0 < rend; r0 += 4) {  // rows sharing a KV head
            const int nr = static_cast<int>(std::min<int64_t>(4, rend - r0));
            accumulate_group<DH, KV>(nr, acc + r0 * Dv, Dv, ones, S + r0 * nk + (lo - k0), nk, vrow, hh * vsh, cnt);
          }
      });
    }
  }
#endif
  if (!whole)
  for (int64_t j0 = (it.k0 / BS) * BS; j0 < kend; j0 += BS) {
    const int64_t blk = block_id(a, it.seq, j0 / BS);
    const KV* kb = kpool + blk * a.kb + it.h0 * a.kh;
    const KV* vb = vpool + blk * a.vb + it.h0 * a.vh;
    const int64_t ahead = j0 + PREFETCH_BLOCKS * BS;
    if (ahead < kend) {  // blocks sit anywhere in the pool: fetch a later one's rows while this one is scored
      const int64_t nxt = block_id(a, it.seq, ahead / BS);
      prefetch_rows(kpool + nxt * a.kb + it.h0 * a.kh, std::min(BS, kend - ahead), a.kt, nh, a.kh, D);
      prefetch_rows(vpool + nxt * a.vb + it.h0 * a.vh, std::min(BS, kend - ahead), a.vt, nh, a.vh, Dv);
    }
    // the block's keys in tiles of at most TILE (a block of up to TILE keys is one tile)
    for (int64_t lo = std::max(j0, it.k0); lo < std::min(j0 + BS, kend); lo += TILE) {
      const int64_t hi = std::min({lo + TILE, j0 + BS, kend});
      for (int64_t j = lo; j < hi; ++j) {
        krow[j - lo] = kb + (j - j0) * a.kt;
        vrow[j - lo] = vb + (j - j0) * a.vt;
      }
      // scores of every (row, key) the mask allows: query qi sees the tile's keys [s0, s0 + cnt) (s0 > 0 only
      // where a sliding window starts inside the tile); the scores of row r sit at sc[r * TILE .. + cnt)
      auto visible = [&](int64_t qi, int64_t& s0) {
        s0 = a.window > 0 ? std::max<int64_t>(0, pos0 + qi - a.window + 1 - lo) : 0;
        return std::min(hi, pos0 + qi + 1) - lo - s0;
      };
      for (int64_t qi = 0; qi < nq; ++qi) {
        int64_t s0;
        const int64_t cnt = visible(qi, s0);
        if (cnt <= 0) continue;
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t r = (qi * nh + hh) * G; r < (qi * nh + hh + 1) * G; ++r)
            score(r, krow + s0, hh * ksh, cnt, sc + r * TILE);
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        int64_t s0;
        const int64_t cnt = visible(qi, s0);  // keys of this tile the query sees
        if (cnt <= 0) continue;
        const KV* const* vr = vrow + s0;
        float corr[4];
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t r0 = (qi * nh + hh) * G, rend = r0 + G; r0 < rend; r0 += 4) {  // rows sharing a KV head
            const int nr = static_cast<int>(std::min<int64_t>(4, rend - r0));
            for (int i = 0; i < nr; ++i) corr[i] = softmax_tile(sc + (r0 + i) * TILE, cnt, m[r0 + i], l[r0 + i]);
            bool grouped = false;
#if defined(__AVX512F__)
            if constexpr (DH > 0 && DH % 16 == 0 && DH <= 128) {
              accumulate_group<DH, KV>(nr, acc + r0 * Dv, Dv, corr, sc + r0 * TILE, TILE, vr, hh * vsh, cnt);
              grouped = true;
            }
#endif
            if (!grouped)
              for (int i = 0; i < nr; ++i)
                accumulate<DH, KV>(acc + (r0 + i) * Dv, corr[i], sc + (r0 + i) * TILE, vr, hh * vsh, cnt, Dv);
          }
      }
    }
  }
  if (it.parts == 1) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t qi = r / HG, head = it.h0 * G + r % HG;
      Q* dst = out + (first + it.q0 + qi) * a.on + head * a.oh;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t d = 0; d < Dv; ++d) store(dst + d, acc[r * Dv + d] * inv);
    }
    return;
  }
  float* p = partial + (it.merge_slot + it.part) * a.slot;
  std::memcpy(p, m, R * sizeof(float));
  std::memcpy(p + R, l, R * sizeof(float));
  std::memcpy(p + 2 * R, acc, R * Dv * sizeof(float));
}

template <typename Q, typename KV, int64_t DH>
void run(const Args& a, const std::vector<Item>& items, const Q* query, const KV* kpool, const KV* vpool, Q* out,
         float* partial, int64_t threads) {
  // deal items to threads longest first, round robin (items arrive sorted by cost)
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch;
    for (int64_t t = t0; t < t1; ++t)
      for (size_t i = t; i < items.size(); i += threads)
        run_item<Q, KV, DH>(a, items[i], query, kpool, vpool, out, partial, scratch);
  });
}

template <typename Q>
void merge(const Args& a, const std::vector<Item>& heads, const float* partial, Q* out) {
  // heads: one entry per split (seq, kvh, chunk) with parts > 1
  at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) {
      const Item& it = heads[h];
      const int64_t HG = (it.h1 - it.h0) * a.G, R = (it.q1 - it.q0) * HG, Dv = a.Dv;
      const int64_t first = a.qstart[it.seq];
      for (int64_t r = 0; r < R; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < it.parts; ++p) mx = std::max(mx, partial[(it.merge_slot + p) * a.slot + r]);
        const int64_t qi = r / HG, head = it.h0 * a.G + r % HG;
        Q* dst = out + (first + it.q0 + qi) * a.on + head * a.oh;
        std::vector<float> o(Dv, 0.f);
        float l = 0.f;
        for (int64_t p = 0; p < it.parts; ++p) {
          const float* part = partial + (it.merge_slot + p) * a.slot;
          if (part[R + r] == 0.f) continue;  // this part saw no key for the row
          const float w = std::exp(part[r] - mx);
          l += part[R + r] * w;
          const float* acc = part + 2 * R + r * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += acc[d] * w;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < Dv; ++d) store(dst + d, o[d] * inv);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& kv_lens,
                           double scale, int64_t window, bool split_keys) {
  TORCH_CHECK(query.device().is_cpu() && key_pool.device().is_cpu() && value_pool.device().is_cpu(),
              "infopt::paged_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 4 && value_pool.dim() == 4,
              "paged_attention: query [N, H, D], pools [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(key_pool.scalar_type() == value_pool.scalar_type(), "paged_attention: key and value pools differ in dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "paged_attention: query must be float32 or bfloat16");
  TORCH_CHECK(key_pool.scalar_type() == at::kFloat || key_pool.scalar_type() == at::kBFloat16 ||
                  key_pool.scalar_type() == at::kHalf,
              "paged_attention: pools must be float32, bfloat16 or float16");
  TORCH_CHECK(query.stride(2) == 1 && key_pool.stride(3) == 1 && value_pool.stride(3) == 1,
              "paged_attention: the head dimension must be contiguous");
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous() &&
                  (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
              "paged_attention: block_table must be a contiguous [S, max_blocks] int32/int64 tensor");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  query_start.is_contiguous() && kv_lens.is_contiguous(),
              "paged_attention: query_start and kv_lens must be contiguous int64");
  const int64_t N = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_pool.size(1), Hkv = key_pool.size(2), Dv = value_pool.size(3);
  const int64_t S = kv_lens.size(0);
  TORCH_CHECK(query_start.size(0) == S + 1 && block_table.size(0) == S, "paged_attention: S mismatch");
  TORCH_CHECK(key_pool.size(3) == D && H % Hkv == 0, "paged_attention: head sizes do not match");
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: no sliding window)");
  auto out = at::empty({N, H, Dv}, query.options());
  if (N == 0) return out;

  Args a{H, Hkv, H / Hkv, D, Dv, BS, block_table.size(1),
         key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
         value_pool.stride(0), value_pool.stride(1), value_pool.stride(2),
         query.stride(0), query.stride(1), out.stride(0), out.stride(1),
         query_start.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), block_table.data_ptr(),
         block_table.scalar_type() == at::kInt, static_cast<float>(scale), QCHUNK * H * (Dv + 2), window, split_keys};
  TORCH_CHECK(a.qstart[S] == N, "paged_attention: query_start[-1] must equal the number of query rows");

  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // items: (sequence, chunk of queries) with every KV head when there are enough of them to share among the
  // threads, else one KV head each
  int64_t chunks = 0;
  for (int64_t s = 0; s < S; ++s) chunks += (a.qstart[s + 1] - a.qstart[s] + QCHUNK - 1) / QCHUNK;
  const int64_t heads_per_item = chunks >= 4 * threads ? Hkv : 1;
  std::vector<Item> base;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = a.qstart[s + 1] - a.qstart[s], L = a.kvlen[s];
    TORCH_CHECK(n >= 0 && L >= n && (L + BS - 1) / BS <= a.MB, "paged_attention: sequence ", s, " has ", n,
                " queries and ", L, " keys, inconsistent with its block table");
    for (int64_t q0 = 0; q0 < n; q0 += QCHUNK)
      for (int64_t h = 0; h < Hkv; h += heads_per_item) {
        const int64_t q1 = std::min(n, q0 + QCHUNK);
        const int64_t keys = L - n + q1;  // keys up to the chunk's last query
        // the chunk's first query sees keys from k0 on (a sliding window's start; 0 without one)
        const int64_t k0 = window > 0 ? std::max<int64_t>(0, L - n + q0 - window + 1) : 0;
        const int64_t cost = ((keys - k0) * (q1 - q0) + 64) * heads_per_item;
        base.push_back({s, h, h + heads_per_item, q0, q1, k0, keys, 0, 1, 0, cost});
      }
  }
  // split long items when there are fewer items than threads can share evenly
  std::vector<Item> items, heads;
  int64_t slots = 0;
  const int64_t want = 4 * threads;
  for (const Item& it : base) {
    int64_t parts = 1;
    // split_keys=false: every query row sums its keys in one fixed order whatever shares the call (batch invariance):
    // no split here, and no three-pass decode (a token decoded and the same token recomputed in a prefill chunk)
    if (split_keys && static_cast<int64_t>(base.size()) < want && threads > 1) {
      parts = std::min<int64_t>((want + base.size() - 1) / base.size(), (it.k1 - it.k0) / MIN_SPLIT_KEYS);
      parts = std::max<int64_t>(1, parts);
    }
    if (parts == 1) {
      items.push_back(it);
      continue;
    }
    const int64_t span = it.k1 - it.k0;
    const int64_t per = ((span + parts - 1) / parts + BS - 1) / BS * BS;  // block-multiple part length
    parts = (span + per - 1) / per;
    Item head = it;
    head.parts = parts;
    head.merge_slot = slots;
    heads.push_back(head);
    for (int64_t p = 0; p < parts; ++p) {
      Item x = head;
      x.part = p;
      x.k0 = it.k0 + p * per;
      x.k1 = std::min(it.k1, it.k0 + (p + 1) * per);
      x.cost = ((x.k1 - x.k0) * (x.q1 - x.q0) + 64) * (x.h1 - x.h0);
      items.push_back(x);
    }
    slots += parts;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::vector<float> partial(heads.empty() ? 0 : slots * a.slot);
  const bool q_bf16 = query.scalar_type() == at::kBFloat16;
  const auto kv = key_pool.scalar_type();
  auto dispatch = [&](auto qtag, auto kvtag) {
    using Q = decltype(qtag);
    using KV = decltype(kvtag);
    auto go = [&](auto dh) {
      run<Q, KV, decltype(dh)::value>(a, items, reinterpret_cast<const Q*>(query.data_ptr()), reinterpret_cast<const KV*>(key_pool.data_ptr()),
               reinterpret_cast<const KV*>(value_pool.data_ptr()), reinterpret_cast<Q*>(out.data_ptr()),
               partial.data(), threads);
    };
    if (D == 64 && Dv == 64) go(std::integral_constant<int64_t, 64>{});
    else if (D == 128 && Dv == 128) go(std::integral_constant<int64_t, 128>{});
    else go(std::integral_constant<int64_t, 0>{});
    if (!heads.empty()) merge<Q>(a, heads, partial.data(), reinterpret_cast<Q*>(out.data_ptr()));
  };
  if (!q_bf16 && kv == at::kFloat) dispatch(float{}, float{});
  else if (!q_bf16 && kv == at::kBFloat16) dispatch(float{}, c10::BFloat16{});
  else if (!q_bf16) dispatch(float{}, c10::Half{});
  else if (kv == at::kFloat) dispatch(c10::BFloat16{}, float{});
  else if (kv == at::kBFloat16) dispatch(c10::BFloat16{}, c10::BFloat16{});
  else dispatch(c10::BFloat16{}, c10::Half{});
  return out;
}

}  // namespace

// Fails on purpose: infopt.ops.cpp calls it once per build, in a child process, to see that an error raised
// in this library reaches Python as a RuntimeError under the installed torch before the library is used.
static int64_t paged_attention_error_probe() {
  TORCH_CHECK(false, "infopt error-path probe");
  return 0;
}

TORCH_LIBRARY_FRAGMENT(infopt, m) {
  m.def("paged_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor block_table, Tensor query_start, "
        "Tensor kv_lens, float scale, int window=0, bool split_keys=True) -> Tensor");
  m.def("paged_attention_error_probe() -> int", &paged_attention_error_probe);
}

TORCH_LIBRARY_IMPL(infopt, CPU, m) { m.impl("paged_attention", &paged_attention); }
