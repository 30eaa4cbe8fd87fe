"""Speculative decoding in the core: the prompt-lookup drafter, and the engine feeding drafts
and keeping what the model agrees with, on the toy backend (exact: it repeats its prompt, so
any token kept wrongly, or KV left from a rejected draft, shows in an output)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from toy_backend import PLUGIN, shared_prefix_workload, started_engine

from laya_core.backend import ModelConfig
from laya_core.config import manifest as mf
from laya_core.config.table import ManifestError
from laya_core.engine.speculative import MAX_PAUSE, NgramDrafter, SpeculativeConfig
from laya_core.plugins import load_registry
from laya_core.types import AUTO_SPECULATIVE, SamplingParams


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_ngram() -> None:
    prompt = [1, 2, 3, 9, 1, 2, 3, 7, 7, 5, 2, 3]
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=3), prompt)
    # [2, 3] last appeared at 5..6 (followed by 7, 7, 5); [5, 2, 3] never appeared before.
    assert drafter.draft([], 8) == [7, 7, 5]
    # The output grows the text: [3, 4] has no earlier occurrence, nor has [4].
    assert drafter.draft([4], 8) == []
    # [1, 2, 3] last appeared at 4..6; the 4-gram [4, 1, 2, 3] did not.
    assert drafter.draft([4, 1, 2, 3], 8) == [7, 7, 5]
    assert drafter.draft([4, 1, 2, 3], 2) == [7, 7]  # the room left limits it


def test_a_copy_goes_on_where_it_was_while_the_text_follows_it() -> None:
    """Two alike lines (1 2 3 4 5 and 1 2 3 4 6), the first already copied: copying the
    second, the draft goes on along the second line, where the latest occurrence of the
    last two tokens is the first line's copy (which goes on with 5)."""
    prompt = [10, 1, 2, 3, 4, 5, 11, 1, 2, 3, 4, 6]
    drafter = NgramDrafter(SpeculativeConfig(prompt_lookup_max=2), prompt)
    assert drafter.draft([10, 1], 8) == [2, 3, 4, 5]
    drafter.accepted(4, 4)
    assert drafter.draft([10, 1, 2, 3, 4, 5, 11], 8) == [1, 2, 3, 4]  # the second line
    drafter.accepted(4, 1)
    assert drafter.draft([10, 1, 2, 3, 4, 5, 11, 1, 2, 3], 8)[:2] == [4, 6]
    # Once the text leaves the copy, the longest n-gram decides again.
    assert drafter.draft([10, 1, 2, 3, 4, 5, 11, 1, 2, 3, 9, 10, 1], 8)[:1] == [2]


def test_no_draft_without_a_long_enough_match_or_room() -> None:
    drafter = NgramDrafter(SpeculativeConfig(prompt_lookup_min=3), [1, 2, 5, 1, 2])
    assert drafter.draft([], 4) == []  # only [1, 2] repeats: shorter than the minimum
    assert NgramDrafter(SpeculativeConfig(), [1, 2, 5, 1, 2]).draft([], 0) == []


def test_drafts_back_off_while_they_fail_and_resume_when_one_is_kept() -> None:
    drafter = NgramDrafter(SpeculativeConfig(), [1, 2, 3, 1, 2])
    assert drafter.draft([], 4)
    drafter.accepted(3, 0)  # one failure: try again at once
    assert drafter.draft([], 4)
    paused = []
    for _ in range(8):  # failures in a row: pauses of 2, 4, 8 ... steps, at most MAX_PAUSE
        drafter.accepted(3, 0)
        steps = 0
        while not drafter.draft([], 4):
            steps += 1
        paused.append(steps)
    assert paused == [min(MAX_PAUSE, 2 ** k) for k in range(1, 9)]
    drafter.accepted(3, 1)  # kept: no pause after the next failure
    drafter.accepted(3, 0)
    assert drafter.draft([], 4)


def _outputs(engine, prompts: list[bytes], params: SamplingParams) -> list[str]:
    async def one(prompt: bytes) -> str:
        return "".join([e.text async for e in engine.submit(list(prompt), params)])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(all_of_them())


def test_the_engine_keeps_exactly_what_the_model_says_beside_neighbours() -> None:
    engine = started_engine(speculative=SpeculativeConfig(), max_num_seqs=4, max_step_tokens=24)
    shared_prefix_workload(engine)  # exact outputs, under sharing, reuse and eviction
    stats = engine.speculative
    # Some drafts were kept and some were not: both ways were taken.
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_drafts_stay_inside_max_tokens_and_the_step_budget() -> None:
    engine = started_engine(speculative=SpeculativeConfig(num_speculative_tokens=8),
                            max_num_seqs=3, max_step_tokens=6)
    prompts = [b"abcabcabcabc", b"xyxyxyxyxy", b"hello hello hello "]
    try:
        for n in (1, 2, 5, 11):
            out = _outputs(engine, prompts, SamplingParams(max_tokens=n))
            assert out == [bytes(p[i % len(p)] for i in range(len(p), len(p) + n)).decode()
                           for p in prompts]
        steps = engine.backend.steps
        assert all(sum(len(i.tokens) for i in step) <= 6 for step in steps)
        assert any(item.draft for step in steps for item in step)
    finally:
        engine.stop()


