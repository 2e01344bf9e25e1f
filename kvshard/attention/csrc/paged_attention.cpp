// Paged attention over kvshard's KV cache on CPU, returning the log-sum-exp with the output.
//
// One call covers every query row of a step that reads cached context. Row r reads the
// sequence row_seq[r] of the block table and sees that sequence's first row_lens[r] local
// tokens (a rank's share of a DCP interleave is packed densely into its blocks, so "visible"
// is always a prefix; several rows of one request carry their own causal bounds).
//
// Work is cut into items: (a run of up to `rows` consecutive rows of one sequence, one KV head,
// a chunk of the query heads that read it, a span of tokens). The query vectors of an item
// share every K/V row it loads, which is converted to float32 once per block. Softmax is
// online in float32. When items are too few for the threads, the token axis is split and the
// partial results merged by their LSE.
//
// The headers are the few the kernel uses, not <torch/extension.h>: that one brings in torch's whole
// C++ frontend, whose parsing took 59 s of a 104 s build on a 2-core AVX2 machine (these headers: 17 s;
// the build: 65 s).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <limits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <ATen/native/CPUBlas.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxVectors = 64;  // query vectors (rows x heads) per item

// exp(x) for finite x <= 0, in a form the compiler vectorises (no libm call): 2^n * p(r)
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 16 floats as one value (GCC/Clang vector extensions): accumulators stay in registers, lowered
// to whatever vector width the target has. The unaligned type reads any float address.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The sums of four vectors' lanes, as one 4-vector: halves added level by level, no scalar chain.
inline v4 hsum4(v16 a0, v16 a1, v16 a2, v16 a3) {
  const v16 x01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 x23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 y = __builtin_shufflevector(x01, x23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(x01, x23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v8 z = __builtin_shufflevector(y, y, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(y, y, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(z, z, 0, 2, 4, 6) + __builtin_shufflevector(z, z, 1, 3, 5, 7);
}

// Key rows scored together per query-vector load: four where the vector registers hold the 16
// accumulators (AVX-512: 32 of them), else two.
#if defined(__AVX512F__)
constexpr int kKeys = 4;
#else
constexpr int kKeys = 2;
#endif

// Four query vectors against kKeys key rows: each q chunk is loaded once for the keys and each k
// chunk once for the four vectors. out[y * 4 + x] = q_x . k_y. (Each score sums its products in
// the same order as one vector against one row would: per 16 lanes, then the lanes, then the tail.)
inline void dot4xk(const float* const* __restrict qs, const float* const* __restrict ks, int64_t n, float* out) {
  v16 a[kKeys][4] = {};
  const float *q0 = qs[0], *q1 = qs[1], *q2 = qs[2], *q3 = qs[3];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 x0 = load16(q0 + i), x1 = load16(q1 + i), x2 = load16(q2 + i), x3 = load16(q3 + i);
#pragma GCC unroll 4
    for (int y = 0; y < kKeys; ++y) {
      const v16 kv = load16(ks[y] + i);
      a[y][0] += x0 * kv;
      a[y][1] += x1 * kv;
      a[y][2] += x2 * kv;
      a[y][3] += x3 * kv;
    }
  }
#pragma GCC unroll 4
  for (int y = 0; y < kKeys; ++y) {
    const v4 sums = hsum4(a[y][0], a[y][1], a[y][2], a[y][3]);
    const float* k = ks[y];
    float s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3];
    for (int64_t t = i; t < n; ++t) {
      s0 += q0[t] * k[t];
      s1 += q1[t] * k[t];
      s2 += q2[t] * k[t];
      s3 += q3[t] * k[t];
    }
    out[y * 4 + 0] = s0;
    out[y * 4 + 1] = s1;
    out[y * 4 + 2] = s2;
    out[y * 4 + 3] = s3;
  }
}

// Four vectors' am[i0, i0 + 16 C) += sum_j p[j] * v_j: each V chunk is loaded once for the four,
// and C chunks of accumulators stay in registers over all n rows.
template <int C>
inline void accumulate4c(float* const* __restrict ams, const float* const* __restrict ps,
                         const float* __restrict v, int64_t stride, int64_t n, int64_t i0) {
  v16 r[4][C];
#pragma GCC unroll 4
  for (int x = 0; x < 4; ++x)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) r[x][c] = load16(ams[x] + i0 + 16 * c);
  const float *p0 = ps[0], *p1 = ps[1], *p2 = ps[2], *p3 = ps[3];
  for (int64_t j = 0; j < n; ++j) {
    const float* row = v + j * stride + i0;
    const float w0 = p0[j], w1 = p1[j], w2 = p2[j], w3 = p3[j];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const v16 vj = load16(row + 16 * c);
      r[0][c] += w0 * vj;
      r[1][c] += w1 * vj;
      r[2][c] += w2 * vj;
      r[3][c] += w3 * vj;
    }
  }
#pragma GCC unroll 4
  for (int x = 0; x < 4; ++x)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) store16(ams[x] + i0 + 16 * c, r[x][c]);
}

// Four vectors' am[0, dv) += sum_j p[j] * v_j.
inline void accumulate4(float* const* __restrict ams, const float* const* __restrict ps,
                        const float* __restrict v, int64_t stride, int64_t n, int64_t dv) {
  constexpr int kChunks = kKeys;  // as many accumulators as the scores use
  int64_t i = 0;
  for (; i + 16 * kChunks <= dv; i += 16 * kChunks) accumulate4c<kChunks>(ams, ps, v, stride, n, i);
  for (; i + 16 <= dv; i += 16) accumulate4c<1>(ams, ps, v, stride, n, i);
  for (; i < dv; ++i) {
    for (int w = 0; w < 4; ++w) {
      float r = ams[w][i];
      for (int64_t j = 0; j < n; ++j) r += ps[w][j] * v[j * stride + i];
      ams[w][i] = r;
    }
  }
}

// Rows of a cache (token stride `stride` elements, `n` channels used) as float32.
template <typename T>
struct Rows;

template <>
struct Rows<float> {
  static constexpr bool kDirect = true;  // read in place
  static void load(const float*, int64_t, int64_t, int64_t, float*, const float*) {}
};

template <>
struct Rows<c10::BFloat16> {
  static constexpr bool kDirect = false;
  static void load(const c10::BFloat16* src, int64_t stride, int64_t count, int64_t n, float* out, const float*) {
    for (int64_t j = 0; j < count; ++j) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src + j * stride);
      uint32_t* o = reinterpret_cast<uint32_t*>(out + j * n);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
    }
  }
};

template <>
struct Rows<c10::Half> {
  static constexpr bool kDirect = false;
  static void load(const c10::Half* src, int64_t stride, int64_t count, int64_t n, float* out, const float*) {
    for (int64_t j = 0; j < count; ++j) {
      const c10::Half* s = src + j * stride;
      float* o = out + j * n;
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
      }
#endif
      for (; i < n; ++i) o[i] = static_cast<float>(s[i]);
    }
  }
};

template <>
struct Rows<c10::Float8_e4m3fn> {
  static constexpr bool kDirect = false;
  static void load(const c10::Float8_e4m3fn* src, int64_t stride, int64_t count, int64_t n, float* out,
                   const float* lut) {
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(src + j * stride);
      float* o = out + j * n;
      for (int64_t i = 0; i < n; ++i) o[i] = lut[s[i]];
    }
  }
};

struct Unit {  // an item before any split along the tokens
  int64_t row0, nrows, seq, kv_head, head0, nheads, max_len;
};

struct Shape {
  int64_t num_heads, num_kv_heads, dk, dv, block_size, max_blocks;
  int64_t q_row, q_head;            // q strides (elements)
  int64_t k_tok, k_head, v_tok, v_head;  // cache strides
  bool v_in_k;                      // V is K's leading channels: reuse K's converted rows
  float scale, v_scale;
};

// The start of an item, on either path: each query vector's bound (the tokens it sees, up to t1), its running
// max and sum, and the query itself through `load(m, src)`; returns the furthest token any vector sees.
template <typename QT, typename F>
int64_t start_item(const Unit& u, int64_t t1, const Shape& sh, const QT* q, const int32_t* lens, int64_t* bounds,
                   float* mx, float* sum, F&& load) {
  int64_t reach = 0;
  for (int64_t r = 0; r < u.nrows; ++r) {
    const int64_t len = std::min<int64_t>(lens[u.row0 + r], t1);
    for (int64_t h = 0; h < u.nheads; ++h) {
      const int64_t m = r * u.nheads + h;
      bounds[m] = len;
      reach = std::max(reach, len);
      load(m, q + (u.row0 + r) * sh.q_row + (u.head0 + h) * sh.q_head);
      mx[m] = kNegInf;
      sum[m] = 0.0f;
    }
  }
  return reach;
}

// The end of an item: o (normalised, times the value scale) and lse per vector; o = 0 and lse = -inf for a vector
// that saw no token.
inline void finish_item(const Unit& u, const Shape& sh, const float* acc, const float* mx, const float* sum,
                        float* out, int64_t out_row_stride, int64_t out_head_stride, float* lse,
                        int64_t lse_row_stride, int64_t lse_head_stride) {
  const int64_t dv = sh.dv;
  for (int64_t r = 0; r < u.nrows; ++r) {
    for (int64_t h = 0; h < u.nheads; ++h) {
      const int64_t m = r * u.nheads + h;
      float* o = out + r * out_row_stride + h * out_head_stride;
      float* l = lse + r * lse_row_stride + h * lse_head_stride;
      if (sum[m] > 0.0f) {
        const float inv = sh.v_scale / sum[m];
        for (int64_t i = 0; i < dv; ++i) o[i] = acc[m * dv + i] * inv;
        *l = mx[m] + std::log(sum[m]);
      } else {
        std::fill(o, o + dv, 0.0f);
        *l = kNegInf;
      }
    }
  }
}

// One item: the units' query vectors over tokens [t0, t1). Writes o (normalised) and lse for each
// vector into out/lse (out rows: vector-major, o_stride apart).
template <typename QT, typename CT>
void run_item(const Unit& u, int64_t t0, int64_t t1, const Shape& sh, const QT* q, const CT* kc, const CT* vc,
              const int32_t* table, const int32_t* lens, const float* lut, float* out, int64_t out_row_stride,
              int64_t out_head_stride, float* lse, int64_t lse_row_stride, int64_t lse_head_stride,
              std::vector<float>& scratch) {
  const int64_t M = u.nrows * u.nheads, dk = sh.dk, dv = sh.dv, B = sh.block_size;
  const int64_t kb_size = Rows<CT>::kDirect ? 0 : B * dk;
  const int64_t vb_size = (Rows<CT>::kDirect || sh.v_in_k) ? 0 : B * dv;
  scratch.resize(M * dk + M * dv + M * B + 2 * M + kb_size + vb_size + dv + B);
  float* qf = scratch.data();
  float* acc = qf + M * dk;
  float* s = acc + M * dv;
  float* mx = s + M * B;
  float* sum = mx + M;
  float* kbuf = sum + M;
  float* vbuf = kbuf + kb_size;
  float* dummy = vbuf + vb_size;  // the output of a missing fourth vector, thrown away
  float* zeros = dummy + dv;      // its weights
  std::fill(zeros, zeros + B, 0.0f);
  int64_t bounds[kMaxVectors];  // tokens each vector sees, up to t1
  // the furthest token any vector of the item sees within [t0, t1)
  const int64_t reach = start_item(u, t1, sh, q, lens, bounds, mx, sum, [&](int64_t m, const QT* src) {
    for (int64_t i = 0; i < dk; ++i) qf[m * dk + i] = static_cast<float>(src[i]) * sh.scale;
  });
  std::fill(acc, acc + M * dv, 0.0f);
  const int32_t* blocks = table + u.seq * sh.max_blocks;
  for (int64_t tok0 = t0; tok0 < reach; tok0 += B) {
    const int64_t count = std::min<int64_t>(B, reach - tok0);
    const int64_t slot0 = static_cast<int64_t>(blocks[tok0 / B]) * B;
    const CT* kp = kc + slot0 * sh.k_tok + u.kv_head * sh.k_head;
    const CT* vp = vc + slot0 * sh.v_tok + u.kv_head * sh.v_head;
    const float* krows;
    const float* vrows;
    int64_t kstride, vstride;
    if constexpr (Rows<CT>::kDirect) {
      krows = reinterpret_cast<const float*>(kp);
      vrows = reinterpret_cast<const float*>(vp);
      kstride = sh.k_tok;
      vstride = sh.v_tok;
    } else {
      Rows<CT>::load(kp, sh.k_tok, count, dk, kbuf, lut);
      krows = kbuf;
      kstride = dk;
      if (sh.v_in_k) {
        vrows = kbuf;
        vstride = dk;
      } else {
        Rows<CT>::load(vp, sh.v_tok, count, dv, vbuf, lut);
        vrows = vbuf;
        vstride = dv;
      }
    }
    // tokens of this block each vector sees
    int64_t seen[kMaxVectors];
    for (int64_t m = 0; m < M; ++m) seen[m] = std::max<int64_t>(0, std::min<int64_t>(count, bounds[m] - tok0));
    // scores, four vectors at a time (a group's vectors see the most tokens any of them sees; the
    // extra scores are never read)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t w = std::min<int64_t>(4, M - m0);
      int64_t n = 0;
      for (int64_t x = 0; x < w; ++x) n = std::max(n, seen[m0 + x]);
      if (n == 0) continue;
      const float* qs[4];
      for (int64_t x = 0; x < 4; ++x) qs[x] = qf + (m0 + std::min(x, w - 1)) * dk;
      float tile[kKeys * 4];
      for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
        const int64_t keys = std::min<int64_t>(kKeys, n - j0);
        const float* ks[kKeys];
        for (int64_t y = 0; y < kKeys; ++y) ks[y] = krows + (j0 + std::min(y, keys - 1)) * kstride;
        dot4xk(qs, ks, dk, tile);
        for (int64_t y = 0; y < keys; ++y) {
          for (int64_t x = 0; x < w; ++x) s[(m0 + x) * B + j0 + y] = tile[y * 4 + x];
        }
      }
    }
    // online softmax, per vector: the weights of this block's tokens replace their scores
    for (int64_t m = 0; m < M; ++m) {
      const int64_t n = seen[m];
      float* sm = s + m * B;
      if (n == 0) continue;
      float block_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sm[j]);
      float* am = acc + m * dv;
      const float new_max = std::max(mx[m], block_max);
      if (new_max > mx[m] && mx[m] != kNegInf) {
        const float alpha = exp_nonpositive(mx[m] - new_max);
        sum[m] *= alpha;
        for (int64_t i = 0; i < dv; ++i) am[i] *= alpha;
      }
      mx[m] = new_max;
      for (int64_t j = 0; j < n; ++j) sm[j] = exp_nonpositive(sm[j] - new_max);  // vectorised
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) total += sm[j];
      sum[m] += total;
    }
    // weighted values, four vectors at a time (a vector's weights past what it sees are zero)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t w = std::min<int64_t>(4, M - m0);
      int64_t n = 0;
      for (int64_t x = 0; x < w; ++x) n = std::max(n, seen[m0 + x]);
      if (n == 0) continue;
      for (int64_t x = 0; x < w; ++x) std::fill(s + (m0 + x) * B + seen[m0 + x], s + (m0 + x) * B + n, 0.0f);
      float* ams[4];
      const float* ps[4];
      for (int64_t x = 0; x < 4; ++x) {
        ams[x] = x < w ? acc + (m0 + x) * dv : dummy;
        ps[x] = x < w ? s + (m0 + x) * B : zeros;
      }
      accumulate4(ams, ps, vrows, vstride, n, dv);
    }
  }
  finish_item(u, sh, acc, mx, sum, out, out_row_stride, out_head_stride, lse, lse_row_stride, lse_head_stride);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KVSHARD_TILED 1
#include <immintrin.h>

#include <type_traits>
// The AVX-512 path: tiles of 16 tokens, one token a lane. A tile's keys are converted to float32 and
// transposed in registers once (kt[i][j] = channel i of token j), so a query vector's 16 scores are one
// accumulator of broadcast-multiply-adds over the channels, with no horizontal sum; the softmax runs on
// those 16 lanes; the values are converted in registers as the weighted sum reads them. Up to 8 query
// vectors go together, so each converted key or value vector is used for all of them.
namespace tiled {

constexpr int kLanes = 16;
constexpr int kGroup = 8;  // query vectors per register group

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// 16 values of a cache row (lanes outside `m` zero) as float32
inline __m512 load16f(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16f(const c10::BFloat16* p, __mmask16 m) {
  const __m256i x = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load16f(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
// float8 e4m3fn by its fields: normal 2^(e-7) (1 + m/8), subnormal m 2^-9, NaN (S.1111.111) read as 0 as the
// portable path's table does
inline __m512 load16f(const c10::Float8_e4m3fn* p, __mmask16 m) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(x, 3), _mm512_set1_epi32(0xF));
  const __m512i mant = _mm512_and_si512(x, _mm512_set1_epi32(7));
  const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                         _mm512_slli_epi32(mant, 20));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mant), _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  const __m512i bits = _mm512_or_si512(_mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub)), sign);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~nan), _mm512_castsi512_ps(bits));
}

// r[i] lane j <- r[j] lane i
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

// kt[i * 16 + j] = channel i of token j, for i < round_up(dk, 16); tokens past `count` and channels past dk are 0
template <typename CT>
inline void key_tile(const CT* k, int64_t stride, int64_t count, int64_t dk, float* kt) {
  for (int64_t i0 = 0; i0 < dk; i0 += kLanes) {
    const __mmask16 cm = lanes(dk - i0);
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < count ? load16f(k + j * stride + i0, cm) : _mm512_setzero_ps();
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (i0 + c) * kLanes, r[c]);
  }
}

// the 16 scores of G query vectors (qf: G rows of dk, scaled): s[g * 16 + j] = q_g . k_j
template <int G>
inline void scores(const float* __restrict qf, int64_t dk, const float* __restrict kt, float* __restrict s) {
  // two accumulator sets, channels alternating between them (a short group hides the add's latency so): for every
  // group size, so that a vector's score sums in the same order whatever group it is in
  constexpr int A = 2;
  __m512 a[A][G];
  for (int x = 0; x < A; ++x)
    for (int g = 0; g < G; ++g) a[x][g] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + A <= dk; i += A) {
#pragma GCC unroll 2
    for (int x = 0; x < A; ++x) {
      const __m512 k = _mm512_loadu_ps(kt + (i + x) * kLanes);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) a[x][g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * dk + i + x]), k, a[x][g]);
    }
  }
  for (; i < dk; ++i) {
    const __m512 k = _mm512_loadu_ps(kt + i * kLanes);
    for (int g = 0; g < G; ++g) a[0][g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * dk + i]), k, a[0][g]);
  }
  for (int g = 0; g < G; ++g) {
    __m512 v = a[0][g];
    v = _mm512_add_ps(v, a[1][g]);
    _mm512_storeu_ps(s + g * kLanes, v);
  }
}

