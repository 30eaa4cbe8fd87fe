"""A tiny, exact backend for testing the engine without a model file.

Its vocabulary is the 256 byte values plus an end token (256); tokenizing is UTF-8 encoding,
so multi-byte characters arrive split across tokens. Its "model" repeats the prompt: the token
at position p is ``prompt[p % len(prompt)]``, or the end token where the prompt holds a 0 byte.
It keeps the tokens each slot was fed and checks every step is fed in order, so it also checks
the engine's chunking and slot bookkeeping. Prompt log-probabilities follow from that model:
each prompt token is certain given those before it (log-probability 0, rank 1, and no
alternatives with any probability to list).

An allowed-token mask (``StepItem.allowed_tokens``) is honoured: where it excludes the token
the model would say, the toy says the lowest allowed token id instead, with the
log-probability the model gives it (-inf: the model was certain of another token); a mask
allowing nothing fails that item alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from laya_core.allowed_tokens import NO_TOKEN_ALLOWED
from laya_core.backend import Backend, ModelConfig, ModelInfo, StepItem, StepResult
from laya_core.cache import BlockCachePolicy
from laya_core.engine import Engine
from laya_core.scheduler import FcfsScheduler
from laya_core.tokenizer import Tokenizer
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
    name = "toy"
    option_names = frozenset({"load_delay_s", "fail_load", "step_delay_s"})

    def load_weights(self) -> ModelInfo:
        time.sleep(self.config.options.get("load_delay_s", 0.0))
        if self.config.options.get("fail_load"):
            raise OSError("the weights are unreadable")
        self.fed: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.steps: list[list[StepItem]] = []
        return ModelInfo(n_ctx_train=512, vocab_size=257, eog_token_ids=frozenset({END}),
                         chat_template=None, bos_token="", eos_token="", add_bos=False)

    def allocate_cache(self, *, n_ctx: int, max_num_seqs: int) -> None:
        self.n_ctx = n_ctx
        self.max_num_seqs = max_num_seqs

    def tokenizer(self) -> ToyTokenizer:
        return ToyTokenizer()

    supports_prefix_sharing = True

    def start_sequence(self, slot: int, params: SamplingParams, keep_tokens: int = 0) -> None:
        assert 0 <= slot < self.max_num_seqs
        assert keep_tokens or slot not in self.fed, f"slot {slot} started twice"
        self.fed[slot] = self.fed.get(slot, [])[:keep_tokens]
        self.prompt_len.pop(slot, None)

    def share_prefix(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        assert not self.fed.get(dst_slot), f"slot {dst_slot} is in use"
        self.fed[dst_slot] = self.fed[src_slot][:num_tokens]

    supports_prompt_logprobs = True

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        self.steps.append(list(items))
        time.sleep(self.config.options.get("step_delay_s", 0.0))  # a model takes time
        assert sum(len(i.tokens) for i in items) <= self.config.max_step_tokens
        out: list[StepResult] = []
        for item in items:
            history = self.fed[item.slot]
            assert item.start_pos == len(history), "tokens fed out of order"
            assert len(item.tokens) - item.sample <= len(item.score_targets) \
                or not item.score_targets, "a chunk scores each row that does not sample"
            history.extend(item.tokens)
            scores = tuple(Sample(t, 0.0, ((t, 0.0),) if item.score_top else (), rank=1)
                           for t in item.score_targets)
            if not item.sample:
                out.append(StepResult(None, scores))
                continue
            prompt_len = self.prompt_len.get(item.slot) or len(history)
            self.prompt_len[item.slot] = prompt_len
            token = history[len(history) % prompt_len] or END
            out.append(self._sample(item, token, scores))
        return out

    @staticmethod
    def _sample(item: StepItem, token: int, scores: tuple[Sample, ...]) -> StepResult:
        allowed = item.allowed_tokens
        if allowed is None or allowed.allows(token):
            return StepResult(Sample(token, 0.0), scores)
        if allowed.is_empty():
            return StepResult(None, scores, NO_TOKEN_ALLOWED)
        return StepResult(Sample(int(allowed.token_ids()[0]), float("-inf")), scores)

    supports_moving = True

    def move_sequence(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        assert not self.fed.get(dst_slot), f"slot {dst_slot} is in use"
        assert len(self.fed[src_slot]) == num_tokens, "a running sequence moves whole"
        self.fed[dst_slot] = self.fed.pop(src_slot)
        if src_slot in self.prompt_len:
            self.prompt_len[dst_slot] = self.prompt_len.pop(src_slot)

    def free_sequence(self, slot: int) -> None:
        self.fed.pop(slot)
        self.prompt_len.pop(slot, None)



def started_engine(**config: object) -> Engine:
    """An engine of the toy backend, loaded; ``config`` holds ModelConfig fields."""
    cfg = ModelConfig(name="toy", backend="toy", path="-", **config)  # type: ignore[arg-type]
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, BlockCachePolicy)
    engine.start()
    assert engine.wait_ready(5)
    return engine
