from laya_core.engine.request import Request, RequestStatus
from laya_core.engine.scheduler import FcfsScheduler, SchedulerConfig
from laya_core.kv.policies import PagedKVCache
from laya_core.types import SamplingParams

_ids = iter(range(10**6))


def seq(prompt_len: int, max_tokens: int = 4, min_last_chunk: int = 1) -> Request:
    return Request(next(_ids), list(range(1, prompt_len + 1)), SamplingParams(max_tokens),
                   min_last_chunk=min_last_chunk)


def scheduler(pool_tokens: int = 256, max_num_seqs: int = 4, step: int = 64) -> FcfsScheduler:
    return FcfsScheduler(SchedulerConfig(max_num_seqs, step),
                         PagedKVCache(pool_tokens, max_num_seqs, prefix_caching=False))


def advance(chunks, token: int = 7) -> None:  # type: ignore[no-untyped-def]
    """Apply a step as the engine does: count the fed tokens, append a sampled one."""
    for c in chunks:
        c.seq.num_computed += len(c.tokens)
        if c.samples:
            c.seq.output_token_ids.append(token)


def test_admits_in_order_within_cache_and_slots() -> None:
    s = scheduler(pool_tokens=64, max_num_seqs=2)
    a, b, c = seq(20, 12), seq(10, 6), seq(1, 1)  # worst cases: 32, 16, 2 tokens
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    assert [x.status for x in (a, b, c)] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING]
    assert s.kv.num_used_blocks == 2 + 1  # 32 tokens = 2 blocks, 16 = 1


def test_head_of_line_waits_for_room() -> None:
    s = scheduler(pool_tokens=64, max_num_seqs=4)
    big, small = seq(40, 20), seq(30, 10)  # 60 then 40 tokens: 4 + 3 blocks of a 4-block pool
    s.add(big)
    s.add(small)
    s.schedule()
    assert big.status is RequestStatus.RUNNING and small.status is RequestStatus.WAITING
    s.finish(big)
    assert s.kv.num_used_blocks == 0
    s.schedule()
    assert small.status is RequestStatus.RUNNING


def test_decode_goes_first_and_prefill_is_chunked() -> None:
    s = scheduler(pool_tokens=1024, step=16)
    short, long = seq(3), seq(40)
    s.add(short)
    chunks = s.schedule().chunks
    advance(chunks)
    assert short.num_computed == 3 and short.output_token_ids == [7]
    s.add(long)
    chunks = s.schedule().chunks
    assert [(c.seq, len(c.tokens), c.start_pos) for c in chunks] == [(short, 1, 3), (long, 15, 0)]
    assert chunks[0].samples and not chunks[1].samples
    advance(chunks)
    chunks = s.schedule().chunks
    assert [(c.seq, len(c.tokens)) for c in chunks] == [(short, 1), (long, 15)]
    advance(chunks)
    chunks = s.schedule().chunks
    assert [(c.seq, len(c.tokens), c.start_pos) for c in chunks] == [(short, 1, 5), (long, 10, 30)]
    assert chunks[1].samples
    assert chunks[1].tokens == tuple(long.prompt_token_ids[30:])


def test_finish_frees_slot_and_cache_and_unknown_waiting_is_removed() -> None:
    s = scheduler(max_num_seqs=1)
    a, b = seq(5), seq(5)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)  # still waiting
    assert not s.waiting and b.status is RequestStatus.FINISHED
    s.finish(a)
    assert not s.has_work and s.kv.num_used_blocks == 0
    c = seq(5)
    s.add(c)
    s.schedule()
    assert c.status is RequestStatus.RUNNING


def test_refuses_what_can_never_fit() -> None:
    s = scheduler(pool_tokens=64)
    try:
        s.add(seq(60, 10))
    except ValueError as e:
        assert "70 tokens" in str(e)
    else:
        raise AssertionError("a sequence larger than the pool was accepted")


def prefill_sizes(prompt_len: int, min_last_chunk: int) -> list[int]:
    s = scheduler(pool_tokens=1024, step=64)
    alone = seq(prompt_len, min_last_chunk=min_last_chunk)
    s.add(alone)
    sizes = []
    while alone.is_prefilling:
        chunks = s.schedule().chunks
        sizes.append(len(chunks[0].tokens))
        advance(chunks)
    return sizes


def test_a_prompt_ends_in_a_chunk_of_at_least_the_backends_last_chunk() -> None:
    """llama.cpp computes a one-token batch with other kernels: 64 + 1 would answer otherwise
    than 63 + 2 or 61 + 4, so it asks for a last chunk of two tokens or more
    (Backend.min_last_prompt_chunk); a backend without that rule takes 64 + 1."""
    assert prefill_sizes(65, min_last_chunk=2) == [63, 2]
    assert prefill_sizes(65, min_last_chunk=1) == [64, 1]
    assert prefill_sizes(68, min_last_chunk=8) == [60, 8]
    assert prefill_sizes(1, min_last_chunk=2) == [1]  # a one-token prompt has no other way


def test_a_prompt_waits_rather_than_leave_a_lone_last_token() -> None:
    s = scheduler(pool_tokens=1024, step=4)
    decoding = [seq(1, 50) for _ in range(3)]
    for d in decoding:
        s.add(d)
    advance(s.schedule().chunks)  # three sequences decode from now on: 1 token of budget left
    late = seq(2, min_last_chunk=2)  # llama.cpp's rule
    s.add(late)
    chunks = s.schedule().chunks
    assert [c.seq for c in chunks] == decoding  # 1 token of 2 would leave a lone last one
    advance(chunks)
    s.finish(decoding[0])
    chunks = s.schedule().chunks
    assert [len(c.tokens) for c in chunks if c.seq is late] == [2]
