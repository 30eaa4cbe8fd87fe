"""The example router plugin (examples/laya-random-router), installed as an outside author's
package is: its policy checked by the manifest as its own, its draws weighted, and a server
that uses it spreading one repeated prompt over both replicas, where prefix routing keeps
it on one."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import SMOLLM_MANIFEST, serving
from laya_random_router.router import RandomRouter

from laya_core.config import manifest as mf
from laya_core.plugins import load_registry
from laya_core.routing.router import NoRouteError, ReplicaState

TWO_REPLICAS = SMOLLM_MANIFEST.replace("max_num_seqs = 8", "max_num_seqs = 2\nreplicas = 2")


def test_laya_plugins_lists_it_with_its_package_and_version() -> None:
    out = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plugins"], check=True,
                         capture_output=True, text=True).stdout
    assert re.search(r"^  random +laya-random-router 0\.1\.0 ", out, re.M), out


def test_draws_follow_the_weights_among_the_replicas_up() -> None:
    router = RandomRouter(seed=3)
    for replica, weight in ((0, 1), (1, 1), (2, 2)):
        router.add_replica("m", replica, weight)
    router.add_alias("alias", "m")
    counts: collections.Counter[int] = collections.Counter()
    for _ in range(4000):
        chosen = router.route("alias")
        counts[chosen] += 1
        router.release(chosen)
    for replica, share in ((0, 0.25), (1, 0.25), (2, 0.5)):  # 4000 draws: sd under 0.008
        assert abs(counts[replica] / 4000 - share) < 0.04, counts
    router.set_state(2, ReplicaState.DOWN)
    assert {router.route("m") for _ in range(200)} == {0, 1}
    assert router.outstanding(0) + router.outstanding(1) == 200
    router.set_state(0, ReplicaState.DRAINING)
    router.set_state(1, ReplicaState.DOWN)
    with pytest.raises(NoRouteError):
        router.route("m")


def test_the_manifest_checks_routing_against_the_chosen_routers_policies() -> None:
    registry = load_registry()
    model = {"name": "m", "path": "embedded:smollm2-135m-instruct"}
    mf.resolve(mf.from_dict({"router": {"impl": "random"},
                             "models": [{**model, "routing": "random"}]}), registry)
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"router": {"impl": "random"}, "models": [model]}), registry)
    assert info.value.key == "models[0].routing"
    assert "must be one of random (the policies of the random router), not 'prefix'" \
        in str(info.value)
    with pytest.raises(mf.ManifestError, match="the policies of the python router"):
        mf.resolve(mf.from_dict({"router": {"impl": "python"},
                                 "models": [{**model, "routing": "random"}]}), registry)


def served_by(url: str) -> dict[str, float]:
    """Finished requests per replica, from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    out: dict[str, float] = collections.defaultdict(float)
    for m in re.finditer(r'^laya:request_success_total\{([^}]*)\} (\S+)$', text, re.M):
        replica = re.search(r'replica="(\d+)"', m.group(1))
        assert replica
        out[replica.group(1)] += float(m.group(2))
    return dict(out)


@pytest.mark.parametrize(("impl", "routing"), [("random", "random"), ("python", "prefix")])
def test_a_repeated_prompt_is_spread_by_random_and_kept_by_prefix(
        tmp_path: Path, impl: str, routing: str) -> None:
    manifest = f'[router]\nimpl = "{impl}"\n' + TWO_REPLICAS + f'routing = "{routing}"\n'
    with serving(manifest, tmp_path) as server:
        for _ in range(24):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "smollm2", "prompt": "The same prompt, every time: " * 4,
                "max_tokens": 1})
            assert r.status_code == 200, r.text
        counts = served_by(server.url)
    print(f"\n{impl}/{routing}: requests per replica {counts}")
    assert sum(counts.values()) == 24
    if impl == "random":
        assert min(counts.get("0", 0), counts.get("1", 0)) >= 3  # p < 1e-4 otherwise
    else:
        assert max(counts.values()) == 24  # every time the replica holding the prefix
