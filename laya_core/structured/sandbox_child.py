"""The child side of :mod:`laya_core.structured.sandbox`: compile, walk, measure, answer.

It reads one setup line (the vocabulary and the limits), builds llguidance's view of the
vocabulary, starts its compile thread (with the parent's stack size), caps its own address
space at what it uses then plus ``memory_bytes``, and answers one JSON line per job line.
It has no model: the strings llguidance asks it to tokenize are split greedily into the
longest tokens, which may differ from the model's own splits but not in what a grammar
costs to compile and mask.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import random
import resource
import sys
import threading
import time
from typing import Any

import llguidance


class _Vocab:
    """The object ``llguidance.TokenizerWrapper`` reads, with a greedy tokenizer."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self.tokens = [bytes.fromhex(t) for t in setup["tokens"]]
        self.special_token_ids = setup["specials"]
        self.eos_token_id = setup["eos"][0] if setup["eos"] else 0
        self.bos_token_id = None
        self.built: llguidance.LLTokenizer | None = None

    def __call__(self, text: bytes | str) -> list[int]:
        if self.built is None:  # TokenizerWrapper's probe, before the tokenizer exists
            return []
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return list(self.built.greedy_tokenize(text))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _allocated() -> int:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2), or 0 elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return 0
    return int(info.uordblks + info.hblkhd)


def _pick(mask: bytes, num_words: int, eos: set[int], rnd: random.Random) -> int | None:
    """An allowed token other than an end token, or None when only ends are allowed."""
    words = memoryview(mask).cast("I")[:num_words]
    nonzero = [i for i, w in enumerate(words) if w]
    rnd.shuffle(nonzero)
    for i in nonzero:
        ids = [i * 32 + b for b in range(32) if words[i] >> b & 1 and i * 32 + b not in eos]
        if ids:
            return rnd.choice(ids)
    return None


def _refusal(matcher: llguidance.LLMatcher) -> dict[str, Any]:
    return {"status": "matcher", "value": matcher.get_error()}


def _walk(matcher: llguidance.LLMatcher, job: dict[str, Any]) -> dict[str, Any] | float:
    """The first masks along a walk of allowed tokens (the same walk each time): the
    slowest after the first, or the refusal when one fails.

    A mask is timed in this thread's CPU time, not the wall clock's: the child runs niced
    beside generation, and on a busy machine it waits for a core longer than it computes,
    which says nothing about what the grammar will cost a replica's step."""
    rnd = random.Random(0)
    eos, slowest = set(job["eos"]), 0.0
    for step in range(job["first_masks"]):
        start = time.thread_time()
        mask = matcher.compute_bitmask()
        if step:
            slowest = max(slowest, time.thread_time() - start)
        if matcher.is_error():
            return _refusal(matcher)
        token = _pick(mask, (job["n_vocab"] + 31) // 32, eos, rnd)
        if token is None:
            if step == 0 and not matcher.is_accepting():
                return {"status": "error", "value": "no output satisfies it"}
            break
        matcher.consume_token(token)
        if matcher.is_error():
            return _refusal(matcher)
    return slowest


def check(tokenizer: llguidance.LLTokenizer, job: dict[str, Any]) -> dict[str, Any]:
    grammar = job["grammar"]
    if job["convert"]:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(grammar))
        except Exception as e:  # noqa: BLE001 - the converter's errors are the grammar's
            return {"status": "error", "value": f"it is not a Lark or GBNF grammar: {e}"}
    before = _allocated()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                   limits=llguidance.LLParserLimits(**job["parser_limits"]))
    if matcher.is_error():
        return _refusal(matcher)
    walked = _walk(matcher, job)
    if isinstance(walked, dict):
        return walked
    return {"status": "ok", "grammar": grammar, "bytes": max(_allocated() - before, 0),
            "mask_s": walked}


def _answer(tokenizer: llguidance.LLTokenizer, job: dict[str, Any]) -> dict[str, Any]:
    try:
        return check(tokenizer, job)
    except MemoryError:
        return {"status": "error", "alive": False, "value": "compiling it needed more than "
                f"the {job['memory_bytes'] // 2**20} MiB of memory one constraint may use"}
    except RecursionError:
        return {"status": "error", "value": "it is nested too deeply to convert"}


def _serve(jobs: queue.SimpleQueue[dict[str, Any]],
           replies: queue.SimpleQueue[dict[str, Any]],
           tokenizer: llguidance.LLTokenizer) -> None:
    while True:
        replies.put(_answer(tokenizer, jobs.get()))


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def main() -> None:
    setup = json.loads(sys.stdin.buffer.readline())
    # Compiling yields the CPU to the replica's generation: on a busy machine a compile
    # waits, not the tokens of the streams already running.
    os.nice(setup["nice"])
    vocab = _Vocab(setup)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab),
                                       n_vocab=len(vocab.tokens),
                                       eos_token=setup["eos"] or None)
    vocab.built = tokenizer
    common = {"eos": setup["eos"], "n_vocab": len(vocab.tokens),
              "first_masks": setup["first_masks"], "parser_limits": setup["parser_limits"],
              "memory_bytes": setup["memory_bytes"]}
    jobs: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    threading.stack_size(setup["stack_bytes"])
    threading.Thread(target=_serve, args=(jobs, replies, tokenizer), daemon=True).start()
    cap = _address_space() + setup["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    sys.stdout.write(json.dumps({"status": "ready"}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        jobs.put({**json.loads(line), **common})
        reply = replies.get()
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if not reply.get("alive", True):
            return
