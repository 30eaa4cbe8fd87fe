"""Prefix reuse: matching, the scheduler's retained slots, and the engine end to end."""

from __future__ import annotations

import asyncio
import random

from toy_backend import ToyBackend

from laya_core.backend import ModelConfig
from laya_core.cache import BlockCachePolicy
from laya_core.engine import Engine
from laya_core.prefix_cache import MIN_REUSE_TOKENS, MIN_TAIL_TOKENS, best_match, common_prefix_len
from laya_core.scheduler import FcfsScheduler, SchedulerConfig
from laya_core.sequence import Sequence
from laya_core.types import SamplingParams


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix_len([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), [*range(777), -1]) == 777


def test_best_match_leaves_two_tokens_and_ignores_short_matches() -> None:
    prompt = list(range(40))
    assert best_match(prompt, [(0, list(range(10))), (1, list(range(30)))]) == (1, 30)
    assert best_match(prompt, [(0, list(range(100)))]) == (0, 38)  # a last chunk of 2
    assert best_match(prompt, [(0, list(range(MIN_REUSE_TOKENS - 1)))]) is None


def seq(i: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(i, prompt, SamplingParams(max_tokens))


def run_to_end(s: FcfsScheduler, sq: Sequence) -> None:
    for chunk in s.schedule():
        chunk.seq.num_computed += len(chunk.tokens)


def test_a_finished_sequence_is_retained_and_taken_over() -> None:
    s = FcfsScheduler(SchedulerConfig(2, 64, prefix_caching=True), BlockCachePolicy(256, 16))
    first = seq(1, list(range(100, 140)))
    s.add(first)
    run_to_end(s, first)
    assert s.finish(first, retain=True)
    assert s.num_retained_blocks == 3 and s.cache.num_used_blocks == 3  # 40 tokens
    second = seq(2, [*range(100, 140), 7, 8])
    s.add(second)
    s.schedule()
    assert second.slot == first.slot and second.reuse == (first.slot, 40)
    assert second.num_computed == 40 and s.num_retained_blocks == 0


def test_retained_slots_are_evicted_when_room_is_needed() -> None:
    s = FcfsScheduler(SchedulerConfig(1, 64, prefix_caching=True), BlockCachePolicy(64, 16))
    first = seq(1, list(range(30)))
    s.add(first)
    run_to_end(s, first)
    s.finish(first, retain=True)
    other = seq(2, list(range(500, 540)), max_tokens=20)  # needs the slot and 4 blocks
    s.add(other)
    s.schedule()
    assert other.slot == first.slot and other.reuse is None
    assert s.take_evicted() == [first.slot] and s.num_retained_blocks == 0


def test_engine_reuses_a_conversation_prefix_with_the_toy_backend() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=2)
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, BlockCachePolicy)
    engine.start()
    assert engine.wait_ready(5)
    history = b"system: be brief. user: hello there, how are you today? "

    async def ask(prompt: bytes, n: int) -> str:
        stream = engine.submit(list(prompt), SamplingParams(max_tokens=n))
        return "".join([e.text async for e in stream])

    first = asyncio.run(ask(history, 8))
    follow_up = history + b"assistant: " + first.encode() + b" user: and you?"
    second = asyncio.run(ask(follow_up, len(follow_up)))
    engine.stop()
    # The toy model repeats its prompt: right only if the reused KV held the right tokens.
    assert first == history[:8].decode()
    assert second == follow_up.decode()
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == len(history)


SYSTEM = list(range(100, 124))  # a shared system prompt: 24 tokens


def finish_after(s: FcfsScheduler, sq: Sequence, answer: list[int]) -> bool:
    """Prefill ``sq``, give it ``answer`` as output, finish it retained; whether it was kept."""
    s.add(sq)
    run_to_end(s, sq)
    sq.output_token_ids.extend(answer)
    sq.num_computed += len(answer) - 1  # the last sampled token is never fed back
    return s.finish(sq, retain=True)


def test_a_shorter_match_copies_and_keeps_the_cached_conversation() -> None:
    s = FcfsScheduler(SchedulerConfig(4, 256, prefix_caching=True), BlockCachePolicy(1024, 16))
    first = seq(1, [*SYSTEM, *range(1, 30)])
    assert finish_after(s, first, [7, 8, 9])
    other = seq(2, [*SYSTEM, *range(50, 60)])  # shares only the system prompt
    s.add(other)
    s.schedule()
    assert other.reuse == (first.slot, len(SYSTEM)) and other.slot != first.slot
    assert first.slot in s.prefix  # still cached for the question it answered
    again = seq(3, [*SYSTEM, *range(1, 30)])
    s.add(again)
    s.schedule()
    assert again.reuse == (first.slot, len(again.prompt_token_ids) - MIN_TAIL_TOKENS)


