#include "q4.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool.h"

namespace laya {
namespace {

// The layers' products with 4-bit weights, each group of 32 inputs of a row with a float16
// scale and minimum (GGUF's Q4_1): w = scale x q + min, q in 0..15. torch's CPU int4 kernel
// turns every weight into a float and took 3.4-4 ms of a 6-7 ms decode step of the embedded
// model on a 2-vCPU Xeon, as fast with the matrices in cache: compute, not memory, bound it.
//
// Here a row of x becomes 16-bit integers, each group of 32 with its own step (its largest
// magnitude to 32767, finer than bfloat16 itself unless the group spans more than 2^7), and
// the weights are summed against them in 32-bit integers (vpdpwssd, 32 products an
// instruction). The stored order makes one scaling serve sixteen groups: a row's groups are
// taken sixteen at a time (a "piece"; a row's last pieces may hold 8, 4 or 2), and each of
// an instruction's sixteen 32-bit lanes sums two inputs of one group, lane l the group
// l mod S of a piece of S groups. After the piece's S instructions each lane holds a whole
// share of its group's sum, and one conversion and one multiply-add with the groups'
// scales (times x's steps) add the piece to the row's float sums. The minimums' term,
// min x (sum of the group's x), is one more multiply-add a piece.
//
// A result depends on its own row of x and of w only, in one fixed order of operations,
// whatever the rows beside it, the tile or the thread: a sequence's logits are the same
// bits in any batch. Weights are asked for 8 KB ahead of their use.

// Up to 2^20 inputs a row (kernels.cpp checks): 2^15 groups, 2^11 + 3 pieces.
constexpr int kLanes = 16, kMaxPieces = (1 << 11) + 4;

// The pieces of a row of ``groups`` groups (an even number): sixteens, then 8, 4, 2.
int pieces_of(int64_t groups, int* sizes) {
  int n = 0;
  while (groups > 0) {
    const int s = groups >= 16 ? 16 : groups >= 8 ? 8 : groups >= 4 ? 4 : 2;
    sizes[n++] = s;
    groups -= s;
  }
  return n;
}

// The input at stored slot 32 j + 2 l + s of a piece of S groups starting at group g0:
// instruction j, lane l, the lane's first or second value s.
INLINE int64_t input_of(int64_t g0, int S, int j, int l, int s) {
  return 32 * (g0 + l % S) + j * (32 / S) + 2 * (l / S) + s;
}

// x's rows as the products read them: the 16-bit values in stored order, and for each
// piece the lanes' steps and their x sums (in x's units).
struct XRows {
  std::vector<int16_t> q;  // [rows, in]
  std::vector<float> lanes;  // [rows, pieces, 2, 16]: steps, then sums
};

struct Args {
  const bf16* x;
  int64_t rows, in, groups, n;
  int npieces;
  int piece[kMaxPieces];
  const int32_t* order;  // q4_order(in)
  XRows* xr;
  const uint8_t* w;
  int64_t row_bytes, chunk;
  bf16* out;
};

#if defined(__x86_64__)
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

// A row's groups in 16-bit steps of their largest magnitude: false if the row holds an
// infinity or a NaN.
KERNEL bool steps_of(const bf16* x, int64_t groups, int16_t* q, float* step) {
  bool finite = true;
  for (int64_t g = 0; g < groups; ++g) {
    float v[32], largest = 0.0f;
    for (int e = 0; e < 32; ++e) {
      v[e] = to_float(x[32 * g + e]);
      finite &= std::fabs(v[e]) <= FLT_MAX;  // false for infinities and NaN
      largest = std::max(largest, std::fabs(v[e]));
    }
    const float s = largest > 0.0f ? largest / 32767.0f : 1.0f, inverse = 1.0f / s;
    step[g] = s;
    for (int e = 0; e < 32; ++e)
      q[32 * g + e] = static_cast<int16_t>(std::nearbyint(v[e] * inverse));
  }
  return finite;
}

void prepare_rows(const Args& a, int64_t first, int64_t last) {
  static thread_local std::vector<int16_t> natural;
  static thread_local std::vector<float> step;
  natural.resize(a.in);
  step.resize(a.groups);
  const int64_t lane_floats = int64_t{a.npieces} * 2 * kLanes;
  for (int64_t r = first; r < last; ++r) {
    int16_t* q = a.xr->q.data() + r * a.in;
    float* lanes = a.xr->lanes.data() + r * lane_floats;
    if (!steps_of(a.x + r * a.in, a.groups, natural.data(), step.data())) {
      // an infinity or NaN in the row (its largest magnitude): NaN outputs, as in floats
      std::fill_n(q, a.in, int16_t{0});
      std::fill_n(lanes, lane_floats, std::nanf(""));
      continue;
    }
    int64_t g0 = 0, slot = 0;
    for (int p = 0; p < a.npieces; ++p) {
      const int S = a.piece[p];
      int32_t sums[kLanes] = {};
      for (int j = 0; j < S; ++j)
        for (int l = 0; l < kLanes; ++l)
          for (int s = 0; s < 2; ++s, ++slot) {
            const int16_t v = natural[a.order[slot]];
            q[slot] = v;
            sums[l] += v;
          }
      float* steps = lanes + p * 2 * kLanes;
      for (int l = 0; l < kLanes; ++l) {
        steps[l] = step[g0 + (l & (S - 1))];
        steps[kLanes + l] = static_cast<float>(sums[l]) * steps[l];
      }
      g0 += S;
    }
  }
}

void prepare_task(const void* args, int64_t i) {
  const Args& a = *static_cast<const Args*>(args);
  prepare_rows(a, i * 16, std::min(a.rows, (i + 1) * 16));
}

#if defined(__x86_64__)
#define VNNI_KERNEL __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))

// A piece's sixteen lanes of float16 values (scales or minimums) of groups g .. g + S - 1:
// lane l the value of group l mod S.
VNNI_KERNEL INLINE __m512 piece_lanes(const uint16_t* v, int S) {
  switch (S) {
    case 16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
    case 8:
      return _mm512_broadcast_f32x8(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
    case 4:
      return _mm512_broadcast_f32x4(
          _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
    default: {
      int32_t pair;
      std::memcpy(&pair, v, 4);
      const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
      return _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(two)));
    }
  }
}

// Outputs n .. n + R - 1 of x rows r .. r + T - 1.
template <int R, int T>
VNNI_KERNEL INLINE void tile(const Args& a, int64_t n, int64_t r) {
  const uint8_t* w[R];
  for (int i = 0; i < R; ++i) w[i] = a.w + (n + i) * a.row_bytes;
  const int64_t lane_floats = int64_t{a.npieces} * 2 * kLanes;
  const int16_t* xq[T];
  const float* xl[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = a.xr->q.data() + (r + t) * a.in;
    xl[t] = a.xr->lanes.data() + (r + t) * lane_floats;
  }
  const int64_t scales = a.in / 2, minimums = scales + 2 * a.groups;
  const __m512i low = _mm512_set1_epi16(15);
  __m512 acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  int64_t off = 0, g0 = 0;
  for (int p = 0; p < a.npieces; ++p) {
    const int S = a.piece[p];
    __m512i d[R][T];
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < T; ++t) d[i][t] = _mm512_setzero_si512();
    for (int c = 0; c < S / 2; ++c) {
      const int64_t b = off / 2 + 32 * c, xo = off + 64 * c;
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + b) + 8192, _MM_HINT_T0);
        const __m512i v =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b)));
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
        for (int t = 0; t < T; ++t) {
          d[i][t] = _mm512_dpwssd_epi32(d[i][t], lo, _mm512_loadu_si512(xq[t] + xo));
          d[i][t] = _mm512_dpwssd_epi32(d[i][t], hi, _mm512_loadu_si512(xq[t] + xo + 32));
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 sc = piece_lanes(reinterpret_cast<const uint16_t*>(w[i] + scales) + g0, S);
      const __m512 mn = piece_lanes(reinterpret_cast<const uint16_t*>(w[i] + minimums) + g0, S);
      for (int t = 0; t < T; ++t) {
        const float* lanes = xl[t] + p * 2 * kLanes;
        const __m512 scale = _mm512_mul_ps(sc, _mm512_loadu_ps(lanes));
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[i][t]), scale, acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(lanes + kLanes), acc[i][t]);
      }
    }
    off += 32 * S;
    g0 += S;
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t)
      a.out[(r + t) * a.n + n + i] = to_bf16(_mm512_reduce_add_ps(acc[i][t]));
}