// acc[g * dv + i] += sum_j p[g * 16 + j] * v_j[i] for G vectors over `count` value rows, CH chunks of 16
// channels at a time so that G * CH accumulators stay in registers
// (p[g * PG + j * PJ]: the token-lane tiles keep a vector's 16 weights together, PG = 16, PJ = 1; the vector-lane
// items a token's, PG = 1, PJ = 16)
template <typename CT, int G, int PG = kLanes, int PJ = 1>
inline void weighted_values(float* __restrict acc, int64_t dv, const float* __restrict p, const CT* v,
                            int64_t stride, int64_t count) {
  constexpr int CH = G <= 4 ? 4 : 2;
  int64_t c = 0;
  for (; c + CH * kLanes <= dv; c += CH * kLanes) {
    __m512 r[G][CH];
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CH; ++h) r[g][h] = _mm512_loadu_ps(acc + g * dv + c + h * kLanes);
    for (int64_t j = 0; j < count; ++j) {
      const CT* row = v + j * stride + c;
      __m512 vj[CH];
      for (int h = 0; h < CH; ++h) vj[h] = load16f(row + h * kLanes, 0xFFFF);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * PG + j * PJ]);
        for (int h = 0; h < CH; ++h) r[g][h] = _mm512_fmadd_ps(w, vj[h], r[g][h]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < CH; ++h) _mm512_storeu_ps(acc + g * dv + c + h * kLanes, r[g][h]);
  }
  for (; c < dv; c += kLanes) {
    const __mmask16 cm = lanes(dv - c);
    __m512 r[G];
    for (int g = 0; g < G; ++g) r[g] = _mm512_maskz_loadu_ps(cm, acc + g * dv + c);
    for (int64_t j = 0; j < count; ++j) {
      const __m512 vj = load16f(v + j * stride + c, cm);
      for (int g = 0; g < G; ++g) r[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * PG + j * PJ]), vj, r[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(acc + g * dv + c, cm, r[g]);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 queries on a bfloat16 cache: the scores as dot products of channel pairs (vdpbf16ps: each product
// exact, summed in float32), on the keys as stored. kw[p * 16 + j] = channels 2p and 2p + 1 of token j, one
// 32-bit word; `words` = dk / 2.
inline void key_tile_pairs(const c10::BFloat16* k, int64_t stride, int64_t count, int64_t words, uint32_t* kw) {
  for (int64_t p0 = 0; p0 < words; p0 += kLanes) {
    const __mmask16 cm = lanes(words - p0);
    __m512 r[16];
    for (int j = 0; j < 16; ++j) {
      r[j] = j < count ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(cm, k + j * stride + 2 * p0))
                       : _mm512_setzero_ps();
    }
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(kw + (p0 + c) * kLanes), r[c]);
  }
}

// s[g * 16 + j] = scale * q_g . k_j for G vectors (qw: G rows of `words` channel pairs)
template <int G>
inline void scores_pairs(const uint32_t* __restrict qw, int64_t words, const uint32_t* __restrict kw, float scale,
                         float* __restrict s) {
  constexpr int A = 2;  // as `scores`: the same order for every group size
  __m512 a[A][G];
  for (int x = 0; x < A; ++x)
    for (int g = 0; g < G; ++g) a[x][g] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + A <= words; p += A) {
#pragma GCC unroll 2
    for (int x = 0; x < A; ++x) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kw + (p + x) * kLanes);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        a[x][g] = _mm512_dpbf16_ps(a[x][g], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[g * words + p + x])), k);
      }
    }
  }
  for (; p < words; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kw + p * kLanes);
    for (int g = 0; g < G; ++g) {
      a[0][g] = _mm512_dpbf16_ps(a[0][g], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[g * words + p])), k);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    __m512 v = a[0][g];
    v = _mm512_add_ps(v, a[1][g]);
    _mm512_storeu_ps(s + g * kLanes, _mm512_mul_ps(v, sc));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSHARD_AMX 1
// AMX tiles: every one of the eight configured as 16 rows of 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_permitted() {  // Linux hands a process the tiles' state only once asked (torch's oneDNN asks too)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A thread's use of the tiles over a scope: configured on entry; on exit released, and torch's record of the thread's
// tile setup cleared, so that oneDNN configures them again for its next product
struct TileScope {
  const bool on;
  explicit TileScope(bool use) : on(use) {
    if (on) configure_tiles();
  }
  ~TileScope() {
    if (on) at::native::cpublas::brgemm_release(true);
  }
};

// The decode items' scores on the tiles: the keys are the A tile as they lie in the cache (16 tokens x 32 channels a
// tile, no transpose), the queries the B tile (qb: per 32 channels, 16 rows of channel pairs x 16 vectors, as 32-bit
// words, zero past the n vectors), so one tile product per 32 channels gives a tile's 16 tokens x 16 vectors of
// scores, each a sum of exact bfloat16 products in float32. Each vector's 16 scores are gathered from the stored tile
// into the token-lane layout the softmax reads: s[vec[x] * 16 + j] = scale * q_x . k_j. A tile shorter than 16 tokens
// is copied into kbuf first (the rows past it zero), so that no load reaches past its block. dk: a multiple of 32, at
// most 128; n at most 16.
inline void scores_tiles(const uint32_t* __restrict qb, int64_t n, const int64_t* vec, int64_t dk,
                         const c10::BFloat16* k, int64_t stride, int64_t count, float scale, c10::BFloat16* kbuf,
                         float* sbuf, float* __restrict s) {
  const int64_t nd = dk / 32;
  const char* base = reinterpret_cast<const char*>(k);
  int64_t bytes = stride * 2;
  if (count < kLanes) {
    for (int64_t j = 0; j < count; ++j) std::memcpy(kbuf + j * dk, k + j * stride, dk * 2);
    std::memset(kbuf + count * dk, 0, (kLanes - count) * dk * 2);
    base = reinterpret_cast<const char*>(kbuf);
    bytes = dk * 2;
  }
  _tile_zero(1);
  for (int64_t c = 0; c < nd; c += 2) {
    _tile_loadd(0, base + c * 64, bytes);
    _tile_loadd(2, qb + c * 256, 64);
    _tile_dpbf16ps(1, 0, 2);
    if (c + 1 < nd) {
      _tile_loadd(3, base + (c + 1) * 64, bytes);
      _tile_loadd(4, qb + (c + 1) * 256, 64);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(1, sbuf, 64);
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t x = 0; x < n; ++x) {
    _mm512_storeu_ps(s + vec[x] * kLanes, _mm512_mul_ps(_mm512_i32gather_ps(rows, sbuf + x, 4), sc));
  }
}
#endif

// Prefetch into L2 the rows [0, count) of a cache tile (row stride `stride` elements, `bytes` used per row).
template <typename CT>
inline void prefetch_rows(const CT* p, int64_t stride, int64_t count, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j) {
    const char* row = reinterpret_cast<const char*>(p + j * stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

// An item's tokens in tiles of up to 16 tokens of one block, on either tile path: where a tile lies, and the
// prefetch of the tile after the next. Forced inline, as `scale_row`: GCC left them as calls in the large tile
// loops, which then ran 1.4x slower (gqa8 float32, 64 x 1K: 2.9 against 2.1 ms).
template <typename CT>
struct TileWalk {
  const Shape& sh;
  const CT* kc;
  const CT* vc;
  const int32_t* blocks;  // the item's row of the block table
  int64_t kv_head, reach;
  int64_t k_bytes = sh.dk * static_cast<int64_t>(sizeof(CT));  // of a row, prefetched: the item's KV heads' channels
  int64_t v_bytes = sh.dv * static_cast<int64_t>(sizeof(CT));

  // where the tile of tokens starting at tok lies: its first slot, and its length
  __attribute__((always_inline)) void at(int64_t tok, int64_t& slot, int64_t& count) const {
    const int64_t in_block = tok % sh.block_size;
    count = std::min<int64_t>({kLanes, sh.block_size - in_block, reach - tok});
    slot = static_cast<int64_t>(blocks[tok / sh.block_size]) * sh.block_size + in_block;
  }
  __attribute__((always_inline)) const CT* keys(int64_t slot) const { return kc + slot * sh.k_tok + kv_head * sh.k_head; }
  __attribute__((always_inline)) const CT* values(int64_t slot) const { return vc + slot * sh.v_tok + kv_head * sh.v_head; }
  // the rows of the tile after the next (this one starts at tok0, `count` long) into L2, while this one is computed
  // (blocks lie anywhere: the hardware's prefetchers do not follow a block table). Two tiles ahead into L2 read
  // 1.6-1.9x faster from memory than one tile ahead into L1, whose few miss buffers 64 prefetched lines overrun.
  // `part` of `parts`: that share of the rows, so that the token-lane tiles spread a tile's prefetches over its
  // phases (key tile, scores, softmax, values) rather than issue them all at once: on cold latents (an engine's
  // step) 1.3x faster (BENCHMARKS.md section 23)
  __attribute__((always_inline)) void prefetch_after(int64_t tok0, int64_t count, int part = 0, int parts = 1) const {
    if (tok0 + count + kLanes >= reach) return;
    int64_t slot, n;
    at(tok0 + count + kLanes, slot, n);
    const int64_t j0 = n * part / parts, j1 = n * (part + 1) / parts;
    prefetch_rows(keys(slot) + j0 * sh.k_tok, sh.k_tok, j1 - j0, k_bytes);
    if (!sh.v_in_k) prefetch_rows(values(slot) + j0 * sh.v_tok, sh.v_tok, j1 - j0, v_bytes);
  }
};

// The first two tiles of unit `u` into L2, issued as the unit before it starts: `prefetch_after` reaches a tile two
// ahead of the one being computed, so without this an item's own first tiles always came from memory
template <typename CT>
inline void prefetch_start(const Unit& u, const Shape& sh, const CT* kc, const CT* vc, const int32_t* table) {
  const TileWalk<CT> tiles{sh, kc, vc, table + u.seq * sh.max_blocks, u.kv_head, u.max_len};
  for (int64_t tok = 0; tok < std::min<int64_t>(u.max_len, 2 * kLanes);) {
    int64_t slot, n;
    tiles.at(tok, slot, n);
    prefetch_rows(tiles.keys(slot), sh.k_tok, n, sh.dk * static_cast<int64_t>(sizeof(CT)));
    if (!sh.v_in_k) prefetch_rows(tiles.values(slot), sh.v_tok, n, sh.dv * static_cast<int64_t>(sizeof(CT)));
    tok += n;
  }
}

// row[0, n) *= alpha
__attribute__((always_inline)) inline void scale_row(float* row, int64_t n, float alpha) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(row + i, _mm512_mul_ps(a, _mm512_loadu_ps(row + i)));
  for (; i < n; ++i) row[i] *= alpha;
}

// f(std::integral_constant<int, g>) for a group of g (1..8) vectors, g known at run time
template <typename F>
inline void with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// exp(x) for x <= 0 in 16 lanes: the portable path's polynomial, 2^n by scalef
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of a token-lane tile for vectors [0, M) (scores s[m * 16 + j] of the tile's `count` tokens from
// tok0; vector m sees tokens below bounds[m]): the weights replace the scores (0 past what a vector sees), and a
// vector's max, sum and accumulator are updated
__attribute__((always_inline)) inline void softmax_tile(int64_t M, int64_t count, int64_t tok0, const int64_t* bounds,
                                                        float* s, float* mx, float* sum, float* acc, int64_t dv) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(count, bounds[m] - tok0));
    float* sm = s + m * kLanes;
    if (n == 0) {
      _mm512_storeu_ps(sm, _mm512_setzero_ps());
      continue;
    }
    const __mmask16 seen = lanes(n);
    const __m512 x = _mm512_loadu_ps(sm);
    const float new_max = std::max(mx[m], _mm512_mask_reduce_max_ps(seen, x));
    if (new_max > mx[m]) {
      if (mx[m] != kNegInf) {
        const float alpha = exp_nonpositive(mx[m] - new_max);
        sum[m] *= alpha;
        scale_row(acc + m * dv, dv, alpha);
      }
      mx[m] = new_max;
    }
    const __m512 w = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_max))));
    sum[m] += _mm512_reduce_add_ps(w);
    _mm512_storeu_ps(sm, w);
  }
}

template <typename QT, typename CT>
void run_item(const Unit& u, int64_t t0, int64_t t1, const Shape& sh, const QT* q, const CT* kc, const CT* vc,
              const int32_t* table, const int32_t* lens, float* out, int64_t out_row_stride, int64_t out_head_stride,
              float* lse, int64_t lse_row_stride, int64_t lse_head_stride, std::vector<float>& scratch) {
  const int64_t M = u.nrows * u.nheads, dk = sh.dk, dv = sh.dv;
  const int64_t dk_pad = (dk + kLanes - 1) / kLanes * kLanes;
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  const bool pairs = kPairs && dk % 2 == 0;  // scores by channel pairs, on the keys as stored
  scratch.resize(M * dk + M * dv + M * kLanes + 2 * M + dk_pad * kLanes);
  float* qf = scratch.data();
  float* acc = qf + M * dk;
  float* s = acc + M * dv;
  float* mx = s + M * kLanes;
  float* sum = mx + M;
  float* kt = sum + M;
  int64_t bounds[kMaxVectors];
  const int64_t reach = start_item(u, t1, sh, q, lens, bounds, mx, sum, [&](int64_t m, const QT* src) {
    if (pairs) {  // the query's bfloat16 channels as they are (qf's room holds them); the scale goes on the scores
      std::memcpy(qf + m * dk / 2, src, dk * sizeof(QT));
    } else {
      for (int64_t i = 0; i < dk; ++i) qf[m * dk + i] = static_cast<float>(src[i]) * sh.scale;
    }
  });
  std::fill(acc, acc + M * dv, 0.0f);
  const TileWalk<CT> tiles{sh, kc, vc, table + u.seq * sh.max_blocks, u.kv_head, reach};
  for (int64_t tok0 = t0; tok0 < reach;) {
    int64_t slot0, count;
    tiles.at(tok0, slot0, count);
    const CT* kp = tiles.keys(slot0);
    const CT* vp = tiles.values(slot0);
    tiles.prefetch_after(tok0, count, 0, 4);
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      if (pairs) {
        uint32_t* kw = reinterpret_cast<uint32_t*>(kt);
        const uint32_t* qw = reinterpret_cast<const uint32_t*>(qf);
        key_tile_pairs(kp, sh.k_tok, count, dk / 2, kw);
        tiles.prefetch_after(tok0, count, 1, 4);
        for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
          with_group(std::min<int64_t>(kGroup, M - m0), [&](auto g) {
            scores_pairs<decltype(g)::value>(qw + m0 * dk / 2, dk / 2, kw, sh.scale, s + m0 * kLanes);
          });
        }
      }
    }
#endif
    if (!pairs) {
      key_tile<CT>(kp, sh.k_tok, count, dk, kt);
      tiles.prefetch_after(tok0, count, 1, 4);
      for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
        with_group(std::min<int64_t>(kGroup, M - m0),
                   [&](auto g) { scores<decltype(g)::value>(qf + m0 * dk, dk, kt, s + m0 * kLanes); });
      }
    }
    tiles.prefetch_after(tok0, count, 2, 4);
    softmax_tile(M, count, tok0, bounds, s, mx, sum, acc, dv);
    tiles.prefetch_after(tok0, count, 3, 4);
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      with_group(std::min<int64_t>(kGroup, M - m0), [&](auto g) {
        weighted_values<CT, decltype(g)::value>(acc + m0 * dv, dv, s + m0 * kLanes, vp, sh.v_tok, count);
      });
    }
    tok0 += count;
  }
  finish_item(u, sh, acc, mx, sum, out, out_row_stride, out_head_stride, lse, lse_row_stride, lse_head_stride);
}


