"""A draft's check on the torch backend gives each of its rows the bits that decoding that
row's token alone gives (``model.build_batch``'s ``checks``), with the backend's defaults
(``deterministic`` off), so that the default prompt lookup changes no output. The rows
attend one call each; the products are the same bits for a row in any number of rows."""

from __future__ import annotations

from collections.abc import Container, Iterator

import pytest
import torch
from laya_backend_torch.backend import TorchBackend
from laya_backend_torch.model import LlamaModel, build_batch

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.types import SamplingParams

PROMPT = list(range(200, 260))  # 60 positions: a partly filled fourth block
DRAFT = [7, 1000, 2000, 3000, 4000, 5, 6, 7, 8]  # nine rows: a check of eight drafts


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def model(request: pytest.FixtureRequest) -> Iterator[LlamaModel]:
    before = torch.get_num_threads()
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=256, max_num_seqs=3, options={"n_threads": request.param}))
    backend.load_weights()
    assert backend.describe()["exact_drafts"] is True
    assert backend.describe()["batch_invariant"] is False  # float32 attention
    backend.allocate_kv(num_tokens=64 * 16, max_num_seqs=3)  # blocks 0 to 63
    yield backend._model  # type: ignore[misc]
    torch.set_num_threads(before)


def forward(model: LlamaModel, items: list[tuple[list[int], int, list[int]]],
            rows: list[int], checks: Container[int] = ()) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(build_batch(items, rows, 16, checks))


def test_a_checks_rows_are_lone_decodes(model: LlamaModel) -> None:
    alone, checked, other = list(range(16)), list(range(16, 32)), list(range(32, 48))
    for table in (alone, checked, other):
        forward(model, [(PROMPT, 0, table)], [len(PROMPT) - 1])
    # The draft's tokens decoded one at a time, each step alone.
    solo = [forward(model, [([t], len(PROMPT) + j, alone)], [0])[0]
            for j, t in enumerate(DRAFT)]
    # The same tokens checked in one step, alone and then beside another sequence's decode
    # and a prompt chunk (a new sequence's first 20 positions).
    rows = list(range(len(DRAFT)))
    together = forward(model, [(DRAFT, len(PROMPT), checked)], rows, {0})
    beside = forward(model, [([9], len(PROMPT), other), (DRAFT, len(PROMPT), checked),
                             (PROMPT[:20], 0, list(range(48, 64)))],
                     [0, *(1 + r for r in rows), len(DRAFT) + 20], {1})
    for j in rows:
        assert torch.equal(together[j], solo[j]), f"row {j} of the check alone"
        assert torch.equal(beside[1 + j], solo[j]), f"row {j} of the check beside others"


def test_a_sequence_alone_answers_alike_with_drafts() -> None:
    """Through ``TorchBackend.step``: a sequence that decodes alone in its steps keeps a
    draft of its own greedy tokens with the log-probabilities its one-token decodes had,
    also beside another sequence's prompt chunk (no other sequence decodes there, so it
    would have decoded alone without the draft)."""
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=256, max_num_seqs=3, options={"n_threads": 1}))
    backend.load_weights()
    backend.allocate_kv(num_tokens=64 * 16, max_num_seqs=3)
    greedy = SamplingParams(max_tokens=100, temperature=0.0, logprobs=1)
    for seq in range(3):
        backend.start_sequence(seq, greedy)
    tables = [list(range(16 * s, 16 * s + 16)) for s in range(3)]
    (first,) = backend.step([StepItem(0, PROMPT, 0, True, block_table=tables[0])])
    assert first.sample is not None
    solo, token = [], first.sample.token_id
    for j in range(6):  # one token at a time: the reference
        (result,) = backend.step([StepItem(0, [token], len(PROMPT) + j, True,
                                           block_table=tables[0])])
        assert result.sample is not None
        solo.append(result.sample)
        token = result.sample.token_id
    draft = [s.token_id for s in solo[:5]]
    for seq, beside in ((1, []), (2, [StepItem(0, PROMPT[:20], 0, False,
                                               block_table=tables[0])])):
        backend.step([StepItem(seq, PROMPT, 0, True, block_table=tables[seq])])
        item = StepItem(seq, [first.sample.token_id, *draft], len(PROMPT), True,
                        block_table=tables[seq], draft=draft)
        result = backend.step([item, *beside])[0]
        assert result.sample is not None
        kept = [result.sample, *result.accepted]
        assert [s.token_id for s in kept] == [s.token_id for s in solo]
        assert [s.logprob for s in kept] == [s.logprob for s in solo], f"beside {beside}"