template <int R>
VNNI_KERNEL void tiles(const Args& a, int64_t n, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) tile<R, 2>(a, n, r);
  if (r < r1) tile<R, 1>(a, n, r);
}

#define AVX2_KERNEL __attribute__((target("avx2,fma,f16c")))

// The same layout on AVX2 (and FMA, F16C): the sixteen lanes as two halves of eight, the
// integer sums by vpmaddwd and an add (the same sums), the float ones lane by lane as above.
// Sixteen registers hold two output rows of one x row.
AVX2_KERNEL INLINE void piece_lanes(const uint16_t* v, int S, __m256& first, __m256& second) {
  const __m128i* p = reinterpret_cast<const __m128i*>(v);
  switch (S) {
    case 16:
      first = _mm256_cvtph_ps(_mm_loadu_si128(p));
      second = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
      return;
    case 8:
      first = second = _mm256_cvtph_ps(_mm_loadu_si128(p));
      return;
    case 4: {
      const __m128 f = _mm_cvtph_ps(_mm_loadl_epi64(p));
      first = second = _mm256_set_m128(f, f);
      return;
    }
    default: {
      int32_t pair;
      std::memcpy(&pair, v, 4);
      const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
      const __m128 f = _mm_movelh_ps(two, two);
      first = second = _mm256_set_m128(f, f);
    }
  }
}