#if defined(KVSHARD_AMX)
// The token-lane items with their scores on AMX tiles (`scores_tiles`): bfloat16 queries on a bfloat16 cache, dk a
// multiple of 32 up to 128, the tiles configured by the caller (TileScope). A unit here may hold the query heads of
// several KV heads (launch gives it every head of its rows): each tile of tokens is then read for all of them in
// turn, so that the cache is read whole rows one after another (a token's KV heads lie side by side) rather than a
// head's channels of each row in a pass of its own. A vector's sums run as on the token-lane path (the values in
// float32), in the same order whatever else its unit holds.
void run_item_tiles(const Unit& u, int64_t t0, int64_t t1, const Shape& sh, const c10::BFloat16* q,
                    const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, const int32_t* lens,
                    float* out, int64_t out_row_stride, int64_t out_head_stride, float* lse, int64_t lse_row_stride,
                    int64_t lse_head_stride, std::vector<float>& scratch) {
  const int64_t M = u.nrows * u.nheads, dk = sh.dk, dv = sh.dv, rep = sh.num_heads / sh.num_kv_heads;
  const int64_t kv0 = u.head0 / rep, kvn = (u.head0 + u.nheads - 1) / rep - kv0 + 1;
  // per KV head: its vectors (vec[first[c] ..]: row-major, then head) and their query words, in groups of 16
  int64_t vec[kMaxVectors], first[kMaxVectors + 1], words_at[kMaxVectors];
  int64_t q_words = 0;
  first[0] = 0;
  for (int64_t c = 0; c < kvn; ++c) {
    const int64_t h0 = std::max(u.head0, (kv0 + c) * rep), h1 = std::min(u.head0 + u.nheads, (kv0 + c + 1) * rep);
    int64_t n = first[c];
    for (int64_t r = 0; r < u.nrows; ++r) {
      for (int64_t h = h0; h < h1; ++h) vec[n++] = r * u.nheads + h - u.head0;
    }
    first[c + 1] = n;
    words_at[c] = q_words;
    q_words += (n - first[c] + kLanes - 1) / kLanes * kLanes * dk / 2;
  }
  scratch.resize(M * dv + M * kLanes + 2 * M + q_words + kLanes * dk / 2 + kLanes * kLanes);
  float* acc = scratch.data();
  float* s = acc + M * dv;
  float* mx = s + M * kLanes;
  float* sum = mx + M;
  uint32_t* qb = reinterpret_cast<uint32_t*>(sum + M);
  auto* kbuf = reinterpret_cast<c10::BFloat16*>(qb + q_words);
  float* sbuf = reinterpret_cast<float*>(qb + q_words + kLanes * dk / 2);
  std::fill(qb, qb + q_words, 0u);
  int64_t where[kMaxVectors];  // vector m's query column: word p at qb[where[m] + p * 16]
  for (int64_t c = 0; c < kvn; ++c) {
    for (int64_t x = first[c]; x < first[c + 1]; ++x) {
      const int64_t l = x - first[c];
      where[vec[x]] = words_at[c] + (l / kLanes) * kLanes * dk / 2 + l % kLanes;
    }
  }
  int64_t bounds[kMaxVectors];
  const int64_t reach = start_item(u, t1, sh, q, lens, bounds, mx, sum, [&](int64_t m, const c10::BFloat16* src) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
    for (int64_t p = 0; p < dk / 2; ++p) qb[where[m] + p * kLanes] = w[p];
  });
  std::fill(acc, acc + M * dv, 0.0f);
  const TileWalk<c10::BFloat16> tiles{sh, kc, vc, table + u.seq * sh.max_blocks, kv0, reach,
                                      ((kvn - 1) * sh.k_head + dk) * 2, ((kvn - 1) * sh.v_head + dv) * 2};
  for (int64_t tok0 = t0; tok0 < reach;) {
    int64_t slot0, count;
    tiles.at(tok0, slot0, count);
    for (int64_t c = 0; c < kvn; ++c) {
      tiles.prefetch_after(tok0, count, c, 2 * kvn);
      const c10::BFloat16* kp = tiles.keys(slot0) + c * sh.k_head;
      const int64_t n = first[c + 1] - first[c];
      for (int64_t g0 = 0; g0 < n; g0 += kLanes) {
        scores_tiles(qb + words_at[c] + g0 * dk / 2, std::min<int64_t>(kLanes, n - g0), vec + first[c] + g0, dk, kp,
                     sh.k_tok, count, sh.scale, kbuf, sbuf, s);
      }
    }
    softmax_tile(M, count, tok0, bounds, s, mx, sum, acc, dv);
    // the values: per KV head and row, its run of vectors (consecutive in the unit's order), at most 8 at a time
    for (int64_t c = 0; c < kvn; ++c) {
      tiles.prefetch_after(tok0, count, kvn + c, 2 * kvn);
      const c10::BFloat16* vp = tiles.values(slot0) + c * sh.v_head;
      const int64_t h0 = std::max(u.head0, (kv0 + c) * rep), h1 = std::min(u.head0 + u.nheads, (kv0 + c + 1) * rep);
      for (int64_t r = 0; r < u.nrows; ++r) {
        for (int64_t m0 = r * u.nheads + h0 - u.head0; m0 < r * u.nheads + h1 - u.head0; m0 += kGroup) {
          with_group(std::min<int64_t>(kGroup, r * u.nheads + h1 - u.head0 - m0), [&](auto g) {
            weighted_values<c10::BFloat16, decltype(g)::value>(acc + m0 * dv, dv, s + m0 * kLanes, vp, sh.v_tok,
                                                                 count);
          });
        }
      }
    }
    tok0 += count;
  }
  finish_item(u, sh, acc, mx, sum, out, out_row_stride, out_head_stride, lse, lse_row_stride, lse_head_stride);
}
#endif

// Items whose rows have 16 query heads on their KV head or a multiple (MLA's heads on their one latent), or 8 or a
// multiple where the scores are bfloat16 pairs or the cache a wide float32 latent (`vector_lanes_for`): the query
// vectors in the lanes instead of the
// tokens. The queries are transposed once per item (qt[c * L + g] = channel c of vector g, L = 16 lanes of a
// 512-bit register or 8 of a 256-bit one), and a token's scores for L vectors are one accumulator of multiply-adds
// over the channels, each of the key's channels broadcast from the cache row where it lies: no key tile is
// converted and transposed per tile (36 transposes of 16 x 16 a tile for MLA's 576 channels). The running max and
// sum are vectors too. The values go through `weighted_values` as on the token-lane path, reading the weights
// token-major, or, on a bfloat16 cache, through `weighted_values_pairs`.

// The operations of the vector-lane path on L float lanes.
template <int L>
struct Lanes;

template <>
struct Lanes<16> {
  using V = __m512;
  using Mask = __mmask16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V mask_max(V src, Mask m, V a, V b) { return _mm512_mask_max_ps(src, m, a, b); }
  static V mask_mov(V src, Mask m, V a) { return _mm512_mask_mov_ps(src, m, a); }
  static V maskz_mov(Mask m, V a) { return _mm512_maskz_mov_ps(m, a); }
  static Mask greater(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask not_equal(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
  // the lanes whose bound is past token `tok`
  static Mask sees(const int32_t* bound, int32_t tok) {
    return _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(bound), _mm512_set1_epi32(tok));
  }
  static V exp(V x) { return exp16(x); }
#if defined(__AVX512BF16__)
  static V dot_pairs(V acc, const uint32_t* q, uint32_t k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_set1_epi32(static_cast<int>(k)));
  }
#endif
};

template <>
struct Lanes<8> {
  using V = __m256;
  using Mask = __mmask8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V mask_max(V src, Mask m, V a, V b) { return _mm256_mask_max_ps(src, m, a, b); }
  static V mask_mov(V src, Mask m, V a) { return _mm256_mask_mov_ps(src, m, a); }
  static V maskz_mov(Mask m, V a) { return _mm256_maskz_mov_ps(m, a); }
  static Mask greater(V a, V b) { return _mm256_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask not_equal(V a, V b) { return _mm256_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
  static Mask sees(const int32_t* bound, int32_t tok) {
    return _mm256_cmpgt_epi32_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bound)),
                                   _mm256_set1_epi32(tok));
  }
  // exp16 on the low half of a 512-bit register (the upper lanes' results are dropped)
  static V exp(V x) { return _mm512_castps512_ps256(exp16(_mm512_castps256_ps512(x))); }
#if defined(__AVX512BF16__)
  static V dot_pairs(V acc, const uint32_t* q, uint32_t k) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                            (__m256bh)_mm256_set1_epi32(static_cast<int>(k)));
  }
#endif
};

// s[j * L + g] = scale * q_g . k_j for the tile's rows j < count (rows of `stride` elements: float32, or bfloat16
// channel pairs as 32-bit words with `Pairs`), 8 rows at a time so that their addresses stay in registers
template <int L, bool Pairs, typename KT>
inline void scores_wide(const KT* __restrict qt, int64_t dk, const KT* k, int64_t stride, int64_t count, float scale,
                        float* __restrict s) {
  using O = Lanes<L>;
  using V = typename O::V;
  for (int64_t j0 = 0; j0 < count; j0 += 8) {
    const KT* r[8];
    for (int j = 0; j < 8; ++j) r[j] = k + std::min<int64_t>(j0 + j, count - 1) * stride;
    V a[8];
    for (int j = 0; j < 8; ++j) a[j] = O::zero();
    for (int64_t c = 0; c < dk; ++c) {
      if constexpr (Pairs) {
#if defined(__AVX512BF16__)
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = O::dot_pairs(a[j], qt + c * L, r[j][c]);
#endif
      } else {
        const V qv = O::load(qt + c * L);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a[j] = O::fmadd(qv, O::set1(r[j][c]), a[j]);
      }
    }
    const V sc = O::set1(scale);
    for (int j = 0; j < 8; ++j) O::store(s + (j0 + j) * L, O::mul(a[j], sc));
  }
}

#if defined(__AVX512BF16__)
// acc[g * dv + perm(i)] += sum_j p_j[g] v_j[i] for G vectors over a bfloat16 cache's value rows, by `vdpbf16ps` on
// pairs of tokens: pw[jp * PJ + g] holds vector g's weights of tokens 2jp and 2jp + 1 rounded to bfloat16 (as
// PyTorch's flash kernel rounds its weights for a bfloat16 product with V), and two rows interleaved by channel
// (unpacklo / unpackhi of 16-bit words) give each lane the two tokens' values of one channel; so each chunk of 32
// channels is kept in the order those unpacks give (`unpermute_pairs` restores it). dv: a multiple of 32.
template <int G, int PJ>
inline void weighted_values_pairs(float* __restrict acc, int64_t dv, const uint32_t* __restrict pw,
                                  const c10::BFloat16* v, int64_t stride, int64_t count) {
  for (int64_t c = 0; c < dv; c += 32) {
    __m512 lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      lo[g] = _mm512_loadu_ps(acc + g * dv + c);
      hi[g] = _mm512_loadu_ps(acc + g * dv + c + 16);
    }
    for (int64_t j = 0; j < count; j += 2) {
      const __m512i r0 = _mm512_loadu_si512(v + j * stride + c);
      const __m512i r1 = j + 1 < count ? _mm512_loadu_si512(v + (j + 1) * stride + c) : _mm512_setzero_si512();
      const __m512bh a = (__m512bh)_mm512_unpacklo_epi16(r0, r1), b = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[(j / 2) * PJ + g]));
        lo[g] = _mm512_dpbf16_ps(lo[g], a, w);
        hi[g] = _mm512_dpbf16_ps(hi[g], b, w);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(acc + g * dv + c, lo[g]);
      _mm512_storeu_ps(acc + g * dv + c + 16, hi[g]);
    }
  }
}

// a row of `weighted_values_pairs`' accumulators back in channel order: in each chunk of 32, lane 4k + i of the
// first 16 is channel 8k + i, of the second 16 channel 8k + 4 + i (k < 4, i < 4)
inline void unpermute_pairs(float* row, int64_t dv) {
  float chunk[32];
  for (int64_t c = 0; c < dv; c += 32) {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        chunk[8 * k + i] = row[c + 4 * k + i];
        chunk[8 * k + 4 + i] = row[c + 16 + 4 * k + i];
      }
    }
    std::memcpy(row + c, chunk, sizeof(chunk));
  }
}

// the bfloat16 pairs of a tile's weights (rounded to nearest even): pw[jp * L + g] = (p[2jp][g], p[2jp + 1][g]),
// p[count][g] = 0
template <int L>
inline void weight_pairs(const float* p, int64_t count, uint32_t* pw) {
  for (int64_t j = 0; j < count; j += 2) {
    if constexpr (L == 16) {
      const __m512 a = _mm512_loadu_ps(p + j * L);
      const __m512 b = j + 1 < count ? _mm512_loadu_ps(p + (j + 1) * L) : _mm512_setzero_ps();
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
      _mm512_storeu_si512(pw + (j / 2) * L, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    } else {
      const __m256 a = _mm256_loadu_ps(p + j * L);
      const __m256 b = j + 1 < count ? _mm256_loadu_ps(p + (j + 1) * L) : _mm256_setzero_ps();
      const __m256i lo = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(a));
      const __m256i hi = _mm256_cvtepu16_epi32((__m128i)_mm256_cvtneps_pbh(b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + (j / 2) * L),
                          _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
    }
  }
}
#endif

// bfloat16 queries on a bfloat16 cache, whole channel pairs in every row: the scores by `vdpbf16ps`
template <typename QT, typename CT>
inline bool pairs_apply(const Shape& sh) {
#if defined(__AVX512BF16__)
  return std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> && sh.dk % 2 == 0 &&
         sh.k_tok % 2 == 0 && sh.k_head % 2 == 0;
#else
  return false;
#endif
}

// Which lanes an item whose rows have `heads` query heads each takes: 16 vectors a register where the heads are a
// multiple of 16; 8 (a 256-bit register) where they are a multiple of 8 and either the scores are bfloat16 pairs
// or the cache is a float32 MLA latent of 512 channels or more (V its keys' leading channels); else 0, the token
// lanes. With float32 keys and a V of its own, 8 vector lanes ran 0.9-1.0x the token lanes on 8 heads of one KV
// head (a broadcast per channel and 8 lanes of work for it, where bfloat16 pairs carry two channels a broadcast:
// BENCHMARKS.md section 19); on MLA's 576-channel latent, 1.08-1.15x, whose token lanes transpose 36 tiles of
// 16 x 16 a tile; on the MLA demo's 160 channels, 0.89-1.10x (section 20). Chosen by the heads and the cache, not
// by the rows x heads of the
// item, so that a row of several (speculative verification, the rest of a prompt) takes the path a decode of its
// token takes, and computes the same bits: on either path a vector's sums run in the same order whatever else its
// item holds.
template <typename QT, typename CT>
inline int vector_lanes_for(int64_t heads, const Shape& sh) {
  if (heads % 16 == 0) return 16;
  if (heads % 8 == 0 && (pairs_apply<QT, CT>(sh) || (std::is_same_v<CT, float> && sh.v_in_k && sh.dk >= 512))) {
    return 8;
  }
  return 0;
}

template <int L, typename QT, typename CT>
void run_item_wide(const Unit& u, int64_t t0, int64_t t1, const Shape& sh, const QT* q, const CT* kc, const CT* vc,
                   const int32_t* table, const int32_t* lens, float* out, int64_t out_row_stride,
                   int64_t out_head_stride, float* lse, int64_t lse_row_stride, int64_t lse_head_stride,
                   std::vector<float>& scratch) {
  using O = Lanes<L>;
  using V = typename O::V;
  const int64_t M = u.nrows * u.nheads, dk = sh.dk, dv = sh.dv;  // M: a multiple of L
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  const bool pairs = pairs_apply<QT, CT>(sh);
  // the values weighed by bfloat16 pairs of tokens too (`weighted_values_pairs`), on a bfloat16 cache
  const bool value_pairs = kPairs && dv % 32 == 0 && sh.v_tok % 2 == 0 && sh.v_head % 2 == 0;
  // keys read as stored (float32, or bfloat16 pairs), else each tile's rows converted to float32 first
  constexpr bool kFloatCache = std::is_same_v<CT, float>;
  const bool convert = !kFloatCache && !pairs;
  scratch.resize(M * dk + M * dv + M * kLanes + 2 * M + (convert ? kLanes * dk : 0) + kLanes / 2 * L);
  float* qt = scratch.data();  // per group of L vectors: [dk][L] floats, or [dk / 2][L] channel pairs
  float* acc = qt + M * dk;
  float* s = acc + M * dv;  // per group: [16 tokens][L vectors]
  float* mx = s + M * kLanes;
  float* sum = mx + M;
  float* kf = sum + M;
  uint32_t* pw = reinterpret_cast<uint32_t*>(kf + (convert ? kLanes * dk : 0));  // [8 token pairs][L]
  int64_t bounds[kMaxVectors];
  const int64_t reach = start_item(u, t1, sh, q, lens, bounds, mx, sum, [&](int64_t m, const QT* src) {
    float* g = qt + (m / L) * L * dk;
    const int64_t lane = m % L;
    if (pairs) {
      uint32_t* w = reinterpret_cast<uint32_t*>(g);
      const uint32_t* from = reinterpret_cast<const uint32_t*>(src);
      for (int64_t p = 0; p < dk / 2; ++p) {
        uint32_t word;
        std::memcpy(&word, from + p, sizeof(word));
        w[p * L + lane] = word;
      }
    } else {
      for (int64_t c = 0; c < dk; ++c) g[c * L + lane] = static_cast<float>(src[c]);
    }
  });
  int32_t bound32[kMaxVectors];
  for (int64_t m = 0; m < M; ++m) bound32[m] = static_cast<int32_t>(bounds[m]);
  std::fill(acc, acc + M * dv, 0.0f);
  const TileWalk<CT> tiles{sh, kc, vc, table + u.seq * sh.max_blocks, u.kv_head, reach};
  for (int64_t tok0 = t0; tok0 < reach;) {
    int64_t slot0, count;
    tiles.at(tok0, slot0, count);
    const CT* kp = tiles.keys(slot0);
    const CT* vp = tiles.values(slot0);
    tiles.prefetch_after(tok0, count);
    if (convert) {
      for (int64_t j = 0; j < count; ++j) {
        for (int64_t c = 0; c < dk; c += kLanes) {
          const __mmask16 cm = lanes(dk - c);
          _mm512_mask_storeu_ps(kf + j * dk + c, cm, load16f(kp + j * sh.k_tok + c, cm));
        }
      }
    }
    for (int64_t g0 = 0; g0 < M; g0 += L) {
      float* sg = s + g0 * kLanes;
      const float* qg = qt + g0 * dk;
      if constexpr (kPairs) {
        if (pairs) {
          scores_wide<L, true>(reinterpret_cast<const uint32_t*>(qg), dk / 2, reinterpret_cast<const uint32_t*>(kp),
                               sh.k_tok / 2, count, sh.scale, sg);
        }
      }
      if constexpr (kFloatCache) {
        scores_wide<L, false>(qg, dk, reinterpret_cast<const float*>(kp), sh.k_tok, count, sh.scale, sg);
      } else if (convert) {
        scores_wide<L, false>(qg, dk, static_cast<const float*>(kf), dk, count, sh.scale, sg);
      }
      // online softmax, L vectors at once: lane g sees token j while j < its bound
      typename O::Mask seen[kLanes];
      V tile_max = O::set1(kNegInf);
      for (int64_t j = 0; j < count; ++j) {
        seen[j] = O::sees(bound32 + g0, static_cast<int32_t>(tok0 + j));
        tile_max = O::mask_max(tile_max, seen[j], tile_max, O::load(sg + j * L));
      }
      const V old_max = O::load(mx + g0);
      const V new_max = O::max(old_max, tile_max);
      V total = O::load(sum + g0);
      // vectors whose max rose after they had seen a token: their sum and accumulators shrink by exp(old - new)
      const typename O::Mask grew = O::greater(new_max, old_max) & O::not_equal(old_max, O::set1(kNegInf));
      if (grew) {
        const V alpha = O::mask_mov(O::set1(1.0f), grew, O::exp(O::sub(old_max, new_max)));
        total = O::mul(total, alpha);
        float a[L];
        O::store(a, alpha);
        for (int g = 0; g < L; ++g) {
          if ((grew >> g) & 1) scale_row(acc + (g0 + g) * dv, dv, a[g]);
        }
      }
      O::store(mx + g0, new_max);
      for (int64_t j = 0; j < count; ++j) {
        const V w = O::maskz_mov(seen[j], O::exp(O::sub(O::load(sg + j * L), new_max)));
        total = O::add(total, w);
        O::store(sg + j * L, w);
      }
      O::store(sum + g0, total);
#if defined(__AVX512BF16__)
      if constexpr (kPairs) {
        if (value_pairs) {
          weight_pairs<L>(sg, count, pw);
          for (int64_t h0 = 0; h0 < L; h0 += kGroup) {
            weighted_values_pairs<kGroup, L>(acc + (g0 + h0) * dv, dv, pw + h0, vp, sh.v_tok, count);
          }
          continue;
        }
      }
#endif
      for (int64_t h0 = 0; h0 < L; h0 += kGroup) {
        weighted_values<CT, kGroup, 1, L>(acc + (g0 + h0) * dv, dv, sg + h0, vp, sh.v_tok, count);
      }
    }
    tok0 += count;
  }
#if defined(__AVX512BF16__)
  if (value_pairs) {
    for (int64_t m = 0; m < M; ++m) unpermute_pairs(acc + m * dv, dv);
  }
#endif
  finish_item(u, sh, acc, mx, sum, out, out_row_stride, out_head_stride, lse, lse_row_stride, lse_head_stride);
}

}  // namespace tiled
#endif

