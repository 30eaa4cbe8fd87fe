// The output head's int8 product (head.cpp).
#pragma once

#include <cstdint>

#include "common.h"

namespace laya {

// Whether this CPU runs head_int8: AVX2 (AVX512-BW and AVX512-VNNI where it has them).
bool head_supported();

// out [rows, vocab] float32 = bf16(x @ w.T * scales) for x [rows, dim] bfloat16 (dim a
// multiple of 32), w [vocab, dim] int8 and scales [vocab] bfloat16; only where
// head_supported(); ``avx2`` takes the AVX2 code where AVX-512's would run (for tests).
void head_int8(const bf16* x, int64_t rows, int64_t dim, const int8_t* w, const bf16* scales,
               float* out, int64_t vocab, int64_t threads, bool avx2 = false);

}  // namespace laya
