// Compiled with -O3 -fopenmp -fno-trapping-math (CMakeLists.txt), no -ffast-math: NaN propagates.
// On AVX2 each row runs in intrinsics, its last partial vector through masked loads and stores
// (so every element of a row takes the same arithmetic); elsewhere in plain loops with std::exp.
// Rows are independent and each is summed in one fixed order, so the results do not depend on
// the thread count.
#include "core/kernels/softmax_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core/kernels/simd.h"

namespace tessel::kernels::cpu {
namespace {

int64_t keys(const ScoreRows& rows, int64_t r) {
  return rows.causal ? std::min(rows.n, r % rows.m + 1) : rows.n;
}

// One head's problem: m queries, n keys (n_pad: rounded up to 8, the probabilities' row length),
// head size d (a multiple of 8), m_pad the queries rounded up to 8.
struct HeadShape {
  int64_t m, n, d, n_pad, m_pad;
  bool causal;
  float scale;
};

#if TESSEL_AVX2_LOOPS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

// Lanes [0, k) of a vector set, k in [0, 8].
inline __m256i first_lanes(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void softmax_row(float* x, int64_t len, int64_t n, float scale) {
  const int64_t full = len / 8 * 8;
  const __m256i tail = first_lanes(len - full);
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = lowest;
  for (int64_t j = 0; j < full; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
  if (full < len)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(lowest, _mm256_maskload_ps(x + full, tail),
                                            _mm256_castsi256_ps(tail)));
  const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-scale * hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = simd::exp8(_mm256_fmadd_ps(_mm256_loadu_ps(x + j), sc, shift));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (full < len) {
    const __m256 e =
        _mm256_and_ps(simd::exp8(_mm256_fmadd_ps(_mm256_maskload_ps(x + full, tail), sc, shift)),
                      _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(x + full, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t j = 0; j < full; j += 8)
    _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), inv));
  if (full < len)
    _mm256_maskstore_ps(x + full, tail, _mm256_mul_ps(_mm256_maskload_ps(x + full, tail), inv));
  std::fill(x + len, x + n, 0.0f);
}

void softmax_backward_row(const float* p, float* dp, int64_t len, int64_t n, float scale) {
  const int64_t full = len / 8 * 8;
  const __m256i tail = first_lanes(len - full);
  __m256 dot = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8)
    dot = _mm256_fmadd_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(dp + j), dot);
  if (full < len)
    dot = _mm256_fmadd_ps(_mm256_maskload_ps(p + full, tail), _mm256_maskload_ps(dp + full, tail),
                          dot);
  const __m256 delta = _mm256_set1_ps(hsum(dot)), sc = _mm256_set1_ps(scale);
  auto grad = [&](__m256 pv, __m256 dv) {
    return _mm256_mul_ps(_mm256_mul_ps(pv, sc), _mm256_sub_ps(dv, delta));
  };
  for (int64_t j = 0; j < full; j += 8)
    _mm256_storeu_ps(dp + j, grad(_mm256_loadu_ps(p + j), _mm256_loadu_ps(dp + j)));
  if (full < len)
    _mm256_maskstore_ps(
        dp + full, tail,
        grad(_mm256_maskload_ps(p + full, tail), _mm256_maskload_ps(dp + full, tail)));
  std::fill(dp + len, dp + n, 0.0f);
}

inline int64_t round8(int64_t x) { return (x + 7) / 8 * 8; }

// Rows per register tile of dots and weighted: 6 rows × 16 columns, 12 accumulators (two FMAs a
// cycle, five cycles each, need ten in flight).
constexpr int kTile = 6;