template <typename QT, typename CT>
void launch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
            const at::Tensor& row_seq, const at::Tensor& row_lens, const Shape& sh, int64_t split_tokens,
            bool portable, bool wide, bool tiles, at::Tensor& out) {
  const int64_t t = q.size(0);
  const int32_t* seqs = row_seq.data_ptr<int32_t>();
  const int32_t* lens = row_lens.data_ptr<int32_t>();
  // Items whose keys fit the AMX tiles take their scores there (`tiles`: asked for, and the system gave the process the
  // tiles' state): bfloat16 queries on a bfloat16 cache, dk a multiple of 32 up to 128, whatever the heads on a KV head
  // (on this path, 1.2-1.9x the vector-lane path's speed at 8 and 16 heads on a KV head). Chosen by the shape alone, as
  // the paths below. A unit then holds every query head of its rows (where they are at most 64), so that it reads
  // whole rows of the cache.
  bool on_tiles = false;
#if defined(KVSHARD_AMX)
  on_tiles = tiles && !portable && std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> &&
             tiled::pairs_apply<QT, CT>(sh) && sh.dk % 32 == 0 && sh.dk <= 128 && tiled::tiles_permitted();
#endif
  const int64_t rep = sh.num_heads / sh.num_kv_heads;
  const bool whole_rows = on_tiles && sh.num_heads <= kMaxVectors;
  const int64_t head_chunk = whole_rows ? sh.num_heads : std::min<int64_t>(rep, kMaxVectors);
  const int64_t rows_per_unit = std::max<int64_t>(1, kMaxVectors / head_chunk);

  std::vector<Unit> units;
  for (int64_t r = 0; r < t;) {
    int64_t e = r + 1;
    while (e < t && e - r < rows_per_unit && seqs[e] == seqs[r]) ++e;
    int64_t max_len = 0;
    for (int64_t i = r; i < e; ++i) max_len = std::max<int64_t>(max_len, lens[i]);
    if (whole_rows) {
      units.push_back({r, e - r, seqs[r], 0, 0, sh.num_heads, max_len});
    } else {
      for (int64_t kv = 0; kv < sh.num_kv_heads; ++kv) {
        for (int64_t h0 = 0; h0 < rep; h0 += head_chunk) {
          units.push_back({r, e - r, seqs[r], kv, kv * rep + h0, std::min(head_chunk, rep - h0), max_len});
        }
      }
    }
    r = e;
  }
  const int64_t B = sh.block_size;
  if (split_tokens <= 0) {  // auto: split only when the units are too few for the threads
    const int64_t threads = at::get_num_threads();
    int64_t total = 0;
    for (const Unit& u : units) total += u.max_len;
    if (static_cast<int64_t>(units.size()) >= 2 * threads || threads == 1) {
      split_tokens = std::numeric_limits<int64_t>::max() / 2;
    } else {
      split_tokens = std::max<int64_t>(512, total / (4 * threads));
    }
  }
  split_tokens = std::max<int64_t>(B, (split_tokens + B - 1) / B * B);

  std::vector<int64_t> first(units.size() + 1, 0);  // items of unit i: [first[i], first[i+1])
  for (size_t i = 0; i < units.size(); ++i) {
    const int64_t n = std::max<int64_t>(1, (units[i].max_len + split_tokens - 1) / split_tokens);
    first[i + 1] = first[i] + n;
  }
  const int64_t num_items = first.back();
  const bool split = num_items > static_cast<int64_t>(units.size());

  float lut[256];
  if constexpr (std::is_same_v<CT, c10::Float8_e4m3fn>) {
    for (int b = 0; b < 256; ++b) {
      const float v = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      lut[b] = std::isnan(v) ? 0.0f : v;
    }
  }
  const QT* qp = q.data_ptr<QT>();
  const CT* kp = kc.data_ptr<CT>();
  const CT* vp = vc.data_ptr<CT>();
  const int32_t* tp = table.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t H = sh.num_heads, dv = sh.dv, P = dv + 1;  // out: [t, H, dv + 1], o then lse
  // one item through the AVX-512 tiles where they are built, else (or when asked) the portable path
  auto run = [&](const Unit& u, int64_t t0, int64_t t1, float* o, int64_t o_row, int64_t o_head, float* l,
                 int64_t l_row, int64_t l_head, std::vector<float>& scratch) {
#if defined(KVSHARD_TILED)
#if defined(KVSHARD_AMX)
    if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>) {
      if (on_tiles) {
        return tiled::run_item_tiles(u, t0, t1, sh, qp, kp, vp, tp, lens, o, o_row, o_head, l, l_row, l_head, scratch);
      }
    }
#endif
    const int vector_lanes = !portable && wide ? tiled::vector_lanes_for<QT, CT>(u.nheads, sh) : 0;
    if (vector_lanes == 16) {
      return tiled::run_item_wide<16, QT, CT>(u, t0, t1, sh, qp, kp, vp, tp, lens, o, o_row, o_head, l, l_row,
                                              l_head, scratch);
    }
    if (vector_lanes == 8) {
      return tiled::run_item_wide<8, QT, CT>(u, t0, t1, sh, qp, kp, vp, tp, lens, o, o_row, o_head, l, l_row,
                                             l_head, scratch);
    }
    if (!portable) {
      return tiled::run_item<QT, CT>(u, t0, t1, sh, qp, kp, vp, tp, lens, o, o_row, o_head, l, l_row, l_head,
                                     scratch);
    }
#endif
    run_item<QT, CT>(u, t0, t1, sh, qp, kp, vp, tp, lens, lut, o, o_row, o_head, l, l_row, l_head, scratch);
  };

  if (!split) {
    // The units, the most work first, each taken by whichever thread is free next: a chunk's rows see more keys
    // the further they lie and the scheduler sorts decodes longest first, so handing each thread a contiguous
    // share of the units (at::parallel_for's) left one thread most of the work (a chunk of 2,048 rows: 1.4x
    // the one-thread speed on two). Every unit is computed alone, whatever thread takes it: the same bits.
    const int64_t n = static_cast<int64_t>(units.size());
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return units[a].max_len * units[a].nrows * units[a].nheads > units[b].max_len * units[b].nrows * units[b].nheads;
    });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#if defined(KVSHARD_AMX)
      const tiled::TileScope scope(on_tiles);
#endif
      std::vector<float> scratch;
      for (int64_t k = next.fetch_add(1); k < n; k = next.fetch_add(1)) {
        const Unit& u = units[order[k]];
#if defined(KVSHARD_TILED)
        if (!portable && k + 1 < n) tiled::prefetch_start(units[order[k + 1]], sh, kp, vp, tp);
#endif
        float* o = op + (u.row0 * H + u.head0) * P;
        run(u, 0, u.max_len, o, H * P, P, o + dv, H * P, P, scratch);
      }
    });
    return;
  }
  // partials per item: [M, dv] outputs and [M] LSEs, vector-major (row, head)
  std::vector<int64_t> offset(units.size() + 1, 0);
  for (size_t i = 0; i < units.size(); ++i) {
    offset[i + 1] = offset[i] + (first[i + 1] - first[i]) * units[i].nrows * units[i].nheads;
  }
  std::vector<float> part_o(offset.back() * dv), part_l(offset.back());
  std::vector<int64_t> unit_of(num_items);
  for (size_t i = 0; i < units.size(); ++i) {
    for (int64_t j = first[i]; j < first[i + 1]; ++j) unit_of[j] = i;
  }
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
#if defined(KVSHARD_AMX)
    const tiled::TileScope scope(on_tiles);
#endif
    std::vector<float> scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t ui = unit_of[it];
      const Unit& u = units[ui];
      const int64_t piece = it - first[ui], M = u.nrows * u.nheads;
      const int64_t base = offset[ui] + piece * M;
      run(u, piece * split_tokens, std::min(u.max_len, (piece + 1) * split_tokens), part_o.data() + base * dv,
          u.nheads * dv, dv, part_l.data() + base, u.nheads, 1, scratch);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t ui = begin; ui < end; ++ui) {
      const Unit& u = units[ui];
      const int64_t pieces = first[ui + 1] - first[ui], M = u.nrows * u.nheads;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t r = m / u.nheads, h = m % u.nheads;
        float* o = op + ((u.row0 + r) * H + u.head0 + h) * P;
        float& l = o[dv];
        float best = kNegInf;
        for (int64_t p = 0; p < pieces; ++p) best = std::max(best, part_l[offset[ui] + p * M + m]);
        std::fill(o, o + dv, 0.0f);
        if (best == kNegInf) {
          l = kNegInf;
          continue;
        }
        float total = 0.0f;
        for (int64_t p = 0; p < pieces; ++p) {
          const int64_t at = offset[ui] + p * M + m;
          if (part_l[at] == kNegInf) continue;
          const float w = std::exp(part_l[at] - best);
          total += w;
          const float* po = part_o.data() + at * dv;
          for (int64_t i = 0; i < dv; ++i) o[i] += w * po[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < dv; ++i) o[i] *= inv;
        l = best + std::log(total);
      }
    }
  });
}

template <typename QT>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                    const at::Tensor& row_seq, const at::Tensor& row_lens, const Shape& sh, int64_t split_tokens,
                    bool portable, bool wide, bool tiles, at::Tensor& out) {
  switch (kc.scalar_type()) {
    case at::kFloat:
      return launch<QT, float>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, portable, wide, tiles, out);
    case at::kBFloat16:
      return launch<QT, c10::BFloat16>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, portable, wide, tiles,
                                       out);
    case at::kHalf:
      return launch<QT, c10::Half>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, portable, wide, tiles,
                                   out);
    case at::kFloat8_e4m3fn:
      return launch<QT, c10::Float8_e4m3fn>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, portable, wide,
                                            tiles, out);
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", kc.scalar_type());
  }
}

}  // namespace

// q [t, H, dk]; key_cache [slots, Hk, dk], value_cache [slots, Hk, dv] (slots = blocks * block_size);
// block_tables [num_seqs, max_blocks] int32; row_seq, row_lens [t] int32.
// Returns [t, H, dv + 1] float32: o in the first dv channels, the lse in the last (natural log; -inf and o = 0
// for a row that sees no key), side by side so that the DCP merge sends them without a packing copy.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                                        const at::Tensor& row_seq, const at::Tensor& row_lens, int64_t block_size,
                                        double scale, double k_scale, double v_scale, int64_t split_tokens,
                                        bool portable, bool wide, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3, "paged_attention: q [t, H, dk], "
              "caches [slots, Hk, d]");
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "paged_attention runs on CPU");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "paged_attention: K and V dtypes differ");
  TORCH_CHECK(q.stride(2) == 1 && key_cache.stride(2) == 1 && value_cache.stride(2) == 1,
              "paged_attention: the last dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && row_seq.scalar_type() == at::kInt &&
                  row_lens.scalar_type() == at::kInt, "paged_attention: block tables, row_seq, row_lens are int32");
  TORCH_CHECK(block_tables.is_contiguous() && row_seq.is_contiguous() && row_lens.is_contiguous(),
              "paged_attention: block tables, row_seq, row_lens must be contiguous");
  const int64_t t = q.size(0), H = q.size(1), dk = q.size(2);
  const int64_t Hk = key_cache.size(1), dv = value_cache.size(2);
  TORCH_CHECK(key_cache.size(2) == dk && value_cache.size(1) == Hk && value_cache.size(0) == key_cache.size(0),
              "paged_attention: cache shapes do not match q");
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "paged_attention: query heads are not a multiple of KV heads");
  TORCH_CHECK(row_seq.numel() == t && row_lens.numel() == t, "paged_attention: one row_seq / row_lens per row");
  TORCH_CHECK(key_cache.size(0) % block_size == 0, "paged_attention: slots are not whole blocks");
  const int64_t max_blocks = block_tables.size(1), num_blocks = key_cache.size(0) / block_size;
  {
    const int32_t* s = row_seq.data_ptr<int32_t>();
    const int32_t* l = row_lens.data_ptr<int32_t>();
    for (int64_t r = 0; r < t; ++r) {
      TORCH_CHECK(s[r] >= 0 && s[r] < block_tables.size(0), "paged_attention: row_seq out of range");
      TORCH_CHECK(l[r] >= 0 && l[r] <= max_blocks * block_size, "paged_attention: row_lens past the block table");
      const int32_t* bt = block_tables.data_ptr<int32_t>() + s[r] * max_blocks;
      for (int64_t b = 0; b * block_size < l[r]; ++b) {
        TORCH_CHECK(bt[b] >= 0 && bt[b] < num_blocks, "paged_attention: block id out of range");
      }
    }
  }
  auto out = at::empty({t, H, dv + 1}, q.options().dtype(at::kFloat));  // o | lse, side by side
  if (t == 0) return out;
  Shape sh;
  sh.num_heads = H;
  sh.num_kv_heads = Hk;
  sh.dk = dk;
  sh.dv = dv;
  sh.block_size = block_size;
  sh.max_blocks = max_blocks;
  sh.q_row = q.stride(0);
  sh.q_head = q.stride(1);
  sh.k_tok = key_cache.stride(0);
  sh.k_head = key_cache.stride(1);
  sh.v_tok = value_cache.stride(0);
  sh.v_head = value_cache.stride(1);
  sh.v_in_k = value_cache.data_ptr() == key_cache.data_ptr() && sh.v_tok == sh.k_tok && sh.v_head == sh.k_head &&
              dv <= dk;
  sh.scale = static_cast<float>(scale * k_scale);
  sh.v_scale = static_cast<float>(v_scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens, portable,
                            wide, tiles, out);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens,
                                    portable, wide, tiles, out);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens,
                                portable, wide, tiles, out);
      break;
    default: TORCH_CHECK(false, "paged_attention: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

// How many threads at::parallel_for runs `n` items on: more than one only where the extension is built with
// OpenMP (the header-only parallel_for runs serially otherwise).
int64_t parallel_threads(int64_t n) {
  std::vector<int> ids(std::max<int64_t>(n, 0), -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ids[i] = at::get_thread_num();
  });
  std::sort(ids.begin(), ids.end());
  return std::unique(ids.begin(), ids.end()) - ids.begin();
}

// ---------------------------------------------------------------------------------------------------------------
// The model step's elementwise operators, fused (layers/norm.py, layers/activation.py, layers/rotary.py): each
// reads its input once and writes its output once, where PyTorch's eager operators make a pass and a dispatch for
// every multiply, conversion and reduction. The arithmetic is theirs: float32, rounded to the tensor's dtype
// where they round (a bfloat16 model's RMSNorm rounds x * rstd before the weight's product). Rows go to the
// threads in blocks of at least kElementwiseGrain elements, so a decode step's few rows stay on one thread.

constexpr int64_t kElementwiseGrain = 1 << 15;

// the sum of squares of n floats: 16 lanes of partial sums, then the lanes and the tail
inline float sum_of_squares(const float* x, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = load16(x + i);
    acc += v * v;
  }
  float ss = 0.0f;
  for (int k = 0; k < 16; ++k) ss += acc[k];
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

// The row loop of the RMSNorms below: rows over the threads (a decode step's few on one), each thread with its
// float32 scratch row and the weight widened once; row(r, xf, wf) computes row r.
template <typename T, typename Row>
void norm_rows(const T* w, int64_t rows, int64_t d, const Row& row) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(d), wf(d);
    for (int64_t i = 0; i < d; ++i) wf[i] = static_cast<float>(w[i]);
    for (int64_t r = begin; r < end; ++r) row(r, xf.data(), wf.data());
  });
}

// xf [d] (float32) normalized by its sum of squares, rounded to the dtype, times the weight, rounded again: the
// eager RMSNorm's two roundings
template <typename T>
void norm_row_scalar(const float* xf, const float* wf, T* o, int64_t d, float eps) {
  const float rstd = 1.0f / std::sqrt(sum_of_squares(xf, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(wf[i] * static_cast<float>(static_cast<T>(xf[i] * rstd)));
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_row, const T* w, T* out, int64_t rows, int64_t d, float eps) {
  norm_rows(w, rows, d, [&](int64_t r, float* xf, const float* wf) {
    const T* xr = x + r * x_row;
    for (int64_t i = 0; i < d; ++i) xf[i] = static_cast<float>(xr[i]);
    norm_row_scalar(xf, wf, out + r * d, d, eps);
  });
}

// x [..., d] (rows of stride x.stride(-2), channels contiguous), weight [d] -> weight * (x * rsqrt(mean(x^2) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rms_norm: channels must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: a contiguous weight of the input's size and dtype");
  const int64_t d = x.size(-1);
  const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, d});
  TORCH_CHECK(x2.stride(-1) == 1, "rms_norm: channels must be contiguous");
  const int64_t rows = x2.size(0);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_rows(x2.data_ptr<float>(), x2.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(), rows, d, e);
      break;
    case at::kBFloat16:
      rms_norm_rows(x2.data_ptr<c10::BFloat16>(), x2.stride(0), weight.data_ptr<c10::BFloat16>(),
                    out.data_ptr<c10::BFloat16>(), rows, d, e);
      break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 floats rounded to bfloat16 as c10's conversion (and `.to`) rounds them: to nearest even on the bits, NaN to
