#include "head.h"

#include "pool.h"

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace laya {
namespace {

// The output head: logits[r, n] = bf16(scale[n] * sum_i x[r, i] * w[n, i]) for bfloat16 rows x
// [rows, dim] and int8 weights w [vocab, dim] with a scale per output, as float32. On the
// embedded model it is 28 MB of weights, read after the layers' 66 MB have pushed it out of
// cache: torch's _weight_int8pack_mm took 1.7 ms of a 5.7 ms decode step on a Xeon whose
// prefetchers left it waiting on memory (0.87 ms with the matrix in cache), converting each
// weight to a float on the way. Here each row of x becomes 16-bit integers with one scale
// (its largest magnitude to kXMax), the weights are widened to 16 bits and multiplied by
// vpdpwssd, 32 a instruction, into 32-bit integer sums, and they are asked for 8 KB ahead.
// The sums are exact, so a logit does not depend on the order, the tile or the rows beside
// it; the one rounding besides bfloat16's is x's to kXMax steps, under 2^-15 of the row's
// largest value, where bfloat16 itself keeps 2^-9 of each value. On AVX512-VNNI, or on
// AVX2 (below); elsewhere the backend keeps torch's product.
#if defined(__x86_64__)
#define VNNI_KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int R, int T>
VNNI_KERNEL INLINE void head_tile(const int16_t* xq, const float* xscale, int64_t dim,
                                  const int8_t* w, const bf16* scales, float* out,
                                  int64_t vocab, int64_t n, int64_t r) {
  __m512i acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_si512();
  for (int64_t k = 0; k < dim; k += 32) {
    __m512i xs[T];
    for (int t = 0; t < T; ++t) xs[t] = _mm512_loadu_si512(xq + (r + t) * dim + k);
    for (int i = 0; i < R; ++i) {
      const int8_t* wi = w + (n + i) * dim + k;
      _mm_prefetch(reinterpret_cast<const char*>(wi) + 8192, _MM_HINT_T0);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)wi));
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_dpwssd_epi32(acc[i][t], wv, xs[t]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const float s = to_float(scales[n + i]);
    for (int t = 0; t < T; ++t) {
      const float sum = static_cast<float>(_mm512_reduce_add_epi32(acc[i][t]));
      out[(r + t) * vocab + n + i] = to_float(to_bf16(sum * xscale[r + t] * s));
    }
  }
}

template <int T>
VNNI_KERNEL void head_rows(const int16_t* xq, const float* xscale, int64_t dim, const int8_t* w,
                           const bf16* scales, float* out, int64_t vocab, int64_t first,
                           int64_t last, int64_t r) {
  int64_t n = first;
  for (; n + 4 <= last; n += 4) head_tile<4, T>(xq, xscale, dim, w, scales, out, vocab, n, r);
  for (; n < last; ++n) head_tile<1, T>(xq, xscale, dim, w, scales, out, vocab, n, r);
}

#define AVX2_KERNEL __attribute__((target("avx2")))

// The same sums on AVX2: sixteen products a vpmaddwd, added in 32-bit integers. Integer sums
// are exact, so the logits are the bits of the AVX-512 code's.
template <int R, int T>
AVX2_KERNEL INLINE void head_tile_avx2(const int16_t* xq, const float* xscale, int64_t dim,
                                       const int8_t* w, const bf16* scales, float* out,
                                       int64_t vocab, int64_t n, int64_t r) {
  __m256i acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_si256();
  for (int64_t k = 0; k < dim; k += 16) {
    __m256i xs[T];
    for (int t = 0; t < T; ++t)
      xs[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r + t) * dim + k));
    for (int i = 0; i < R; ++i) {
      const int8_t* wi = w + (n + i) * dim + k;
      if (k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(wi) + 8192, _MM_HINT_T0);
      const __m256i wv =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wi)));
      for (int t = 0; t < T; ++t)
        acc[i][t] = _mm256_add_epi32(acc[i][t], _mm256_madd_epi16(wv, xs[t]));
    }
  }
  for (int i = 0; i < R; ++i) {
    const float s = to_float(scales[n + i]);
    for (int t = 0; t < T; ++t) {
      __m128i q = _mm_add_epi32(_mm256_castsi256_si128(acc[i][t]),
                                _mm256_extracti128_si256(acc[i][t], 1));
      q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4e));
      q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1));
      const float sum = static_cast<float>(_mm_cvtsi128_si32(q));
      out[(r + t) * vocab + n + i] = to_float(to_bf16(sum * xscale[r + t] * s));
    }
  }
}

