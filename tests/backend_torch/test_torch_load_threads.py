"""The torch backend loads on one thread and steps on the threads it chose.

The load is thousands of small tensor operations, each ending at an OpenMP barrier that
waits for every thread of the team; with a core taken by another process (or by another
replica loading at once) each barrier waits out a scheduler slice (backend.py,
``load_weights``). What is checked is where the thread count stands at each stage, not how
long the load took."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from laya_backend_torch import model
from laya_backend_torch.backend import TorchBackend

from laya_core.backend import ModelConfig
from laya_core.builtin.model_paths import embedded_file


def load_on_a_thread(n_threads: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Load the embedded model on a thread of its own, as an engine does (OpenMP's thread
    count is per calling thread); torch's thread count as the layers were built, after
    the load, and as the backend reports it."""
    seen: dict[str, Any] = {"building": []}
    build = model.LlamaModel.__init__

    def spy(self: model.LlamaModel, *args: Any, **kwargs: Any) -> None:
        seen["building"].append(torch.get_num_threads())
        build(self, *args, **kwargs)
        seen["building"].append(torch.get_num_threads())

    monkeypatch.setattr(model.LlamaModel, "__init__", spy)
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=64, max_num_seqs=1, options={"n_threads": n_threads}))

    def run() -> None:
        try:
            backend.load_weights()
            seen["loaded"] = torch.get_num_threads()
            seen["runtime"] = backend.describe()["n_threads"]
        finally:
            backend.close()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return seen


def test_the_load_runs_on_one_thread_and_gives_the_steps_theirs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = load_on_a_thread(2, monkeypatch)
    assert seen["building"] == [1, 1]
    assert seen["loaded"] == 2 and seen["runtime"] == 2