// 0x7FC0, subnormals kept (the AVX512-BF16 instruction would flush them to zero)
inline __m256i bf16_bits16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 widen_bf16_16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#endif

// x + residual (rounded to the dtype, as the eager add rounds) and RMSNorm of that sum, in one pass: the decoder
// layers' residual add before each norm (models/causal_lm.py's `PreNormDecoderLayer`). Returns [norm(sum), sum].
template <typename T>
void add_rms_norm_rows(const T* x, int64_t x_row, const T* res, int64_t res_row, const T* w, T* out, T* sum,
                       int64_t rows, int64_t d, float eps) {
  norm_rows(w, rows, d, [&](int64_t r, float* xf, const float* wf) {
    const T* xr = x + r * x_row;
    const T* rr = res + r * res_row;
    T* s = sum + r * d;
    T* o = out + r * d;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (d % 16 == 0) {  // the same roundings and the same order of the sum of squares, 16 channels a step
        const auto load = [](const T* p) {
          return widen_bf16_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        };
        const auto store = [](T* p, __m512 v) {
          const __m256i b = bf16_bits16(v);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
          return b;
        };
        v16 acc = {};  // as sum_of_squares adds them up
        for (int64_t i = 0; i < d; i += 16) {
          _mm512_storeu_ps(xf + i, widen_bf16_16(store(s + i, _mm512_add_ps(load(xr + i), load(rr + i)))));
          const v16 v = load16(xf + i);
          acc += v * v;
        }
        float ss = 0.0f;
        for (int k = 0; k < 16; ++k) ss += acc[k];
        const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(d) + eps));
        for (int64_t i = 0; i < d; i += 16) {
          const __m512 normed = widen_bf16_16(bf16_bits16(_mm512_mul_ps(_mm512_loadu_ps(xf + i), rstd)));
          store(o + i, _mm512_mul_ps(_mm512_loadu_ps(wf + i), normed));
        }
        return;
      }
    }
#endif
    for (int64_t i = 0; i < d; ++i) {
      s[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      xf[i] = static_cast<float>(s[i]);
    }
    norm_row_scalar(xf, wf, o, d, eps);
  });
}

// x, residual [t, d] (rows of any stride, channels contiguous), weight [d] -> [rms_norm(x + residual), x + residual]
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps) {
  TORCH_CHECK(x.device().is_cpu() && residual.device().is_cpu() && weight.device().is_cpu(),
              "add_rms_norm: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual [t, d] of one dtype, channels contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: a contiguous weight of the input's size and dtype");
  const int64_t rows = x.size(0), d = x.size(1);
  auto out = at::empty({rows, d}, x.options());
  auto sum = at::empty({rows, d}, x.options());
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(), residual.stride(0),
                        weight.data_ptr<float>(), out.data_ptr<float>(), sum.data_ptr<float>(), rows, d, e);
      break;
    case at::kBFloat16:
      add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), residual.data_ptr<c10::BFloat16>(),
                        residual.stride(0), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                        sum.data_ptr<c10::BFloat16>(), rows, d, e);
      break;
    default: TORCH_CHECK(false, "add_rms_norm: unsupported dtype ", x.scalar_type());
  }
  return {out, sum};
}

// x [t, H, d] float32 (any row and head strides, channels contiguous: the attention's output, a view of its packed
// [o | lse]) -> [t, H * d] contiguous, in float32 or (bf16) rounded to bfloat16 to nearest even as `.to` rounds: the
// attention output as the output projection takes it, one pass where `.to(dtype).flatten(1)` of the view took two
// (36 us at a decode step's 32 x 9 x 64 against a few).
at::Tensor flatten_heads(const at::Tensor& x, bool bf16) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "flatten_heads: x [t, H, d] float32 on a CPU, channels contiguous");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  auto out = at::empty({t, heads * d}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* src = x.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(heads * d, 1));
  at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = src + r * s0 + h * s1;
        const int64_t o = (r * heads + h) * d;
        if (!bf16) {
          std::memcpy(out.data_ptr<float>() + o, in, d * sizeof(float));
          continue;
        }
        c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + o;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        for (; i + 16 <= d; i += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16_bits16(_mm512_loadu_ps(in + i)));
        }
#endif
        for (; i < d; ++i) dst[i] = static_cast<c10::BFloat16>(in[i]);
      }
    }
  });
  return out;
}

// Each row's argmax of float32 logits [r, V] (the sampler's greedy tokens): the first of tied maxima, and where a row
// holds a NaN its first NaN, as torch's `max(dim=-1).indices` gives them (its oracle in tests/test_sampler.py). One
// pass over the row, sixteen lanes each keeping its own first maximum, then the lanes reduced, the lower index
// winning a tie; the rows spread over the threads.
at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0, "row_argmax: logits [r, V > 0] float32, rows contiguous");
  const int64_t rows = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = src + r * stride;
      int64_t best = 0, i = 0;
      float top = x[0];
      bool nan = std::isnan(top);
#if defined(__AVX512F__)
      if (!nan && V >= 16) {
        __m512 lane_top = _mm512_loadu_ps(x);
        __m512i lane_at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i sixteen = _mm512_set1_epi32(16);
        __m512i at = lane_at;
        __mmask16 unordered = _mm512_cmp_ps_mask(lane_top, lane_top, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V && !unordered; i += 16) {
          const __m512 v = _mm512_loadu_ps(x + i);
          at = _mm512_add_epi32(at, sixteen);
          unordered = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 above = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);  // strictly: a lane keeps its first
          lane_top = _mm512_mask_mov_ps(lane_top, above, v);
          lane_at = _mm512_mask_mov_epi32(lane_at, above, at);
        }
        if (unordered) {  // the block holding the first NaN: the scalar loop below finds it from its start
          i -= 16;
          nan = true;
        } else {
          alignas(64) float tops[16];
          alignas(64) int32_t ats[16];
          _mm512_store_ps(tops, lane_top);
          _mm512_store_si512(ats, lane_at);
          top = tops[0];
          best = ats[0];
          for (int j = 1; j < 16; ++j) {
            if (tops[j] > top || (tops[j] == top && ats[j] < best)) {
              top = tops[j];
              best = ats[j];
            }
          }
        }
      }
#endif
      if (nan) {  // the first NaN at or after i (a NaN at 0 is one)
        while (i < V && !std::isnan(x[i])) ++i;
        best = i;
      } else {
        for (; i < V; ++i) {
          if (std::isnan(x[i])) {
            best = i;
            break;
          }
          if (x[i] > top) {
            top = x[i];
            best = i;
          }
        }
      }
      dst[r] = best;
    }
  });
  return out;
}

// A step's new keys and values into the cache's slots, one call for both (kv/cache.py's `write`): key [n, Hk, dk]
// and value [n, Hk, dv] (any token stride; each head's channels contiguous) into key_cache [S, Hk, dk] and
// value_cache [S, Hk, dv] (contiguous, the inputs' dtype) at slots [n] (int64), checked against S first, as
// index_copy_ checks them. An undefined value_cache writes the key alone (MLA: the value is a view of the key).
void write_kv(const at::Tensor& key_cache, const c10::optional<at::Tensor>& value_cache, const at::Tensor& slots,
              const at::Tensor& key, const c10::optional<at::Tensor>& value) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.is_contiguous(), "write_kv: slots: a contiguous int64 CPU vector");
  const int64_t n = slots.size(0);
  const auto check = [&](const at::Tensor& cache, const at::Tensor& x, const char* what) {
    TORCH_CHECK(cache.device().is_cpu() && x.device().is_cpu() && cache.is_contiguous() && cache.dim() == 3 &&
                    x.dim() == 3 && x.size(0) == n && x.size(1) == cache.size(1) && x.size(2) == cache.size(2) &&
                    x.stride(2) == 1 && x.scalar_type() == cache.scalar_type(),
                "write_kv: ", what, " [n, Hk, d] of its cache's dtype and heads, channels contiguous, into a "
                "contiguous cache [slots, Hk, d]");
  };
  check(key_cache, key, "key");
  TORCH_CHECK(value_cache.has_value() == value.has_value(), "write_kv: a value with its cache, or neither");
  if (value_cache) check(*value_cache, *value, "value");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < num_slots, "write_kv: slot ", sl[i], " out of the cache's ", num_slots);
  }
  TORCH_CHECK(!value_cache || value_cache->size(0) == num_slots, "write_kv: key and value caches of one length");
  const auto copy = [&](const at::Tensor& cache, const at::Tensor& x) {
    const int64_t heads = x.size(1), d = x.size(2), bytes = d * x.element_size();
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    const int64_t ts = x.stride(0) * x.element_size(), hs = x.stride(1) * x.element_size(), row = heads * bytes;
    for (int64_t i = 0; i < n; ++i) {
      char* to = dst + sl[i] * row;
      if (hs == bytes) {
        std::memcpy(to, src + i * ts, row);
      } else {
        for (int64_t h = 0; h < heads; ++h) std::memcpy(to + h * bytes, src + i * ts + h * hs, bytes);
      }
    }
  };
  copy(key_cache, key);
  if (value_cache) copy(*value_cache, *value);
}

// silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) (the kernel's exp): never overflows; below -87 (past float32's
// range) sigmoid(-|g|) is 0, as PyTorch's
inline float silu(float g) {
  const float e = g < -87.0f || g > 87.0f ? 0.0f : exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#if defined(KVSHARD_TILED)
inline __m512 silu16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g));
  const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), tiled::exp16(x));
  const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), one, e);
  return _mm512_mul_ps(g, _mm512_div_ps(numerator, _mm512_add_ps(one, e)));
}
#endif

// (the layers fuse SiLU only where the AVX-512 path is built: layers/fused.py)
inline void silu_row(float* g, int64_t n) {
  int64_t i = 0;
#if defined(KVSHARD_TILED)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(g + i, silu16(_mm512_loadu_ps(g + i)));
#endif
  for (; i < n; ++i) g[i] = silu(g[i]);
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_row, T* out, int64_t rows, int64_t half) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(half, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> gf(half);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_row;
      const T* u = g + half;
      T* o = out + r * half;
      for (int64_t i = 0; i < half; ++i) gf[i] = static_cast<float>(g[i]);
      silu_row(gf.data(), half);
      // the activation rounded to the dtype before the product, as two eager operators round
      for (int64_t i = 0; i < half; ++i) {
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(gf[i])) * static_cast<float>(u[i]));
      }
    }
  });
}

// gate_up [..., 2I] -> [..., I]: silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul: a CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: an even last dimension");
  const int64_t half = x.size(-1) / 2;
  const at::Tensor x2 = (x.dim() == 2 ? x : x.reshape({-1, 2 * half}));
  const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = half;
  auto out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = xc.size(0);
  switch (x.scalar_type()) {
    case at::kFloat:
      silu_and_mul_rows(xc.data_ptr<float>(), xc.stride(0), out.data_ptr<float>(), rows, half);
      break;
    case at::kBFloat16:
      silu_and_mul_rows(xc.data_ptr<c10::BFloat16>(), xc.stride(0), out.data_ptr<c10::BFloat16>(), rows, half);
      break;
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// One token's heads. Products rounded one by one and then added, as the eager operators do: no fused multiply-add
// (a function of its own, kept out of line: inlined into at::parallel_for's threaded region, it lost the attribute).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rotary_token(const T* x, int64_t x_head, const float* c,
                                                                          const float* s, T* out, int64_t h,
                                                                          int64_t d, bool interleaved, float* x1,
                                                                          float* x2) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < h; ++j) {
    const T* xr = x + j * x_head;
    T* o = out + j * d;
    if (interleaved) {  // pairs (0, 1), (2, 3), ...: the even channels are the first half, the odd the second
      for (int64_t k = 0; k < half; ++k) {
        x1[k] = static_cast<float>(xr[2 * k]);
        x2[k] = static_cast<float>(xr[2 * k + 1]);
      }
    } else {
      for (int64_t k = 0; k < half; ++k) {
        x1[k] = static_cast<float>(xr[k]);
        x2[k] = static_cast<float>(xr[half + k]);
      }
    }
    for (int64_t k = 0; k < half; ++k) {
      const float a = x1[k] * c[k], b = x2[k] * s[k];
      o[k] = static_cast<T>(a - b);
    }
    for (int64_t k = 0; k < half; ++k) {
      const float a = x2[k] * c[k], b = x1[k] * s[k];
      o[half + k] = static_cast<T>(a + b);
    }
  }
}

template <typename T>
void rotary_rows(const T* x, int64_t x_tok, int64_t x_head, const float* cos, const float* sin, T* out, int64_t t,
                 int64_t h, int64_t d, bool interleaved) {
  const int64_t half = d / 2;
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(h * d, 1));
  at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> x1(half), x2(half);
    for (int64_t i = begin; i < end; ++i) {
      rotary_token(x + i * x_tok, x_head, cos + i * half, sin + i * half, out + i * h * d, h, d, interleaved,
                   x1.data(), x2.data());
    }
  });
}

// x [t, h, d] (channels contiguous, any token and head strides), cos / sin [t, d / 2] float32 -> x rotated,
// contiguous, in the rotated half-by-half order (interleaved pairs come out as the reference's permuted order)
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.device().is_cpu(), "rotary: CPU tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary: x [t, h, d], d even, contiguous");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == t && sin.size(0) == t &&
                  cos.size(1) == d / 2 && sin.size(1) == d / 2,
              "rotary: cos / sin contiguous float32 [t, d / 2]");
  auto out = at::empty({t, h, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  switch (x.scalar_type()) {
    case at::kFloat:
      rotary_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  out.data_ptr<float>(), t, h, d, interleaved);
      break;
    case at::kBFloat16:
      rotary_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                  out.data_ptr<c10::BFloat16>(), t, h, d, interleaved);
      break;
    default: TORCH_CHECK(false, "rotary: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// One row of S partial attentions merged by their LSE, with attention/merge.py's arithmetic: the LSEs' log-sum-exp
// taken against their largest (0 where that is infinite, as torch.logsumexp), each part weighted by exp(lse - total)
// (total 0 where it is not finite: an empty row, every part -inf, gets o = 0 and lse = -inf), the weighted outputs
// added in part order. Products rounded and then added, as the eager operators do: no fused multiply-add (a function
// of its own, kept out of line, as rotary_token).
__attribute__((noinline, optimize("fp-contract=off"))) void merge_row(const float* const* __restrict o,
                                                                       const float* __restrict l, int64_t parts,
                                                                       int64_t dv, float* __restrict out,
                                                                       float* __restrict weights) {
  float top = kNegInf;
  for (int64_t s = 0; s < parts; ++s) top = std::max(top, l[s]);
  if (std::isinf(top)) top = 0.0f;
  float sum = 0.0f;
  for (int64_t s = 0; s < parts; ++s) sum += std::exp(l[s] - top);
  const float total = std::log(sum) + top;
  const float finite = std::isfinite(total) ? total : 0.0f;
  for (int64_t s = 0; s < parts; ++s) weights[s] = std::exp(l[s] - finite);
  const float* __restrict o0 = o[0];
  const float w0 = weights[0];
  for (int64_t i = 0; i < dv; ++i) out[i] = o0[i] * w0;
  for (int64_t s = 1; s < parts; ++s) {
    const float* __restrict os = o[s];
    const float w = weights[s];
    for (int64_t i = 0; i < dv; ++i) out[i] = out[i] + os[i] * w;
  }
  out[dv] = total;
}

// outputs[s] [t, H, dv] (channels contiguous, any row and head strides) and lses[s] [t, H], float32, S >= 1 partial
// attentions over disjoint keys -> [t, H, dv + 1]: their merge, o and lse side by side (attention/merge.py)
at::Tensor merge_states(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& lses) {
  TORCH_CHECK(!outputs.empty() && outputs.size() == lses.size(), "merge_states: as many outputs as LSEs, at least one");
  const at::Tensor& first = outputs[0];
  TORCH_CHECK(first.dim() == 3, "merge_states: outputs [t, H, dv]");
  const int64_t t = first.size(0), h = first.size(1), dv = first.size(2), parts = outputs.size();
  for (int64_t s = 0; s < parts; ++s) {
    const at::Tensor& o = outputs[s];
    const at::Tensor& l = lses[s];
    TORCH_CHECK(o.device().is_cpu() && l.device().is_cpu(), "merge_states: CPU tensors");
    TORCH_CHECK(o.scalar_type() == at::kFloat && l.scalar_type() == at::kFloat, "merge_states: float32 parts");
    TORCH_CHECK(o.dim() == 3 && o.size(0) == t && o.size(1) == h && o.size(2) == dv && (dv <= 1 || o.stride(2) == 1),
                "merge_states: every output [t, H, dv], channels contiguous");
    TORCH_CHECK(l.dim() == 2 && l.size(0) == t && l.size(1) == h, "merge_states: every LSE [t, H]");
  }
  auto merged = at::empty({t, h, dv + 1}, first.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<const float*> o_base(parts), l_base(parts);
  std::vector<int64_t> o_row(parts), o_head(parts), l_row(parts), l_head(parts);
  for (int64_t s = 0; s < parts; ++s) {
    o_base[s] = outputs[s].data_ptr<float>();
    l_base[s] = lses[s].data_ptr<float>();
    o_row[s] = outputs[s].stride(0);
    o_head[s] = outputs[s].stride(1);
    l_row[s] = lses[s].stride(0);
    l_head[s] = lses[s].stride(1);
  }
  float* out = merged.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(parts * (dv + 1), 1));
  at::parallel_for(0, t * h, grain, [&](int64_t begin, int64_t end) {
    std::vector<const float*> o(parts);
    std::vector<float> l(parts), weights(parts);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / h, j = r % h;
      for (int64_t s = 0; s < parts; ++s) {
        o[s] = o_base[s] + i * o_row[s] + j * o_head[s];
        l[s] = l_base[s][i * l_row[s] + j * l_head[s]];
      }
      merge_row(o.data(), l.data(), parts, dv, out + r * (dv + 1), weights.data());
    }
  });
  return merged;
}

// outputs [S, t, H, dv] and lses [S, t, H] (a collective's buffer: any strides but the channels') -> merge_states
at::Tensor merge_stacked(const at::Tensor& outputs, const at::Tensor& lses) {
  TORCH_CHECK(outputs.dim() == 4 && lses.dim() == 3 && outputs.size(0) == lses.size(0),
              "merge_stacked: outputs [S, t, H, dv] and lses [S, t, H]");
  std::vector<at::Tensor> o, l;
  for (int64_t s = 0; s < outputs.size(0); ++s) {
    o.push_back(outputs.select(0, s));
    l.push_back(lses.select(0, s));
  }
  return merge_states(o, l);
}

// The routed experts of one MoE layer in one call (layers/moe.py, its `fused` path): x [t, D], weights [t, k]
// float32 and ids [t, k] int64 (the expert of each (token, slot) pair among this rank's E; any other id is another
// rank's), w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I] in x's dtype (float32 or bfloat16) -> [t, D]:
// the sum over this rank's experts. The pairs are sorted by expert (tokens ascending within one), each expert's rows
// gathered once and run through ATen's products (the ones `loop` calls, on the same rows), the experts spread over
// the threads when there are enough of them (each product then on one thread); every token's experts are added in
// ascending order, each term rounded to x's dtype first and each sum rounded to it: what the eager `loop` computes,
// without its dozen operators per expert.
template <typename T>
void moe_scale_rows(const at::Tensor& y, const float* w, const int64_t* order, int64_t n, int64_t d, T* ys) {
  const T* yp = y.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r) {
    const float f = w[order[r]];
    for (int64_t c = 0; c < d; ++c) ys[r * d + c] = static_cast<T>(static_cast<float>(yp[r * d + c]) * f);
  }
}