AVX2_KERNEL void head_range_avx2(const int16_t* xq, const float* xscale, int64_t rows,
                                 int64_t dim, const int8_t* w, const bf16* scales, float* out,
                                 int64_t vocab, int64_t first, int64_t last) {
  for (int64_t r = 0; r < rows; r += 2) {
    const bool two = rows - r >= 2;
    int64_t n = first;
    for (; n + 4 <= last; n += 4) {
      if (two)
        head_tile_avx2<4, 2>(xq, xscale, dim, w, scales, out, vocab, n, r);
      else
        head_tile_avx2<4, 1>(xq, xscale, dim, w, scales, out, vocab, n, r);
    }
    for (; n < last; ++n) {
      if (two)
        head_tile_avx2<1, 2>(xq, xscale, dim, w, scales, out, vocab, n, r);
      else
        head_tile_avx2<1, 1>(xq, xscale, dim, w, scales, out, vocab, n, r);
    }
  }
}

// Outputs first .. last of every row, in tiles of up to four rows of x.
void head_range(const int16_t* xq, const float* xscale, int64_t rows, int64_t dim,
                const int8_t* w, const bf16* scales, float* out, int64_t vocab, int64_t first,
                int64_t last, bool avx2) {
  static const bool vnni = cpu_avx512_vnni();
  if (avx2 || !vnni) {
    head_range_avx2(xq, xscale, rows, dim, w, scales, out, vocab, first, last);
    return;
  }
  for (int64_t r = 0; r < rows; r += 4) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: head_rows<4>(xq, xscale, dim, w, scales, out, vocab, first, last, r); break;
      case 3: head_rows<3>(xq, xscale, dim, w, scales, out, vocab, first, last, r); break;
      case 2: head_rows<2>(xq, xscale, dim, w, scales, out, vocab, first, last, r); break;
      default: head_rows<1>(xq, xscale, dim, w, scales, out, vocab, first, last, r); break;
    }
  }
}

#else
void head_range(const int16_t*, const float*, int64_t, int64_t, const int8_t*, const bf16*,
                float*, int64_t, int64_t, int64_t, bool) {}
#endif

}  // namespace

bool head_supported() { return cpu_avx2(); }

void head_int8(const bf16* x, int64_t rows, int64_t dim, const int8_t* w, const bf16* scales,
               float* out, int64_t vocab, int64_t threads, bool avx2) {
  // x's integer steps: as fine as 16 bits allow while a 32-bit sum of dim products of
  // |w| <= 127 cannot overflow.
  const float x_max = static_cast<float>(
      std::min<int64_t>(32767, (int64_t{1} << 31) / (128 * std::max<int64_t>(dim, 1))));
  std::vector<int16_t> xq(rows * dim);
  std::vector<float> xscale(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * dim;
    float largest = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = to_float(xr[i]);
      finite = finite && std::isfinite(v);
      largest = std::max(largest, std::fabs(v));
    }
    if (!finite) {  // an infinity or NaN in x: NaN logits, as in floats
      xscale[r] = std::nanf("");
      std::fill_n(xq.begin() + r * dim, dim, int16_t{0});
      continue;
    }
    const float step = largest > 0.0f ? largest / x_max : 1.0f;
    xscale[r] = step;
    for (int64_t i = 0; i < dim; ++i)
      xq[r * dim + i] = static_cast<int16_t>(std::nearbyint(to_float(xr[i]) / step));
  }
  // Outputs in chunks of multiples of four, a few a thread, claimed in order (pool.h); each
  // chunk writes its own columns.
  struct Share {
    const int16_t* xq;
    const float* xscale;
    int64_t rows, dim;
    const int8_t* w;
    const bf16* scales;
    float* out;
    int64_t vocab, chunk;
    bool avx2;
  };
  threads = std::max<int64_t>(1, threads);
  const int64_t tasks = rows * vocab * dim < kPoolWork
                            ? 1
                            : std::max<int64_t>(1, std::min(threads * 4, vocab / 64));
  const Share share{xq.data(), xscale.data(), rows, dim, w, scales, out, vocab,
                    ((vocab + tasks - 1) / tasks + 3) / 4 * 4, avx2};
  run_tasks(
      [](const void* args, int64_t i) {
        const Share& s = *static_cast<const Share*>(args);
        head_range(s.xq, s.xscale, s.rows, s.dim, s.w, s.scales, s.out, s.vocab, i * s.chunk,
                   std::min(s.vocab, (i + 1) * s.chunk), s.avx2);
      },
      &share, (vocab + share.chunk - 1) / share.chunk, threads);
}

}  // namespace laya
