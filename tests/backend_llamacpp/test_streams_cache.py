"""The llama.cpp plugin's cache policy: slots, retained KV, takeovers, copies, moves and
compaction, as ops in the order they happened; and the engine end to end on a streams toy."""

from __future__ import annotations

import asyncio
import random

from laya_backend_llamacpp.backend import LlamaCppBackend
from laya_backend_llamacpp.stream_ops import (
    DropStream,
    ForgetSaved,
    MoveStream,
    SaveStream,
    StartStream,
)
from laya_backend_llamacpp.streams import StreamsKVCache
from streams_toy import started_streams_engine
from toy_backend import follow_up_conversation, shared_prefix_workload

from laya_core.engine.engine import Engine
from laya_core.engine.request import Request
from laya_core.engine.scheduler import FcfsScheduler, SchedulerConfig
from laya_core.kv.policies import KVOp
from laya_core.types import SamplingParams


def seq(i: int, prompt: list[int], max_tokens: int = 4) -> Request:
    # As the engine of a llama.cpp replica makes it: a last prompt chunk of two or more.
    return Request(i, prompt, SamplingParams(max_tokens),
                   min_last_chunk=LlamaCppBackend.min_last_prompt_chunk)


def scheduler(num_seqs: int, step: int, pool: int, compaction: bool = False) -> FcfsScheduler:
    kv = StreamsKVCache(pool, num_seqs)
    kv.compaction = compaction
    return FcfsScheduler(SchedulerConfig(num_seqs, step), kv)


def kv_of(s: FcfsScheduler) -> StreamsKVCache:
    assert isinstance(s.kv, StreamsKVCache)
    return s.kv


def run_to_end(s: FcfsScheduler) -> tuple[KVOp, ...]:
    """One step: feed every chunk; the plan's ops."""
    plan = s.schedule()
    for chunk in plan.chunks:
        chunk.seq.num_computed += len(chunk.tokens)
    return plan.ops


def test_a_finished_sequence_is_retained_and_taken_over() -> None:
    s = scheduler(2, 64, 256)
    kv = kv_of(s)
    first = seq(1, list(range(100, 140)))
    s.add(first)
    run_to_end(s)
    slot = kv.slot_of(first)
    s.finish(first, retain=True)
    assert slot in kv.prefix and kv.num_cached_blocks == 3 and kv.num_used_blocks == 0
    second = seq(2, [*range(100, 140), 7, 8])
    s.add(second)
    ops = s.schedule().ops
    assert kv.slot_of(second) == slot and ops == (StartStream(slot, second.params, 40),)
    assert second.num_computed == 40 == second.num_cached_tokens and kv.num_cached_blocks == 0


def test_retained_slots_are_evicted_when_room_is_needed() -> None:
    s = scheduler(1, 64, 64)
    first = seq(1, list(range(30)))
    s.add(first)
    run_to_end(s)
    s.finish(first, retain=True)
    other = seq(2, list(range(500, 540)), max_tokens=20)  # needs the slot and 4 blocks
    s.add(other)
    assert s.schedule().ops == (DropStream(0), StartStream(0, other.params))
    assert other.num_cached_tokens == 0 and kv_of(s).num_cached_blocks == 0


SYSTEM = list(range(100, 124))  # a shared system prompt: 24 tokens


def finish_after(s: FcfsScheduler, sq: Request, answer: list[int]) -> bool:
    """Prefill ``sq``, give it ``answer`` as output, finish it retained; whether it was kept."""
    s.add(sq)
    run_to_end(s)
    sq.output_token_ids.extend(answer)
    sq.num_computed += len(answer) - 1  # the last sampled token is never fed back
    slot = kv_of(s).slot_of(sq)
    s.finish(sq, retain=True)
    return slot in kv_of(s).prefix


def test_a_shorter_match_copies_and_keeps_the_cached_conversation() -> None:
    s = scheduler(4, 256, 1024)
    kv = kv_of(s)
    first = seq(1, [*SYSTEM, *range(1, 30)])
    assert finish_after(s, first, [7, 8, 9])
    (cached,) = kv.prefix.slots()
    other = seq(2, [*SYSTEM, *range(50, 60)])  # shares only the system prompt
    s.add(other)
    (start,) = s.schedule().ops
    assert start == StartStream(kv.slot_of(other), other.params, copy_from=cached,
                                num_copied=len(SYSTEM))
    assert kv.slot_of(other) != cached and cached in kv.prefix  # kept for its question
    again = seq(3, [*SYSTEM, *range(1, 30)])
    s.add(again)
    s.schedule()
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 2  # the last chunk


