"""llama.cpp's products of a Q4_1 or Q8_0 matrix with several rows, through the kernels Laya
adds (plugins/backend_llamacpp/patches/q4_1-gemm.patch): each row comes out bit for bit as
the one-row product gives it, and right; and the installed llama-cpp-python is the patched
build.

ggml is called directly (ctypes, on the libraries llama-cpp-python ships): a matrix of
random weights times 1 to 17 rows of activations, on one thread and on two, with an even
and an odd number of blocks a row (the AVX-512 kernel takes blocks two at a time). Rows 2
to 17 go through the several-row kernels (tiles of 4 x 4, and of 2 x 5 to 2 x 8, once or
twice over), one row through llama.cpp's own. A change of one part in 10^4 in the kernel's
sums fails the first test (checked by hand)."""

from __future__ import annotations

import ctypes
import importlib.metadata
from pathlib import Path

import numpy as np
import pytest

Q4_1, Q8_0, F32 = 3, 8, 0  # enum ggml_type
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
M = 98  # rows that do not fill the kernels' tiles evenly
ROWS = 17


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


@pytest.fixture(scope="module")
def ggml() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp  # loads the libraries first, as the backend does

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.argtypes, base.ggml_init.restype = [InitParams], p
    base.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_2d.restype = p
    base.ggml_mul_mat.argtypes, base.ggml_mul_mat.restype = [p, p, p], p
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes = [p, p]
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_free.argtypes = [p]
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, p]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    cpu.ggml_cpu_init.argtypes = []
    cpu.ggml_cpu_init()
    return base, cpu


def product(ggml: tuple[ctypes.CDLL, ctypes.CDLL], kind: int, w: bytes, x: np.ndarray,
            threads: int) -> np.ndarray:
    """ggml_mul_mat of the matrix ``w`` [M, K] of type ``kind`` and the float32 rows ``x``
    [n, K]: [n, M]."""
    base, cpu = ggml
    k = x.shape[1]
    ctx = base.ggml_init(InitParams(64 << 20, None, False))
    try:
        a = base.ggml_new_tensor_2d(ctx, kind, k, M)
        b = base.ggml_new_tensor_2d(ctx, F32, k, len(x))
        ctypes.memmove(base.ggml_get_data(a), w, len(w))
        ctypes.memmove(base.ggml_get_data(b), np.ascontiguousarray(x, np.float32).ctypes.data,
                       x.size * 4)
        out = base.ggml_mul_mat(ctx, a, b)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
        data = (ctypes.c_float * (M * len(x))).from_address(base.ggml_get_data(out))
        return np.array(data, dtype=np.float32).reshape(len(x), M)
    finally:
        base.ggml_free(ctx)


def dequantize(kind: int, w: bytes, k: int) -> np.ndarray:
    """The matrix ``w`` as float64 [M, k]. Q4_1 blocks: float16 scale d and minimum m, 16
    bytes of 4-bit q (the low halves are the block's first 16 values), d x q + m. Q8_0
    blocks: float16 scale d, 32 signed bytes q, d x q."""
    blocks = np.frombuffer(w, dtype=np.uint8).reshape(M, k // 32, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    if kind == Q8_0:
        return (d * blocks[..., 2:].view(np.int8).astype(np.float64)).reshape(M, k)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    qs = blocks[..., 4:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.float64)
    return (d * q + m).reshape(M, k)


def quantize(ggml: tuple[ctypes.CDLL, ctypes.CDLL], kind: int, k: int) -> bytes:
    rng = np.random.default_rng(7)
    f = rng.normal(0.0, 0.05, size=(M, k)).astype(np.float32)
    f[:, :32] += 0.2  # a block whose minimum is far from zero: Q4_1's m x s term matters
    dst = ctypes.create_string_buffer(M * k // 32 * BLOCK_BYTES[kind])
    size = ggml[0].ggml_quantize_chunk(kind, f.ctypes.data, dst, 0, M, k, None)
    assert size == len(dst)
    return dst.raw


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [576, 608], ids=["18-blocks", "19-blocks"])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_of_a_batch_is_its_one_row_product(ggml, kind: int, k: int,
                                                     threads: int) -> None:
    weights = quantize(ggml, kind, k)
    rng = np.random.default_rng(threads)
    x = rng.normal(0.0, 1.0, size=(ROWS, k)).astype(np.float32)
    alone = np.concatenate([product(ggml, kind, weights, x[i:i + 1], threads)
                            for i in range(ROWS)])
    for n in range(2, ROWS + 1):
        together = product(ggml, kind, weights, x[:n], threads)
        assert together.tobytes() == alone[:n].tobytes(), n  # bit for bit
    # ... and the products are right: the activations go through 8 bits on the way.
    want = x.astype(np.float64) @ dequantize(kind, weights, k).T
    assert np.abs(alone - want).max() < 0.01 * np.abs(want).max()


def test_the_installed_llama_cpp_carries_laya_s_patches() -> None:
    version = importlib.metadata.version("llama-cpp-python")
    assert version.endswith("+laya.q41gemm.rowexact"), version
