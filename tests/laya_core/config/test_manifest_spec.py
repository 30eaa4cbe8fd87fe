"""spec/manifest.md documents every manifest key and every option of every installed
backend, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laya_core.config import manifest as mf
from laya_core.plugins import load_registry

SPEC = Path(__file__).resolve().parents[3] / "spec" / "manifest.md"


def documented() -> dict[str, set[str]]:
    """The keys in the first column of each section's tables, by section heading."""
    sections: dict[str, set[str]] = {}
    current = ""
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            current = line.lstrip("#").strip()
            sections.setdefault(current, set())
        elif m := re.match(r"^\| `([a-z_]+)` \|", line):
            sections[current].add(m.group(1))
    return sections


def section(title: str) -> set[str]:
    matches = [keys for heading, keys in documented().items() if heading.startswith(title)]
    assert matches, f"spec/manifest.md has no section {title!r}"
    return matches[0]


@pytest.mark.parametrize(("title", "keys"), [
    ("`[server]`", mf.SERVER_KEYS),
    ("`[memory]`", mf.MEMORY_KEYS),
    ("`[router]`", mf.ROUTER_KEYS),
    ("`[cluster]`", mf.CLUSTER_KEYS),
    ("`[[models]]`", mf.MODEL_KEYS),
    ("`[models_dir]`", ("path",)),  # and the [[models]] keys, each model's
])
def test_every_table_key_is_documented_and_only_those(title: str, keys: tuple[str, ...]) -> None:
    doc = section(title)
    assert set(keys) - doc == set(), f"undocumented keys in {title}"
    assert doc - set(keys) == set(), f"documented keys that {title} does not read"


def test_every_backend_option_is_documented() -> None:
    registry = load_registry()
    assert registry.backends, "no backend is installed"
    for name, entry in registry.backends.items():
        if name == "toy":
            continue
        doc = section(f"`options` of the `{name}` backend")
        options = set(entry.obj.option_names)
        assert options - doc == set(), f"undocumented {name} options"
        assert doc - options == set(), f"documented {name} options it does not have"


def test_every_flag_and_variable_is_documented() -> None:
    from laya_core.config.cli_settings import MODEL_ENV, SETTINGS

    text = SPEC.read_text(encoding="utf-8")
    for s in SETTINGS:
        for name in (*s.flags, s.env):
            assert f"`{name}" in text, f"{name} is not in spec/manifest.md"
    assert f"`{MODEL_ENV}`" in text


def test_the_manifest_with_every_key_holds_every_key_and_passes_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    text = SPEC.read_text(encoding="utf-8")
    block = re.search(r"## Every key, in one manifest.*?```toml\n(.*?)```", text, re.S)
    assert block, "spec/manifest.md has no manifest with every key"
    data = tomllib.loads(block.group(1))
    assert set(data) == set(mf.TOP_KEYS)
    assert set(data["server"]) == set(mf.SERVER_KEYS)
    assert set(data["memory"]) == set(mf.MEMORY_KEYS)
    assert set(data["router"]) == set(mf.ROUTER_KEYS)
    assert set(data["cluster"]) == set(mf.CLUSTER_KEYS)
    (model,) = data["models"]
    assert set(model) == set(mf.MODEL_KEYS)
    folder = tmp_path / "deploy"
    folder.mkdir()
    (folder / "laya.toml").write_text(block.group(1))
    (folder / "keys.txt").write_text("sk-laya-from-the-file\n")
    (folder / "models").mkdir()  # [models_dir]: empty, as it may start
    monkeypatch.setenv("LAYA_EXTRA_KEYS", "sk-laya-from-the-env")
    monkeypatch.chdir(tmp_path)  # api_keys_file is the manifest folder's, not the cwd's
    manifest = mf.resolve(mf.load(folder / "laya.toml"), load_registry())
    assert set(manifest.server.api_keys) == {"sk-laya-example-1", "sk-laya-from-the-env",
                                             "sk-laya-from-the-file"}