template <typename T>
void moe_add_up(T* out, const T* ys, const int64_t* id, const int64_t* position, int64_t t, int64_t k, int64_t experts,
                int64_t d) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(k * d, 1));
  at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> mine(k);  // (expert, sorted position) of a token's pairs
    for (int64_t i = begin; i < end; ++i) {
      int64_t m = 0;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t p = i * k + s;
        if (id[p] >= 0 && id[p] < experts) mine[m++] = {id[p], position[p]};
      }
      std::sort(mine.begin(), mine.begin() + m);
      T* o = out + i * d;
      for (int64_t j = 0; j < m; ++j) {
        const T* y = ys + mine[j].second * d;
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(static_cast<float>(o[c]) + static_cast<float>(y[c]));
      }
    }
  });
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2) {
  TORCH_CHECK(x.device().is_cpu() && weights.device().is_cpu() && ids.device().is_cpu() && w13.device().is_cpu() &&
                  w2.device().is_cpu(),
              "moe_experts: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_experts: x [t, D], weights and ids [t, k]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat,
              "moe_experts: int64 ids and float32 weights");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) &&
                  w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 [E, 2I, D] and w2 [E, D, I]");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x and the weights float32 or bfloat16 alike");
  const int64_t t = ids.size(0), k = ids.size(1), experts = w13.size(0), d = x.size(1);
  const at::Tensor xc = x.contiguous(), idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  auto out = at::zeros({t, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < t * k; ++p) {
    if (id[p] >= 0 && id[p] < experts) ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  const int64_t pairs = start[experts];
  if (pairs == 0) return out;
  // the pairs in expert order, (token, slot) ascending within one expert; where each pair went
  std::vector<int64_t> order(pairs), position(t * k, -1), next(start.begin(), start.end() - 1), active;
  for (int64_t p = 0; p < t * k; ++p) {
    if (id[p] >= 0 && id[p] < experts) {
      position[p] = next[id[p]];
      order[next[id[p]]++] = p;
    }
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (start[e + 1] > start[e]) active.push_back(e);
  }
  auto xs = at::empty({pairs, d}, xc.options());
  const size_t row_bytes = d * xc.element_size();
  const char* xp = static_cast<const char*>(xc.data_ptr());
  char* xsp = static_cast<char*>(xs.data_ptr());
  for (int64_t i = 0; i < pairs; ++i) std::memcpy(xsp + i * row_bytes, xp + (order[i] / k) * row_bytes, row_bytes);
  auto ys = at::empty({pairs, d}, xc.options());  // each pair's term, weighted and rounded to x's dtype
  const float* w = wc.data_ptr<float>();
  auto run = [&](int64_t e) {
    const int64_t off = start[e], n = start[e + 1] - off;
    const at::Tensor y = at::mm(silu_and_mul(at::mm(xs.narrow(0, off, n), w13.select(0, e).t())),
                                w2.select(0, e).t()).contiguous();
    if (x.scalar_type() == at::kFloat) {
      moe_scale_rows(y, w, order.data() + off, n, d, ys.data_ptr<float>() + off * d);
    } else {
      moe_scale_rows(y, w, order.data() + off, n, d, ys.data_ptr<c10::BFloat16>() + off * d);
    }
  };
  const int64_t count = active.size();
  if (count >= at::get_num_threads()) {  // one expert a thread at a time, each product on its thread
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) run(active[j]);
    });
  } else {  // fewer experts than threads: the products take the threads
    for (int64_t e : active) run(e);
  }
  if (x.scalar_type() == at::kFloat) {
    moe_add_up(out.data_ptr<float>(), ys.data_ptr<float>(), id, position.data(), t, k, experts, d);
  } else {
    moe_add_up(out.data_ptr<c10::BFloat16>(), ys.data_ptr<c10::BFloat16>(), id, position.data(), t, k, experts, d);
  }
  return out;
}


// The experts a token's router picks, from its scores (float32 [t, E], rows contiguous; softmax or sigmoid already
// taken): what TopKRouter's eager chain does between the scores and the weights' normalisation, in one call.
// method 0 (noaux_tc): the choice is scores + bias, groups ranked by the sum of their two best choices, the weights
// the unbiased scores; 1 (greedy): the top_k scores; 2 (group_limited_greedy): groups ranked by their best score.
// Experts outside the topk_groups best groups are out of the choice (-inf; 0 for method 2, as masked_fill leaves
// them). Order: by value, the lower index first among equals. Returns weights [t, top_k] float32, ids [t, top_k] int64.
std::vector<at::Tensor> moe_select(const at::Tensor& scores, const at::Tensor& bias, int64_t method, int64_t groups,
                                   int64_t topk_groups, int64_t top_k) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "moe_select: scores are contiguous float32 [t, E]");
  const int64_t t = scores.size(0), E = scores.size(1);
  TORCH_CHECK(method >= 0 && method <= 2 && groups > 0 && E % groups == 0 && topk_groups > 0 &&
                  topk_groups <= groups && top_k > 0 && top_k <= E, "moe_select: bad routing arguments");
  TORCH_CHECK(method != 0 || (bias.defined() && bias.numel() == E && bias.scalar_type() == at::kFloat &&
                              bias.is_contiguous()), "moe_select: noaux_tc needs a float32 bias of E");
  auto weights = at::empty({t, top_k}, scores.options());
  auto ids = at::empty({t, top_k}, scores.options().dtype(at::kLong));
  const float* sd = scores.data_ptr<float>();
  const float* bd = method == 0 ? bias.data_ptr<float>() : nullptr;
  float* wd = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  const int64_t per = E / groups;
  const float fill = method == 2 ? 0.f : -std::numeric_limits<float>::infinity();
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> choice(E), rank(groups);
    std::vector<int64_t> order(std::max(E, groups));
    std::vector<char> kept(groups);
    for (int64_t i = begin; i < end; ++i) {
      const float* sc = sd + i * E;
      for (int64_t e = 0; e < E; ++e) choice[e] = bd ? sc[e] + bd[e] : sc[e];
      if (method != 1) {
        for (int64_t g = 0; g < groups; ++g) {
          const float* c = choice.data() + g * per;
          if (method == 0) {  // the sum of the group's two best (one expert a group: itself)
            float a = -std::numeric_limits<float>::infinity(), b = a;
            for (int64_t e = 0; e < per; ++e) {
              if (c[e] > a) {
                b = a;
                a = c[e];
              } else if (c[e] > b) {
                b = c[e];
              }
            }
            rank[g] = per > 1 ? a + b : a;
          } else {
            rank[g] = *std::max_element(c, c + per);
          }
        }
        std::iota(order.begin(), order.begin() + groups, 0);
        std::partial_sort(order.begin(), order.begin() + topk_groups, order.begin() + groups,
                          [&](int64_t x, int64_t y) { return rank[x] > rank[y] || (rank[x] == rank[y] && x < y); });
        std::fill(kept.begin(), kept.end(), 0);
        for (int64_t g = 0; g < topk_groups; ++g) kept[order[g]] = 1;
        for (int64_t g = 0; g < groups; ++g)
          if (!kept[g]) std::fill(choice.begin() + g * per, choice.begin() + (g + 1) * per, fill);
      }
      std::iota(order.begin(), order.begin() + E, 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + E,
                        [&](int64_t x, int64_t y) { return choice[x] > choice[y] || (choice[x] == choice[y] && x < y); });
      for (int64_t j = 0; j < top_k; ++j) {
        id[i * top_k + j] = order[j];
        wd[i * top_k + j] = method == 0 ? sc[order[j]] : choice[order[j]];
      }
    }
  });
  return {weights, ids};
}

// A weight [N, K] in the tiles' pair layout, [N / 16, K / 32, 16, 32]: w[16t + n][32c + 2p + j] at [t][c][p][2n + j], so
// that each 32-channel step of 16 features is a B tile of 1 KiB, contiguous (layers/linear.py's `pair_weight` makes it)
bool paired_weight(const at::Tensor& w) { return w.dim() == 4 && w.size(2) == 16 && w.size(3) == 32; }

#if defined(KVSHARD_AMX)
// Attention of bfloat16 rows over bfloat16 keys on AMX tiles, for long prefill chunks (to themselves, causally,
// and over their requests' gathered cached context), head sizes 32, 64 and 128. The query heads that share a KV head
// are rows of one group (a row is a (query head, token) pair: each packed key tile serves all of them). A block
// of 16 rows takes 512 keys at a time: Q·Kᵀ on the tiles into float32 scores, an online softmax in float32 on
// AVX-512 (2^x by a degree-5 polynomial and the exponent set by vscalefps), the weights rounded to bfloat16 as
// PyTorch's flash kernel rounds them, P·V on the tiles into the float32 accumulator. Keys are packed into the tiles'
// pair-interleaved layout 16,384 at a time (a longer context is attended a range at a time, the rows' softmax state
// kept across ranges: its packed copy stays 8 MB a KV head at head size 128); a thread runs each 512-key block over a span of 8 row blocks in turn, so
// that the block's packed keys and values come from memory once for 128 rows (at head size 128 they outgrow the
// core's L2 over a few thousand keys), and the next row block's Q·Kᵀ runs between the rows of a block's softmax (the
// tile unit works while the vector units do: 1.03-1.18x on one thread at head sizes 32 and 64). The flash kernel
// stays its oracle (tests/test_amx_attention.py).
namespace amx {
constexpr int KEYS = 512;  // keys per softmax block: the per-row cost of a block spread over 512 scores
constexpr int ROWS = 16;   // query rows per block (one tile's rows)
constexpr int SPAN = 8;    // blocks that take each block of keys in turn, while its packed keys and values are cached
constexpr int64_t RANGE = 16384;  // keys packed at a time: a longer context is attended a range at a time

inline __m512 exp2_of(__m512 t) {  // 2^t for finite t (below -150: 0), relative error ~2e-6
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xFFFF : (n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1)); }

// Keys [32 at j0] of one KV head as Q·Kᵀ's B tiles: per 16 keys and 32 channels, 16 rows (channel pairs) x 16
// keys of 32 bits; values as P·V's B tiles: per 32 keys and 16 channels, 16 rows (key pairs) x 16 channels x 2.
// Keys past `len` are zeros (their weights are masked to 0). kp and vp hold the keys from `base` on.
void pack(const uint16_t* k, const uint16_t* v, int64_t ks, int64_t vs, int len, int j0, int base, int d,
          uint32_t* kp, uint16_t* vp) {
  const int nd = d / 32, nc = d / 16;
  for (int half = 0; half < 2; ++half)
    for (int part = 0; part < nd; ++part) {
      uint32_t* tile = kp + (int64_t(((j0 - base) >> 4) + half) * nd + part) * 256;
      for (int n = 0; n < 16; ++n) {
        const int key = j0 + half * 16 + n;
        const uint32_t* row = key < len ? reinterpret_cast<const uint32_t*>(k + key * ks) + part * 16 : nullptr;
        for (int kk = 0; kk < 16; ++kk) tile[kk * 16 + n] = row ? row[kk] : 0u;
      }
    }
  for (int c = 0; c < nc; ++c) {
    uint16_t* tile = vp + (int64_t((j0 - base) >> 5) * nc + c) * 512;
    for (int kk = 0; kk < 16; ++kk)
      for (int e = 0; e < 2; ++e) {
        const int key = j0 + 2 * kk + e;
        const uint16_t* row = key < len ? v + key * vs + c * 16 : nullptr;
        for (int n = 0; n < 16; ++n) tile[kk * 32 + n * 2 + e] = row ? row[n] : 0;
      }
  }
}

// A block of up to 16 rows (one tile's): their vectors (contiguous, zero-padded to 16), row r seeing keys
// [0, limit[r]), and their online softmax's state; out (float32) and lse through the row pointers once done.
struct Rows {
  alignas(64) uint16_t q[ROWS * 128];
  alignas(64) float acc[ROWS * 128];
  float m[ROWS], l[ROWS];
  int limit[ROWS];
  int rows = 0, kmax = 0;
  float* out_rows[ROWS];
  float* lse_rows[ROWS];

  void start(int d) {
    kmax = 0;
    for (int r = 0; r < ROWS; ++r) {
      kmax = std::max(kmax, r < rows ? limit[r] : 0);
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * ROWS * d);
  }

  void finish(int d) const {
    for (int r = 0; r < rows; ++r) {
      const float inv = l[r] > 0 ? 1.f / l[r] : 0.f;
      for (int c = 0; c < d; ++c) out_rows[r][c] = acc[r * d + c] * inv;
      *lse_rows[r] = l[r] > 0 ? (m[r] + std::log2(l[r])) * 0.69314718055994531f
                              : -std::numeric_limits<float>::infinity();
    }
  }
};

// Keys of block b's rows in [kb0, kb0 + 512) that its scores cover (kb0 < b.kmax): a multiple of 32.
inline int block_keys(const Rows& b, int kb0) { return std::min(KEYS, (b.kmax - kb0 + 31) / 32 * 32); }

// Q·Kᵀ of block b's rows over the keys [kb0, kb0 + 512) into S, in steps of 32 keys: load_q puts b's rows in the
// first tiles, steps(first, last) runs steps [first, last). Its tiles are free again after each step, so the steps
// can be spread between another block's softmax rows (the tile unit works while the vector units do).
struct Scores {
  const uint32_t* kp;  // packed keys from `base` on
  float* S;
  int kb0, d, base;

  void load_q(const Rows& b) const {
    _tile_loadd(0, b.q, d * 2);
    if (d > 32) _tile_loadd(1, b.q + 32, d * 2);
    if (d > 64) {
      _tile_loadd(2, b.q + 64, d * 2);
      _tile_loadd(3, b.q + 96, d * 2);
    }
  }

  void steps(int first, int last) const {
    const int nd = d / 32;
    for (int step = first; step < last; ++step) {
      const int s = step * 2;
      const uint32_t* ka = kp + int64_t(((kb0 - base) >> 4) + s) * nd * 256;
      const uint32_t* kb = ka + nd * 256;
      if (nd > 2) {  // head size 128: Q in tiles 0-3, the two key tiles' parts through tiles 4 and 7 into 5 and 6
        _tile_zero(5);
        _tile_zero(6);
        _tile_loadd(4, ka, 64);
        _tile_loadd(7, kb, 64);
        _tile_dpbf16ps(5, 0, 4);
        _tile_dpbf16ps(6, 0, 7);
        _tile_loadd(4, ka + 256, 64);
        _tile_loadd(7, kb + 256, 64);
        _tile_dpbf16ps(5, 1, 4);
        _tile_dpbf16ps(6, 1, 7);
        _tile_loadd(4, ka + 512, 64);
        _tile_loadd(7, kb + 512, 64);
        _tile_dpbf16ps(5, 2, 4);
        _tile_dpbf16ps(6, 2, 7);
        _tile_loadd(4, ka + 768, 64);
        _tile_loadd(7, kb + 768, 64);
        _tile_dpbf16ps(5, 3, 4);
        _tile_dpbf16ps(6, 3, 7);
        _tile_stored(5, S + s * 16, KEYS * 4);
        _tile_stored(6, S + s * 16 + 16, KEYS * 4);
      } else {  // two key tiles in flight
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(2, ka, 64);
        _tile_loadd(3, kb, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (nd > 1) {
          _tile_loadd(2, ka + 256, 64);
          _tile_loadd(3, kb + 256, 64);
          _tile_dpbf16ps(4, 1, 2);
          _tile_dpbf16ps(5, 1, 3);
        }
        _tile_stored(4, S + s * 16, KEYS * 4);
        _tile_stored(5, S + s * 16 + 16, KEYS * 4);
      }
    }
  }
};

// Row r of block b over its nk keys from kb0 (scores in S): the online softmax's update, its weights into P.
void softmax_row(Rows& b, int r, int kb0, int nk, int d, float scale2, const float* S, uint16_t* P) {
  const __m512 vscale = _mm512_set1_ps(scale2);
  const float* sr = S + r * KEYS;
  uint16_t* pr = P + r * KEYS;
  const int valid = r < b.rows ? std::min(nk, b.limit[r] - kb0) : 0;
  if (valid <= 0) {  // no key of this block for the row (or a padding row): weights 0, nothing rescaled
    std::memset(pr, 0, nk * 2);
    return;
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), mx2 = mx;
  if (valid == nk) {
    for (int j = 0; j < nk; j += 32) {
      mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
      mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(sr + j + 16));
    }
    mx = _mm512_max_ps(mx, mx2);
  } else {
    for (int j = 0; j < nk; j += 16)
      mx = _mm512_mask_max_ps(mx, first_lanes(valid - j), mx, _mm512_loadu_ps(sr + j));
  }
  const float mnew = std::max(b.m[r], _mm512_reduce_max_ps(mx) * scale2);
  const float alpha = std::exp2(b.m[r] - mnew);
  const __m512 vm = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps(), sum2 = sum;
  for (int j = 0; j < nk; j += 32) {
    __m512 e0 = exp2_of(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vscale, vm));
    __m512 e1 = exp2_of(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j + 16), vscale, vm));
    if (j + 32 > valid) {
      e0 = _mm512_maskz_mov_ps(first_lanes(valid - j), e0);
      e1 = _mm512_maskz_mov_ps(first_lanes(valid - j - 16), e1);
    }
    sum = _mm512_add_ps(sum, e0);
    sum2 = _mm512_add_ps(sum2, e1);
    _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  b.l[r] = b.l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(sum, sum2));
  b.m[r] = mnew;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int c = 0; c < d; c += 16)
      _mm512_storeu_ps(b.acc + r * d + c, _mm512_mul_ps(va, _mm512_loadu_ps(b.acc + r * d + c)));
  }
}

