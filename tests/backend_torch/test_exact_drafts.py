"""A draft's check on the torch backend gives each of its rows the bits that decoding that
row's token alone gives (``model.build_batch``'s ``checks``), with the backend's defaults
(``deterministic`` off), so that the default prompt lookup changes no output. The rows
attend one call each; the products are the same bits for a row in any number of rows.

Both ways a step runs: on laya_torch_kernels (the default, ``native``), where every
one-token query attends on its own, and on PyTorch's operations (``eager``: the model's
``kernels`` taken away, as where they are not installed)."""

from __future__ import annotations

from collections.abc import Container, Iterator

import pytest
import torch
from laya_backend_torch.backend import TorchBackend
from laya_backend_torch.batch import build_batch
from laya_backend_torch.model import LlamaModel

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.types import SamplingParams

PROMPT = list(range(200, 260))  # 60 positions: a partly filled fourth block
DRAFT = [7, 1000, 2000, 3000, 4000, 5, 6, 7, 8]  # nine rows: a check of eight drafts


def loaded(threads: int, native: bool) -> TorchBackend:
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=256, max_num_seqs=3, options={"n_threads": threads}))
    backend.load_weights()
    assert backend.describe()["exact_drafts"] is True
    assert backend.describe()["batch_invariant"] is False  # float32 attention
    assert backend.describe()["kernels"].startswith("laya_torch_kernels")
    if not native:
        backend._model.kernels = None  # type: ignore[attr-defined]
    backend.allocate_kv(num_tokens=64 * 16, max_num_seqs=3)  # blocks 0 to 63
    assert backend._model.native is native  # type: ignore[attr-defined]
    return backend


@pytest.fixture(scope="module", params=[(1, True), (2, True), (1, False), (2, False)],
                ids=["1-thread-native", "2-threads-native", "1-thread-eager",
                     "2-threads-eager"])
def model(request: pytest.FixtureRequest) -> Iterator[LlamaModel]:
    before = torch.get_num_threads()
    yield loaded(*request.param)._model  # type: ignore[misc]
    torch.set_num_threads(before)


def forward(model: LlamaModel, items: list[tuple[list[int], int, list[int]]],
            rows: list[int], checks: Container[int] = ()) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(build_batch(items, rows, 16, checks, model.native))


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


def test_on_the_kernels_a_decode_is_alike_in_any_batch() -> None:
    """On the kernels a decoding row attends on its own: its logits are a lone decode's
    bits beside other decodes of longer and shorter histories, a check and a prompt chunk."""
    before = torch.get_num_threads()
    model = loaded(2, True)._model
    tables = [list(range(16 * s, 16 * s + 16)) for s in range(4)]
    for s, n in enumerate((60, 20, 100)):
        forward(model, [(list(range(300, 300 + n)), 0, tables[s])], [n - 1])
    alone = forward(model, [([11], 60, tables[0])], [0])[0]
    together = forward(model, [([12], 20, tables[1]), ([11], 60, tables[0]),
                               ([13], 100, tables[2]), ([14, 15, 16], 101, tables[2]),
                               (PROMPT[:30], 0, tables[3])], [0, 1, 2, 5, 35])
    torch.set_num_threads(before)
    assert torch.equal(together[1], alone)


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_a_sequence_alone_answers_alike_with_drafts(native: bool) -> None:
    """Through ``TorchBackend.step``: a sequence that decodes alone in its steps keeps a
    draft of its own greedy tokens with the log-probabilities its one-token decodes had,
    also beside another sequence's prompt chunk (no other sequence decodes there, so it
    would have decoded alone without the draft)."""
    backend = loaded(1, native)
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


def test_the_model_takes_the_head_where_it_can() -> None:
    """The int8 output head runs on the kernels where the CPU has AVX2 (/ready says so), and
    its logits are torch's product's within bfloat16's rounding; elsewhere the model keeps
    torch's."""
    import laya_torch_kernels

    before = torch.get_num_threads()
    backend = loaded(2, True)
    model = backend._model
    supported = laya_torch_kernels.head_supported()
    assert model.native_head is supported
    assert ("the int8 output head too" in backend.describe()["kernels"]) is supported
    table = list(range(16))
    items = [(PROMPT[:40], 0, table)]
    kernel_logits = forward(model, items, [39])
    model.native_head = False
    torch_logits = forward(model, items, [39])
    torch.set_num_threads(before)
    step = 2.0 ** -7 * torch_logits.abs().amax()
    assert ((kernel_logits - torch_logits).abs() <= step).all()
    assert kernel_logits.argmax() == torch_logits.argmax()


def test_on_the_kernels_an_index_out_of_range_is_an_error() -> None:
    """The kernels index the pool without bounds checks of their own: a slot or position
    outside it is refused before they run, as PyTorch's index_select refuses it."""
    before = torch.get_num_threads()
    model = loaded(1, True)._model
    torch.set_num_threads(before)
    slots = model.kv_pool.shape[1]
    positions = model.cos.shape[0]
    for table, start in (([slots // 16], 0), (list(range(positions // 16 + 1)), positions)):
        with pytest.raises(IndexError, match="out of range"):
            forward(model, [([5], start, table)], [0])


@pytest.mark.parametrize(("options", "reason"), [
    ({"deterministic": True}, "off: deterministic attends in float64"),
    ({"dtype": "float32"}, "off: they take bfloat16 on the CPU")])
def test_kernels_say_why_they_are_off(options: dict[str, object], reason: str) -> None:
    """/ready's ``kernels`` names why a replica runs PyTorch's operations instead."""
    before = torch.get_num_threads()
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=256, max_num_seqs=1, options={"n_threads": 1, **options}))
    backend.load_weights()
    torch.set_num_threads(before)
    assert backend.describe()["kernels"] == reason
