"""The toy model of toy_backend.py on the streams layout, as llama.cpp keeps its KV: a stream
per slot, run by the llama.cpp plugin's cache policy (``StreamsKVCache``).

It keeps the tokens each slot was fed and checks every step is fed in order, so the policy's
slots, takeovers, copies, moves and evictions show in its output when they are wrong.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from laya_backend_llamacpp.streams import StreamsKVCache
from toy_backend import ToyBackend

from laya_core.backend import ModelConfig, StepItem, StepResult
from laya_core.engine.engine import Engine
from laya_core.engine.scheduler import FcfsScheduler
from laya_core.types import Sample, SamplingParams


class StreamsToy(ToyBackend):
    name = "toy-streams"
    kv_layout = "streams"
    supports_moving = True

    def allocate_kv(self, *, num_tokens: int, max_num_seqs: int) -> None:
        self.num_tokens, self.max_num_seqs = num_tokens, max_num_seqs
        self.fed: dict[int, list[int]] = {}
        self.saved_kv_tokens = self.config.options.get("saved_kv_tokens", num_tokens // 4)
        self.saved: dict[int, list[int]] = {}

    def save_stream(self, slot: int, key: int) -> None:
        assert key not in self.saved
        self.saved[key] = list(self.fed[slot])

    def restore_stream(self, key: int, slot: int, num_tokens: int) -> None:
        assert not self.fed.get(slot), f"slot {slot} is in use"
        assert len(self.saved[key]) >= num_tokens, "restoring KV that was not saved"
        self.fed[slot] = self.saved.pop(key)[:num_tokens]

    def forget_saved(self, key: int) -> None:
        del self.saved[key]

    def start_sequence(self, slot: int, params: SamplingParams,  # type: ignore[override]
                       keep_tokens: int = 0) -> None:
        assert 0 <= slot < self.max_num_seqs
        assert keep_tokens or slot not in self.fed, f"slot {slot} started twice"
        self.fed[slot] = self.fed.get(slot, [])[:keep_tokens]
        self.prompt_len.pop(slot, None)

    def share_prefix(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        assert not self.fed.get(dst_slot), f"slot {dst_slot} is in use"
        assert len(self.fed[src_slot]) >= num_tokens, "copying KV that is not there"
        self.fed[dst_slot] = self.fed[src_slot][:num_tokens]

    def move_sequence(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        assert not self.fed.get(dst_slot), f"slot {dst_slot} is in use"
        assert len(self.fed[src_slot]) == num_tokens, "a running sequence moves whole"
        self.fed[dst_slot] = self.fed.pop(src_slot)
        if src_slot in self.prompt_len:
            self.prompt_len[dst_slot] = self.prompt_len.pop(src_slot)

    def free_sequence(self, slot: int) -> None:
        self.fed.pop(slot)
        self.prompt_len.pop(slot, None)

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        self.steps.append(list(items))
        time.sleep(self.config.options.get("step_delay_s", 0.0))
        assert sum(len(i.tokens) for i in items) <= self.config.max_step_tokens
        out: list[StepResult] = []
        for item in items:
            history = self.fed[item.seq_id]
            assert item.start_pos == len(history), "tokens fed out of order"
            history.extend(item.tokens)
            scores = tuple(Sample(t, 0.0, ((t, 0.0),) if item.score_top else (), rank=1)
                           for t in item.score_targets)
            if not item.sample:
                out.append(StepResult(None, scores))
                continue
            prompt_len = self.prompt_len.setdefault(item.seq_id, len(history))
            token = history[len(history) % prompt_len] or 256
            out.append(self._answer(item, token, scores))
        return out


def started_streams_engine(**config: object) -> Engine:
    """An engine of the streams toy with the llama.cpp plugin's policy, loaded."""
    cfg = ModelConfig(name="toy", backend="toy-streams", path="-",
                      **config)  # type: ignore[arg-type]
    engine = Engine(cfg, StreamsToy(cfg), FcfsScheduler, StreamsKVCache)
    engine.start()
    assert engine.wait_ready(5), engine.error
    return engine