// s[r][j] = sum_k x[r][k]·yt[k][j] for rows r < R and j < jend (a multiple of 8): R query rows
// (d contiguous floats each) against yt [d][ld] (keys transposed), up to kTile×16 outputs per
// register tile.
template <int R>
void dots(const float* const* x, const float* yt, int64_t ld, int64_t d, int64_t jend, float* s,
          int64_t lds) {
  int64_t j = 0;
  for (; j + 16 <= jend; j += 16) {
    __m256 a[R][2];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < d; ++k) {
      const __m256 y0 = _mm256_loadu_ps(yt + k * ld + j), y1 = _mm256_loadu_ps(yt + k * ld + j + 8);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x[r] + k);
        a[r][0] = _mm256_fmadd_ps(xv, y0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(xv, y1, a[r][1]);
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * lds + j, a[r][0]);
      _mm256_storeu_ps(s + r * lds + j + 8, a[r][1]);
    }
  }
  if (j < jend) {  // 8 left
    __m256 a[R];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < d; ++k) {
      const __m256 y0 = _mm256_loadu_ps(yt + k * ld + j);
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) a[r] =
          _mm256_fmadd_ps(_mm256_broadcast_ss(x[r] + k), y0, a[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + r * lds + j, a[r]);
  }
}

void dots_rows(const float* const* x, int rows, const float* yt, int64_t ld, int64_t d,
               int64_t jend, float* s, int64_t lds) {
  switch (rows) {
    case 6:
      return dots<6>(x, yt, ld, d, jend, s, lds);
    case 5:
      return dots<5>(x, yt, ld, d, jend, s, lds);
    case 4:
      return dots<4>(x, yt, ld, d, jend, s, lds);
    case 3:
      return dots<3>(x, yt, ld, d, jend, s, lds);
    case 2:
      return dots<2>(x, yt, ld, d, jend, s, lds);
    default:
      return dots<1>(x, yt, ld, d, jend, s, lds);
  }
}

// out[r][c..c+8·NV) (+)= sum_{j in [lo, hi)} p[r][j]·z[j][c..]: R rows of weights over rows of z
// (d floats apart); weights outside a row's own range are exact zeros, so the union is summed.
template <int R, int NV>
void weighted_chunk(const float* const* p, int64_t lo, int64_t hi, const float* z, int64_t d,
                    int64_t c, float* const* out, bool accumulate) {
  __m256 a[R][NV];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) a[r][v] =
          accumulate ? _mm256_loadu_ps(out[r] + c + 8 * v) : _mm256_setzero_ps();
  for (int64_t j = lo; j < hi; ++j) {
    __m256 zv[NV];
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) zv[v] =
        _mm256_loadu_ps(z + j * d + c + 8 * v);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m256 pv = _mm256_broadcast_ss(p[r] + j);
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) a[r][v] =
          _mm256_fmadd_ps(pv, zv[v], a[r][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v)
          _mm256_storeu_ps(out[r] + c + 8 * v, a[r][v]);
}

// One register tile of weighted_chunk: `rows` rows (1-6) by nv vectors (1-2).
void weighted_tile(int rows, int nv, const float* const* p, int64_t lo, int64_t hi, const float* z,
                   int64_t ld, int64_t c, float* const* out, bool accumulate) {
  switch (rows * 2 + nv - 2) {
#define TESSEL_TILE(R)                                                 \
  case R * 2:                                                          \
    return weighted_chunk<R, 2>(p, lo, hi, z, ld, c, out, accumulate); \
  case R * 2 - 1:                                                      \
    return weighted_chunk<R, 1>(p, lo, hi, z, ld, c, out, accumulate);
    TESSEL_TILE(6)
    TESSEL_TILE(5)
    TESSEL_TILE(4)
    TESSEL_TILE(3)
    TESSEL_TILE(2)
    TESSEL_TILE(1)
#undef TESSEL_TILE
  }
}

// out rows (+)= the weighted sums of z's rows [.., d] (d a multiple of 8), 16 columns a tile.
void weighted_rows(int rows, const float* const* p, int64_t lo, int64_t hi, const float* z,
                   int64_t d, float* const* out, bool accumulate) {
  for (int64_t c = 0; c < d; c += 16)
    weighted_tile(rows, c + 16 <= d ? 2 : 1, p, lo, hi, z, d, c, out, accumulate);
}