def test_a_repeated_answer_is_cached_once_and_a_new_answer_replaces_the_old() -> None:
    s = FcfsScheduler(SchedulerConfig(4, 256, prefix_caching=True), BlockCachePolicy(1024, 16))
    prompt = [*SYSTEM, *range(1, 30)]
    first = seq(1, prompt)
    assert finish_after(s, first, [7, 8, 9])
    same = seq(2, list(prompt))
    assert not finish_after(s, same, [7, 8, 9])  # the same tokens: not kept twice
    assert s.prefix.slots() == [first.slot]
    different = seq(3, list(prompt))
    assert finish_after(s, different, [6, 5])  # the same prompt, another answer
    assert s.prefix.slots() == [different.slot] and first.slot in s.take_evicted()


def started(s: FcfsScheduler, count: int, prompt_len: int = 20) -> list[Sequence]:
    """``count`` sequences with distinct prompts (1000.., 2000.., ...), admitted and prefilled;
    they take slots 0, 1, 2, ... in order."""
    seqs = [seq(i, list(range(1000 * i, 1000 * i + prompt_len))) for i in range(1, count + 1)]
    for x in seqs:
        s.add(x)
    run_to_end(s, seqs[0])
    assert [x.slot for x in seqs] == list(range(count))
    return seqs


def test_new_sequences_join_the_block_of_running_slots() -> None:
    s = FcfsScheduler(SchedulerConfig(4, 512, prefix_caching=True), BlockCachePolicy(2048, 16))
    a, b, c = started(s, 3)
    s.finish(b, retain=True)  # a hole at 1, holding b's KV
    d = seq(4, list(range(5000, 5020)))
    s.add(d)
    run_to_end(s, d)
    # Slot 1 joins 0 and 2 into one block: its KV goes, as nothing waits for it.
    assert d.slot == 1 and s.take_evicted() == [1]
    s.finish(d, retain=True)
    e = seq(5, list(range(6000, 6020)))
    later = seq(6, [*range(5000, 5020), 1, 2])  # waits to reuse d's KV in slot 1
    for x in (e, later):
        s.add(x)
    s.schedule()
    # e takes slot 1, between two running ones; the KV that `later` waits for moves to 3,
    # where `later` takes it over: four running slots in one block, nothing recomputed.
    assert e.slot == 1 and s.take_moved() == [(1, 3, 20)]
    assert later.slot == 3 and later.reuse == (3, 20) and s.take_evicted() == []


def three_slots_one_running() -> tuple[FcfsScheduler, list[Sequence]]:
    """Slot 0 runs; slots 1 and 2 hold finished sequences' KV (prompts 2000.., 3000..)."""
    s = FcfsScheduler(SchedulerConfig(3, 512, prefix_caching=True), BlockCachePolicy(2048, 16))
    a, b, c = started(s, 3)
    s.finish(b, retain=True)
    s.finish(c, retain=True)
    return s, [a, b, c]


def test_wanted_kv_moves_over_kv_nobody_waits_for() -> None:
    s, _ = three_slots_one_running()
    e = seq(5, list(range(6000, 6020)))
    later = seq(6, [*range(2000, 2020), 1, 2])  # wants slot 1
    for x in (e, later):
        s.add(x)
    s.schedule()
    assert e.slot == 1 and s.take_evicted() == [2] and s.take_moved() == [(1, 2, 20)]
    assert later.slot == 2 and later.reuse == (2, 20)


def test_wanted_kv_with_nowhere_to_go_is_taken_only_as_the_last_choice() -> None:
    s, _ = three_slots_one_running()
    e = seq(5, list(range(6000, 6020)))
    wants_1 = seq(6, [*range(2000, 2020), 1, 2])
    wants_2 = seq(7, [*range(3000, 3020), 1, 2])
    for x in (e, wants_1, wants_2):
        s.add(x)
    s.schedule()
    # Both retained slots are wanted and no slot is free, so nothing can move: e takes
    # slot 1 next to the running one, and the next in line then needs slot 2.
    assert s.take_moved() == [] and s.take_evicted() == [1, 2]
    assert (e.slot, wants_1.slot, wants_1.reuse) == (1, 2, None)