def test_a_repeated_answer_is_cached_once_and_a_new_answer_replaces_the_old() -> None:
    s = scheduler(4, 256, 1024)
    kv = kv_of(s)
    prompt = [*SYSTEM, *range(1, 30)]
    assert finish_after(s, seq(1, prompt), [7, 8, 9])
    (first_slot,) = kv.prefix.slots()
    assert not finish_after(s, seq(2, list(prompt)), [7, 8, 9])  # the same: not kept twice
    assert kv.prefix.slots() == [first_slot]
    kv.take_ops()
    different = seq(3, list(prompt))
    assert finish_after(s, different, [6, 5])  # the same prompt, another answer
    assert first_slot not in kv.prefix and len(kv.prefix) == 1
    assert DropStream(first_slot) in kv.take_ops()


def started(s: FcfsScheduler, count: int, prompt_len: int = 20) -> list[Request]:
    """``count`` sequences with distinct prompts (1000.., 2000.., ...), admitted and prefilled;
    they take slots 0, 1, 2, ... in order."""
    seqs = [seq(i, list(range(1000 * i, 1000 * i + prompt_len))) for i in range(1, count + 1)]
    for x in seqs:
        s.add(x)
    run_to_end(s)
    assert [kv_of(s).slot_of(x) for x in seqs] == list(range(count))
    return seqs


def test_new_sequences_join_the_block_of_running_slots() -> None:
    s = scheduler(4, 512, 2048)
    a, b, c = started(s, 3)
    s.finish(b, retain=True)  # a hole at 1, holding b's KV
    d = seq(4, list(range(5000, 5020)))
    s.add(d)
    # Slot 1 joins 0 and 2 into one block: its KV goes, as nothing waits for it.
    assert run_to_end(s) == (DropStream(1), StartStream(1, d.params))
    s.finish(d, retain=True)
    e = seq(5, list(range(6000, 6020)))
    later = seq(6, [*range(5000, 5020), 1, 2])  # waits to reuse d's KV in slot 1
    for x in (e, later):
        s.add(x)
    # e takes slot 1, between two running ones; the KV that `later` waits for moves to 3,
    # where `later` takes it over: four running slots in one block, nothing recomputed.
    assert s.schedule().ops == (MoveStream(1, 3, 20), StartStream(1, e.params),
                                StartStream(3, later.params, keep_tokens=20))
    assert later.num_cached_tokens == 20


def three_slots_one_running() -> FcfsScheduler:
    """Slot 0 runs; slots 1 and 2 hold finished sequences' KV (prompts 2000.., 3000..)."""
    s = scheduler(3, 512, 2048)
    a, b, c = started(s, 3)
    s.finish(b, retain=True)
    s.finish(c, retain=True)
    return s


def test_wanted_kv_moves_over_kv_nobody_waits_for() -> None:
    s = three_slots_one_running()
    e = seq(5, list(range(6000, 6020)))
    later = seq(6, [*range(2000, 2020), 1, 2])  # wants slot 1
    for x in (e, later):
        s.add(x)
    assert s.schedule().ops == (DropStream(2), MoveStream(1, 2, 20), StartStream(1, e.params),
                                StartStream(2, later.params, keep_tokens=20))


def test_wanted_kv_with_nowhere_to_go_is_taken_only_as_the_last_choice() -> None:
    s = three_slots_one_running()
    e = seq(5, list(range(6000, 6020)))
    wants_1 = seq(6, [*range(2000, 2020), 1, 2])
    wants_2 = seq(7, [*range(3000, 3020), 1, 2])
    for x in (e, wants_1, wants_2):
        s.add(x)
    # Both retained slots are wanted and no slot is free, so nothing can move: e takes
    # slot 1 next to the running one, and the next in line then needs slot 2.
    assert s.schedule().ops == (DropStream(1), StartStream(1, e.params),
                                DropStream(2), StartStream(2, wants_1.params))
    assert wants_2 in s.waiting