template <int R>
AVX2_KERNEL INLINE void tile_avx2(const Args& a, int64_t n, int64_t r) {
  const uint8_t* w[R];
  for (int i = 0; i < R; ++i) w[i] = a.w + (n + i) * a.row_bytes;
  const int16_t* xq = a.xr->q.data() + r * a.in;
  const float* xl = a.xr->lanes.data() + r * int64_t{a.npieces} * 2 * kLanes;
  const int64_t scales = a.in / 2, minimums = scales + 2 * a.groups;
  const __m256i low = _mm256_set1_epi16(15);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t off = 0, g0 = 0;
  for (int p = 0; p < a.npieces; ++p) {
    const int S = a.piece[p];
    __m256i d[R][2];
    for (int i = 0; i < R; ++i) d[i][0] = d[i][1] = _mm256_setzero_si256();
    for (int c = 0; c < S / 2; ++c) {
      const int64_t b = off / 2 + 32 * c, xo = off + 64 * c;
      for (int i = 0; i < R; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(w[i] + b) + 8192, _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {  // lanes 8 h .. 8 h + 7
          const __m256i v = _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[i] + b + 16 * h)));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
          const __m256i* x = reinterpret_cast<const __m256i*>(xq + xo + 16 * h);
          d[i][h] = _mm256_add_epi32(d[i][h], _mm256_madd_epi16(lo, _mm256_loadu_si256(x)));
          d[i][h] = _mm256_add_epi32(d[i][h], _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 2)));
        }
      }
    }
    const float* lanes = xl + p * 2 * kLanes;
    for (int i = 0; i < R; ++i) {
      __m256 sc[2], mn[2];
      piece_lanes(reinterpret_cast<const uint16_t*>(w[i] + scales) + g0, S, sc[0], sc[1]);
      piece_lanes(reinterpret_cast<const uint16_t*>(w[i] + minimums) + g0, S, mn[0], mn[1]);
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_mul_ps(sc[h], _mm256_loadu_ps(lanes + 8 * h));
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[i][h]), scale, acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(mn[h], _mm256_loadu_ps(lanes + kLanes + 8 * h), acc[i][h]);
      }
    }
    off += 32 * S;
    g0 += S;
  }
  for (int i = 0; i < R; ++i) {
    const __m256 v = _mm256_add_ps(acc[i][0], acc[i][1]);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    a.out[r * a.n + n + i] = to_bf16(_mm_cvtss_f32(q));
  }
}

