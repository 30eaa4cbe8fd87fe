// A decode step's small operations for the torch backend, on bfloat16 rows.
//
// Eager PyTorch spends a few microseconds dispatching each operation, whatever its size: a
// SmolLM2-135M decode step made about 1,100 of them (36 a layer), and on a 2-vCPU Xeon they
// cost about 3.5 of its 11-12 ms, more than the int4 products of its 30 layers. Here each run
// of small operations between two products is one call: a norm (with the residual add before
// it), the rotary embedding with the K/V write into the paged pool, attention of one-token
// queries over their histories, and the SwiGLU activation.
//
// Every row is computed on its own, the same way in any batch: a row's result depends on its
// own inputs only, never on how many rows share the call or which thread runs it. So a
// draft's check, attended row by row here, gives each row the bits of a lone decode.
// Arithmetic is float32 with one rounding to bfloat16 (round to nearest even) per output.
//
// Arguments are raw addresses (torch's data_ptr()) and sizes: the Python side (model.py)
// checks dtypes, shapes and contiguity before it calls. The output head's product is in
// head.cpp; this module binds it too.

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "head.h"
#include "pool.h"
#include "q4.h"

namespace nb = nanobind;

namespace {

using namespace laya;

// exp(x) for float32, within 2 ulp over the range used (softmax's x <= 0, SiLU's |x| < 88),
// written so that loops over it vectorize: 2^(x log2 e) as 2^n (the exponent's bits) times a
// degree-6 polynomial of 2^f, f in [-0.5, 0.5]. Below about -88 it gives 0 (2^-127 and
// under), above 88 about 2^127.
inline float fast_exp(float x) {
  float y = std::min(std::max(x * 1.44269504088896341f, -127.0f), 127.0f);
  float n = std::nearbyint(y);
  float f = y - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return n <= -127.0f ? 0.0f : p * scale;
}

// The KV pool's element: bfloat16 or IEEE half (the KV cache's ``bf16`` and ``f16``).
inline float load(bf16 v) { return to_float(v); }
inline float load(_Float16 v) { return static_cast<float>(v); }
template <typename P>
P from_bf16(bf16 v);
template <>
inline bf16 from_bf16<bf16>(bf16 v) { return v; }
template <>
inline _Float16 from_bf16<_Float16>(bf16 v) { return static_cast<_Float16>(to_float(v)); }

// One build per instruction-set level (AVX-512; AVX2 with FMA and F16C; the baseline),
// picked when the module loads (GCC's function multiversioning). Templates are inlined
// into these.
#if defined(__x86_64__)
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

KERNEL void add_rms_norm_rows(bf16* h, const bf16* delta, const bf16* weight, bf16* out,
                              int64_t rows, int64_t dim, float eps) {
  std::vector<float> x(dim);
  for (int64_t r = 0; r < rows; ++r) {
    bf16* hr = h + r * dim;
    float squares = 0.0f;
    if (delta) {  // the residual add, rounded to bfloat16 as the stream is kept
      const bf16* d = delta + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        bf16 sum = to_bf16(to_float(hr[i]) + to_float(d[i]));
        hr[i] = sum;
        x[i] = to_float(sum);
      }
    } else {
      for (int64_t i = 0; i < dim; ++i) x[i] = to_float(hr[i]);
    }
    for (int64_t i = 0; i < dim; ++i) squares += x[i] * x[i];
    float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
    bf16* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = to_bf16(x[i] * scale * to_float(weight[i]));
  }
}

KERNEL void silu_mul_rows(const bf16* gate_up, bf16* out, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* gate = gate_up + r * 2 * inner;
    const bf16* up = gate + inner;
    bf16* o = out + r * inner;
    for (int64_t i = 0; i < inner; ++i) {
      float g = to_float(gate[i]);
      o[i] = to_bf16(g / (1.0f + fast_exp(-g)) * to_float(up[i]));
    }
  }
}

// Rotates the q and k heads of each row of ``qkv`` [rows, (heads + 2 kv_heads) x dim] in
// place (rotate-half: x cos + roll(x, dim / 2) signed_sin, the tables' rows at the row's
// position), then copies the row's K and V heads to its pool slot [2 kv_heads, dim].
template <typename P>
INLINE void rope_store_rows(bf16* qkv, int64_t rows, const int64_t* positions, const bf16* cos,
                            const bf16* signed_sin, int64_t heads, int64_t kv_heads,
                            int64_t dim, P* pool, const int64_t* slots) {
  const int64_t stride = (heads + 2 * kv_heads) * dim, half = dim / 2;
  std::vector<float> x(dim);
  for (int64_t r = 0; r < rows; ++r) {
    bf16* row = qkv + r * stride;
    const bf16* c = cos + positions[r] * dim;
    const bf16* s = signed_sin + positions[r] * dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      bf16* v = row + h * dim;
      for (int64_t i = 0; i < dim; ++i) x[i] = to_float(v[i]);
      for (int64_t i = 0; i < half; ++i)
        v[i] = to_bf16(x[i] * to_float(c[i]) + x[i + half] * to_float(s[i]));
      for (int64_t i = half; i < dim; ++i)
        v[i] = to_bf16(x[i] * to_float(c[i]) + x[i - half] * to_float(s[i]));
    }
    P* slot = pool + slots[r] * 2 * kv_heads * dim;
    const bf16* kv = row + heads * dim;
    for (int64_t i = 0; i < 2 * kv_heads * dim; ++i) slot[i] = from_bf16<P>(kv[i]);
  }
}