// P·V of block b's rows over its nk keys from kb0 into their accumulator (weights in P; packed values from `base` on).
void values(Rows& b, int kb0, int base, int nk, const uint16_t* vp, int d, const uint16_t* P) {
  const int nc = d / 16;
  if (d > 64) {  // every tile free (a block's Q is loaded again before its scores): P in 0, V through 1-3, four
    // accumulator tiles of 16 channels in 4-7
    for (int c = 0; c < nc; c += 4) {
      _tile_loadd(4, b.acc + c * 16, d * 4);
      _tile_loadd(5, b.acc + c * 16 + 16, d * 4);
      _tile_loadd(6, b.acc + c * 16 + 32, d * 4);
      _tile_loadd(7, b.acc + c * 16 + 48, d * 4);
      for (int j = 0; j < nk / 32; ++j) {
        _tile_loadd(0, P + j * 32, KEYS * 2);
        const uint16_t* vt = vp + (int64_t(((kb0 - base) >> 5) + j) * nc + c) * 512;
        _tile_loadd(1, vt, 64);
        _tile_loadd(2, vt + 512, 64);
        _tile_loadd(3, vt + 1024, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, vt + 1536, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, b.acc + c * 16, d * 4);
      _tile_stored(5, b.acc + c * 16 + 16, d * 4);
      _tile_stored(6, b.acc + c * 16 + 32, d * 4);
      _tile_stored(7, b.acc + c * 16 + 48, d * 4);
    }
    return;
  }
  for (int c = 0; c < nc; c += 2) {  // two 16-channel tiles of the accumulator at a time
    _tile_loadd(4, b.acc + c * 16, d * 4);
    _tile_loadd(5, b.acc + c * 16 + 16, d * 4);
    for (int j = 0; j < nk / 32; ++j) {
      _tile_loadd(6, P + j * 32, KEYS * 2);
      const uint16_t* vt = vp + (int64_t(((kb0 - base) >> 5) + j) * nc + c) * 512;
      _tile_loadd(2, vt, 64);
      _tile_loadd(3, vt + 512, 64);
      _tile_dpbf16ps(4, 6, 2);
      _tile_dpbf16ps(5, 6, 3);
    }
    _tile_stored(4, b.acc + c * 16, d * 4);
    _tile_stored(5, b.acc + c * 16 + 16, d * 4);
  }
}
}  // namespace amx

bool amx_ready() { return tiled::tiles_permitted(); }

// q [g, s, H, d], k and v [g, L, Hk, d] (bfloat16, channels contiguous; d 32, 64 or 128): out [g, s, H, d] and lse
// [g, s, H] (float32). causal: s == L and token t sees keys <= t; else every token sees all L keys. d: 32, 64 or 128.
// key_range: keys packed at a time (a multiple of 512; 0: RANGE). A context longer than that is packed and attended a
// range at a time, the rows' softmax state kept across ranges, so that the packed copy stays a range's size.
std::vector<at::Tensor> amx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                      bool causal, int64_t key_range) {
  TORCH_CHECK(tiled::tiles_permitted(), "the AMX tiles' state was refused by the system");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "amx_attention: q, k, v are [g, s|L, heads, d]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "amx_attention: bfloat16 only");
  const int64_t g = q.size(0), s = q.size(1), H = q.size(2), d = q.size(3), L = k.size(1), Hk = k.size(2);
  TORCH_CHECK(d == 32 || d == 64 || d == 128, "amx_attention: head size 32, 64 or 128");
  TORCH_CHECK(k.size(3) == d && v.size(3) == d && v.size(1) == L && v.size(2) == Hk && k.size(0) == g && v.size(0) == g,
              "amx_attention: k and v of one shape [g, L, Hk, d]");
  TORCH_CHECK(H % Hk == 0 && (!causal || s == L), "amx_attention: heads a multiple of KV heads; causal needs s == L");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "amx_attention: channels contiguous");
  TORCH_CHECK(key_range >= 0 && key_range % amx::KEYS == 0, "amx_attention: key_range a multiple of ", amx::KEYS);
  const int64_t rep = H / Hk, groups = g * Hk, rows = rep * s, Lp = (L + 31) / 32 * 32;
  const int64_t range = std::min<int64_t>(Lp, key_range > 0 ? key_range : amx::RANGE);
  const int64_t ranges = (Lp + range - 1) / range;
  auto kp = at::empty({groups, range * d / 2}, q.options().dtype(at::kInt));
  auto vp = at::empty({groups, range * d}, q.options().dtype(at::kShort));
  auto out = at::empty({g, s, H, d}, q.options().dtype(at::kFloat));
  auto lse = at::empty({g, s, H}, q.options().dtype(at::kFloat));
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  // A thread takes a span of up to SPAN blocks of one group and runs each 512-key block of the group's keys over all
  // of them in turn, so that the block's packed keys and values (128 KB at head size 64) are read from memory once
  // for the span, not once for each 16 rows.
  const int64_t blocks = (rows + amx::ROWS - 1) / amx::ROWS, spans = (blocks + amx::SPAN - 1) / amx::SPAN;
  const int64_t items = groups * spans;
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
  const float scale2 = float(scale) * 1.44269504088896341f;  // scores in log2 units: 2^x in place of e^x
  // over several ranges every block's state lives across them (12 KB a block of 16 rows); over one, a thread's span's
  std::vector<amx::Rows> state(ranges > 1 ? size_t(groups * blocks) : 0);
  for (int64_t rg = 0; rg < ranges; ++rg) {
    const int64_t k0 = rg * range, k1 = std::min(Lp, k0 + range), key_units = (k1 - k0) / 32;
    at::parallel_for(0, groups * key_units, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t gi = i / key_units, b = gi / Hk, h = gi % Hk;
        amx::pack(kd + b * k.stride(0) + h * k.stride(2), vd + b * v.stride(0) + h * v.stride(2), k.stride(1),
                  v.stride(1), int(L), int(k0 + (i % key_units) * 32), int(k0), int(d),
                  reinterpret_cast<uint32_t*>(kp.data_ptr()) + gi * (range * d / 2),
                  reinterpret_cast<uint16_t*>(vp.data_ptr()) + gi * (range * d));
      }
    });
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      tiled::configure_tiles();
      std::vector<amx::Rows> local(ranges > 1 ? 0 : amx::SPAN);
      std::vector<float> S(2 * amx::ROWS * amx::KEYS);  // one block's scores while the next block's are made
      std::vector<uint16_t> P(amx::ROWS * amx::KEYS);
      for (int64_t i = begin; i < end; ++i) {
        // a causal group's later rows see more keys: items alternate from both ends so that a thread's contiguous
        // share holds light and heavy spans alike
        const int64_t gi = i / spans, j = i % spans, sp = (j % 2 == 0) ? j / 2 : spans - 1 - j / 2;
        const int64_t b = gi / Hk, h = gi % Hk;
        const auto* kg = reinterpret_cast<const uint32_t*>(kp.data_ptr()) + gi * (range * d / 2);
        const auto* vg = reinterpret_cast<const uint16_t*>(vp.data_ptr()) + gi * (range * d);
        const int64_t first = sp * amx::SPAN, count = std::min<int64_t>(amx::SPAN, blocks - first);
        amx::Rows* span = ranges > 1 ? state.data() + gi * blocks + first : local.data();
        int kmax = 0;
        for (int64_t x = 0; x < count; ++x) {
          amx::Rows& blk = span[x];
          if (rg == 0) {
            const int64_t r0 = (first + x) * amx::ROWS;
            blk.rows = int(std::min<int64_t>(amx::ROWS, rows - r0));
            std::memset(blk.q, 0, sizeof(uint16_t) * amx::ROWS * d);
            for (int r = 0; r < blk.rows; ++r) {
              const int64_t row = r0 + r, head = h * rep + row / s, t = row % s;
              std::memcpy(blk.q + r * d, qd + b * q.stride(0) + t * q.stride(1) + head * q.stride(2), d * 2);
              blk.limit[r] = causal ? int(t + 1) : int(L);
              blk.out_rows[r] = od + ((b * s + t) * H + head) * d;
              blk.lse_rows[r] = ld + (b * s + t) * H + head;
            }
            blk.start(int(d));
          }
          kmax = std::max(kmax, blk.kmax);
        }
        // For each 512-key block of the range: the scores of the span's first block, then for each block its softmax
        // with the next block's Q·Kᵀ steps spread between its rows (into the other half of S), then its P·V.
        int active[amx::SPAN];
        for (int kb0 = int(k0); kb0 < std::min<int64_t>(kmax, k1); kb0 += amx::KEYS) {
          int n = 0;
          for (int64_t x = 0; x < count; ++x)
            if (kb0 < span[x].kmax) active[n++] = int(x);
          amx::Scores opening{kg, S.data(), kb0, int(d), int(k0)};
          opening.load_q(span[active[0]]);
          opening.steps(0, amx::block_keys(span[active[0]], kb0) / 32);
          for (int i = 0; i < n; ++i) {
            amx::Rows& blk = span[active[i]];
            const int nk = amx::block_keys(blk, kb0);
            float* scores = S.data() + (i & 1) * amx::ROWS * amx::KEYS;
            amx::Scores next{kg, S.data() + ((i + 1) & 1) * amx::ROWS * amx::KEYS, kb0, int(d), int(k0)};
            const int pairs = i + 1 < n ? amx::block_keys(span[active[i + 1]], kb0) / 32 : 0;
            if (pairs) next.load_q(span[active[i + 1]]);
            for (int r = 0; r < amx::ROWS; ++r) {
              next.steps(r * pairs / amx::ROWS, (r + 1) * pairs / amx::ROWS);
              amx::softmax_row(blk, r, kb0, nk, int(d), scale2, scores, P.data());
            }
            amx::values(blk, kb0, int(k0), nk, vg, int(d), P.data());
          }
        }
        if (rg == ranges - 1)
          for (int64_t x = 0; x < count; ++x) span[x].finish(int(d));
      }
      at::native::cpublas::brgemm_release(true);  // the tiles back, torch's record of the thread's setup cleared
    });
  }
  return {out, lse};
}

// y [M, N] = x [M, K] @ w [N, K]ᵀ (+ bias [N]), bfloat16, on AMX tiles: a decode step's linear layers, reading the
// weight as it lies (no reordered copy). The weight's rows are the A tile (16 output features x 32 input channels a
// tile, at the weight's row stride: no transpose), x the B tile (per 32 channels, 16 rows of channel pairs x 16 rows
// of x, packed once a call by transposing its 32-bit words), so that a tile product gives 16 features x 16 rows of
// x, transposed in registers on the way out. Every output is a sum in float32, in the order of the channels whatever
// M is (a row's result does not depend on the other rows), rounded once to bfloat16 after the bias is added. A thread
// takes a contiguous run of 32-feature blocks (one stretch of the weight's memory, which the hardware prefetchers
// stream) and runs every 32 rows of x over a block in turn, the block cached. K: a multiple of 32; N: of 16.
// Epilogues (AmxOut): the bfloat16 y; float32 y, each the bfloat16 result widened (what `.float()` of the bfloat16
// y gives, without its pass over y: the LM head's logits); or SiLU-and-multiply of a gate-up weight [2I, K], whose
// blocks pair 16 gate features with the same 16 up features (I apart in the weight), each rounded to bfloat16 as
// the product's y, then silu(gate) * up rounded as `silu_and_mul` rounds it: y [M, I], its bits.
// x: bfloat16 rows [M, K], or the paged kernel's float32 output per head [M, H, d] (d a multiple of 32, any row and
// head strides), each value rounded to bfloat16 as `flatten_heads` rounds it while it is packed. A weight in the
// tiles' pair layout (the linear layers', layers/linear.py's `pair_weight`) runs the other way round, the same bits
// (`amx_product_paired`): x's rows the A tiles, the weight's tiles the B tiles, no packing and no transposes.
enum class AmxOut { kBFloat16, kFloat, kSiluMul };

namespace {
// A block's sums over kb 32-channel steps: tiles 0 and 1 the weight's two 16-feature tiles (w0, w1; `w_step` bytes a
// step apart, rows `w_stride` apart), 2 and 3 the two 16-row groups' tiles (r0, r1; likewise), sums 4 (w0, r0),
// 5 (w1, r0), 6 (w0, r1), 7 (w1, r1) stored to acc[0..3]. RowsAsA: the rows the A tiles (sums 16 rows x 16 features:
// a weight in the tiles' pair layout), else the weight's rows (16 features x 16 rows: the weight as it lies)
template <bool RowsAsA>
inline void tile_block(int64_t kb, const char* w0, const char* w1, int64_t w_step, int64_t w_stride, const char* r0,
                       const char* r1, int64_t r_step, int64_t r_stride, bool two, bool g2, float (*acc)[256]) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = 0; c < kb; ++c) {
    _tile_loadd(0, w0 + c * w_step, w_stride);
    _tile_loadd(2, r0 + c * r_step, r_stride);
    if constexpr (RowsAsA) _tile_dpbf16ps(4, 2, 0); else _tile_dpbf16ps(4, 0, 2);
    if (two) {
      _tile_loadd(1, w1 + c * w_step, w_stride);
      if constexpr (RowsAsA) _tile_dpbf16ps(5, 2, 1); else _tile_dpbf16ps(5, 1, 2);
    }
    if (g2) {
      _tile_loadd(3, r1 + c * r_step, r_stride);
      if constexpr (RowsAsA) _tile_dpbf16ps(6, 3, 0); else _tile_dpbf16ps(6, 0, 3);
      if (two) {
        if constexpr (RowsAsA) _tile_dpbf16ps(7, 3, 1); else _tile_dpbf16ps(7, 1, 3);
      }
    }
  }
  _tile_stored(4, acc[0], 64);
  _tile_stored(5, acc[1], 64);
  _tile_stored(6, acc[2], 64);
  _tile_stored(7, acc[3], 64);
}

// One row's 16 or 32 results of an AMX product (lo: features n0.., hi: n0 + 16.. or, for SiLU, the up features), the
// bias already added, stored as the mode asks: rounded once to bfloat16 (out); rounded to bfloat16 and widened to
// float32 (outf); or SiLU-and-multiply of the gate and up values the bfloat16 product would hold, with
// silu_and_mul_rows' arithmetic (out, 16 features)
inline void store_result_row(__m512 lo, __m512 hi, AmxOut mode, bool two, uint16_t* out, float* outf) {
  const auto rounded = [](__m512 v) {  // the bfloat16 result, widened back (its bits in the upper half)
    const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  };
  if (mode == AmxOut::kSiluMul) {
    const __m512 act = widen_bf16_16(bf16_bits16(silu16(rounded(lo))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_bits16(_mm512_mul_ps(act, rounded(hi))));
  } else if (mode == AmxOut::kFloat) {
    _mm512_storeu_ps(outf, rounded(lo));
    if (two) _mm512_storeu_ps(outf + 16, rounded(hi));
  } else if (two) {
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  }
}

// x's rows as B tiles: [mg][kb][16 channel pairs][16 rows] 32-bit words, rows past M zero
at::Tensor amx_pack_rows(const at::Tensor& x, int64_t M, int64_t K) {
  const int64_t kb = K / 32, mg = (M + 15) / 16;
  auto xb = at::empty({mg * kb * 256}, x.options().dtype(at::kInt));
  auto* xbd = reinterpret_cast<float*>(xb.data_ptr());
  const bool heads = x.dim() == 3;
  const char* base = reinterpret_cast<const char*>(x.data_ptr());
  const int64_t s0 = x.stride(0) * x.element_size(), s1 = heads ? x.stride(1) * 4 : 0, d = heads ? x.size(2) : 0;
  const auto row_chunk = [&](int64_t row, int64_t c) -> __m512 {  // channels 32c..32c+31 of a row as 16 words
    if (!heads) return _mm512_loadu_ps(reinterpret_cast<const float*>(base + row * s0) + c * 16);
    const float* src = reinterpret_cast<const float*>(base + row * s0 + (c * 32 / d) * s1) + (c * 32) % d;
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_bits16(_mm512_loadu_ps(src))),
                                            bf16_bits16(_mm512_loadu_ps(src + 16)), 1);
    return _mm512_castsi512_ps(both);
  };
  at::parallel_for(0, mg * kb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / kb, c = i % kb, rows = std::min<int64_t>(16, M - g * 16);
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) r[j] = j < rows ? row_chunk(g * 16 + j, c) : _mm512_setzero_ps();
      tiled::transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_store_ps(xbd + (i * 16 + p) * 16, r[p]);
    }
  });
  return xb;
}

// x's rows as A tiles: bfloat16 rows of K channels, `stride` bytes apart, 16 rows a group; `group(g)` where group g
// starts. Bfloat16 rows are read where they lie, but for a last group shorter than 16 rows, which is copied with its
// rows past M zero (the tiles load 16); the heads' float32 output is copied whole, rounded to bfloat16 as
// `flatten_heads` rounds it.
struct RowTiles {
  const char* base;
  const char* last;  // a copy of the last group, or null where it is whole or the base is a copy
  int64_t stride, groups;
  std::vector<uint16_t> copy;

