"""How many threads a backend's step gets: all the cores, unless others need them now.

Backend-neutral: llama.cpp's ggml threads and torch's OpenMP intra-op pool both meet at a
barrier per operation with the calling thread computing beside them, so the same signal
serves both. What follows was measured with llama.cpp.

llama.cpp's compute threads meet at a barrier after every graph node, hundreds of times per
forward pass. While every thread has a core of its own that costs little; when another
process (or another replica's threads) takes one of those cores, each barrier waits until the
switched-out thread runs again, and two threads run slower than one. Measured on a 2-core
AMD EPYC, 4 sequences decoding, tokens/s:

    alone:                              1 thread 122,  2 threads 223
    beside one busy process:            1 thread 122,  2 threads  97
    beside another 2-thread llama.cpp:  2 threads 54 each, where 1 thread each gave 120 each

So the default uses every core and watches for that case. The signal is the share of each
decode's wall time that the calling thread spent on a CPU (``time.thread_time``): it is
OpenMP's thread 0 and computes alongside the others, so alone the share is 1.00 (the
threads spin at the barrier rather than sleep), beside a busy process 0.71, beside another
2-thread process 0.49. Three windows in a row whose share falls below ``min_share`` drop one
thread (a busy neighbour stays; a moment's noise does not); a dropped thread is offered back
after ``probe_after_s`` and kept if the share stays high, else the next offer waits twice as
long.

A change of thread count can change a greedy output in its last bits: llama.cpp's CPU flash
attention splits the KV range among the threads (measured: 1 and 2 threads agreed for 66
tokens, then diverged), so ``n_threads`` set to a number, or flash attention off, is the
way to outputs that never depend on the machine's load. Polling or priority settings of ggml's own thread
pool do not help here: the OpenMP build (llama-cpp-python's default) waits in OpenMP's
barrier, and raising priority needs real-time scheduling and privileges.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path


class ThreadGovernor:
    """Chooses the thread count of the next decode from how well the last ones ran."""

    def __init__(self, max_threads: int, *, window_s: float = 0.2, min_share: float = 0.85,
                 patience: int = 3, probe_after_s: float = 4.0, max_probe_after_s: float = 64.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be at least 1")
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s = window_s
        self.min_share = min_share
        self.patience = patience  # low windows in a row before a thread goes
        self._low_windows = 0
        self._base_probe_s = probe_after_s
        self._max_probe_s = max_probe_after_s
        self._probe_after_s = probe_after_s
        self._clock = clock
        self._next_probe = 0.0
        self._probing = False
        self._wall = 0.0
        self._cpu = 0.0
        self.num_drops = 0  # how often contention took a thread away, for /ready
        self.last_share: float | None = None  # of the last full window

    def record(self, wall_s: float, cpu_s: float) -> int | None:
        """Account one decode (its wall time and the calling thread's CPU time, seconds);
        returns the new thread count when it changes, else None."""
        self._wall += wall_s
        self._cpu += cpu_s
        if self._wall < self.window_s:
            return None
        share = self.last_share = self._cpu / self._wall
        self._wall = self._cpu = 0.0
        before = self.threads
        self._low_windows = self._low_windows + 1 if share < self.min_share else 0
        if self._probing:
            self._end_probe(kept=share >= self.min_share)
        elif self._low_windows >= self.patience and self.threads > 1:
            self._drop()
        elif self.threads < self.max_threads and self._clock() >= self._next_probe:
            self.threads += 1
            self._probing = True
        return self.threads if self.threads != before else None

    def _drop(self) -> None:
        self._low_windows = 0
        self.threads -= 1
        self.num_drops += 1
        self._next_probe = self._clock() + self._probe_after_s

    def _end_probe(self, kept: bool) -> None:
        self._probing = False
        if kept:
            self._probe_after_s = self._base_probe_s
            return
        self._probe_after_s = min(self._probe_after_s * 2, self._max_probe_s)
        self._drop()


def physical_cores(cpus: Iterable[int] | None = None, sysfs: Path = Path("/sys")) -> int:
    """Cores (not hyper-threads) among the CPUs this process may run on.

    Two hyper-threads of one core share its execution units, and a backend's threads wait
    for each other after every operation, so a second thread per core only adds waiting.
    Falls back to the number of CPUs where the topology cannot be read.
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"devices/system/cpu/cpu{cpu}/topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))
