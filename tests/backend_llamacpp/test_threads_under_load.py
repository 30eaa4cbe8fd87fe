"""n_threads "auto" on the real model: every core alone, one thread beside busy processes,
and every core again once they are gone."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from laya_backend_llamacpp import cpu
from laya_backend_llamacpp.backend import LlamaCppBackend

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.types import SamplingParams

# It needs every core free when the busy processes are gone: no other test beside it.
pytestmark = pytest.mark.serial

SEQ_LEN = 256


@pytest.fixture(scope="module")
def backend() -> Iterator[LlamaCppBackend]:
    if cpu.physical_cores() < 2:
        pytest.skip("one core: there is no thread to give up")
    b = LlamaCppBackend(ModelConfig(name="m", backend="llamacpp",
                                    path=embedded_file("smollm2-135m-instruct"),
                                    max_seq_len=SEQ_LEN, max_num_seqs=4))
    b.load_weights()
    b.allocate_cache(n_ctx=SEQ_LEN * 4, max_num_seqs=4)
    yield b
    b.close()


def decode_until(b: LlamaCppBackend, threads: int, timeout_s: float) -> bool:
    """Decode 4 sequences (restarting them when full) until ``threads`` are in use."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for slot in range(4):
            b.free_sequence(slot)
            b.start_sequence(slot, SamplingParams(temperature=0.0))
        out = b.step([StepItem(s, [1, 2, 3], 0, True) for s in range(4)])
        for pos in range(3, SEQ_LEN):
            tokens = [r.sample.token_id for r in out]  # type: ignore[union-attr]
            out = b.step([StepItem(s, [tokens[s]], pos, True) for s in range(4)])
            if b.describe()["n_threads"] == threads:
                return True
            if time.monotonic() > deadline:
                break
    return False


def in_worker_thread(fn: Callable[[], bool]) -> bool:
    """Decode on a thread of its own, as an engine does: the OpenMP team that a thread's
    decodes start ends with that thread, not with pytest's main thread, where it would slow
    every later engine in the session."""
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return bool(result and result[0])


def test_auto_threads_give_way_to_busy_processes_and_come_back(backend: LlamaCppBackend) -> None:
    b, cores = backend, cpu.physical_cores()
    assert b.describe()["n_threads"] == cores and b.describe()["n_threads_mode"] == "auto"
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        assert in_worker_thread(lambda: decode_until(b, 1, timeout_s=20)), b.describe()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert b.describe()["n_threads_drops"] >= 1
    # The probe after 4 s finds the cores free again and keeps them.
    assert in_worker_thread(lambda: decode_until(b, cores, timeout_s=30)), b.describe()
