"""A backend that needs no local model file (``Backend.needs_model_file = False``): its
models pass ``laya check`` and ``laya plan`` with a path that is not a file, planned from
the shape the backend reports."""

from __future__ import annotations

from pathlib import Path

import pytest
from toy_backend import ToyBackend

from laya_core.cli.main import build_parser
from laya_core.config import manifest as mf
from laya_core.hookspecs import hookimpl
from laya_core.models.files import ModelShape
from laya_core.plugins import load_registry

URL = "http://127.0.0.1:9/v1"


class Remote(ToyBackend):
    """The toy, as if its model were served elsewhere and reached by URL."""

    name = "remote-toy"
    needs_model_file = False
    # Preferred over another installed backend that takes URLs (examples/laya-backend-openai).
    default_preference = 1

    @classmethod
    def check_model_path(cls, path: str) -> str | None:
        return None if path.startswith("http://") else f"{path} is not an http:// URL"

    @classmethod
    def model_shape(cls, path: str) -> ModelShape:
        return ModelShape(architecture="remote", n_layers=0, n_heads=0, n_kv_heads=0,
                          head_dim_k=0, head_dim_v=0, hidden_size=0, vocab_size=257,
                          n_ctx_train=2048, weights_bytes=0,
                          weights_source=f"held by the server at {path}")


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register(Remote.name, Remote)


def run(command: str, source: Path | str,
        capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    args = build_parser().parse_args([command, str(source)])
    code = int(args.func(args, load_registry([Plugin()])))
    return code, capsys.readouterr().out


def test_check_and_plan_pass_without_a_model_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(f'[[models]]\nname = "m"\npath = "{URL}"\n')  # backend: the default
    code, out = run("check", manifest, capsys)
    assert code == 0
    # Chosen as the preferred installed backend that takes the URL; the URL kept as written.
    assert f"ok: m: backend remote-toy, {URL}, max_seq_len 2048" in out
    code, out = run("plan", manifest, capsys)
    assert code == 0 and "held by the server at " + URL in out
    # The URL alone as SOURCE: a model served alone, kept as written.
    code, out = run("check", URL, capsys)
    assert code == 0 and f"backend remote-toy, {URL}," in out


def test_a_backend_that_needs_a_file_is_still_refused_a_url(tmp_path: Path) -> None:
    data = {"models": [{"name": "m", "path": URL, "backend": "llamacpp"}]}
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict(data), load_registry([Plugin()]))
    assert info.value.key == "models[0].path" and "no such file" in info.value.message
