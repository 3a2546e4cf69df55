// Fused CPU kernels for DeepSeek Sparse Attention (see glm5_mcore/kernels/__init__.py).
//
// What PyTorch ops cannot do on a CPU without materialising big intermediates:
// - glm5_indexer_topk: the indexer's ReLU(q·k) head-weighted scores of one query row at a time, kept
//   in a row buffer, and the deterministic top-k of that row (ties to the lower key index);
// - glm5_sparse_latent_fwd / _bwd: absorbed-MLA attention of each query over its selected latent
//   rows, read in place (no gathered [S, K, D] copy), flash-style backward from the saved lse;
// - glm5_sparse_latent_target / glm5_indexer_kl: the sparse training stage's indexer loss: the
//   attention target over each query's selected latent rows (heads summed), and the KL of the
//   indexer's softmax over the same keys against it, forward and gradients, selected key rows read
//   in place (no gathered [S, K, dI] or [S, K, D] copy).
// All math is fp32. Row-major contiguous arrays; index -1 = not selected. Threads split query rows;
// the backward's latent gradient is summed from per-thread buffers, so results do not depend on the
// thread count except through fp32 summation order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

using i64 = int64_t;
static const float NEG_INF = -std::numeric_limits<float>::infinity();

template <class F>
static void parallel_rows(i64 n, int nt, F f) {
  if (nt <= 1 || n < 64) {
    f(i64(0), n, 0);
    return;
  }
  i64 step = (n + nt - 1) / nt;
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t) {
    i64 a = t * step, b = std::min(n, a + step);
    if (a < b) th.emplace_back(f, a, b, t);
  }
  for (auto& x : th) x.join();
}

