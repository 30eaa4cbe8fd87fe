"""``laya plan`` for ``[cluster] engine = "ray"``: which node each replica's actor would land on.

Each replica's actor asks Ray for ``num_cpus`` and ``memory`` (its ledger's total bytes;
laya_core/replica/ray_client.py), so the placement is a first fit of the ledger, in its order,
into what each node has free now. A replica that fits no node is refused with the numbers.
A cluster that cannot be reached is said so, and the plan stands as for worker processes
on one machine.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

import attrs

from laya_core.memory.ledger import Plan
from laya_core.replica.ray_client import actor_resources
from laya_core.units import fmt_bytes

CONNECT_TIMEOUT_S = 3.0


@attrs.define
class Node:
    """One alive node and what it has free (bytes of Ray's ``memory``, CPUs)."""

    node_id: str
    address: str
    memory_bytes: float
    cpus: float


def cluster_address(address: str | None) -> str | None:
    return address or os.environ.get("RAY_ADDRESS") or None


def reachable(address: str) -> str | None:
    """Why ``host:port`` takes no connection, or None (a quick probe before Ray's own
    connect, which waits long for a cluster that is not there)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), CONNECT_TIMEOUT_S):
            return None
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def nodes(address: str) -> list[Node]:
    """The cluster's alive nodes with their free resources (joins it as a driver)."""
    import ray
    from ray._private import state  # per-node availability has no public call yet

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    free = state.state.available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        have = free.get(n["NodeID"], n["Resources"])
        out.append(Node(n["NodeID"], n["NodeManagerAddress"], have.get("memory", 0.0),
                        have.get("CPU", 0.0)))
    return out


def place(plan: Plan, cluster: Sequence[Node]) -> list[tuple[int, Node | None]]:
    """Per replica, the node its actor would take (first fit in ledger order), or None."""
    free = [attrs.evolve(n) for n in cluster]
    out: list[tuple[int, Node | None]] = []
    for r in plan.replicas:
        cpus = actor_resources(r.cpu_threads, None)["num_cpus"]
        node = next((n for n in free if n.memory_bytes >= r.total_bytes and n.cpus >= cpus),
                    None)
        if node is not None:
            node.memory_bytes -= r.total_bytes
            node.cpus -= cpus
        out.append((r.replica, None if node is None else
                    next(n for n in cluster if n.node_id == node.node_id)))
    return out


def report(plan: Plan, address: str | None) -> tuple[str, bool]:
    """The placement as a person reads it, and whether every replica finds a node."""
    where = cluster_address(address)
    if where is None:
        return ("ray: no cluster address ([cluster] address or RAY_ADDRESS): laya serve "
                "starts a local Ray; planned as for worker processes on this machine", True)
    why = reachable(where)
    if why is not None:
        return (f"ray: cannot reach the cluster at {where} ({why}); planned as for worker "
                "processes on this machine", True)
    cluster = nodes(where)
    lines = [f"ray cluster at {where}: {len(cluster)} node(s), free now:"]
    lines += [f"  node {n.node_id[:12]} {n.address:<15} memory {fmt_bytes(int(n.memory_bytes))}"
              f", {n.cpus:g} CPU" for n in cluster]
    ok = True
    ledgers = {r.replica: r for r in plan.replicas}
    for replica, node in place(plan, cluster):
        r = ledgers[replica]
        ask = (f"{fmt_bytes(r.total_bytes)}, {actor_resources(r.cpu_threads, None)['num_cpus']} "
               "CPU")
        if node is None:
            ok = False
            lines.append(f"  {r.model} replica {replica} ({ask}) FITS NO NODE: the largest "
                         f"free memory is {fmt_bytes(int(max((n.memory_bytes for n in cluster), default=0)))}"
                         " before the replicas above; add a node, or lower this model's "
                         "max_seq_len, max_num_seqs or replicas")
        else:
            lines.append(f"  {r.model} replica {replica} ({ask}) -> node "
                         f"{node.node_id[:12]} ({node.address})")
    return "\n".join(lines), ok