// An 8×8 block: dst[c][r] = src[r][c].
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// dst[c][r] = src[r][c] for r < rows, c < cols (cols a multiple of 8).
void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
  const int64_t full = rows / 8 * 8;
  for (int64_t r = 0; r < full; r += 8)
    for (int64_t c = 0; c < cols; c += 8)
      transpose8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  for (int64_t r = full; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// Rows of one head as pointers: row i of a [rows, d] head at base + i·stride.
struct Rows {
  const float* base;
  int64_t stride;
  const float* at(int64_t i) const { return base + i * stride; }
};

// A block of up to R rows [i0, i0 + R) of x times yt into s (row stride lds), then each row's
// softmax (forward) or its backward against p.
void scores_block(const Rows& x, int64_t i0, int rows, const float* yt, const HeadShape& h,
                  float* s) {
  const float* xs[kTile];
  for (int r = 0; r < rows; ++r) xs[r] = x.at(i0 + r);
  const int64_t jend = h.causal ? std::min(h.n_pad, round8(i0 + rows)) : h.n_pad;
  dots_rows(xs, rows, yt, h.n_pad, h.d, jend, s + i0 * h.n_pad, h.n_pad);
}

int64_t head_keys(const HeadShape& h, int64_t i) { return h.causal ? i + 1 : h.n; }

// out rows [0, m) = w rows (row stride n_pad, row i's keys [0, head_keys(i))) times z [n, d].
void weigh_rows(const float* w, const HeadShape& h, const float* z, float* out,
                int64_t out_stride) {
  for (int64_t i0 = 0; i0 < h.m; i0 += kTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kTile, h.m - i0));
    const float* ws[kTile];
    float* outs[kTile];
    for (int r = 0; r < rows; ++r)
      ws[r] = w + (i0 + r) * h.n_pad, outs[r] = out + (i0 + r) * out_stride;
    weighted_rows(rows, ws, 0, head_keys(h, i0 + rows - 1), z, h.d, outs, false);
  }
}

// accᵀ [d][n_pad] += zᵀ w (the transpose of wᵀ z): z [m, d] rows `zs` apart, w [m, n_pad] (zeros
// past each row's keys); zt scratch [d][m_pad]. Both operands are read along their rows: z is the
// one transposed, [m, d] rather than w's [m, n_pad]. A block of keys [c, c + 16) sums the queries
// from c on when causal (the earlier ones do not see it).
void weigh_keys(const float* w, const HeadShape& h, const float* z, int64_t zs, float* zt,
                float* acc_t) {
  transpose(z, h.m, h.d, zs, zt, h.m_pad);
  for (int64_t c = 0; c < h.n_pad; c += 16) {
    const int64_t lo = h.causal ? c : 0;
    const int nv = c + 16 <= h.n_pad ? 2 : 1;
    for (int64_t r0 = 0; r0 < h.d; r0 += kTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kTile, h.d - r0));
      const float* zs_rows[kTile];
      float* outs[kTile];
      for (int r = 0; r < rows; ++r)
        zs_rows[r] = zt + (r0 + r) * h.m_pad, outs[r] = acc_t + (r0 + r) * h.n_pad;
      weighted_tile(rows, nv, zs_rows, lo, h.m, w, h.n_pad, c, outs, true);
    }
  }
}

// Per thread: what one key/value head's group needs, reused over its tasks.
struct Scratch {
  std::vector<float> kt, kc, vc, ds, zt, dkt, dvt, rows;
  explicit Scratch(const HeadShape& h) {
    kt.resize(h.d * h.n_pad), kc.resize(h.n * h.d), vc.resize(h.n * h.d);
    ds.resize(h.m * h.n_pad), zt.resize(h.d * h.m_pad), dkt.resize(h.d * h.n_pad);
    dvt.resize(h.d * h.n_pad), rows.resize(h.n_pad * h.d);
  }
};

const float* head_of(const HeadsConst& t, int64_t b, int64_t head) {
  return t.data + b * t.sb + head * t.sh;
}
float* head_of(const HeadsOut& t, int64_t b, int64_t head) {
  return t.data + b * t.sb + head * t.sh;
}

// [rows, d] rows of a head into contiguous memory, and back.
void gather(const float* src, int64_t stride, int64_t rows, int64_t d, float* dst) {
  for (int64_t i = 0; i < rows; ++i) std::copy(src + i * stride, src + i * stride + d, dst + i * d);
}
void scatter(const float* src, int64_t rows, int64_t d, float* dst, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) std::copy(src + i * d, src + i * d + d, dst + i * stride);
}