// Native vectors: 16 floats with AVX-512, 8 with AVX/AVX2, 4 otherwise (SSE2: any x86-64). A GCC
// vector wider than the registers is split into several and the register blocks below then spill,
// so every block is sized in native vectors per ISA. The caller pads the rows the vector kernels
// read to a multiple of 16 floats (a multiple of every W).
#if defined(__AVX512F__)
constexpr i64 W = 16;
#elif defined(__AVX__)
constexpr i64 W = 8;
#else
constexpr i64 W = 4;
#endif
typedef float V __attribute__((vector_size(W * 4)));
typedef float VU __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t Vi __attribute__((vector_size(W * 4)));
typedef float V4 __attribute__((vector_size(16)));
static inline V ld(const float* p) { return *(const VU*)p; }
static inline void st(float* p, V v) { *(VU*)p = v; }
static inline V splat(float x) { return V{} + x; }
// v folded to 4 lanes (lane i = sum of lanes i mod 4)
static inline V4 to4(V v) {
#if defined(__AVX512F__)
  typedef float V8 __attribute__((vector_size(32)));
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif defined(__AVX__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  return v;
#endif
}
static inline float hsum(V v) {
  const V4 b = to4(v);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
// (sum(a), sum(b), sum(c), sum(d)) with shared shuffles
static inline V4 hsum4(V a, V b, V c, V d) {
  const V4 a4 = to4(a), b4 = to4(b), c4 = to4(c), d4 = to4(d);
  const V4 x = __builtin_shufflevector(a4, b4, 0, 4, 1, 5) + __builtin_shufflevector(a4, b4, 2, 6, 3, 7);
  const V4 y = __builtin_shufflevector(c4, d4, 0, 4, 1, 5) + __builtin_shufflevector(c4, d4, 2, 6, 3, 7);
  return __builtin_shufflevector(x, y, 0, 1, 4, 5) + __builtin_shufflevector(x, y, 2, 3, 6, 7);
}

// a·b over n floats, n a multiple of W
static inline float vdot(const float* a, const float* b, i64 n) {
  V acc{};
  for (i64 c = 0; c < n; c += W) acc += ld(a + c) * ld(b + c);
  return hsum(acc);
}

// exp(x) on W lanes (Cephes expf: Cody-Waite reduction, degree-6 polynomial, ~2 ulp): 0 below
// -87.3 (so exp(-inf) = 0), x <= 88 assumed. Written with vector types: auto-vectorisation of a
// scalar exp is compiler-dependent.
static inline V vexp(V x) {
  const V lo = splat(-87.3f);
  const Vi under = x < lo;
  x = x < lo ? lo : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  V fx = __builtin_convertvector(__builtin_convertvector(t, Vi), V);
  fx = fx > t ? fx - 1.f : fx;  // floor
  V r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  V y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const Vi bits = (__builtin_convertvector(fx, Vi) + 127) << 23;
  y = y * (V)bits;
  return under ? V{} : y;
}

// log(x) on W lanes for x > 0 normal (Cephes logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)), degree-8
// polynomial, ~2 ulp); the callers pass x >= 1e-10.
static inline V vlog(V x) {
  const Vi bits = (Vi)x;
  Vi e = ((bits >> 23) & 0xff) - 126;
  V m = (V)((bits & 0x807fffff) | 0x3f000000);  // mantissa in [0.5, 1)
  const Vi small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.f : m - 1.f;
  const V z = m * m;
  V y = splat(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const V fe = __builtin_convertvector(e, V);
  y = y + fe * -2.12194440e-4f - 0.5f * z;
  return m + y + fe * 0.693359375f;
}

// Loads/stores of n < W trailing floats through a zero-padded vector.
static inline V ld_part(const float* p, i64 n) {
  V v{};
  for (i64 i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
static inline void st_part(float* p, V v, i64 n) {
  for (i64 i = 0; i < n; ++i) p[i] = v[i];
}

// p <- exp(p - m); returns the sum.
static float exp_shifted_sum(float* p, i64 N, float m) {
  V sum{};
  i64 j = 0;
  for (; j + W <= N; j += W) {
    const V e = vexp(ld(p + j) - m);
    st(p + j, e);
    sum += e;
  }
  if (j < N) {
    const i64 rest = N - j;
    V e = vexp(ld_part(p + j, rest) - m);
    for (i64 i = rest; i < W; ++i) e[i] = 0.f;
    st_part(p + j, e, rest);
    sum += e;
  }
  return hsum(sum);
}

// p <- exp(p) (p holds logit - lse), ds <- exp(p) * ds * scale (ds holds dP - delta): dS of softmax.
static void probs_and_dscores(float* p, float* ds, i64 N, float scale) {
  i64 x = 0;
  for (; x + W <= N; x += W) {
    const V e = vexp(ld(p + x));
    st(p + x, e);
    st(ds + x, e * ld(ds + x) * scale);
  }
  if (x < N) {
    const i64 rest = N - x;
    const V e = vexp(ld_part(p + x, rest));
    st_part(p + x, e, rest);
    st_part(ds + x, e * ld_part(ds + x, rest) * scale, rest);
  }
}

// y += a x over n floats, n a multiple of W
static inline void vaxpy(float* y, float a, const float* x, i64 n) {
  const V av = splat(a);
  for (i64 c = 0; c < n; c += W) st(y + c, ld(y + c) + av * ld(x + c));
}

// Order-preserving map of a float to uint32 (-0.0 counts as +0.0, as float comparison does).
static inline uint32_t okey(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct SelectScratch {
  std::vector<uint32_t> key, cand;
  std::vector<int32_t> at;
  std::vector<float> sample;
  uint32_t hist[4][2048];
  uint32_t total[2048];
};

// total[b] = #{i : (keys[i] >> sh) & width == b}; four interleaved counters break the store-to-load
// chain of runs of equal bins (scores cluster in a few exponents).
static void histogram(const uint32_t* keys, i64 n, int sh, uint32_t width, SelectScratch& sc) {
  std::memset(sc.hist, 0, sizeof(sc.hist));
  i64 i = 0;
  for (; i + 4 <= n; i += 4) {
    ++sc.hist[0][(keys[i] >> sh) & width];
    ++sc.hist[1][(keys[i + 1] >> sh) & width];
    ++sc.hist[2][(keys[i + 2] >> sh) & width];
    ++sc.hist[3][(keys[i + 3] >> sh) & width];
  }
  for (; i < n; ++i) ++sc.hist[0][(keys[i] >> sh) & width];
  for (uint32_t b = 0; b <= width; ++b) sc.total[b] = sc.hist[0][b] + sc.hist[1][b] + sc.hist[2][b] + sc.hist[3][b];
}

// The K-th largest of key[0:n) (K <= n) by radix select (11 + 11 + 10 bits, each later digit only
// over the keys left in the chosen bin); `need` = how many entries equal to it belong to the top K.
static uint32_t kth_largest(const uint32_t* key, i64 n, i64 K, i64& need, SelectScratch& sc) {
  if (n < 16384) {  // short inputs: 8-bit digits, one small table (clearing 4 x 2048 counters costs more)
    sc.cand.resize(n);
    uint32_t* cand = sc.cand.data();
    uint32_t hist[256];
    uint32_t prefix = 0, mask = 0;
    need = K;
    const uint32_t* keys = key;
    i64 nk = n;
    for (int sh = 24; sh >= 0; sh -= 8) {
      if (sh < 24) {
        i64 nc = 0;
        for (i64 i = 0; i < nk; ++i) {
          cand[nc] = keys[i];
          nc += (keys[i] & mask) == prefix;
        }
        keys = cand, nk = nc;
      }
      std::memset(hist, 0, sizeof(hist));
      for (i64 i = 0; i < nk; ++i) ++hist[(keys[i] >> sh) & 255u];
      int b = 255;
      while (hist[b] < need) need -= hist[b--];
      prefix |= uint32_t(b) << sh;
      mask |= 255u << sh;
    }
    return prefix;
  }
  const int shifts[3] = {21, 10, 0};
  const uint32_t widths[3] = {2047u, 2047u, 1023u};
  sc.cand.resize(n);
  uint32_t* cand = sc.cand.data();
  uint32_t prefix = 0, mask = 0;
  need = K;
  const uint32_t* keys = key;
  i64 nk = n;
  for (int pass = 0; pass < 3; ++pass) {
    if (pass > 0) {  // keep the keys of the chosen bin
      i64 nc = 0;
      for (i64 i = 0; i < nk; ++i) {
        cand[nc] = keys[i];
        nc += (keys[i] & mask) == prefix;
      }
      keys = cand, nk = nc;
    }
    histogram(keys, nk, shifts[pass], widths[pass], sc);
    int64_t b = widths[pass];
    while (sc.total[b] < need) need -= sc.total[b--];
    prefix |= uint32_t(b) << shifts[pass];
    mask |= widths[pass] << shifts[pass];
  }
  return prefix;
}

// Rows much longer than K: a strided sample of the row gives a threshold that, with a wide
// margin, about 2K entries clear; one pass keeps those (in index order) and the exact top-k is
// taken among them. Returns false (nothing written) when fewer than K clear it.
static bool select_row_sampled(const float* s, i64 L, i64 K, i64 base, i64* o, SelectScratch& sc) {
  constexpr i64 M = 256;
  sc.sample.resize(M);
  for (i64 i = 0; i < M; ++i) {
    const float x = s[(i * L) / M];
    sc.sample[i] = x == x ? x : NEG_INF;
  }
  const i64 r = std::min<i64>(M - 1, 2 * ((K * M + L - 1) / L) + 8);
  std::nth_element(sc.sample.begin(), sc.sample.begin() + r, sc.sample.end(), std::greater<float>());
  const float thr = sc.sample[r];
  if (!(thr > NEG_INF)) return false;
  sc.at.resize(L + 16);
  int32_t* at = sc.at.data();
  i64 nc = 0, c = 0;
#if defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(thr);
  __m512i cols = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; c + 16 <= L; c += 16) {
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + c), tv, _CMP_GE_OQ);
    _mm512_storeu_si512(at + nc, _mm512_maskz_compress_epi32(keep, cols));
    nc += __builtin_popcount(keep);
    cols = _mm512_add_epi32(cols, _mm512_set1_epi32(16));
  }
#endif
  for (; c < L; ++c) {
    at[nc] = int32_t(c);
    nc += s[c] >= thr;
  }
  if (nc < K) return false;
  sc.key.resize(nc);
  uint32_t* key = sc.key.data();
  for (i64 i = 0; i < nc; ++i) key[i] = okey(s[at[i]]);
  i64 need;
  const uint32_t kth = kth_largest(key, nc, K, need, sc);
  i64 m = 0;
  for (i64 i = 0; i < nc && m < K; ++i)
    if (key[i] > kth || (key[i] == kth && need-- > 0)) o[m++] = at[i] + base;
  return true;
}

// Top-k of s[l:h) (entries that are -inf or NaN are never chosen): every entry above the k-th
// largest value, then entries equal to it in index order. Writes ascending column+offset, then -1.
// O(h - l): a sampled threshold for long rows, else a radix select over the whole row.
static void select_row(const float* s, i64 l, i64 h, i64 K, i64 offset, i64* o, SelectScratch& sc) {
  const i64 L = std::max<i64>(h - l, 0);
  if (L >= 4 * K && L >= 1024 && select_row_sampled(s + l, L, K, l + offset, o, sc)) return;
  sc.key.resize(L);
  uint32_t* key = sc.key.data();
  i64 n = 0;  // finite or +inf entries; NaN gets key 0, below every candidate's, -inf its own (low) key
  for (i64 c = 0; c < L; ++c) {
    const float x = s[l + c];
    key[c] = x == x ? okey(x) : 0u;
    n += x > NEG_INF;
  }
  i64 m = 0;
  if (n <= K) {
    for (i64 c = 0; c < L; ++c)
      if (s[l + c] > NEG_INF) o[m++] = l + c + offset;
  } else {
    i64 need;
    const uint32_t kth = kth_largest(key, L, K, need, sc);
    for (i64 c = 0; c < L && m < K; ++c) {
      const uint32_t k = key[c];
      if (k > kth || (k == kth && need-- > 0)) o[m++] = l + c + offset;
    }
  }
  for (; m < K; ++m) o[m] = -1;
}

extern "C" {

// scores [R, ld]; row r chooses among columns [lo[r], hi[r]); out [R, K] (see select_row).
void glm5_topk_rows(const float* scores, i64 R, i64 ld, const i64* lo, const i64* hi, i64 K, i64 offset,
                    i64* out, int nt) {
  parallel_rows(R, nt, [&](i64 a, i64 b, int) {
    SelectScratch sc;
    for (i64 r = a; r < b; ++r) select_row(scores + r * ld, lo[r], hi[r], K, offset, out + r * K, sc);
  });
}

// Register block of the indexer: IR query rows x IV key vectors of accumulators (16 of the 32 zmm
// registers with AVX-512; 12 of the 16 ymm / xmm otherwise, leaving room for the key vectors).
#if defined(__AVX512F__)
constexpr i64 IR = 4, IV = 4;
#else
constexpr i64 IR = 6, IV = 2;
#endif
constexpr i64 KB = IV * W;  // keys per block (64 / 16 / 8: divides 64)

// q [S, nI, dI], kT [dI, Tp] (keys transposed, Tp a multiple of 64, zero beyond T), w [S, nI];
// row r scores keys [lo[r], hi[r]): I[c] = sum_h w[r,h] * relu(q[r,h]·k[c]); out [S, K] = the row's
// top-k (see select_row). Rows go in groups of IR over the union of their key ranges, keys in blocks
// of KB: IR x IV vector accumulators per head, each key vector loaded once for the IR rows.
void glm5_indexer_topk(const float* q, const float* kT, const float* w, i64 S, i64 nI, i64 dI, i64 Tp,
                       const i64* lo, const i64* hi, i64 K, i64* out, int nt) {
  constexpr i64 R = IR;
  const i64 groups = (S + R - 1) / R;
  parallel_rows(groups, nt, [&](i64 ga, i64 gb, int) {
    std::vector<float> rows(R * Tp);
    SelectScratch sc;
    const V zero{};
    for (i64 g = ga; g < gb; ++g) {
      const i64 r0 = g * R, nr = std::min(R, S - r0);
      i64 l = lo[r0], h = hi[r0];
      for (i64 r = 1; r < nr; ++r) l = std::min(l, lo[r0 + r]), h = std::max(h, hi[r0 + r]);
      const float* qs[R];
      for (i64 r = 0; r < R; ++r) qs[r] = q + (r0 + std::min(r, nr - 1)) * nI * dI;
      for (i64 c0 = l & ~(KB - 1); c0 < h; c0 += KB) {
        for (i64 hh = 0; hh < nI; ++hh) {
          V a[R][IV] = {};
          const float* kr = kT + c0;
          for (i64 d = 0; d < dI; ++d, kr += Tp) {
            V kv[IV];
            for (i64 v = 0; v < IV; ++v) kv[v] = ld(kr + W * v);
            for (i64 r = 0; r < R; ++r) {
              const V qv = splat(qs[r][hh * dI + d]);
              for (i64 v = 0; v < IV; ++v) a[r][v] += qv * kv[v];
            }
          }
          for (i64 r = 0; r < nr; ++r) {
            const V wv = splat(w[(r0 + r) * nI + hh]);
            float* o = rows.data() + r * Tp + c0;
            for (i64 v = 0; v < IV; ++v) {
              const V x = wv * (a[r][v] > zero ? a[r][v] : zero);
              st(o + W * v, hh == 0 ? x : ld(o + W * v) + x);
            }
          }
        }
      }
      for (i64 r = 0; r < nr; ++r)
        select_row(rows.data() + r * Tp, lo[r0 + r], hi[r0 + r], K, 0, out + (r0 + r) * K, sc);
    }
  });
}

// Prefetch the row `ahead` keys on (the latent is larger than L2 and the rows are random).
static inline void prefetch_row(const float* base, const i64* id, i64 j, i64 K, i64 D, int write) {
  constexpr i64 ahead = 32;
  if (j + ahead < K && id[j + ahead] >= 0) {
    const char* p = (const char*)(base + id[j + ahead] * D);
    for (i64 b = 0; b < D * 4; b += 64) {
      if (write)
        __builtin_prefetch(p + b, 1);
      else
        __builtin_prefetch(p + b, 0);
    }
  }
}

// Scores of one query against its selected rows: p[h*K + j] = scale * q_h · row_j[:D] (-inf where
// idx < 0), minus sub[h] when given; q_h = qt + h*D, row_j = lat + idx_j*ldr. Two rows x four heads
// per pass: eight independent accumulators (FMA latency x throughput) and each row chunk loaded once
// per four heads. A row of index < 0 reads row 0 and is then overwritten.
static void score_rows(const float* qt, const float* lat, i64 ldr, const i64* id, i64 n, i64 D, i64 K, float scale,
                       const float* sub, float* p) {
  for (i64 j = 0; j < K; j += 2) {
    const i64 j1 = std::min(j + 1, K - 1);  // odd K: the last row twice
    const i64 i0 = id[j], i1 = id[j1];
    prefetch_row(lat, id, j, K, ldr, 0);
    prefetch_row(lat, id, j1, K, ldr, 0);
    const float *x0 = lat + std::max<i64>(i0, 0) * ldr, *x1 = lat + std::max<i64>(i1, 0) * ldr;
    for (i64 h0 = 0; h0 < n; h0 += 4) {
      i64 hs[4];
      for (i64 u = 0; u < 4; ++u) hs[u] = std::min(h0 + u, n - 1);  // a short last group repeats a head
      V a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
      const float *q0 = qt + hs[0] * D, *q1 = qt + hs[1] * D, *q2 = qt + hs[2] * D, *q3 = qt + hs[3] * D;
      for (i64 c = 0; c < D; c += W) {
        const V r = ld(x0 + c), t = ld(x1 + c);
        V v = ld(q0 + c);
        a0 += v * r, b0 += v * t;
        v = ld(q1 + c);
        a1 += v * r, b1 += v * t;
        v = ld(q2 + c);
        a2 += v * r, b2 += v * t;
        v = ld(q3 + c);
        a3 += v * r, b3 += v * t;
      }
      const V4 sa = hsum4(a0, a1, a2, a3), sb = hsum4(b0, b1, b2, b3);
      for (i64 u = 0; u < 4; ++u) {
        const float m = sub ? sub[hs[u]] : 0.f;
        p[hs[u] * K + j] = i0 < 0 ? NEG_INF : scale * sa[u] - m;
        p[hs[u] * K + j1] = i1 < 0 ? NEG_INF : scale * sb[u] - m;
      }
    }
  }
}

}  // extern "C"

// Rows per block of the weighted row sums: a block (JB x 576 floats of GLM-5's latent = 147 KB) stays
// in L2 while every chunk of the row sweeps it.
constexpr i64 JB = 64;

// acc[h][c0 : c0 + NV*W] (+)= sum_{j in [j0, j1)} p[h*K + j] * row_j[c0 : ...] for heads h0 .. h0+3
// (heads past n: p = 0, nothing stored), NV vectors x 4 heads in registers; `first`: acc starts at 0.
template <int NV>
static inline void weighted_rows(const float* lat, i64 ldr, const i64* id, i64 j0, i64 j1, const float* p, i64 K,
                                 i64 h0, i64 n, i64 c0, float* acc, i64 lda, bool first) {
  const i64 nh = std::min<i64>(4, n - h0);
  V s[4][NV];
  for (i64 u = 0; u < 4; ++u)
    for (int v = 0; v < NV; ++v) s[u][v] = u < nh && !first ? ld(acc + (h0 + u) * lda + c0 + v * W) : V{};
  const float* p0 = p + h0 * K;
  for (i64 j = j0; j < j1; ++j) {
    const i64 i = id[j];
    if (i < 0) continue;
    V r[NV];
    for (int v = 0; v < NV; ++v) r[v] = ld(lat + i * ldr + c0 + v * W);
    for (i64 u = 0; u < 4; ++u) {
      const V pv = splat(p0[u * K + j]);
      for (int v = 0; v < NV; ++v) s[u][v] += pv * r[v];
    }
  }
  for (i64 u = 0; u < nh; ++u)
    for (int v = 0; v < NV; ++v) st(acc + (h0 + u) * lda + c0 + v * W, s[u][v]);
}

// acc[h, :C] = sum_j p[h*K + j] * row_j[:C] for all n heads (C a multiple of W), blocked by JB rows.
static void weighted_rows_all(const float* lat, i64 ldr, const i64* id, i64 K, const float* p, i64 n, i64 C,
                              float* acc, i64 lda) {
  for (i64 j0 = 0; j0 < K || j0 == 0; j0 += JB) {
    const i64 j1 = std::min(K, j0 + JB);
    i64 c = 0;
    for (; c + 2 * W <= C; c += 2 * W)
      for (i64 h0 = 0; h0 < n; h0 += 4) weighted_rows<2>(lat, ldr, id, j0, j1, p, K, h0, n, c, acc, lda, j0 == 0);
    for (; c < C; c += W)
      for (i64 h0 = 0; h0 < n; h0 += 4) weighted_rows<1>(lat, ldr, id, j0, j1, p, K, h0, n, c, acc, lda, j0 == 0);
  }
}

extern "C" {

// q [S, n, D], lat [T, D], idx [S, K] -> out [S, n, dc] = softmax(scale q·lat_sel) · lat_sel[:, :dc],
// lse [S, n] (-inf and out 0 where a row selects nothing). D and dc are multiples of 16.
void glm5_sparse_latent_fwd(const float* q, const float* lat, const i64* idx, i64 S, i64 n, i64 D, i64 K,
                            float scale, i64 dc, float* out, float* lse, int nt) {
  parallel_rows(S, nt, [&](i64 a, i64 b, int) {
    std::vector<float> p((n + 3) / 4 * 4 * K, 0.f);  // rows of heads >= n stay 0
    for (i64 t = a; t < b; ++t) {
      const i64* id = idx + t * K;
      score_rows(q + t * n * D, lat, D, id, n, D, K, scale, nullptr, p.data());
      for (i64 hh = 0; hh < n; ++hh) {
        float* ph = p.data() + hh * K;
        float m = NEG_INF;
        for (i64 j = 0; j < K; ++j) m = std::max(m, ph[j]);
        if (m == NEG_INF) {
          lse[t * n + hh] = NEG_INF;
          std::fill(ph, ph + K, 0.f);
          continue;
        }
        const float sum = exp_shifted_sum(ph, K, m);
        const float inv = 1.f / sum;
        for (i64 j = 0; j < K; ++j) ph[j] *= inv;
        lse[t * n + hh] = m + std::log(sum);
      }
      weighted_rows_all(lat, D, id, K, p.data(), n, dc, out + t * n * dc, dc);
    }
  });
}

// drow_j[c0 : c0 + W] += sum_h ds[h,j] q_h[c0 : ...] + p[h,j] dout_h[c0 : ...] (the dout term where
// c0 < dc) for j in [j0, j1), all heads; q_h / dout_h chunks of four heads at a time in registers.
static void scatter_rows(float* dl, i64 D, const i64* id, i64 j0, i64 j1, const float* ds, const float* p, i64 K,
                         const float* qt, const float* gt, i64 n, i64 dc, i64 c0) {
  const bool in_dc = c0 < dc;
  for (i64 h0 = 0; h0 < n; h0 += 4) {
    const i64 nh = std::min<i64>(4, n - h0);
    V qa[4], ga[4];
    for (i64 u = 0; u < 4; ++u) {
      qa[u] = u < nh ? ld(qt + (h0 + u) * D + c0) : V{};
      ga[u] = u < nh && in_dc ? ld(gt + (h0 + u) * dc + c0) : V{};
    }
    const float* s0 = ds + h0 * K;
    const float* p0 = p + h0 * K;
    for (i64 j = j0; j < j1; ++j) {  // heads past n: ds = p = 0, qa = ga = 0
      const i64 i = id[j];
      if (i < 0) continue;
      float* drow = dl + i * D + c0;
      V g = ld(drow), e = splat(s0[j]) * qa[0];  // two chains of four FMAs
      g += splat(p0[j]) * ga[0];
      e += splat(s0[K + j]) * qa[1];
      g += splat(p0[K + j]) * ga[1];
      e += splat(s0[2 * K + j]) * qa[2];
      g += splat(p0[2 * K + j]) * ga[2];
      e += splat(s0[3 * K + j]) * qa[3];
      g += splat(p0[3 * K + j]) * ga[3];
      st(drow, g + e);
    }
  }
}

// Backward of glm5_sparse_latent_fwd from its out and lse: dq [S, n, D] (written), dlat [T, D]
// (accumulated into; must hold the caller's starting values, usually zeros).
void glm5_sparse_latent_bwd(const float* q, const float* lat, const i64* idx, const float* out, const float* lse,
                            const float* dout, i64 S, i64 n, i64 D, i64 K, i64 T, float scale, i64 dc, float* dq,
                            float* dlat, int nt) {
  const int used = (nt <= 1 || S < 64) ? 1 : nt;
  std::vector<std::vector<float>> part(used > 1 ? used : 0);
  for (auto& v : part) v.assign(T * D, 0.f);
  parallel_rows(S, used, [&](i64 a, i64 b, int tid) {
    float* dl = used > 1 ? part[tid].data() : dlat;
    const i64 n4 = (n + 3) / 4 * 4;
    std::vector<float> p(n4 * K, 0.f), ds(n4 * K, 0.f), delta(n);  // rows of heads >= n stay 0
    for (i64 t = a; t < b; ++t) {
      const i64* id = idx + t * K;
      const float* qt = q + t * n * D;
      const float* gt = dout + t * n * dc;
      for (i64 hh = 0; hh < n; ++hh) delta[hh] = vdot(gt + hh * dc, out + (t * n + hh) * dc, dc);
      // p = scale q_h·row - lse_h, ds = dout_h·row[:dc] - delta_h; one load of each row chunk
      for (i64 j = 0; j < K; ++j) {
        const i64 i = id[j];
        if (i < 0) {
          for (i64 hh = 0; hh < n; ++hh) p[hh * K + j] = NEG_INF, ds[hh * K + j] = 0.f;
          continue;
        }
        prefetch_row(lat, id, j, K, D, 0);
        prefetch_row(dl, id, j, K, D, 1);
        const float* row = lat + i * D;
        for (i64 h0 = 0; h0 < n; h0 += 4) {
          i64 hs[4];
          for (i64 u = 0; u < 4; ++u) hs[u] = std::min(h0 + u, n - 1);
          V a[4] = {}, g[4] = {};
          for (i64 c = 0; c < dc; c += W) {
            const V r = ld(row + c);
            for (i64 u = 0; u < 4; ++u) {
              a[u] += ld(qt + hs[u] * D + c) * r;
              g[u] += ld(gt + hs[u] * dc + c) * r;
            }
          }
          for (i64 c = dc; c < D; c += W) {
            const V r = ld(row + c);
            for (i64 u = 0; u < 4; ++u) a[u] += ld(qt + hs[u] * D + c) * r;
          }
          const V4 sa = hsum4(a[0], a[1], a[2], a[3]), sg = hsum4(g[0], g[1], g[2], g[3]);
          for (i64 u = 0; u < 4; ++u) {
            p[hs[u] * K + j] = scale * sa[u] - lse[t * n + hs[u]];
            ds[hs[u] * K + j] = sg[u] - delta[hs[u]];
          }
        }
      }
      probs_and_dscores(p.data(), ds.data(), n * K, scale);
      // dq_h = sum_j ds[h,j] row_j;  drow_j += sum_h ds[h,j] q_h + p[h,j] dout_h[:dc], by blocks of JB rows
      weighted_rows_all(lat, D, id, K, ds.data(), n, D, dq + t * n * D, D);
      for (i64 j0 = 0; j0 < K; j0 += JB)
        for (i64 c = 0; c < D; c += W) scatter_rows(dl, D, id, j0, std::min(K, j0 + JB), ds.data(), p.data(), K, qt, gt, n, dc, c);
    }
  });
  for (auto& v : part) vaxpy(dlat, 1.f, v.data(), T * D);
}

}  // extern "C"

extern "C" {

// q [R, n, D], lat [T, D], idx [R, K] -> out [R, K] = sum_h softmax_j(scale q_h·lat_idx[j]) over the row's
// selected rows (0 where idx < 0; a row that selects nothing is all 0). D a multiple of 16.
void glm5_sparse_latent_target(const float* q, const float* lat, const i64* idx, i64 R, i64 n, i64 D, i64 K,
                               float scale, float* out, int nt) {
  parallel_rows(R, nt, [&](i64 a, i64 b, int) {
    std::vector<float> p(n * K);
    for (i64 t = a; t < b; ++t) {
      const i64* id = idx + t * K;
      float* o = out + t * K;
      std::fill(o, o + K, 0.f);
      score_rows(q + t * n * D, lat, D, id, n, D, K, scale, nullptr, p.data());
      for (i64 hh = 0; hh < n; ++hh) {
        float* ph = p.data() + hh * K;
        float m = NEG_INF;
        for (i64 j = 0; j < K; ++j) m = std::max(m, ph[j]);
        if (m == NEG_INF) continue;
        const float inv = 1.f / exp_shifted_sum(ph, K, m);
        for (i64 j = 0; j < K; ++j) o[j] += ph[j] * inv;
      }
    }
  });
}

// The sparse stage's indexer KL per query row r over its selected keys j (idx[r, j] >= 0):
//   I_j = sum_h w[r,h] relu(q[r,h]·k[idx_j]),  logp = log_softmax_j(I),
//   kl[r] = sum_j t_j (log(max(t_j, 1e-10)) - logp_j)        (Megatron-Core's indexer_kl_sum terms)
// q [R, nI, dI], w [R, nI], k [T, dI], idx / t [R, K]; dI a multiple of 16. With dq (then dw, dk too)
// given, the gradients of g * sum_r kl[r] instead: dI_j = g (p_j sum(t) - t_j), dw, dq written, dk
// [T, dI] accumulated into (the caller's starting values, usually zeros); kl is then not written.
void glm5_indexer_kl(const float* q, const float* w, const float* k, const i64* idx, const float* tgt, i64 R,
                     i64 nI, i64 dI, i64 K, i64 T, float g, float* kl, float* dq, float* dw, float* dk, int nt) {
  const bool grad = dq != nullptr;
  const int parts = grad && nt > 1 && R >= 64 ? nt : 0;  // parallel_rows splits the rows: one dk per thread
  std::vector<std::vector<float>> part(parts);
  for (auto& v : part) v.assign(T * dI, 0.f);
  parallel_rows(R, nt, [&](i64 a, i64 b, int tid) {
    float* dkl = parts ? part[tid].data() : dk;
    const i64 n4 = (nI + 3) / 4 * 4;
    std::vector<float> dots(n4 * K, 0.f), dr(n4 * K, 0.f), I(K), e(K);  // rows of heads >= nI stay 0
    for (i64 r = a; r < b; ++r) {
      const i64* id = idx + r * K;
      const float* tg = tgt + r * K;
      const float* qr = q + r * nI * dI;
      const float* wr = w + r * nI;
      score_rows(qr, k, dI, id, nI, dI, K, 1.f, nullptr, dots.data());
      float m = NEG_INF;
      for (i64 j = 0; j < K; ++j) I[j] = 0.f;
      for (i64 hh = 0; hh < nI; ++hh) {  // I = sum_h w_h relu(dots_h), vectorised over keys
        const float* dh = dots.data() + hh * K;
        const V wv = splat(wr[hh]), zero{};
        i64 j = 0;
        for (; j + W <= K; j += W) {
          const V d = ld(dh + j);
          st(I.data() + j, ld(I.data() + j) + wv * (d > zero ? d : zero));
        }
        for (; j < K; ++j) I[j] += wr[hh] * std::max(dh[j], 0.f);
      }
      for (i64 j = 0; j < K; ++j) {
        I[j] = id[j] >= 0 ? I[j] : NEG_INF;
        m = std::max(m, I[j]);
      }
      if (m == NEG_INF) {  // nothing selected: no loss, no gradient
        if (grad) {
          std::fill(dq + r * nI * dI, dq + (r + 1) * nI * dI, 0.f);
          std::fill(dw + r * nI, dw + (r + 1) * nI, 0.f);
        } else {
          kl[r] = 0.f;
        }
        continue;
      }
      std::copy(I.begin(), I.end(), e.begin());
      const float lse = m + std::log(exp_shifted_sum(e.data(), K, m));  // e_j = exp(I_j - m), 0 off the set
      if (!grad) {  // sum_j t_j (log max(t_j, eps) - I_j + lse) over the selected keys
        V acc{};
        i64 j = 0;
        for (; j + W <= K; j += W) {
          const V t = ld(tg + j), x = ld(I.data() + j);
          const V lt = vlog(t > splat(1e-10f) ? t : splat(1e-10f));
          acc += x > splat(NEG_INF) ? t * (lt - x + lse) : V{};
        }
        float tail = 0.f;
        for (; j < K; ++j)
          if (id[j] >= 0) tail += tg[j] * (std::log(std::max(tg[j], 1e-10f)) - I[j] + lse);
        kl[r] = hsum(acc) + tail;
        continue;
      }
      float tsum = 0.f;
      for (i64 j = 0; j < K; ++j) tsum += tg[j];
      const float pscale = std::exp(m - lse);  // p_j = e_j exp(m - lse)
      float* dwr = dw + r * nI;
      for (i64 j = 0; j < K; ++j) e[j] = id[j] >= 0 ? g * (e[j] * pscale * tsum - tg[j]) : 0.f;  // dI_j
      for (i64 hh = 0; hh < nI; ++hh) {  // dw_h = sum_j dI_j relu(dots_hj), dr[h, j] = dI_j w_h [dots_hj > 0]
        const float* dh = dots.data() + hh * K;
        float* rh = dr.data() + hh * K;
        const V wv = splat(wr[hh]), zero{};
        V acc{};
        i64 j = 0;
        for (; j + W <= K; j += W) {
          const V d = ld(dh + j), di = ld(e.data() + j);
          const Vi on = d > zero;
          acc += on ? di * d : zero;
          st(rh + j, on ? di * wv : zero);
        }
        float tail = 0.f;
        for (; j < K; ++j) {
          const bool on = dh[j] > 0.f;
          tail += on ? e[j] * dh[j] : 0.f;
          rh[j] = on ? e[j] * wr[hh] : 0.f;
        }
        dwr[hh] = hsum(acc) + tail;
      }
      // dq_h = sum_j dr[h, j] k_j;  dk_j += sum_h dr[h, j] q_h
      weighted_rows_all(k, dI, id, K, dr.data(), nI, dI, dq + r * nI * dI, dI);
      for (i64 j = 0; j < K; ++j) {
        const i64 i = id[j];
        if (i < 0) continue;
        float* krow = dkl + i * dI;
        for (i64 c = 0; c < dI; c += W) {
          V acc = ld(krow + c);
          for (i64 hh = 0; hh < nI; ++hh) acc += splat(dr[hh * K + j]) * ld(qr + hh * dI + c);
          st(krow + c, acc);
        }
      }
    }
  });
  for (auto& v : part) vaxpy(dk, 1.f, v.data(), T * dI);
}

}  // extern "C"