def test_a_request_may_opt_out() -> None:
    engine = started_engine(speculative=SpeculativeConfig())
    try:
        out = _outputs(engine, [b"abcabcabcabc"], SamplingParams(max_tokens=12,
                                                                 speculative=False))
        assert out == ["abcabcabcabc"]
        assert engine.speculative.num_drafts == 0
        assert not any(item.draft for step in engine.backend.steps for item in step)
    finally:
        engine.stop()


def test_no_drafts_in_a_step_with_more_sequences_than_disable_by_batch_size() -> None:
    """``disable_by_batch_size = 1``: three prompts at once decode without drafts while
    more than one runs, and with them once one is left; the outputs are the model's."""
    engine = started_engine(speculative=SpeculativeConfig(disable_by_batch_size=1),
                            max_num_seqs=3, max_step_tokens=64)
    prompts = [b"abcabcabcabc", b"xyxyxyxyxy", b"hello hello hello "]
    try:
        out = _outputs(engine, prompts, SamplingParams(max_tokens=3))
        assert out == [bytes(p[i % len(p)] for i in range(len(p), len(p) + 3)).decode()
                       for p in prompts]
        assert len(engine.backend.steps) > 1 and engine.speculative.num_drafts == 0
        assert _outputs(engine, prompts[:1], SamplingParams(max_tokens=9)) == ["abcabcabc"]
        assert engine.speculative.num_drafts > 0  # alone, it drafts
    finally:
        engine.stop()


def _model(**speculative: object) -> dict[str, object]:
    return {"models": [{"name": "m", "path": "/x.gguf", "speculative": speculative}]}


def test_the_manifest_table() -> None:
    m = mf.from_dict(_model(num_speculative_tokens=6, prompt_lookup_max=5))
    assert m.models[0].speculative == SpeculativeConfig("ngram", 6, 2, 5)
    m = mf.from_dict(_model(disable_by_batch_size=2))
    assert m.models[0].speculative == SpeculativeConfig(disable_by_batch_size=2)
    # Absent: prompt lookup where it changes nothing (the engine decides once loaded);
    # false: off; true: prompt lookup's defaults everywhere.
    assert mf.from_dict({"models": [{"name": "m", "path": "/x.gguf"}]}).models[0] \
        .speculative == AUTO_SPECULATIVE == SpeculativeConfig(disable_by_batch_size=2, auto=True)
    off = {"models": [{"name": "m", "path": "/x.gguf", "speculative": False}]}
    assert mf.from_dict(off).models[0].speculative is None
    on = {"models": [{"name": "m", "path": "/x.gguf", "speculative": True}]}
    assert mf.from_dict(on).models[0].speculative == SpeculativeConfig()


@pytest.mark.parametrize(("table", "key", "says"), [
    ({"method": "draft"}, "models[0].speculative.model", "is required"),
    ({"model": "/d.gguf"}, "models[0].speculative.model", 'only for method = "draft"'),
    ({"method": "eagle"}, "models[0].speculative.method", '"ngram"'),
    ({"num_speculative_tokens": 0}, "models[0].speculative.num_speculative_tokens", "between"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "models[0].speculative.prompt_lookup_max",
     "at least prompt_lookup_min"),
    ({"lookahead": 3}, "models[0].speculative.lookahead", "unknown key"),
    ({"disable_by_batch_size": 0}, "models[0].speculative.disable_by_batch_size", "between"),
    ({"disable_by_batch_size": "4"}, "models[0].speculative.disable_by_batch_size",
     "expected int"),
    ("ngram", "models[0].speculative", "expected dict or bool"),
])
def test_a_bad_table_names_its_key(table: object, key: str, says: str) -> None:
    data = _model(**table) if isinstance(table, dict) else \
        {"models": [{"name": "m", "path": "/x.gguf", "speculative": table}]}
    with pytest.raises(ManifestError) as e:
        mf.from_dict(data)
    assert key in str(e.value) and says in str(e.value)


def test_a_draft_model_is_resolved_and_checked_naming_its_key(tmp_path: Path) -> None:
    """A draft model's path is relative to the manifest and resolved as a model's; a file
    that is not there, or a backend that runs no draft model, is refused naming the key."""
    registry = load_registry([PLUGIN])  # the toy backend runs no draft model

    def resolved(backend: str, model: str) -> ModelConfig:
        data = {"models": [{"name": "m", "backend": backend,
                            "path": "embedded:smollm2-135m-instruct",
                            "speculative": {"method": "draft", "model": model}}]}
        return mf.resolve(mf.from_dict(data, base_dir=tmp_path), registry).models[0]

    spec = resolved("llamacpp", "embedded:smollm2-135m-instruct").speculative
    assert spec is not None and spec.model is not None and spec.model.endswith(".gguf")
    with pytest.raises(ManifestError) as e:
        resolved("llamacpp", "draft.gguf")
    assert e.value.key == "models[0].speculative.model" and str(tmp_path) in e.value.message
    with pytest.raises(ManifestError) as e:
        resolved("toy", "embedded:smollm2-135m-instruct")
    assert e.value.key == "models[0].speculative.method" and "no draft model" in str(e.value)


