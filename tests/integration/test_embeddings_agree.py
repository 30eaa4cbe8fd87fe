"""The two backends embed the same text alike: llama.cpp with the file's Q4_1 weights
against torch with its defaults (int4 layers, bfloat16 on an AVX512-BF16 CPU) and with the
weights dequantized to float32."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_backend_torch.backend import TorchBackend

from laya_core.backend import Backend, ModelConfig
from laya_core.builtin.model_paths import embedded_file
from laya_core.engine.embed_jobs import unit_float32

pytestmark = pytest.mark.model


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The torch backend's load sets the calling thread's torch threads: one, as asked,
    and back afterwards."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)

# Cosine similarity of the two backends' embeddings of one text. Measured (AMD EPYC,
# avx2/avx512, one thread): 0.9985 to 0.9998 over prose, code, digits, chat markup and a
# 300-token text, with torch's defaults and in float32 alike; two different texts of the
# same kind score 0.45 to 0.71.
MIN_COSINE = 0.995
TEXTS = ["The capital of France is Paris.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n",
         " ".join(f"word{i}" for i in range(60))]  # longer than torch's 64-token chunks


def vectors(backend: Backend) -> np.ndarray:
    backend.load_weights()
    backend.allocate_kv(num_tokens=1024, max_num_seqs=2)
    tok = backend.tokenizer()
    try:
        return np.stack([np.frombuffer(unit_float32(backend.embed(tok.encode(
            t, add_special=True))), "<f4") for t in TEXTS])
    finally:
        backend.close()


def config(backend: str, **options: object) -> ModelConfig:
    return ModelConfig(name="smollm2", backend=backend,
                       path=embedded_file("smollm2-135m-instruct"), max_seq_len=512,
                       max_num_seqs=2, max_step_tokens=64, embeddings=True,
                       options={"n_threads": 1, **options})


@pytest.fixture(scope="module")
def llamacpp() -> np.ndarray:
    return vectors(LlamaCppBackend(config("llamacpp")))


@pytest.mark.parametrize("options", [{}, {"dtype": "float32", "quantize": "none"}],
                         ids=["defaults", "float32"])
def test_the_backends_agree(llamacpp: np.ndarray, options: dict[str, str]) -> None:
    torch_vectors = vectors(TorchBackend(config("torch", **options)))
    cosines = (llamacpp * torch_vectors).sum(axis=1)
    assert cosines.min() >= MIN_COSINE, cosines
    # and each text is nearer its own embedding on the other backend than any other text
    assert ((llamacpp @ torch_vectors.T).argmax(axis=1) == np.arange(len(TEXTS))).all()


def test_llamacpp_embeds_what_its_own_pooling_gives(llamacpp: np.ndarray) -> None:
    """Last-token pooling (SmolLM2 declares none) against llama.cpp's own LAST pooling."""
    import llama_cpp as ll

    backend = LlamaCppBackend(config("llamacpp"))
    backend.load_weights()
    try:
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 512, 512, 512
        params.embeddings, params.pooling_type = True, 3  # LLAMA_POOLING_TYPE_LAST
        # as the backend computes by default: flash attention off (on, the two differ from
        # the fourth digit: llama.cpp's kernels with and without it sum otherwise)
        params.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = ll.llama_init_from_model(backend._model, params)
        ids = backend.tokenize(TEXTS[0], add_special=True)
        batch = ll.llama_batch_init(len(ids), 0, 1)
        for j, token in enumerate(ids):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, j, 1
            batch.seq_id[j][0], batch.logits[j] = 0, True
        batch.n_tokens = len(ids)
        assert ll.llama_decode(ctx, batch) == 0
        ll.llama_batch_free(batch)
        own = np.ctypeslib.as_array(ll.llama_get_embeddings_seq(ctx, 0), shape=(576,))
        own = own / np.linalg.norm(own)
        ll.llama_free(ctx)
        assert float(own @ llamacpp[0]) > 0.9999
    finally:
        backend.close()
