// What the kernels of laya_torch_kernels share: bfloat16 as bits, its conversions, which
// code the CPU runs, and when a call is worth a second thread.
#pragma once

#include <cstdint>
#include <cstring>

#define INLINE inline __attribute__((always_inline))

namespace laya {

using bf16 = uint16_t;

inline float to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 to_bf16(float f) {  // round to nearest even, as torch's cast does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// Which of the kernels' codes this CPU runs: AVX-512 with VNNI (the BW, DQ and VNNI
// extensions, and F16C), or AVX2 (with FMA and F16C, which every AVX2 CPU has).
inline bool cpu_avx512_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Below this many multiply-adds a product stays on the calling thread even with the pool's
// workers spinning (pool.h): handing work over costs about a microsecond.
constexpr int64_t kPoolWork = 1 << 16;

}  // namespace laya
