"""The memory plan as a person reads it: each replica's ledger by device, the totals, each
GPU against its budget, and the settings that would fit (``laya plan``, ``laya check`` and
``laya serve`` when it refuses)."""

from __future__ import annotations

from collections.abc import Callable

from laya_core.memory import devices
from laya_core.memory.ledger import Plan
from laya_core.units import fmt_bytes


def format_plan(plan: Plan) -> str:
    """The ledger as a person reads it."""
    lines = []
    for r in plan.replicas:
        p = r.profile
        gpus = r.gpus

        def where(of: Callable[[str], int], gpus: tuple[str, ...] = gpus) -> str:
            return "" if not gpus else "   (" + ", ".join(
                f"{d} {fmt_bytes(of(d))}" for d in (*gpus, devices.HOST)) + ")"

        lines += [
            f"{r.model} (replica {r.replica}, backend {r.config.backend}): "
            f"max_seq_len {r.max_seq_len}, max_num_seqs {r.config.max_num_seqs}, "
            f"KV {p.kv_dtype}",
            f"  weights            {fmt_bytes(p.weights_bytes):>12}   {p.weights_source}"
            + where(r.weights_on),
            f"  KV per token       {fmt_bytes(p.kv_bytes_per_token):>12}",
            f"  KV per sequence    {fmt_bytes(r.kv_bytes_per_seq):>12}   at max_seq_len "
            f"{r.max_seq_len}",
            f"  KV pool            {fmt_bytes(r.kv_pool_bytes):>12}   {r.pool_tokens} tokens: "
            f"{r.max_concurrent_seqs} full-length sequence(s) at once" + where(r.kv_pool_on),
        ]
        lines += [f"  {o.name:<18} {fmt_bytes(o.bytes):>12}   "
                  + (f"[{o.device}] " if o.device != devices.HOST else "") + o.how
                  + (f" (shared by this process's replicas: {o.shared})" if o.shared else "")
                  for o in p.overheads]
        lines.append(f"  replica total      {fmt_bytes(r.total_bytes):>12}"
                     + ("   in host RAM; " + ", ".join(f"{fmt_bytes(r.bytes_on(d))} on {d}"
                                                      for d in gpus) if gpus else ""))
    lines += [
        f"runtime              {fmt_bytes(plan.runtime_bytes):>12}   Python, HTTP server, "
        "libraries (once per process); the chat-template sandbox (64 MiB cap); the "
        "Responses API's stored responses (16.25 MiB cap)"
        + ("; each replica in a worker process of its own" if plan.processes else ""),
    ]
    if plan.shared_bytes_counted_once:
        lines.append(f"shared, once         {fmt_bytes(-plan.shared_bytes_counted_once):>12}   "
                     "the replicas' shared lines, each counted once in the total")
    if (largest := plan.largest_on_demand) is not None:
        pinned = sorted({r.model for r in plan.pinned})
        on_demand = sorted({r.model for r in plan.replicas if r.config.on_demand})
        lines += [
            f"pinned               {fmt_bytes(sum(r.total_bytes for r in plan.pinned)):>12}"
            f"   load = always: {', '.join(pinned) or 'none'}",
            f"largest on demand    {fmt_bytes(plan.model_bytes(largest)):>12}   {largest}, "
            f"of {len(on_demand)} loaded on demand ({', '.join(on_demand)}): each must fit "
            "beside the pinned ones; the total counts the largest",
        ]
    lines += [
        f"total                {fmt_bytes(plan.total_bytes):>12}"
        + ("   in host RAM" if plan.gpus_used else ""),
        f"budget               {fmt_bytes(plan.budget.bytes):>12}   {plan.budget.source}",
    ]
    for d in sorted({*plan.gpus.budgets, *plan.gpus_used}, key=devices.device_index):
        b = plan.gpus.budgets.get(d)
        lines.append(f"{d:<20} {fmt_bytes(plan.gpu_bytes(d)):>12}   of "
                     + (f"{fmt_bytes(b.bytes)} ({b.source})" if b else "nothing: the machine "
                        "has no such GPU")
                     + (": OVER" if d in plan.gpus_over else ""))
    over = [f"{fmt_bytes(plan.total_bytes - plan.budget.bytes)} over budget"
            + (" in host RAM" if plan.gpus_used else "")] \
        if plan.total_bytes > plan.budget.bytes else []
    over += [f"{fmt_bytes(plan.gpu_bytes(d) - plan.gpus.budget_bytes(d))} over {d}'s"
             for d in plan.gpus_over]
    if plan.fits:
        lines.append(f"fits: {fmt_bytes(plan.budget.bytes - plan.total_bytes)} to spare"
                     + "".join(f", {fmt_bytes(plan.gpus.budget_bytes(d) - plan.gpu_bytes(d))}"
                               f" on {d}" for d in plan.gpus_used))
    else:
        lines.append(f"DOES NOT FIT: {'; '.join(over)}. " + (
            "Any one of these would fit:" if plan.largest_on_demand is None
            else "Each model named needs one of its lines (the pinned models must fit "
            "together, each on-demand one beside them):"))
        lines += [f"  {s}" for s in plan.suggestions]
    return "\n".join(lines)