def test_kv_is_copied_before_a_later_admission_in_the_step_drops_it() -> None:
    """Regression: a later admission in the same step evicted the slot an earlier one was
    about to copy its prefix from, and llama.cpp refused the step. The ops run in the order
    they were decided, so the copy reads the KV before the drop."""
    s = scheduler(4, 512, 4096)
    cached, gone, running = started(s, 3, prompt_len=30)
    s.finish(cached, retain=True)
    s.finish(gone)
    copier = seq(4, [*range(1000, 1020), 5, 6, 7])  # shares 20 tokens with slot 0
    other, third = seq(5, list(range(5000, 5020))), seq(6, list(range(6000, 6020)))
    for x in (copier, other, third):
        s.add(x)
    ops = s.schedule().ops
    assert ops == (DropStream(1), StartStream(1, copier.params, copy_from=0, num_copied=20),
                   StartStream(3, other.params), DropStream(0), StartStream(0, third.params))


def test_a_hole_in_the_running_block_is_closed_when_nothing_waits() -> None:
    s = scheduler(6, 512, 4096, compaction=True)
    kv = kv_of(s)
    seqs = started(s, 4)
    for x in seqs:
        x.output_token_ids.append(7)  # all decoding now
    s.finish(seqs[1], retain=True)  # a hole at 1, holding KV
    # The last running sequence moves into the hole; the KV there moves to the free slot
    # farthest from the block.
    assert s.schedule().ops == (MoveStream(1, 5, 20), MoveStream(3, 1, 20, running=True))
    assert sorted(kv.handle(x) for x in s.running) == [0, 1, 2] and 5 in kv.prefix
    assert s.schedule().ops == ()  # one block again


def two_saved_and_a_third_retained() -> tuple[FcfsScheduler, StreamsKVCache, Request]:
    """One slot and 110 tokens of host memory: conversations saved as they are evicted, one
    restored; at the end 81 tokens are saved (keys 1 and 2) and slot 0 retains a third 60.
    Returns the scheduler, its cache, and a fourth request that will evict the third."""
    s = scheduler(1, 512, 4096)
    kv = kv_of(s)
    kv.saved_capacity = 110  # tokens of host memory
    first = seq(1, list(range(1000, 1040)))
    assert finish_after(s, first, [7, 8])  # 41 tokens of KV in slot 0
    second = seq(2, list(range(2000, 2040)))
    s.add(second)
    assert run_to_end(s) == (SaveStream(0, 0), DropStream(0), StartStream(0, second.params))
    s.finish(second, retain=True)
    back = seq(3, [*range(1000, 1040), 7, 8, 5, 6])  # the first conversation, one turn on
    s.add(back)
    assert s.schedule().ops == (SaveStream(0, 1), DropStream(0),
                                StartStream(0, back.params, num_copied=41, restore=0))
    assert back.num_cached_tokens == 41 and list(kv.saved) == [1]  # restored: not saved
    third, fourth = (seq(i, list(range(1000 * i, 1000 * i + 60))) for i in (4, 5))
    s.finish(back, retain=True)
    s.add(third)
    s.add(fourth)
    run_to_end(s)  # third in slot 0: back's 41 tokens are saved beside second's 40
    assert kv.num_saved_tokens == 81
    s.finish(third, retain=True)
    return s, kv, fourth


def test_evicted_streams_are_saved_and_restored_so_more_conversations_stay_cached() -> None:
    s, kv, fourth = two_saved_and_a_third_retained()
    # fourth evicts third's 60 tokens: the least recently saved (second's) makes room
    assert s.schedule().ops == (ForgetSaved(1), SaveStream(0, 3), DropStream(0),
                                StartStream(0, fourth.params))
    assert kv.num_saved_tokens == 101 and list(kv.saved) == [2, 3]