// zᵀ of a head's [n, d] rows: [d][n_pad], the padding keys 0.
void transposed(const float* z, int64_t stride, const HeadShape& h, float* zt) {
  transpose(z, h.n, h.d, stride, zt, h.n_pad);
  for (int64_t k = 0; k < h.d; ++k) std::fill(zt + k * h.n_pad + h.n, zt + (k + 1) * h.n_pad, 0.0f);
}

void forward_group(const AttentionDims& a, const HeadShape& h, int64_t b, int64_t kv,
                   const HeadsConst& q, const HeadsConst& k, const HeadsConst& v,
                   const HeadsOut& out, float* probs, Scratch& sc) {
  transposed(head_of(k, b, kv), k.ss, h, sc.kt.data());
  gather(head_of(v, b, kv), v.ss, h.n, h.d, sc.vc.data());
  const int64_t groups = a.heads / a.kv_heads;
  for (int64_t head = kv * groups; head < (kv + 1) * groups; ++head) {
    float* p = probs + (b * a.heads + head) * h.m * h.n_pad;
    const Rows rows{head_of(q, b, head), q.ss};
    for (int64_t i0 = 0; i0 < h.m; i0 += kTile) {
      const int count = static_cast<int>(std::min<int64_t>(kTile, h.m - i0));
      scores_block(rows, i0, count, sc.kt.data(), h, p);
      for (int64_t i = i0; i < i0 + count; ++i)
        softmax_row(p + i * h.n_pad, head_keys(h, i), h.n_pad, h.scale);
    }
    weigh_rows(p, h, sc.vc.data(), head_of(out, b, head), out.ss);
  }
}

void backward_group(const AttentionDims& a, const HeadShape& h, int64_t b, int64_t kv,
                    const HeadsConst& dout, const HeadsConst& q, const HeadsConst& k,
                    const HeadsConst& v, const float* probs, const HeadsOut& dq, const HeadsOut& dk,
                    const HeadsOut& dv, Scratch& sc) {
  transposed(head_of(v, b, kv), v.ss, h, sc.kt.data());  // vᵀ, for dP = dO·vᵀ
  gather(head_of(k, b, kv), k.ss, h.n, h.d, sc.kc.data());
  std::fill(sc.dkt.begin(), sc.dkt.end(), 0.0f);
  std::fill(sc.dvt.begin(), sc.dvt.end(), 0.0f);
  const int64_t groups = a.heads / a.kv_heads;
  for (int64_t head = kv * groups; head < (kv + 1) * groups; ++head) {
    const float* p = probs + (b * a.heads + head) * h.m * h.n_pad;
    const float* d_out = head_of(dout, b, head);
    weigh_keys(p, h, d_out, dout.ss, sc.zt.data(), sc.dvt.data());  // dVᵀ += dOᵀ·P
    float* ds = sc.ds.data();
    const Rows rows{d_out, dout.ss};
    for (int64_t i0 = 0; i0 < h.m; i0 += kTile) {  // dP = dO·Vᵀ, then dS
      const int count = static_cast<int>(std::min<int64_t>(kTile, h.m - i0));
      scores_block(rows, i0, count, sc.kt.data(), h, ds);
      for (int64_t i = i0; i < i0 + count; ++i)
        softmax_backward_row(p + i * h.n_pad, ds + i * h.n_pad, head_keys(h, i), h.n_pad, h.scale);
    }
    weigh_rows(ds, h, sc.kc.data(), head_of(dq, b, head), dq.ss);               // dQ = dS·K
    weigh_keys(ds, h, head_of(q, b, head), q.ss, sc.zt.data(), sc.dkt.data());  // dKᵀ += Qᵀ·dS
  }
  for (auto [acc_t, out] : {std::pair{sc.dkt.data(), &dk}, std::pair{sc.dvt.data(), &dv}}) {
    transpose(acc_t, h.d, h.n_pad, h.n_pad, sc.rows.data(), h.d);
    scatter(sc.rows.data(), h.n, h.d, head_of(*out, b, kv), out->ss);
  }
}
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {

void softmax_row(float* x, int64_t len, int64_t n, float scale) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < len; ++j) mx = std::max(mx, x[j]);
  float sum = 0;
  for (int64_t j = 0; j < len; ++j) sum += x[j] = std::exp(scale * (x[j] - mx));
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < len; ++j) x[j] *= inv;
  std::fill(x + len, x + n, 0.0f);
}

