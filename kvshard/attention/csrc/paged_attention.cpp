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
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
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
  int64_t reach = 0;  // the furthest token any vector of the item sees within [t0, t1)
  for (int64_t r = 0; r < u.nrows; ++r) {
    const int64_t len = std::min<int64_t>(lens[u.row0 + r], t1);
    for (int64_t h = 0; h < u.nheads; ++h) {
      const int64_t m = r * u.nheads + h;
      bounds[m] = len;
      reach = std::max(reach, len);
      const QT* src = q + (u.row0 + r) * sh.q_row + (u.head0 + h) * sh.q_head;
      for (int64_t i = 0; i < dk; ++i) qf[m * dk + i] = static_cast<float>(src[i]) * sh.scale;
      mx[m] = kNegInf;
      sum[m] = 0.0f;
    }
  }
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

template <typename QT, typename CT>
void launch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
            const at::Tensor& row_seq, const at::Tensor& row_lens, const Shape& sh, int64_t split_tokens,
            at::Tensor& out) {
  const int64_t t = q.size(0);
  const int32_t* seqs = row_seq.data_ptr<int32_t>();
  const int32_t* lens = row_lens.data_ptr<int32_t>();
  const int64_t rep = sh.num_heads / sh.num_kv_heads;
  const int64_t head_chunk = std::min<int64_t>(rep, kMaxVectors);
  const int64_t rows_per_unit = std::max<int64_t>(1, kMaxVectors / head_chunk);

  std::vector<Unit> units;
  for (int64_t r = 0; r < t;) {
    int64_t e = r + 1;
    while (e < t && e - r < rows_per_unit && seqs[e] == seqs[r]) ++e;
    int64_t max_len = 0;
    for (int64_t i = r; i < e; ++i) max_len = std::max<int64_t>(max_len, lens[i]);
    for (int64_t kv = 0; kv < sh.num_kv_heads; ++kv) {
      for (int64_t h0 = 0; h0 < rep; h0 += head_chunk) {
        units.push_back({r, e - r, seqs[r], kv, kv * rep + h0, std::min(head_chunk, rep - h0), max_len});
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

  if (!split) {
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t i = begin; i < end; ++i) {
        const Unit& u = units[i];
        float* o = op + (u.row0 * H + u.head0) * P;
        run_item<QT, CT>(u, 0, u.max_len, sh, qp, kp, vp, tp, lens, lut, o, H * P, P, o + dv, H * P, P, scratch);
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
    std::vector<float> scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t ui = unit_of[it];
      const Unit& u = units[ui];
      const int64_t piece = it - first[ui], M = u.nrows * u.nheads;
      const int64_t base = offset[ui] + piece * M;
      run_item<QT, CT>(u, piece * split_tokens, std::min(u.max_len, (piece + 1) * split_tokens), sh, qp, kp, vp,
                       tp, lens, lut, part_o.data() + base * dv, u.nheads * dv, dv, part_l.data() + base, u.nheads,
                       1, scratch);
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
                    at::Tensor& out) {
  switch (kc.scalar_type()) {
    case at::kFloat: return launch<QT, float>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, out);
    case at::kBFloat16:
      return launch<QT, c10::BFloat16>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, out);
    case at::kHalf: return launch<QT, c10::Half>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, out);
    case at::kFloat8_e4m3fn:
      return launch<QT, c10::Float8_e4m3fn>(q, kc, vc, table, row_seq, row_lens, sh, split_tokens, out);
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
                                        double scale, double k_scale, double v_scale, int64_t split_tokens) {
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
      dispatch_cache<float>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens, out);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens,
                                    out);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(q, key_cache, value_cache, block_tables, row_seq, row_lens, sh, split_tokens, out);
      break;
    default: TORCH_CHECK(false, "paged_attention: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention with LSE over kvshard's KV cache (CPU)");
}
