"""A tiny, exact backend for testing the engine without a model file.

Its vocabulary is the 256 byte values plus an end token (256); tokenizing is UTF-8 encoding,
so multi-byte characters arrive split across tokens. Its "model" repeats the prompt: the token
at position p is ``prompt[p % len(prompt)]``, or the end token where the prompt holds a 0 byte.
It is a paged backend: each position's token id lives in a block of its KV pool, and a step
reads the sequence's history through the item's block table only, so a wrong block table or
KV shared where it should not be changes its output. It checks every sequence is fed in
order, so it also checks the engine's chunking and the KV manager's bookkeeping. Prompt
log-probabilities follow from that model: each prompt token is certain given those before it
(log-probability 0, rank 1, and no alternatives with any probability to list).

An allowed-token mask (``StepItem.allowed_tokens``) is honoured: where it excludes the token
the model would say, the toy says the lowest allowed token id instead, with the
log-probability the model gives it (-inf: the model was certain of another token); a mask
allowing nothing fails that item alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from laya_core.backend import (
    Backend,
    MemoryProfile,
    ModelConfig,
    ModelInfo,
    Overhead,
    StepItem,
    StepResult,
)
from laya_core.config import manifest as mf
from laya_core.engine.allowed_tokens import NO_TOKEN_ALLOWED, AllowedTokens
from laya_core.engine.engine import Engine
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.hookspecs import hookimpl
from laya_core.kv.policies import PagedKVCache
from laya_core.models.files import ModelShape
from laya_core.models.tokenizer import Tokenizer
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import Sample, SamplingParams

END = 256


class ToyTokenizer(Tokenizer):
    """UTF-8 bytes as token ids, and the end token; pure Python, so safe from any thread."""

    vocab_size = 257
    special_tokens: frozenset[str] = frozenset()

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == END else bytes([token_id])


class ToyBackend(Backend):
    """The toy model on the paged layout: its KV pool holds one token id per position, and
    each step reads a sequence's history through its block table only."""

    name = "toy"
    kv_layout = "paged"
    # gpu_bytes: a line of that many bytes on "cuda:0" in its plan (nothing is allocated),
    # for the residency of models on a GPU planned for another machine.
    option_names = frozenset({"load_delay_s", "fail_load", "step_delay_s", "crash_load",
                              "gpu_bytes"})

    @classmethod
    def memory_profile(cls, config: ModelConfig, shape: ModelShape) -> MemoryProfile:
        profile = super().memory_profile(config, shape)
        gpu = config.options.get("gpu_bytes")
        if not gpu:
            return profile
        return attrs.evolve(profile, overheads=(
            *profile.overheads, Overhead("toy on a GPU", int(gpu), "the option", device="cuda:0")))
    supports_prompt_logprobs = True
    supports_speculative = True

    def load_weights(self) -> ModelInfo:
        time.sleep(self.config.options.get("load_delay_s", 0.0))
        if self.config.options.get("fail_load"):
            raise OSError("the weights are unreadable")
        if self.config.options.get("crash_load"):  # a native crash, as a bad kernel gives
            import os
            import signal
            import sys

            print("toy: about to crash while loading", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        self.started: dict[int, int | None] = {}  # sequence id -> the next position it feeds
        self.prompt_len: dict[int, int] = {}
        self.steps: list[list[StepItem]] = []
        self.embedded: list[list[int]] = []  # each input embedded, in order
        return ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                         chat_template=None, bos_token="", eos_token="", add_bos=False)

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        self.num_tokens, self.max_num_seqs = num_tokens, max_num_seqs
        # pool: [num_blocks][block_size] token ids; None where no KV was ever written
        block = self.block_size
        self.pool: list[list[int | None]] = [[None] * block for _ in range(num_tokens // block)]

    def tokenizer(self) -> ToyTokenizer:
        return ToyTokenizer()

    def load_tokenizer(self) -> ToyTokenizer:
        return ToyTokenizer()

    def start_sequence(self, seq_id: int, params: SamplingParams) -> None:
        assert seq_id not in self.started, f"sequence {seq_id} started twice"
        self.started[seq_id] = None

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        self.steps.append(list(items))
        time.sleep(self.config.options.get("step_delay_s", 0.0))  # a model takes time
        assert sum(len(i.tokens) for i in items) <= self.config.max_step_tokens
        assert len(items) <= self.max_num_seqs
        return [self._run(item) for item in items]

    def _run(self, item: StepItem) -> StepResult:
        expected = self.started[item.seq_id]
        assert expected in (None, item.start_pos), "tokens fed out of order"
        assert len(item.tokens) - item.sample <= len(item.score_targets) \
            or not item.score_targets, "a chunk scores each row that does not sample"
        table, end, block = item.block_table, item.start_pos + len(item.tokens), self.block_size
        assert len(table) * block >= end, "a block table too short for its tokens"
        for j, token in enumerate(item.tokens):
            p = item.start_pos + j
            self.pool[table[p // block]][p % block] = token
        self.started[item.seq_id] = end
        history = [self.pool[table[p // block]][p % block] for p in range(end)]
        assert None not in history, "KV missing: a cached block that was never computed"
        scores = tuple(Sample(t, 0.0, ((t, 0.0),) if item.score_top else (), rank=1)
                       for t in item.score_targets)
        if not item.sample:
            return StepResult(None, scores)
        fed = end - len(item.draft)  # the draft's rows come after the row that samples
        prompt_len = self.prompt_len.setdefault(item.seq_id, fed)
        token = history[fed % prompt_len] or END
        result = self._answer(item, token, scores)  # type: ignore[arg-type]
        if result.sample is None:
            return result
        last = result.sample
        accepted: list[Sample] = []
        # Kept while the model says the draft; each row after a draft token under its mask.
        for j, (drafted, mask) in enumerate(zip(item.draft, item.draft_masks, strict=True)):
            if last.token_id != drafted or (mask is not None and mask.is_empty()):
                break
            last = self._sample(history[(fed + j + 1) % prompt_len] or END, mask)
            accepted.append(last)
        self.started[item.seq_id] = fed + len(accepted)  # the rest is fed again
        return attrs.evolve(result, accepted=tuple(accepted))

    @classmethod
    def _answer(cls, item: StepItem, token: int, scores: tuple[Sample, ...]) -> StepResult:
        """The row that samples: the toy's token under the item's mask, or the error of a
        mask that allows nothing."""
        if item.allowed_tokens is not None and item.allowed_tokens.is_empty():
            return StepResult(None, scores, NO_TOKEN_ALLOWED)
        return StepResult(cls._sample(token, item.allowed_tokens), scores)

    @staticmethod
    def _sample(token: int, allowed: AllowedTokens | None) -> Sample:
        """The toy's token, or where its mask refuses it the first token the mask allows
        (the mask allows some: checked before)."""
        if allowed is None or allowed.allows(token):
            return Sample(token, 0.0)
        return Sample(int(allowed.token_ids()[0]), float("-inf"))

    def free_sequence(self, seq_id: int) -> None:
        del self.started[seq_id]
        self.prompt_len.pop(seq_id, None)

    supports_embeddings = True
    EMBEDDING_SIZE = 8

    def embed(self, token_ids: Sequence[int]) -> list[float]:
        """The toy's embedding: how many of the input's tokens fall in each residue class
        mod 8 (so two texts with the same letters in another order embed alike), plus the
        last token's class counted once more (the default pooling's last-token weight)."""
        assert all(0 <= t < END for t in token_ids), "an id outside the vocabulary"
        vector = [0.0] * self.EMBEDDING_SIZE
        for t in token_ids:
            vector[t % self.EMBEDDING_SIZE] += 1.0
        vector[token_ids[-1] % self.EMBEDDING_SIZE] += 1.0
        self.embedded.append(list(token_ids))
        time.sleep(self.config.options.get("step_delay_s", 0.0))
        return vector


class ToyPlugin:
    """Registers the toy backend as ``toy``: the conformance suite's ``--laya-plugin
    toy_backend:PLUGIN``."""

    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("toy", ToyBackend)


PLUGIN = ToyPlugin()


def toy_deployment(workdir: Path, models: list[dict[str, Any]],
                   server: dict[str, Any] | None = None) -> Deployment:
    """A deployment of ``models`` on the toy backend, not yet started: each model's table
    gets ``backend = "toy"`` and an empty weights file in ``workdir`` as its ``path`` (the
    toy reads none); ``server`` is the manifest's ``[server]`` table."""
    weights = workdir / "toy.bin"
    weights.write_bytes(b"")
    registry = load_registry([PLUGIN])
    tables: dict[str, Any] = {
        "models": [{"backend": "toy", "path": str(weights), **model} for model in models]}
    if server is not None:
        tables["server"] = server
    return Deployment(mf.resolve(mf.from_dict(tables), registry), registry)


def started_engine(**config: object) -> Engine:
    """An engine of the toy backend, loaded; ``config`` holds ModelConfig fields."""
    cfg = ModelConfig(name="toy", backend="toy", path="-", **config)  # type: ignore[arg-type]
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, PagedKVCache)
    engine.start()
    assert engine.wait_ready(5)
    return engine


def shared_prefix_workload(engine: Engine, count: int = 60, seed: int = 7) -> None:
    """More requests than slots, sharing a system prompt and repeating questions, arriving
    at random moments, so that the cache policy shares, reuses and evicts cached KV while
    others run. The toy repeats its prompt, so any wrong KV shows in an output; every output
    must be exact. Stops the engine."""
    import asyncio
    import random

    system = b"system: answer in one short sentence, politely. "
    questions = [b"user: why is the sky blue? ", b"user: name a prime. ",
                 b"user: what is a cat? and a dog? ", b"user: count to three. ",
                 b"user: where is Paris? ", b"user: say hi. "]
    rng = random.Random(seed)
    prompts = [system + rng.choice(questions) + b"assistant:" * rng.randint(0, 1)
               for _ in range(count)]

    def expected(prompt: bytes, n: int) -> str:
        return bytes(prompt[p % len(prompt)] for p in range(len(prompt), len(prompt) + n)).decode()

    async def one(prompt: bytes, n: int) -> str:
        await asyncio.sleep(rng.random() * 0.05)
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=n))
        return "".join([e.text async for e in stream])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p, 4 + i % 9) for i, p in enumerate(prompts)))

    outputs = asyncio.run(all_of_them())
    engine.stop()
    assert outputs == [expected(p, 4 + i % 9) for i, p in enumerate(prompts)]


def follow_up_conversation(engine: Engine) -> tuple[bytes, bytes]:
    """Ask a question, then its follow-up with the answer in its history; both outputs must
    be exact (the toy repeats its prompt: right only if the reused KV held the right tokens).
    Returns the first prompt and the follow-up. Stops the engine."""
    import asyncio

    history = b"system: be brief. user: hello there, how are you today? "

    async def ask(prompt: bytes, n: int) -> str:
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=n))
        return "".join([e.text async for e in stream])

    first = asyncio.run(ask(history, 8))
    follow_up = history + b"assistant: " + first.encode() + b" user: and you?"
    second = asyncio.run(ask(follow_up, len(follow_up)))
    engine.stop()
    assert first == history[:8].decode()
    assert second == follow_up.decode()
    return history, follow_up