def test_saved_kv_a_waiting_request_wants_is_forgotten_last() -> None:
    s, kv, fourth = two_saved_and_a_third_retained()
    second_again = seq(6, [*range(2000, 2040), 9, 9])  # waits behind fourth, wants key 1
    s.add(second_again)
    # Room for third's 60 tokens comes from back's saved KV (key 2), not second's.
    assert s.schedule().ops == (ForgetSaved(2), SaveStream(0, 3), DropStream(0),
                                StartStream(0, fourth.params))
    assert list(kv.saved) == [1, 3]
    s.finish(fourth, retain=True)
    run_to_end(s)
    assert second_again.num_cached_tokens == 40  # restored from host memory


def recorded(engine: Engine) -> list[KVOp]:
    """Keep every op the engine takes from its cache policy."""
    seen: list[KVOp] = []
    kv = engine.scheduler.kv  # type: ignore[union-attr]
    take = kv.take_ops

    def keep() -> tuple[KVOp, ...]:
        out = take()
        seen.extend(out)
        return out

    kv.take_ops = keep  # type: ignore[method-assign]
    return seen


def test_engine_reuses_a_conversation_prefix() -> None:
    engine = started_streams_engine(max_seq_len=256, max_num_seqs=2)
    history, _ = follow_up_conversation(engine)
    assert engine.prefix_hits == 1 and engine.prefix_tokens_reused == len(history)


def test_many_requests_sharing_prefixes_all_get_exact_outputs() -> None:
    """More requests than slots, sharing a system prompt and repeating questions, so that
    the engine copies, takes over, moves and evicts cached KV while others run; the toy
    backend checks every step's positions, and repeats its prompt, so any wrong KV shows."""
    engine = started_streams_engine(max_seq_len=256, max_num_seqs=4, max_step_tokens=48,
                                    options={"step_delay_s": 0.001})
    ops = recorded(engine)
    shared_prefix_workload(engine)
    assert engine.prefix_hits > 40
    moves = [op for op in ops if isinstance(op, MoveStream)]
    print(f"\n{engine.prefix_hits} prefix hits, {len(moves)} moves")


def test_the_engine_closes_a_hole_and_the_moved_stream_stays_exact() -> None:
    engine = started_streams_engine(max_seq_len=256, max_num_seqs=6,
                                    options={"step_delay_s": 0.002})
    ops = recorded(engine)
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
    moved = [op for op in ops if isinstance(op, MoveStream) and op.running]
    assert moved and (moved[0].src, moved[0].dst) == (3, 1)
    assert outputs == [bytes(p[i % len(p)] for i in range(len(p), len(p) + n)).decode()
                       for p, n in zip(prompts, limits, strict=True)]


def test_more_conversations_than_slots_all_reuse_their_kv_when_revisited() -> None:
    """Issue 13's measurement on the streams toy: 12 conversations on 4 slots, then each
    again one turn on; every revisit finds its conversation (saved or in a stream), and the
    toy's exact output shows the restored KV is the conversation's."""
    engine = started_streams_engine(max_seq_len=512, max_num_seqs=4,
                                    options={"saved_kv_tokens": 2048})
    rng = random.Random(3)
    system = b"system: you are a helpful assistant. "  # shared: a short match in every slot
    chats = [system + bytes(rng.randrange(32, 127) for _ in range(120)) for _ in range(12)]

    async def ask(prompt: bytes, n: int) -> tuple[str, int]:
        events = [e async for e in engine.submit(list(prompt), SamplingParams(max_tokens=n))]
        usage = events[-1].usage
        assert usage is not None
        return "".join(e.text for e in events), usage.cached_tokens

    firsts = [asyncio.run(ask(c, 8))[0] for c in chats]
    revisits = [asyncio.run(ask(c + a.encode() + b" and then?", 8))
                for c, a in zip(chats, firsts, strict=True)]
    engine.stop()
    for chat, first, (text, cached) in zip(chats, firsts, revisits, strict=True):
        prompt = chat + first.encode() + b" and then?"
        assert text.encode() == bytes(prompt[p % len(prompt)]
                                               for p in range(len(prompt), len(prompt) + 8))
        assert cached >= len(chat), "a revisit prefilled its conversation again"


