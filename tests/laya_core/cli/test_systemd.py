"""The systemd unit of ``laya plan --systemd``: its user, its hardening, and systemd's verdict."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from laya_core.cli import systemd
from laya_core.config import manifest as mf
from laya_core.memory import planner
from laya_core.memory.ledger import Plan
from laya_core.plugins import load_registry

HARDENING = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only",
             "ProtectKernelTunables=yes", "ProtectControlGroups=yes", "RestrictSUIDSGID=yes")


def plan_and_manifest(folder: Path) -> tuple[Plan, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "laya.toml"
    manifest.write_text('[[models]]\nname = "smol"\npath = "embedded:smollm2-135m-instruct"\n')
    registry = load_registry()
    resolved = mf.resolve(mf.load(str(manifest)), registry, need_backends=False)
    return planner.make_plan(resolved, registry), manifest


# Where a deployment keeps its manifest; unit() only names it. (pytest's folders are in /tmp.)
SRV = Path("/srv/laya/laya.toml")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    return plan_and_manifest(tmp_path_factory.mktemp("systemd"))[0]


def lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x and not x.startswith("#")]


def test_the_unit_runs_as_laya_by_default(plan: Plan) -> None:
    unit = lines(systemd.unit(plan, SRV))
    assert "User=laya" in unit and "Group=laya" in unit
    assert not any(x.startswith(("User=root", "DynamicUser")) for x in unit)
    assert all(x in unit for x in HARDENING)
    # The model file lives in the venv, which is under /tmp in a CI clone: then the real
    # /tmp stays visible.
    model_in_tmp = any(Path(r.config.path).is_relative_to("/tmp") for r in plan.replicas)
    assert f"PrivateTmp={'no' if model_in_tmp else 'yes'}" in unit
    assert f"ExecStart={sys.executable} -m laya_core.cli.main serve {SRV}" in unit
    assert "WorkingDirectory=/srv/laya" in unit


def test_another_user_and_names_it_refuses(plan: Plan) -> None:
    unit = lines(systemd.unit(plan, SRV, user="llm-serve"))
    assert "User=llm-serve" in unit and "Group=llm-serve" in unit
    for bad in ("root", "", "Laya Server", "laya\nUser=root", "-laya"):
        with pytest.raises(ValueError, match="not a user name"):
            systemd.unit(plan, SRV, user=bad)


def test_a_manifest_in_tmp_keeps_the_real_tmp(tmp_path: Path) -> None:
    plan, manifest = plan_and_manifest(tmp_path)
    assert "PrivateTmp=no" in lines(systemd.unit(plan, manifest))


@pytest.mark.slow  # runs systemd-analyze
def test_systemd_accepts_the_unit(plan: Plan, tmp_path: Path) -> None:
    # `make test` installs systemd where it is missing (the Makefile's test-system-deps);
    # this test never skips.
    assert shutil.which("systemd-analyze"), \
        "systemd-analyze is missing: sudo apt-get install systemd"
    path = tmp_path / "laya.service"
    path.write_text(systemd.unit(plan, SRV))
    run = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0 and "laya.service" not in run.stderr, run.stderr
