"""Milliseconds per decode step of the torch backend, one sequence or several, and where
the time goes (torch.profiler's top operations with ``--profile``).

    python tools/profile_torch_step.py --options '{"dtype": "bfloat16", "quantize": "int4"}'
    python tools/profile_torch_step.py --batch 8 --profile

The backend is driven directly (TorchBackend.step on hand-made items, no engine), on the
embedded model: a 40-token prompt per sequence, then decode steps. Nothing else should run
meanwhile; compare configurations in alternating runs.
"""

from __future__ import annotations

import argparse
import json
import time

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.types import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--options", default="{}", help="[models.options] as JSON")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    from laya_backend_torch.backend import TorchBackend

    options = {"n_threads": 1, **json.loads(args.options)}
    backend = TorchBackend(ModelConfig(
        name="m", backend="torch", path=embedded_file("smollm2-135m-instruct"),
        max_seq_len=1024, max_num_seqs=args.batch, options=options))
    backend.load_weights()
    backend.allocate_kv(num_tokens=args.batch * 1024, max_num_seqs=args.batch)
    tables = [list(range(s * 64, (s + 1) * 64)) for s in range(args.batch)]
    position, token = [], []
    for s in range(args.batch):
        backend.start_sequence(s, SamplingParams(max_tokens=1000, temperature=0.0))
        prompt = list(range(100 + s, 140 + s))
        (result,) = backend.step([StepItem(s, prompt, 0, True, block_table=tables[s])])
        assert result.sample is not None
        position.append(len(prompt))
        token.append(result.sample.token_id)

    def step() -> None:
        results = backend.step([StepItem(s, [token[s]], position[s], True,
                                         block_table=tables[s]) for s in range(args.batch)])
        for s, result in enumerate(results):
            assert result.sample is not None
            position[s] += 1
            token[s] = result.sample.token_id

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    took = (time.perf_counter() - start) / args.steps
    print(f"{options}, {args.batch} sequence(s): {took * 1e3:.2f} ms a step, "
          f"{args.batch / took:.1f} tokens/s")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(10):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