def test_a_paged_draft_pool_hands_out_blocks_per_slot_and_takes_them_back() -> None:
    """A paged draft backend's blocks (draft_model._Blocks): a slot's table grows to cover
    what it is fed, a trim gives back the blocks past it, and a slot that would need more
    blocks than are left gets none (its sequence goes without a draft) and keeps its own."""
    from laya_core.engine.draft_model import _Blocks

    blocks = _Blocks(num_blocks=4, block_size=16)
    assert blocks.cover(0, 17) == [0, 1]
    assert blocks.cover(0, 32) == [0, 1]  # already covered
    assert blocks.cover(1, 20) == [2, 3]
    assert blocks.cover(1, 33) is None and blocks.tables[1] == [2, 3]  # none left
    blocks.trim(0, 10)  # positions 0-9 stay: one block
    assert blocks.tables[0] == [0] and blocks.cover(1, 33) == [2, 3, 1]
    blocks.trim(0, 0)
    blocks.trim(1, 0)
    assert blocks.cover(2, 64) is not None and sorted(blocks.tables[2]) == [0, 1, 2, 3]


def test_a_draft_grows_while_kept_whole_and_shrinks_to_what_was_kept() -> None:
    text = list(range(50)) * 2  # the second half repeats the first: everything copies
    drafter = NgramDrafter(SpeculativeConfig(num_speculative_tokens=8), text[:60])
    assert len(drafter.draft([], 100)) == 8
    drafter.accepted(8, 3)  # three kept: the next draft is one longer than that
    assert len(drafter.draft([], 100)) == 4
    drafter.accepted(4, 4)  # kept whole: twice as long, up to num_speculative_tokens
    assert len(drafter.draft([], 100)) == 8
    drafter.accepted(8, 0)  # none kept: one token, at once
    assert len(drafter.draft([], 100)) == 1


def test_the_plan_holds_the_draft_models_weights_and_kv() -> None:
    from laya_core.memory.planner import make_plan
    from laya_core.models.files import read_shape

    registry = load_registry()
    model = {"name": "m", "backend": "llamacpp", "path": "embedded:smollm2-135m-instruct",
             "max_seq_len": 512, "max_num_seqs": 2, "speculative": False}
    plans = [make_plan(mf.resolve(mf.from_dict({"models": [m]}), registry), registry)
             .replicas[0] for m in (model, {**model, "speculative": {
                 "method": "draft", "model": "embedded:smollm2-135m-instruct"}})]
    lines = {o.name: o.bytes for o in plans[1].profile.overheads}
    shape = read_shape(registry.resolve_model_path("embedded:smollm2-135m-instruct"))
    assert lines["draft model weights"] == shape.weights_bytes
    # The same model drafts: its pool is the model's, byte for byte.
    assert lines["draft model KV"] == plans[0].kv_pool_bytes
    assert lines["draft model compute buffer"] > 0
    # Beside them, the model's logits buffer grows for the rows that check drafts.
    before = {o.name: o.bytes for o in plans[0].profile.overheads}
    assert lines["logits buffer"] > before["logits buffer"]
    assert plans[1].total_bytes - plans[0].total_bytes == sum(
        b for name, b in lines.items() if name.startswith("draft model")) + \
        lines["logits buffer"] - before["logits buffer"]


def test_the_plan_counts_check_rows_only_for_the_steps_that_draft() -> None:
    """With ``disable_by_batch_size``, only steps of that many sequences check drafts: the
    logits a step may sample are the larger of one row per sequence and their rows."""
    from laya_core.memory.ledger import sampled_rows_per_step

    def rows(seqs: int, off: bool = False, **spec: object) -> int:
        model = {"name": "m", "path": "/x.gguf", "max_num_seqs": seqs, "max_step_tokens": 256}
        if spec or off:
            model["speculative"] = spec or False
        return sampled_rows_per_step(mf.from_dict({"models": [model]}).models[0])

    assert rows(8, off=True) == 8 and rows(8, method="ngram") == 40  # 8 sequences x (1 + 4)
    assert rows(8) == 10  # the default: steps of two sequences draft (2 x 5 rows)
    assert rows(8, method="ngram", disable_by_batch_size=1) == 8  # one drafts: 5 rows
    assert rows(2, method="ngram", disable_by_batch_size=1) == 5
    assert rows(8, method="ngram", disable_by_batch_size=4) == 20
    assert rows(100, method="ngram") == 256  # within the step's budget