AVX2_KERNEL void tiles_avx2(const Args& a, int64_t n, int64_t n1, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (n1 - n >= 2)
      tile_avx2<2>(a, n, r);
    else
      tile_avx2<1>(a, n, r);
  }
}

// Output rows [i chunk, (i + 1) chunk) of every row of x, x in blocks of 64 rows that stay
// in cache while the chunk's weights pass over them.
template <bool kAvx2>
void product_task(const void* args, int64_t i) {
  const Args& a = *static_cast<const Args*>(args);
  const int64_t n0 = i * a.chunk, n1 = std::min(a.n, n0 + a.chunk);
  for (int64_t r0 = 0; r0 < a.rows; r0 += 64) {
    const int64_t r1 = std::min(a.rows, r0 + 64);
    if constexpr (kAvx2) {
      for (int64_t n = n0; n < n1; n += 2) tiles_avx2(a, n, n1, r0, r1);
      continue;
    }
    for (int64_t n = n0; n < n1; n += 4) {
      switch (std::min<int64_t>(4, n1 - n)) {
        case 4: tiles<4>(a, n, r0, r1); break;
        case 3: tiles<3>(a, n, r0, r1); break;
        case 2: tiles<2>(a, n, r0, r1); break;
        default: tiles<1>(a, n, r0, r1); break;
      }
    }
  }
}

#else
template <bool kAvx2>
void product_task(const void*, int64_t) {}
#endif

}  // namespace

const char* q4_path() { return cpu_avx512_vnni() ? "avx512-vnni" : cpu_avx2() ? "avx2" : ""; }

int64_t q4_row_bytes(int64_t in) { return in / 2 + 4 * (in / 32); }

std::vector<int32_t> q4_order(int64_t in) {
  std::vector<int32_t> order(in);
  int sizes[kMaxPieces];
  const int npieces = pieces_of(in / 32, sizes);
  int64_t g0 = 0, off = 0;
  for (int p = 0; p < npieces; ++p) {
    const int S = sizes[p];
    for (int j = 0; j < S; ++j)
      for (int l = 0; l < kLanes; ++l)
        for (int s = 0; s < 2; ++s)
          order[off + 32 * j + 2 * l + s] = static_cast<int32_t>(input_of(g0, S, j, l, s));
    g0 += S;
    off += 32 * S;
  }
  return order;
}

void q4_product(const bf16* x, int64_t rows, int64_t in, const uint8_t* w, int64_t n,
                bf16* out, int64_t threads, bool avx2) {
  if (rows <= 0 || n <= 0) return;
  static thread_local XRows xr;
  static thread_local std::vector<std::pair<int64_t, std::vector<int32_t>>> orders;
  auto known = std::find_if(orders.begin(), orders.end(), [&](auto& o) { return o.first == in; });
  if (known == orders.end()) {
    orders.emplace_back(in, q4_order(in));
    known = orders.end() - 1;
  }
  Args a;
  a.order = known->second.data();
  a.x = x;
  a.rows = rows;
  a.in = in;
  a.groups = in / 32;
  a.n = n;
  a.npieces = pieces_of(a.groups, a.piece);
  a.xr = &xr;
  a.w = w;
  a.row_bytes = q4_row_bytes(in);
  a.out = out;
  xr.q.resize(rows * in);
  xr.lanes.resize(rows * a.npieces * 2 * kLanes);
  threads = std::max<int64_t>(1, threads);
  const bool alone = threads <= 1 || rows * n * in < kPoolWork;
  if (rows <= 16 || alone)
    prepare_rows(a, 0, rows);
  else
    run_tasks(prepare_task, &a, (rows + 15) / 16, threads);
  // Output rows in chunks of multiples of 4, a few a thread, claimed in order.
  const int64_t tasks = alone ? 1 : std::min<int64_t>(threads * 4, (n + 3) / 4);
  a.chunk = ((n + tasks - 1) / tasks + 3) / 4 * 4;
  static const bool avx512 = cpu_avx512_vnni();
  run_tasks(avx2 || !avx512 ? product_task<true> : product_task<false>, &a,
            (n + a.chunk - 1) / a.chunk, alone ? 1 : threads);
}

}  // namespace laya
