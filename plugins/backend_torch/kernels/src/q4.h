// The layers' 4-bit products (q4.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace laya {

// Which code runs q4_product on this CPU: "avx512-vnni" (AVX512-BW, -DQ and -VNNI), "avx2"
// (AVX2, FMA and F16C), or "" where neither runs.
const char* q4_path();

// The bytes of one output row of a [n, in] matrix in q4_product's layout (in a multiple of
// 64): in / 2 bytes of 4-bit values, then a float16 scale and a float16 minimum for each
// group of 32 inputs.
int64_t q4_row_bytes(int64_t in);

// Which input each stored 4-bit value of a row is, in storing order (see q4.cpp): the
// values' byte j of a 32-byte chunk c holds order[64c + j] in its low half and
// order[64c + 32 + j] in its high half.
std::vector<int32_t> q4_order(int64_t in);

// out [rows, n] bfloat16 = x @ w.T for x [rows, in] bfloat16 and w [n, q4_row_bytes(in)]:
// w[o, i] = scale x q + min of i's group in row o. Only where q4_path() is not "";
// ``avx2`` takes the AVX2 code where AVX-512's would run (for tests).
void q4_product(const bf16* x, int64_t rows, int64_t in, const uint8_t* w, int64_t n,
                bf16* out, int64_t threads, bool avx2 = false);

}  // namespace laya