def test_saved_kv_only_a_waiting_request_wants_is_kept_and_the_evicted_is_not_saved() -> None:
    s, kv, fourth = two_saved_and_a_third_retained()
    kv.saved_capacity = 90  # room for third's 60 tokens only by forgetting both saved
    second_again = seq(6, [*range(2000, 2040), 9, 9])  # waits behind fourth, wants key 1
    s.add(second_again)
    assert s.schedule().ops == (DropStream(0), StartStream(0, fourth.params))
    assert list(kv.saved) == [1, 2] and kv.num_saved_tokens == 81
    s.finish(fourth, retain=True)
    run_to_end(s)
    assert second_again.num_cached_tokens == 40


class Refusing:
    """Makes one of a streams toy's methods raise, the given number of times."""

    def __init__(self, engine: Engine, method: str, times: int = 1) -> None:
        self.real = getattr(engine.backend, method)
        self.left = times
        setattr(engine.backend, method, self)

    def __call__(self, *args: object) -> None:
        if self.left:
            self.left -= 1
            raise MemoryError("no host memory left")
        self.real(*args)


def ask_streams(engine: Engine, prompt: bytes, n: int = 6) -> tuple[str, int, str | None]:
    """The text, cached tokens and error of one request; the text is checked against the
    toy's rule (it repeats its prompt) unless the request failed."""
    async def go() -> list:
        return [e async for e in engine.submit(list(prompt), SamplingParams(max_tokens=n))]

    events = asyncio.run(go())
    text, last = "".join(e.text for e in events), events[-1]
    if last.error is None:
        expected = bytes(prompt[p % len(prompt)] for p in range(len(prompt), len(prompt) + n))
        assert text.encode() == expected
    return text, last.usage.cached_tokens if last.usage else 0, last.error


def test_a_failed_save_is_forgotten_and_a_failed_restore_fails_only_its_request() -> None:
    engine = started_streams_engine(max_seq_len=256, max_num_seqs=1,
                                    options={"saved_kv_tokens": 1024})
    kv = engine.scheduler.kv  # type: ignore[union-attr]
    first, second = (bytes(range(65 + i, 65 + i + 40)) for i in (0, 20))
    ask_streams(engine, first)
    Refusing(engine, "save_stream")
    assert ask_streams(engine, second)[2] is None  # evicting first: its save fails
    assert not kv.saved
    assert ask_streams(engine, first + b" again")[1] == 0  # prefilled, not restored
    assert list(kv.saved) == [1]  # second's KV, saved when this one took the slot
    Refusing(engine, "restore_stream")
    _, _, error = ask_streams(engine, second + b" again")
    assert error is not None and "no host memory left" in error
    assert ask_streams(engine, second + b" once more")[2] is None
    assert engine.state.name == "READY" and engine.kv_usage == 0.0
    engine.stop()


def lora_seq(i: int, prompt: list[int], adapter: str | None) -> Request:
    return Request(i, prompt, SamplingParams(4, lora=adapter),
                   min_last_chunk=LlamaCppBackend.min_last_prompt_chunk)


def test_kv_of_one_adapter_is_reused_by_that_adapter_alone_and_forgotten_at_unload() -> None:
    """The same prompt under the base model and two adapters: each finds only the stream its
    own adapter computed; unloading an adapter drops its retained stream (unsaved), so one
    loaded later under its name starts cold."""
    s = scheduler(4, 64, 512)
    kv = kv_of(s)
    prompt = list(range(100, 140))
    for i, adapter in enumerate(("a", None)):
        first = lora_seq(i, prompt, adapter)
        s.add(first)
        run_to_end(s)
        s.finish(first, retain=True)
    held = {kv.prefix.adapter(slot) for slot in kv.prefix.slots()}
    assert held == {"a", None}  # the base did not dedupe the adapter's stream, nor reuse it
    for i, adapter, reused in ((2, "b", 0), (3, "a", 40), (4, None, 40)):
        again = lora_seq(i, [*prompt, 7, 8], adapter)
        s.add(again)
        run_to_end(s)
        assert again.num_cached_tokens == reused, adapter
        s.finish(again, retain=True)
    (a_slot,) = [slot for slot in kv.prefix.slots() if kv.prefix.adapter(slot) == "a"]
    kv.forget_adapter("a")
    assert kv.take_ops() == (DropStream(a_slot),) and a_slot not in kv.prefix
    cold = lora_seq(5, [*prompt, 7, 8], "a")
    s.add(cold)
    run_to_end(s)
    assert cold.num_cached_tokens == 0
