"""What waking a thread costs on this machine, in CPU: the floor under Laya's CPU per token.

    python tools/wake_cost.py --messages 600

At concurrency 1 each token crosses Laya's threads one message at a time (the worker's
engine hands it to its sender, the front end's supervisor reads it and hands it to the event
loop, which writes the SSE chunk), and each hop wakes a thread that was asleep. On a virtual
machine a wake-up can cost more CPU than the Python work it wakes up for. This program
measures, with ``time.process_time`` (the process's CPU, every thread):

- ``sleep``: one ``time.sleep(--gap-ms)``, the cost of a thread going to sleep and waking;
- ``ping-pong``: a message to another thread and its answer, both threads awake, no sleep;
- ``socket->thread->loop``: a small pickled message every ``--gap-ms`` from another process,
  read by a thread that hands it to an asyncio loop with ``call_soon_threadsafe`` (how the
  front end reads a worker's step messages now: two wakes a message);
- ``socket->loop``: the same messages read by the loop itself (``add_reader``; one wake).

Each figure is microseconds of CPU per sleep, round trip or message; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import queue
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

# About the size of a c=1 step message: one token's event and the replica's snapshot.
MESSAGE = ("events", [(1, ("token", (123,), None, {"logprob": -0.5}))],
           {f"counter_{i}": float(i) for i in range(40)})


def cpu_of_sleep(n: int, gap_s: float) -> float:
    start = time.process_time()
    for _ in range(n):
        time.sleep(gap_s)
    return (time.process_time() - start) / n


def cpu_of_ping_pong(n: int) -> float:
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (x := there.get()) is not None:
            back.put(x)

    thread = threading.Thread(target=echo)
    thread.start()
    start = time.process_time()
    for i in range(n):
        there.put(i)
        back.get()
    spent = time.process_time() - start
    there.put(None)
    thread.join()
    return spent / n


def _send_messages(fd: int, n: int, gap_s: float) -> None:
    conn = Connection(fd)
    data = pickle.dumps(MESSAGE)
    for _ in range(n):
        conn.send_bytes(data)
        time.sleep(gap_s)
    conn.close()


def cpu_of_receiving(n: int, gap_s: float, through_thread: bool) -> float:
    """CPU of this process per message from a child process (the child's is not counted)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: send, then leave without running the parent's cleanup
        ours.close()
        try:
            _send_messages(theirs.detach(), n, gap_s)
        finally:
            os._exit(0)
    theirs.close()
    conn = Connection(ours.detach())
    loop = asyncio.new_event_loop()
    done = loop.create_future()
    got = 0

    def deliver(message: Any) -> None:
        nonlocal got
        got += 1
        if got == n:
            done.set_result(None)

    if through_thread:
        def reader() -> None:
            try:
                while True:
                    loop.call_soon_threadsafe(deliver, pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError, RuntimeError):
                return

        threading.Thread(target=reader, daemon=True).start()
    else:
        def readable() -> None:
            while conn.poll(0):
                deliver(pickle.loads(conn.recv_bytes()))

        loop.add_reader(conn.fileno(), readable)
    start = time.process_time()
    loop.run_until_complete(done)
    spent = time.process_time() - start
    if not through_thread:
        loop.remove_reader(conn.fileno())
    os.waitpid(pid, 0)
    conn.close()
    loop.close()
    return spent / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=600, help="per measurement")
    p.add_argument("--gap-ms", type=float, default=5.0,
                   help="the sleeps and the time between messages (a model's step)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each")
    args = p.parse_args(argv)
    if args.messages < 1 or args.gap_ms <= 0 or args.rounds < 1:
        p.error("--messages and --rounds must be at least 1, --gap-ms above 0")
    gap = args.gap_ms / 1000
    results: dict[str, list[float]] = {"sleep": [], "ping-pong": [],
                                       "socket->thread->loop": [], "socket->loop": []}
    for _ in range(args.rounds):
        results["sleep"].append(cpu_of_sleep(args.messages, gap))
        results["ping-pong"].append(cpu_of_ping_pong(args.messages * 5))
        results["socket->thread->loop"].append(cpu_of_receiving(args.messages, gap, True))
        results["socket->loop"].append(cpu_of_receiving(args.messages, gap, False))
    us = {k: [round(v * 1e6, 1) for v in vs] for k, vs in results.items()}
    for name, values in us.items():
        print(f"{name:<22} {', '.join(f'{v:7.1f}' for v in values)} us of CPU each")
    print(json.dumps({"gap_ms": args.gap_ms, "messages": args.messages, "us_cpu": us}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