def test_kv_being_copied_from_is_not_evicted_before_the_copy() -> None:
    """Regression: a later admission in the same step evicted the slot an earlier one was
    about to copy its prefix from, and llama.cpp refused the step (positions 0..64 in the
    cache, 80 assumed)."""
    s = FcfsScheduler(SchedulerConfig(4, 512, prefix_caching=True), BlockCachePolicy(4096, 16))
    cached, gone, running = started(s, 3, prompt_len=30)
    s.finish(cached, retain=True)
    s.finish(gone)
    copier = seq(4, [*range(1000, 1020), 5, 6, 7])  # shares 20 tokens with slot 0
    other, third = seq(5, list(range(5000, 5020))), seq(6, list(range(6000, 6020)))
    for x in (copier, other, third):
        s.add(x)
    s.schedule()
    assert copier.slot == 1 and copier.reuse == (0, 20) and other.slot == 3
    # Slot 0 is the only one left, but copier has not copied from it yet: third waits.
    assert third.slot is None and s.take_evicted() == []
    s.take_moved()  # the engine starts copier here
    s.schedule()
    assert third.slot == 0 and s.take_evicted() == [0]


def recorded(engine: Engine, method: str) -> list[tuple[int, int, int]]:
    """Keep what the engine takes from its scheduler's ``method`` (take_moved and the like)."""
    seen: list[tuple[int, int, int]] = []
    take = getattr(engine.scheduler, method)

    def keep() -> list[tuple[int, int, int]]:
        out = take()
        seen.extend(out)
        return out

    setattr(engine.scheduler, method, keep)
    return seen


def test_many_requests_sharing_prefixes_all_get_exact_outputs() -> None:
    """More requests than slots, sharing a system prompt and repeating questions, so that
    the engine copies, takes over, moves and evicts cached KV while others run; the toy
    backend checks every step's positions, and repeats its prompt, so any wrong KV shows."""
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=4,
                      max_step_tokens=48, options={"step_delay_s": 0.001})
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, BlockCachePolicy)
    engine.start()
    assert engine.wait_ready(5)
    moved, compactions = recorded(engine, "take_moved"), recorded(engine, "take_compactions")
    system = b"system: answer in one short sentence, politely. "
    questions = [b"user: why is the sky blue? ", b"user: name a prime. ",
                 b"user: what is a cat? and a dog? ", b"user: count to three. ",
                 b"user: where is Paris? ", b"user: say hi. "]
    rng = random.Random(7)
    prompts = [system + rng.choice(questions) + b"assistant:" * rng.randint(0, 1)
               for _ in range(60)]

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
    assert engine.prefix_hits > 40
    print(f"\n{engine.prefix_hits} prefix hits, {len(moved)} moves, "
          f"{len(compactions)} running sequences moved")


def test_a_hole_in_the_running_block_is_closed_when_nothing_waits() -> None:
    config = SchedulerConfig(6, 512, prefix_caching=True, compaction=True)
    s = FcfsScheduler(config, BlockCachePolicy(4096, 16))
    seqs = started(s, 4)
    for x in seqs:
        x.output_token_ids.append(7)  # all decoding now
    s.finish(seqs[1], retain=True)  # a hole at 1, holding KV
    s.schedule()
    # The last running sequence moves into the hole; the KV there moves to the free slot
    # farthest from the block.
    assert s.take_moved() == [(1, 5, 20)] and s.take_compactions() == [(3, 1, 20)]
    assert sorted(x.slot for x in s.running) == [0, 1, 2] and 5 in s.prefix
    s.schedule()
    assert s.take_compactions() == []  # one block again


def test_the_engine_closes_a_hole_and_the_moved_stream_stays_exact() -> None:
    cfg = ModelConfig(name="toy", backend="toy", path="-", max_seq_len=256, max_num_seqs=6,
                      options={"step_delay_s": 0.002})
    engine = Engine(cfg, ToyBackend(cfg), FcfsScheduler, BlockCachePolicy)
    engine.start()
    assert engine.wait_ready(5)
    moved = recorded(engine, "take_compactions")
    prompts = [b"first prompt, long run. ", b"second: short. ", b"third prompt runs on. ",
               b"fourth prompt, the one that moves. "]
    limits = (40, 3, 40, 40)

    async def one(prompt: bytes, n: int) -> str:
        return "".join([e.text async for e in engine.submit(list(prompt),
                                                            SamplingParams(max_tokens=n))])

    async def together() -> list[str]:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, limits, strict=True)))

    outputs = asyncio.run(together())
    engine.stop()
    # Slots 0-3 in arrival order; the second ends first and the fourth moves into its slot.
    assert moved and moved[0][:2] == (3, 1)
    assert outputs == [bytes(p[i % len(p)] for i in range(len(p), len(p) + n)).decode()
                       for p, n in zip(prompts, limits, strict=True)]
