"""What llama.cpp's several-row batches cost and compute, against one-row decodes.

For each GGUF file: prompt processing of 512 tokens (tok/s), one decode at position 400
(ms), a check of a 5-row draft at the same position (``--check N`` for other sizes; ms, and
its ratio to one decode), and,
with ``--rows``, how far each row of a batch at positions 400-408 is from the same token
decoded alone (the largest logit difference; 0.0 is bit-identical). Speculative decoding on
llama.cpp pays where a check costs little more than a decode, and is exact token for token
where the rows are bit-identical (docs/benchmarks.md, 2026-12-04).

    python tools/llamacpp_rows.py [--rows] [--flash-attn] [--check N ...] [--at POS ...] FILE.gguf ...

Runs the llama-cpp-python this interpreter imports (PYTHONPATH can point at another build).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

TEXT = b"def f(x):\n    return x + 1\nclass A:\n    pass\n" * 60


class Rows:
    def __init__(self, path: str, flash_attn: bool, threads: int = 2) -> None:
        import llama_cpp
        from laya_backend_llamacpp.reference import reference_llama

        self.lib = llama_cpp
        self.model = reference_llama(path, n_ctx=1024, n_batch=512, n_threads=threads, verbose=False,
                           flash_attn=flash_attn)
        self.ctx = self.model._ctx.ctx
        self.vocab = self.model.n_vocab()
        self.tokens = self.model.tokenize(TEXT)[:512]
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(self, start: int, count: int, every_row: bool = False) -> float:
        """Feed tokens ``start .. start + count`` after dropping the KV from ``start``; the
        seconds the decode took."""
        lib, b = self.lib, self.batch
        lib.llama_memory_seq_rm(lib.llama_get_memory(self.ctx), 0, start, -1)
        b.n_tokens = count
        for i in range(count):
            b.token[i], b.pos[i], b.n_seq_id[i] = self.tokens[start + i], start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if every_row or i == count - 1 else 0
        t = time.perf_counter()
        if lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - t

    def logits(self, row: int) -> list[float]:
        import numpy as np

        out = self.lib.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(out, shape=(self.vocab,)).copy()

    def timings(self, checks: list[int], positions: list[int] | None = None) -> str:
        pp = statistics.median(self.decode(0, 512) for _ in range(5))
        line = f"pp512 {512 / pp:7.1f} tok/s"
        for at in positions or []:  # a decode's cost grows with the KV cells it attends over
            self.decode(0, at)
            at_ms = statistics.median(self.decode(at, 1) for _ in range(30)) * 1000
            line += f"  decode at {at} {at_ms:6.2f} ms"
        self.decode(0, 400)
        one = statistics.median(self.decode(400, 1) for _ in range(30))
        line += f"  decode {one * 1000:6.2f} ms"
        for n in checks:
            check = statistics.median(self.decode(400, n, every_row=True) for _ in range(20))
            line += f"  {n}-row check {check * 1000:6.2f} ms ({check / one:.2f}x)"
        return line

    def row_differences(self, rows: int = 9) -> list[float]:
        import numpy as np

        self.decode(0, 400)
        alone = []
        for i in range(rows):
            self.decode(400 + i, 1)
            alone.append(self.logits(0))
        self.decode(400, rows, every_row=True)
        return [round(float(np.abs(self.logits(i) - alone[i]).max()), 4) for i in range(rows)]


def _within(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (the 512 tokens of TEXT)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number, not {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}: the text "
                                             "is 512 tokens")
        return value
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rows", action="store_true", help="compare a batch's rows too")
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--check", type=_within(1, 112), action="append",
                        help="rows of a check to time (repeat; default 5)")
    parser.add_argument("--at", type=_within(1, 511), action="append", default=[],
                        help="also time one decode at this position (repeat; up to 511)")
    args = parser.parse_args()
    for path in args.files:
        rows = Rows(path, args.flash_attn)
        print(f"{path.rsplit('/', 1)[-1]:40s} {rows.timings(args.check or [5], args.at)}", flush=True)
        if args.rows:
            print(f"{'':40s} rows of a 9-row batch, largest logit difference to one row:"
                  f" {rows.row_differences()}", flush=True)


if __name__ == "__main__":
    main()