void softmax_backward_row(const float* p, float* dp, int64_t len, int64_t n, float scale) {
  float delta = 0;
  for (int64_t j = 0; j < len; ++j) delta += p[j] * dp[j];
  for (int64_t j = 0; j < len; ++j) dp[j] = scale * p[j] * (dp[j] - delta);
  std::fill(dp + len, dp + n, 0.0f);
}

}  // namespace baseline

// Rows per thread at least: a row is up to a few hundred elements, a fork costs microseconds.
constexpr int64_t kGrainRows = 64;

#if TESSEL_AVX2_LOOPS
HeadShape head_shape(const AttentionDims& a) {
  return {a.m, a.n, a.d, padded_keys(a.n), (a.m + 7) / 8 * 8, a.causal, a.scale};
}

// f(b, kv, scratch) for every key/value head of every batch row, split over the threads.
template <class F>
void over_groups(const AttentionDims& a, const F& f) {
  const auto h = head_shape(a);
  simd::over_threads(a.b * a.kv_heads, 1, 1, [&](int64_t first, int64_t end) {
    avx2::Scratch sc(h);
    for (int64_t t = first; t < end; ++t) f(h, t / a.kv_heads, t % a.kv_heads, sc);
  });
}
#endif

}  // namespace

int64_t padded_keys(int64_t n) { return (n + 7) / 8 * 8; }

bool head_loops_apply(int64_t d) { return simd::has_avx2_fma() && d % 8 == 0; }

#if TESSEL_AVX2_LOOPS
void attention_forward(const AttentionDims& a, const HeadsConst& q, const HeadsConst& k,
                       const HeadsConst& v, const HeadsOut& out, float* probs) {
  over_groups(a, [&](const HeadShape& h, int64_t b, int64_t kv, avx2::Scratch& sc) {
    avx2::forward_group(a, h, b, kv, q, k, v, out, probs, sc);
  });
}

void attention_backward(const AttentionDims& a, const HeadsConst& dout, const HeadsConst& q,
                        const HeadsConst& k, const HeadsConst& v, const float* probs,
                        const HeadsOut& dq, const HeadsOut& dk, const HeadsOut& dv) {
  over_groups(a, [&](const HeadShape& h, int64_t b, int64_t kv, avx2::Scratch& sc) {
    avx2::backward_group(a, h, b, kv, dout, q, k, v, probs, dq, dk, dv, sc);
  });
}
#else
// Reached only where head_loops_apply() is true, which it never is in a build without them.
void attention_forward(const AttentionDims&, const HeadsConst&, const HeadsConst&,
                       const HeadsConst&, const HeadsOut&, float*) {
  throw std::logic_error("attention_forward: head loops called where head_loops_apply() is false");
}

void attention_backward(const AttentionDims&, const HeadsConst&, const HeadsConst&,
                        const HeadsConst&, const HeadsConst&, const float*, const HeadsOut&,
                        const HeadsOut&, const HeadsOut&) {
  throw std::logic_error("attention_backward: head loops called where head_loops_apply() is false");
}
#endif

void softmax_rows(float* s, const ScoreRows& rows) {
  [[maybe_unused]] const bool vec = simd::has_avx2_fma();
  simd::over_threads(rows.count, kGrainRows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* x = s + r * rows.n;
#if TESSEL_AVX2_LOOPS
      if (vec) {
        avx2::softmax_row(x, keys(rows, r), rows.n, rows.scale);
        continue;
      }
#endif
      baseline::softmax_row(x, keys(rows, r), rows.n, rows.scale);
    }
  });
}

void softmax_backward_rows(const float* p, float* dp, const ScoreRows& rows) {
  [[maybe_unused]] const bool vec = simd::has_avx2_fma();
  simd::over_threads(rows.count, kGrainRows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t off = r * rows.n;
#if TESSEL_AVX2_LOOPS
      if (vec) {
        avx2::softmax_backward_row(p + off, dp + off, keys(rows, r), rows.n, rows.scale);
        continue;
      }
#endif
      baseline::softmax_backward_row(p + off, dp + off, keys(rows, r), rows.n, rows.scale);
    }
  });
}

}  // namespace tessel::kernels::cpu