  RowTiles(const at::Tensor& x, int64_t M, int64_t K) : groups((M + 15) / 16) {
    const bool heads = x.dim() == 3;
    const char* xd = reinterpret_cast<const char*>(x.data_ptr());
    const int64_t s0 = x.stride(0) * x.element_size();
    if (!heads) {
      base = xd;
      stride = s0;
      last = nullptr;
      if (M % 16) {  // the last group's rows at the same stride, the rest zero
        copy.assign(16 * s0 / 2, 0);
        for (int64_t m = (groups - 1) * 16; m < M; ++m) {
          std::memcpy(copy.data() + (m % 16) * s0 / 2, xd + m * s0, K * 2);
        }
        last = reinterpret_cast<const char*>(copy.data());
      }
      return;
    }
    const int64_t s1 = x.stride(1) * 4, d = x.size(2);
    copy.assign(groups * 16 * K, 0);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* row = copy.data() + m * K;
      for (int64_t c = 0; c < K; c += 16) {
        const float* src = reinterpret_cast<const float*>(xd + m * s0 + (c / d) * s1) + c % d;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + c), bf16_bits16(_mm512_loadu_ps(src)));
      }
    }
    base = reinterpret_cast<const char*>(copy.data());
    stride = K * 2;
    last = nullptr;
  }
  const char* group(int64_t g) const { return last && g == groups - 1 ? last : base + g * 16 * stride; }
};
}  // namespace


// `amx_product` from a weight in the tiles' pair layout: x's rows as the A tiles (`RowTiles`), the weight's as the B
// tiles, so that a tile of sums holds 16 rows x 16 features and each row's features come out as they lie, with no
// transpose. A tile product sums the same pairs of products in the same order whichever operand is A: the bits of the
// weight as it lies (tests/test_linear.py holds the two against each other). Each feature block: two tiles of 16
// features (n0, n1: for SiLU the gate's and the up's), with each pair of row groups.
at::Tensor amx_product_paired(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                              AmxOut mode, int64_t M, int64_t K, int64_t N, at::Tensor& y) {
  const bool silu = mode == AmxOut::kSiluMul;
  const int64_t kb = K / 32, mg = (M + 15) / 16, out_n = silu ? N / 2 : N;
  const RowTiles rows_of(x, M, K);
  const char* wd = reinterpret_cast<const char*>(w.data_ptr());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr());
  auto* yf = reinterpret_cast<float*>(y.data_ptr());
  const auto* bd = bias ? reinterpret_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
  const int64_t tile_bytes = 1024, t_bytes = kb * tile_bytes;  // a B tile; a tile of features' K steps
  const int64_t blocks = silu ? out_n / 16 : (N + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    tiled::TileScope scope(true);
    alignas(64) float acc[4][256];  // [row half x 2 + feature half]: 16 rows x 16 features
    // rows a chunk of up to 16 groups (up to 1 MiB of rows) at a time, each chunk across the thread's blocks: a
    // chunk's rows stay in L2 while the blocks' weights pass (a 2,048-row prompt chunk's 2.4 MB of rows re-read from
    // L3 for every 32 features ran 1.6-2.6x slower than oneDNN)
    const int64_t chunk_groups = std::clamp<int64_t>((1 << 20) / (16 * K * 2) / 2 * 2, 2, 16);
    for (int64_t r0 = 0; r0 < mg; r0 += chunk_groups)
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = silu ? blk * 16 : blk * 32, n1 = silu ? out_n + blk * 16 : n0 + 16;
      const bool two = n1 < N;
      const char* w0 = wd + (n0 / 16) * t_bytes;
      const char* w1 = wd + (n1 / 16) * t_bytes;
      __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
      if (bd) {
        bias_lo = tiled::load16f(bd + n0, 0xFFFF);
        if (two) bias_hi = tiled::load16f(bd + n1, 0xFFFF);
      }
      for (int64_t g = r0; g < std::min(mg, r0 + chunk_groups); g += 2) {
        const bool g2 = g + 1 < mg;
        tile_block<true>(kb, w0, w1, tile_bytes, 64, rows_of.group(g), g2 ? rows_of.group(g + 1) : nullptr, 64,
                         rows_of.stride, two, g2, acc);
        for (int64_t h = 0; h < (g2 ? 2 : 1); ++h) {
          const int64_t m0 = (g + h) * 16, rows = std::min<int64_t>(16, M - m0);
          for (int64_t r = 0; r < rows; ++r) {
            store_result_row(_mm512_add_ps(_mm512_load_ps(acc[2 * h] + r * 16), bias_lo),
                             _mm512_add_ps(_mm512_load_ps(acc[2 * h + 1] + r * 16), bias_hi), mode, two,
                             yd + (m0 + r) * (silu ? out_n : N) + n0, yf + (m0 + r) * N + n0);
          }
        }
      }
    }
  });
  return y;
}

at::Tensor amx_product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, AmxOut mode) {
  TORCH_CHECK(tiled::tiles_permitted(), "the AMX tiles' state was refused by the system");
  const bool heads = x.dim() == 3, paired = paired_weight(w);
  TORCH_CHECK((w.dim() == 2 || paired) && (x.dim() == 2 || heads),
              "amx_linear: x [M, K] (or [M, H, d]) and w [N, K] (or in the tiles' pair layout [N / 16, K / 32, 16, 32])");
  const int64_t M = x.size(0), K = heads ? x.size(1) * x.size(2) : x.size(1);
  const int64_t N = paired ? w.size(0) * 16 : w.size(0), kb = K / 32, wk = paired ? w.size(1) * 32 : w.size(1);
  TORCH_CHECK(K == wk, "amx_linear: x's features (", K, ") are not w's (", wk, ")");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && x.scalar_type() == (heads ? at::kFloat : at::kBFloat16),
              "amx_linear: a bfloat16 w and x (or float32 heads)");
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "amx_linear: K a multiple of 32 and N of 16");
  TORCH_CHECK(heads ? (x.stride(2) == 1 && x.size(2) % 32 == 0) : (x.stride(1) == 1 && x.stride(0) % 2 == 0),
              "amx_linear: rows contiguous (heads: channels contiguous, a multiple of 32 a head)");
  TORCH_CHECK(w.is_contiguous(), "amx_linear: a contiguous w");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                        bias->scalar_type() == at::kBFloat16), "amx_linear: a bfloat16 bias [N]");
  const bool silu = mode == AmxOut::kSiluMul, float_out = mode == AmxOut::kFloat;
  TORCH_CHECK(!silu || N % 32 == 0, "amx_linear_silu: 2I gate-up features, I a multiple of 16");
  const int64_t out_n = silu ? N / 2 : N;
  auto y = at::empty({M, out_n}, w.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  if (paired) return amx_product_paired(x, w, bias, mode, M, K, N, y);
  const auto xb = amx_pack_rows(x, M, K);
  const auto* xbd = reinterpret_cast<const float*>(xb.data_ptr());
  const int64_t mg = (M + 15) / 16;
  const char* wd = reinterpret_cast<const char*>(w.data_ptr());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr());
  auto* yf = reinterpret_cast<float*>(y.data_ptr());
  const auto* bd = bias ? reinterpret_cast<const c10::BFloat16*>(bias->data_ptr()) : nullptr;
  const int64_t wrow = K * 2;
  // a block: the features of its two A tiles (n0 and n1) and the output column its results start at
  const int64_t blocks = silu ? out_n / 16 : (N + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    tiled::TileScope scope(true);
    alignas(64) float acc[4][256];  // [feature half + 2 x row half]: 16 features x 16 rows
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = silu ? blk * 16 : blk * 32, n1 = silu ? out_n + blk * 16 : n0 + 16;
      const bool two = n1 < N;
      const char* w0 = wd + n0 * wrow;
      const char* w1 = wd + n1 * wrow;
      __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
      if (bd) {
        bias_lo = tiled::load16f(bd + n0, 0xFFFF);
        if (two) bias_hi = tiled::load16f(bd + n1, 0xFFFF);
      }
      for (int64_t g = 0; g < mg; g += 2) {
        const bool g2 = g + 1 < mg;
        const float* b0 = xbd + g * kb * 256;
        const float* b1 = b0 + kb * 256;
        tile_block<false>(kb, w0, w1, 64, wrow, reinterpret_cast<const char*>(b0), reinterpret_cast<const char*>(b1),
                          1024, 64, two, g2, acc);
        for (int64_t h = 0; h < (g2 ? 2 : 1); ++h) {
          __m512 lo[16], hi[16];
          for (int j = 0; j < 16; ++j) {
            lo[j] = _mm512_load_ps(acc[2 * h] + j * 16);
            hi[j] = _mm512_load_ps(acc[2 * h + 1] + j * 16);
          }
          tiled::transpose16(lo);  // now lo[r]: row r's 16 features
          if (two) tiled::transpose16(hi);
          const int64_t m0 = (g + h) * 16, rows = std::min<int64_t>(16, M - m0);
          for (int64_t r = 0; r < rows; ++r) {
            store_result_row(_mm512_add_ps(lo[r], bias_lo), _mm512_add_ps(hi[r], bias_hi), mode, two,
                             yd + (m0 + r) * (silu ? out_n : N) + n0, yf + (m0 + r) * N + n0);
          }
        }
      }
    }
  });
  return y;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      bool float_out) {
  return amx_product(x, w, bias, float_out ? AmxOut::kFloat : AmxOut::kBFloat16);
}

// A weight in the tiles' pair layout back as [N, K] (a copy, for the products that run from it: torch's linear on
// many rows): each 32-channel step of 16 features is a 16 x 16 transpose of 32-bit words (channel pairs)
at::Tensor amx_plain_weight(const at::Tensor& wp) {
  TORCH_CHECK(paired_weight(wp) && wp.is_contiguous() && wp.scalar_type() == at::kBFloat16,
              "amx_plain_weight: a contiguous bfloat16 weight in the tiles' pair layout [N / 16, K / 32, 16, 32]");
  const int64_t T = wp.size(0), C = wp.size(1), K = C * 32;
  auto w = at::empty({T * 16, K}, wp.options());
  const auto* src = reinterpret_cast<const float*>(wp.data_ptr());  // 32-bit words: a channel pair each
  auto* dst = reinterpret_cast<float*>(w.data_ptr());
  at::parallel_for(0, T * C, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / C, c = i % C;
      __m512 r[16];
      for (int p = 0; p < 16; ++p) r[p] = _mm512_loadu_ps(src + (i * 16 + p) * 16);  // [p][n]
      tiled::transpose16(r);  // r[n]: feature n's 16 channel pairs
      for (int n = 0; n < 16; ++n) _mm512_storeu_ps(dst + (t * 16 + n) * (K / 2) + c * 16, r[n]);
    }
  });
  return w;
}

// silu_and_mul(amx_linear(x, w, bias)) in one pass, the same bits: a gate-up weight [2I, K] (I a multiple of 16)
at::Tensor amx_linear_silu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return amx_product(x, w, bias, AmxOut::kSiluMul);
}
#else
bool amx_ready() { return false; }

std::vector<at::Tensor> amx_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool, int64_t) {
  TORCH_CHECK(false, "amx_attention: this build has no AMX path (the CPU or compiler lacks AMX tiles)");
  return {};
}

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "amx_linear: this build has no AMX path (the CPU or compiler lacks AMX tiles)");
  return {};
}

at::Tensor amx_plain_weight(const at::Tensor&) {
  TORCH_CHECK(false, "amx_plain_weight: this build has no AMX path (the CPU or compiler lacks AMX tiles)");
  return {};
}

at::Tensor amx_linear_silu(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_linear_silu: this build has no AMX path (the CPU or compiler lacks AMX tiles)");
  return {};
}
#endif

// A weight's output features, as it lies [N, K] or in the tiles' pair layout [N / 16, K / 32, 16, 32]
inline int64_t linear_features(const at::Tensor& w) { return paired_weight(w) ? w.size(0) * 16 : w.size(0); }

// A Llama-family decode step's layers in one call (models/decode_program.py's `DecodeProgram`, where every product
// takes the AMX tiles): per layer the residual add and RMSNorm, the QKV product, Qwen3's per-head norms where given,
// the rotary embedding, the cache write, the paged kernel, the output's conversion, the output product (its bias
// added apart, as a row-parallel layer adds it), the residual add and RMSNorm, the MLP's products around
// SiLU-and-multiply: the calls the layers' modules make for such a step, in their order, so the same bits. Two pairs
// of them run as one pass where the shapes let them: the output's conversion inside the output product's packing of
// its rows, and SiLU-and-multiply in the gate-up product's epilogue (`amx_product`: the heads' output, and the gate
// and up values, as they lie in the core that made them, no pass of their own over them). Run from
// Python the calls are the same but each comes back to an interpreter whose code and data the kernels' streams of
// keys, values and weights have evicted from the core's caches (the first operator after a paged-kernel call took 40
// us where it takes 2-4): here they follow each other directly. weights: kLayerWeights a layer (absent ones None);
// x [t, D] the embedded tokens; returns the states before the final norm (the last layer's output plus its residual).
constexpr int64_t kLayerWeights = 12;  // in norm, post norm, qkv w, qkv b, o w, o b, gate_up w, gate_up b,
                                       // down w, down b, q norm, k norm

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<c10::optional<at::Tensor>>& weights,
                         const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& row_seq,
                         const at::Tensor& row_lens, int64_t block_size, double scale, int64_t hq, int64_t hk,
                         int64_t d, double eps, bool tiles) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(x_in.dim() == 2 && static_cast<int64_t>(weights.size()) == layers * kLayerWeights &&
                  static_cast<int64_t>(value_caches.size()) == layers,
              "decode_layers: x [t, D], ", kLayerWeights, " weights and a key and value cache a layer");
  const auto need = [&](int64_t l, int64_t i) -> const at::Tensor& {
    const auto& w = weights[l * kLayerWeights + i];
    TORCH_CHECK(w.has_value(), "decode_layers: layer ", l, " lacks weight ", i);
    return *w;
  };
  const int64_t t = x_in.size(0);
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  at::Tensor x = x_in, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const auto* w = &weights[l * kLayerWeights];
    at::Tensor h;
    if (!residual.defined()) {  // the first layer: its input is the residual stream
      h = rms_norm(x, need(l, 0), eps);
      residual = x;
    } else {
      auto hr = add_rms_norm(x, residual, need(l, 0), eps);
      h = hr[0];
      residual = hr[1];
    }
    const at::Tensor qkv = amx_linear(h, need(l, 2), w[3], false);
    at::Tensor q = qkv.narrow(1, 0, hq * d).view({t, hq, d});
    at::Tensor k = qkv.narrow(1, hq * d, hk * d).view({t, hk, d});
    const at::Tensor v = qkv.narrow(1, (hq + hk) * d, hk * d).view({t, hk, d});
    if (w[10].has_value()) {
      q = rms_norm(q, *w[10], eps);
      k = rms_norm(k, need(l, 11), eps);
    }
    q = rotary(q, cos, sin, false);
    k = rotary(k, cos, sin, false);
    write_kv(key_caches[l], value_caches[l], slots, k, v);
    const at::Tensor packed = paged_attention(q, key_caches[l], value_caches[l], block_tables, row_seq, row_lens,
                                              block_size, scale, 1.0, 1.0, 0, false, true, tiles);
    // the heads' float32 output packed for the tiles as it lies, rounded as flatten_heads rounds it
    at::Tensor y = d % 32 == 0 && bf16 ? amx_linear(packed.narrow(2, 0, d), need(l, 4), c10::nullopt, false)
                                        : amx_linear(flatten_heads(packed.narrow(2, 0, d), bf16), need(l, 4),
                                                     c10::nullopt, false);
    if (w[5].has_value()) y = at::add(y, *w[5]);
    auto hr = add_rms_norm(y, residual, need(l, 1), eps);
    residual = hr[1];
    const at::Tensor act = linear_features(need(l, 6)) % 32 == 0 ? amx_linear_silu(hr[0], need(l, 6), w[7])
                                                         : silu_and_mul(amx_linear(hr[0], need(l, 6), w[7], false));
    x = amx_linear(act, need(l, 8), c10::nullopt, false);
    if (w[9].has_value()) x = at::add(x, *w[9]);
  }
  return residual.defined() ? at::add(x, residual) : x;
}

// The computing calls run with Python's lock released, as PyTorch's own operators do: their arguments are converted
// before it is let go and their results after it is taken back, and none of them touches a Python object, so that the
// server's event loop (in the same process as rank 0's engine loop) runs while a kernel does, not only between calls.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  m.def("parallel_threads", &parallel_threads, "Threads at::parallel_for runs n items on");
  m.def("paged_attention", &paged_attention, "Paged attention with LSE over kvshard's KV cache (CPU)", unlocked);
  m.def("rms_norm", &rms_norm, "RMSNorm with float32 statistics, fused (CPU)", unlocked);
  m.def("add_rms_norm", &add_rms_norm, "x + residual and its RMSNorm, fused (CPU)", unlocked);
  m.def("flatten_heads", &flatten_heads, "[t, H, d] float32 -> [t, H * d] in float32 or bfloat16 (CPU)", unlocked);
  m.def("row_argmax", &row_argmax, "Each row's first maximum, or first NaN, of float32 logits (CPU)", unlocked);
  m.def("write_kv", &write_kv, "A step's keys and values into their cache slots, one call (CPU)", unlocked);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up, fused (CPU)", unlocked);
  m.def("rotary", &rotary, "Rotary embedding of [t, h, d] by [t, d / 2] angles, fused (CPU)", unlocked);
  m.def("merge_states", &merge_states, "Partial attentions merged by their LSE, fused (CPU)", unlocked);
  m.def("merge_stacked", &merge_stacked, "merge_states of parts stacked along a first dimension (CPU)", unlocked);
  m.def("decode_layers", &decode_layers, "A Llama-family decode step's layers in one call (CPU, AMX products)",
        unlocked);
  m.def("amx_ready", &amx_ready, "Whether this build has the AMX path and the system gave the process the tiles");
  m.def("amx_attention", &amx_attention,
        "Attention with LSE of bfloat16 rows on AMX tiles (CPU; head size 32, 64 or 128)", unlocked);
  m.def("amx_linear_silu", &amx_linear_silu, "silu_and_mul(amx_linear(x, w, bias)) of a gate-up weight, one pass (CPU)",
        unlocked);
  m.def("amx_linear", &amx_linear,
        "x @ w.T (+ bias) of bfloat16 rows on AMX tiles from the weight as it lies or in the tiles' pair layout (CPU)",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("float_out") = false, unlocked);
  m.def("amx_plain_weight", &amx_plain_weight, "A weight in the AMX tiles' pair layout back as [N, K] (CPU)", unlocked);
  m.def("moe_select", &moe_select, "The experts a token's router picks from its scores, and their weights (CPU)",
        unlocked);
  m.def("moe_experts", &moe_experts, "The routed experts of one MoE layer: sorted, gathered, ATen's products (CPU)",
        unlocked);
#if defined(KVSHARD_TILED)
  m.attr("tiled") = true;
#else
  m.attr("tiled") = false;
#endif
}