KERNEL void rope_store_bf16(bf16* qkv, int64_t rows, const int64_t* positions, const bf16* cos,
                            const bf16* signed_sin, int64_t heads, int64_t kv_heads,
                            int64_t dim, bf16* pool, const int64_t* slots) {
  rope_store_rows(qkv, rows, positions, cos, signed_sin, heads, kv_heads, dim, pool, slots);
}

KERNEL void rope_store_f16(bf16* qkv, int64_t rows, const int64_t* positions, const bf16* cos,
                           const bf16* signed_sin, int64_t heads, int64_t kv_heads,
                           int64_t dim, _Float16* pool, const int64_t* slots) {
  rope_store_rows(qkv, rows, positions, cos, signed_sin, heads, kv_heads, dim, pool, slots);
}

struct AttendArgs {
  const bf16* qkv;
  int64_t qkv_stride;
  const void* pool;
  bool half;  // the pool's elements: _Float16, else bf16
  const int64_t* spec;  // per attended row: its row, the offset of its history, its length
  const int64_t* histories;
  bf16* out;
  int64_t heads, kv_heads, dim;
  float scale;
};

// Sixteen floats as one value (GCC's vector extensions): one zmm register with AVX-512, two
// ymm with AVX2, four xmm on the baseline, from the same source in each clone.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// IEEE half to float by integer operations, which vectorize (GCC 12 converts _Float16
// vectors one element at a time): the exponent and mantissa moved to a float's places and
// multiplied by 2^112, the difference of the two exponent biases, which also makes a half's
// subnormals the floats they stand for; infinity and NaN get the float's all-ones exponent.
INLINE f32x16 load16(const _Float16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16);
  const u32x16 magnitude = (w & 0x7fffu) << 13;
  f32x16 f;
  std::memcpy(&f, &magnitude, sizeof f);
  f *= 0x1p112f;
  u32x16 bits;
  std::memcpy(&bits, &f, sizeof bits);
  const u32x16 special = (w & 0x7c00u) == 0x7c00u;  // all ones where infinity or NaN
  bits |= ((w & 0x8000u) << 16) | (special & 0x7f800000u);
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

INLINE f32x16 load16(const bf16* p) {  // bfloat16: the float's upper half
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

INLINE float sum16(f32x16 v) {
  float total = 0.0f;
  for (int i = 0; i < 16; ++i) total += v[i];
  return total;
}

// The largest query heads a K/V head (group) and head size (in sixteens) ``attend`` takes;
// model.py keeps larger ones on PyTorch's attention.
constexpr int kMaxGroup = 16, kMaxChunks = 16;

// One query row's heads that share K/V head ``g``, over the row's history: softmax(q K^T
// scale) V, two passes over the history (scores, then the weighted sum of V). ``C``: the
// head size in sixteens of floats where it is known when compiling (64 and 128: whole
// registers, held across the history), else 0 and ``a.dim`` one float at a time.
template <typename P, int C>
INLINE void attend_head(const AttendArgs& a, const P* pool, int64_t j, int64_t g,
                        std::vector<float>& scores) {
  const int64_t row = a.spec[3 * j], length = a.spec[3 * j + 2];
  const int64_t* history = a.histories + a.spec[3 * j + 1];
  const int64_t group = a.heads / a.kv_heads, dim = C ? 16 * C : a.dim;
  const int64_t slot_size = 2 * a.kv_heads * dim, chunks = (dim + 15) / 16;
  scores.resize(group * length);
  alignas(64) f32x16 q[kMaxGroup * kMaxChunks];    // [group, chunks], scaled
  alignas(64) f32x16 acc[kMaxGroup * kMaxChunks];  // [group, chunks]
  float* s = scores.data();                        // [group, length]
  const bf16* qr = a.qkv + row * a.qkv_stride + g * group * dim;
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < chunks * 16; ++i)
      q[h * chunks + i / 16][i % 16] = i < dim ? to_float(qr[h * dim + i]) * a.scale : 0.0f;
  float top[kMaxGroup], total[kMaxGroup];
  for (int64_t h = 0; h < group; ++h) top[h] = -INFINITY;
  for (int64_t t = 0; t < length; ++t) {
    const P* k = pool + history[t] * slot_size + g * dim;
    for (int64_t h = 0; h < group; ++h) {
      float dot;
      if constexpr (C > 0) {
        f32x16 d = q[h * C] * load16(k);
        for (int c = 1; c < C; ++c) d += q[h * C + c] * load16(k + 16 * c);
        dot = sum16(d);
      } else {
        dot = 0.0f;
        for (int64_t i = 0; i < dim; ++i) dot += q[h * chunks + i / 16][i % 16] * load(k[i]);
      }
      s[h * length + t] = dot;
      top[h] = std::max(top[h], dot);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* p = s + h * length;
    const float m = top[h];
    float z = 0.0f;
    for (int64_t t = 0; t < length; ++t) {
      p[t] = fast_exp(p[t] - m);
      z += p[t];
    }
    total[h] = z;
  }
  for (int64_t i = 0; i < group * chunks; ++i) acc[i] = f32x16{};
  for (int64_t t = 0; t < length; ++t) {
    const P* v = pool + history[t] * slot_size + (a.kv_heads + g) * dim;
    if constexpr (C > 0) {
      f32x16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
      for (int64_t h = 0; h < group; ++h) {
        const float p = s[h * length + t];
        for (int c = 0; c < C; ++c) acc[h * C + c] += p * vv[c];
      }
    } else {
      for (int64_t h = 0; h < group; ++h) {
        const float p = s[h * length + t];
        for (int64_t i = 0; i < dim; ++i) acc[h * chunks + i / 16][i % 16] += p * load(v[i]);
      }
    }
  }
  bf16* o = a.out + row * a.heads * dim + g * group * dim;
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < dim; ++i)
      o[h * dim + i] = to_bf16(acc[h * chunks + i / 16][i % 16] / total[h]);
}

