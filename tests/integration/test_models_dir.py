"""A folder of models (``[models_dir]``, ``laya serve --models-dir DIR``): each GGUF file in
it is a model loaded on demand named after its file, with the flags' settings; a bad file
is named in the error; a file copied in while the server runs is served without a restart,
and a file that is not a model is left out with the reason in the log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess

from laya_core.config import manifest as mf
from laya_core.plugins import load_registry


@pytest.fixture(scope="module")
def gguf() -> str:
    path = load_registry().resolve_model_path("embedded:smollm2-135m-instruct")
    assert path and path.endswith(".gguf")
    return path


def folder_of(tmp_path: Path, gguf: str, *names: str) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    for name in names:  # links: the same 100 MB file under several names
        (folder / name).symlink_to(gguf)
    return folder


def test_the_manifest_table_gives_each_file_an_on_demand_entry(tmp_path: Path,
                                                               gguf: str) -> None:
    folder = folder_of(tmp_path, gguf, "chat.gguf", "coder.Q4_1.gguf")
    (folder / ".hidden.gguf").symlink_to(gguf)
    (folder / "notes.txt").write_text("not a model")
    registry = load_registry()
    manifest = mf.build({
        "models": [{"name": "chat", "path": "embedded:smollm2-135m-instruct"}],
        "models_dir": {"path": str(folder), "max_seq_len": 256, "idle_unload_s": 60}},
        registry)
    by_name = {m.name: m for m in manifest.models}
    assert set(by_name) == {"chat", "coder.Q4_1"}  # [[models]] keeps its name
    assert by_name["chat"].load == "always"
    coder = by_name["coder.Q4_1"]
    assert (coder.load, coder.max_seq_len, coder.idle_unload_s) == ("on_demand", 256, 60.0)
    (folder / "broken.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(mf.ManifestError) as info:
        mf.build({"models_dir": {"path": str(folder)}}, registry)
    assert info.value.key == "models_dir.path" and "broken.gguf" in info.value.message
    for table, key in (({"path": str(tmp_path / "nowhere")}, "models_dir.path"),
                       ({"path": str(folder), "name": "x"}, "models_dir.name"),
                       ({"path": str(folder), "max_seq_len": 3}, "models_dir.max_seq_len")):
        with pytest.raises(mf.ManifestError) as info:
            mf.build({"models_dir": table}, registry)
        assert info.value.key == key, info.value


def test_a_model_copied_in_while_serving_is_served(tmp_path: Path, gguf: str) -> None:
    folder = folder_of(tmp_path, gguf, "first.gguf")
    server = ServerProcess(None, tmp_path, args=["--models-dir", str(folder), "-c", "256",
                                                 "-np", "2", "-t", "1"])
    try:
        server.wait_ready()
        cards = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(c["id"], c["load"], c["status"]) for c in cards] == [
            ("first", "on_demand", "unloaded")]
        (folder / "junk.gguf").write_bytes(b"not a model at all")
        (folder / ".second.part").symlink_to(gguf)  # as a copy lands: under a hidden name,
        os.rename(folder / ".second.part", folder / "second.gguf")  # then renamed
        deadline = time.monotonic() + 60
        while "second" not in {c["id"] for c in httpx.get(f"{server.url}/v1/models").json()[
                "data"]}:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": "second", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi."}]})
        assert answer.status_code == 200, answer.text
        assert "load;dur=" in answer.headers["server-timing"]
        card = httpx.get(f"{server.url}/v1/models/second").json()
        assert (card["status"], card["max_model_len"]) == ("loaded", 256)  # the flags' -c
        assert "junk" not in {c["id"] for c in httpx.get(f"{server.url}/v1/models").json()[
            "data"]}
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert "not serving" in server.log() and "junk.gguf" in server.log()


def test_laya_check_lists_the_folders_models(tmp_path: Path, gguf: str) -> None:
    folder = folder_of(tmp_path, gguf, "a.gguf", "b.gguf")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYA_")}
    out = subprocess.run([sys.executable, "-m", "laya_core.cli.main", "plan", "--models-dir",
                          str(folder), "-c", "512"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "largest on demand" in out.stdout and "of 2 loaded on demand (a, b)" in out.stdout
