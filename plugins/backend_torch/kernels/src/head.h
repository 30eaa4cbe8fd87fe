// The output head's int8 product (head.cpp).
#pragma once

#include <cstdint>

#include "common.h"

namespace laya {

// Whether this CPU runs head_int8: AVX512-BW and AVX512-VNNI.
bool head_supported();

// out [rows, vocab] float32 = bf16(x @ w.T * scales) for x [rows, dim] bfloat16 (dim a
// multiple of 32), w [vocab, dim] int8 and scales [vocab] bfloat16; only where
// head_supported().
void head_int8(const bf16* x, int64_t rows, int64_t dim, const int8_t* w, const bf16* scales,
               float* out, int64_t vocab, int64_t threads);

}  // namespace laya