template <typename P>
INLINE void attend_tasks(const AttendArgs& a, const P* pool, int64_t first, int64_t last) {
  std::vector<float> scores;
  for (int64_t task = first; task < last; ++task) {
    const int64_t j = task / a.kv_heads, g = task % a.kv_heads;
    if (a.dim == 64)
      attend_head<P, 4>(a, pool, j, g, scores);
    else if (a.dim == 128)
      attend_head<P, 8>(a, pool, j, g, scores);
    else
      attend_head<P, 0>(a, pool, j, g, scores);
  }
}

KERNEL void attend_range(const AttendArgs& a, int64_t first, int64_t last) {
  if (a.half)
    attend_tasks(a, static_cast<const _Float16*>(a.pool), first, last);
  else
    attend_tasks(a, static_cast<const bf16*>(a.pool), first, last);
}

void attend(const AttendArgs& a, int64_t n, int64_t threads) {
  int64_t work = 0;
  for (int64_t j = 0; j < n; ++j) work += a.spec[3 * j + 2];
  work *= 2 * a.heads * a.dim;
  const int64_t tasks = n * a.kv_heads;
  threads = std::min(threads, tasks);
  if (threads <= 1 || work < kPoolWork) {
    attend_range(a, 0, tasks);
    return;
  }
  // Tasks (a row's K/V head) in a few chunks a thread, claimed in order (pool.h); each
  // writes its own outputs.
  struct Share {
    const AttendArgs* a;
    int64_t tasks, chunk;
  };
  const int64_t chunks = std::min(tasks, threads * 4);
  const Share share{&a, tasks, (tasks + chunks - 1) / chunks};
  run_tasks(
      [](const void* args, int64_t i) {
        const Share& s = *static_cast<const Share*>(args);
        attend_range(*s.a, i * s.chunk, std::min(s.tasks, (i + 1) * s.chunk));
      },
      &share, (tasks + share.chunk - 1) / share.chunk, threads);
}

template <typename T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

NB_MODULE(laya_torch_kernels, m) {
  m.doc() = "A decode step's small operations on bfloat16 rows (Laya's torch backend).";
  m.def(
      "add_rms_norm",
      [](uintptr_t h, uintptr_t delta, uintptr_t weight, uintptr_t out, int64_t rows,
         int64_t dim, float eps) {
        nb::gil_scoped_release release;
        add_rms_norm_rows(at<bf16>(h), at<const bf16>(delta), at<const bf16>(weight),
                          at<bf16>(out), rows, dim, eps);
      },
      "h, delta, weight, out, rows, dim, eps: h += delta (when delta is not 0, in place, "
      "rounded), then out = rms_norm(h) * weight; [rows, dim] bfloat16 each.");
  m.def(
      "silu_mul",
      [](uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t inner) {
        nb::gil_scoped_release release;
        silu_mul_rows(at<const bf16>(gate_up), at<bf16>(out), rows, inner);
      },
      "gate_up [rows, 2 inner], out [rows, inner]: out = silu(gate) * up.");
  m.def(
      "rope_store",
      [](uintptr_t qkv, int64_t rows, uintptr_t positions, uintptr_t cos, uintptr_t signed_sin,
         int64_t heads, int64_t kv_heads, int64_t dim, uintptr_t pool, bool half,
         uintptr_t slots) {
        nb::gil_scoped_release release;
        if (half)
          rope_store_f16(at<bf16>(qkv), rows, at<const int64_t>(positions), at<const bf16>(cos),
                         at<const bf16>(signed_sin), heads, kv_heads, dim, at<_Float16>(pool),
                         at<const int64_t>(slots));
        else
          rope_store_bf16(at<bf16>(qkv), rows, at<const int64_t>(positions),
                          at<const bf16>(cos), at<const bf16>(signed_sin), heads, kv_heads, dim,
                          at<bf16>(pool), at<const int64_t>(slots));
      },
      "Rotates each row's q and k heads in place and writes its K and V to pool[slots[row]] "
      "(float16 elements if half, else bfloat16).");
  m.def(
      "attend",
      [](uintptr_t qkv, int64_t qkv_stride, uintptr_t pool, bool half, uintptr_t spec,
         uintptr_t histories, int64_t n, uintptr_t out, int64_t heads, int64_t kv_heads,
         int64_t dim, float scale, int64_t threads) {
        nb::gil_scoped_release release;
        AttendArgs a{at<const bf16>(qkv), qkv_stride, at<const void>(pool), half,
                     at<const int64_t>(spec), at<const int64_t>(histories), at<bf16>(out),
                     heads, kv_heads, dim, scale};
        attend(a, n, threads);
      },
      "n one-token queries (spec [n, 3]: row, offset into histories, length) over their "
      "histories' pool slots; each writes out[row].");
  m.def("head_supported", &laya::head_supported,
        "Whether this CPU runs head_int8 (AVX2; AVX512-VNNI where it has it).");
  m.def(
      "head_int8",
      [](uintptr_t x, int64_t rows, int64_t dim, uintptr_t w, uintptr_t scales, uintptr_t out,
         int64_t vocab, int64_t threads, bool avx2) {
        if (!laya::head_supported()) throw nb::value_error("head_int8 needs AVX2");
        nb::gil_scoped_release release;
        laya::head_int8(at<const bf16>(x), rows, dim, at<const int8_t>(w),
                        at<const bf16>(scales), at<float>(out), vocab, threads, avx2);
      },
      nb::arg("x"), nb::arg("rows"), nb::arg("dim"), nb::arg("w"), nb::arg("scales"),
      nb::arg("out"), nb::arg("vocab"), nb::arg("threads"), nb::arg("avx2") = false,
      "x [rows, dim] bfloat16 (dim a multiple of 32), w [vocab, dim] int8, scales [vocab] "
      "bfloat16, out [rows, vocab] float32: out = bf16(x @ w.T * scales), as float32, x in "
      "16-bit steps of its row's largest value; avx2 takes the AVX2 code where AVX-512's "
      "would run.");
  m.def("q4_path", &laya::q4_path,
        "The code that runs q4_product on this CPU: 'avx512-vnni', 'avx2', or '' (none).");
  m.def("q4_row_bytes", &laya::q4_row_bytes, "in: the bytes of a row of q4_product's layout.");
  m.def(
      "q4_order",
      [](int64_t in, uintptr_t out) {
        const std::vector<int32_t> order = laya::q4_order(in);
        std::memcpy(at<int32_t>(out), order.data(), order.size() * sizeof(int32_t));
      },
      "in, out [in] int32: the input of each stored 4-bit value of a row, in storing order.");
  m.def(
      "q4_product",
      [](uintptr_t x, int64_t rows, int64_t in, uintptr_t w, int64_t n, uintptr_t out,
         int64_t threads, bool avx2) {
        if (in <= 0 || in % 64 || in > (int64_t{1} << 20))
          throw nb::value_error("q4_product takes inputs in multiples of 64, up to 2^20");
        if (!*laya::q4_path()) throw nb::value_error("q4_product needs AVX2, FMA and F16C");
        nb::gil_scoped_release release;
        laya::q4_product(at<const bf16>(x), rows, in, at<const uint8_t>(w), n, at<bf16>(out),
                         threads, avx2);
      },
      nb::arg("x"), nb::arg("rows"), nb::arg("in_features"), nb::arg("w"), nb::arg("n"),
      nb::arg("out"), nb::arg("threads"), nb::arg("avx2") = false,
      "x [rows, in] bfloat16, w [n, q4_row_bytes(in)] uint8, out [rows, n] bfloat16: out = "
      "x @ w.T, x in 16-bit steps of each group's largest value; avx2 takes the AVX2 code "
      "where AVX-512's would run.");
}
