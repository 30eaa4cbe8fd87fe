from pathlib import Path

import pytest

from laya_core import manifest as mf
from laya_core.plugins import load_registry


def model(**overrides: object) -> dict[str, object]:
    return {"name": "m", "path": "embedded:smollm2-135m-instruct", **overrides}


def parse(**top: object) -> mf.Manifest:
    data = {"models": [model()], **top}
    return mf.from_dict(data)


def test_defaults_are_safe() -> None:
    m = parse()
    assert m.server.host == "127.0.0.1" and m.server.port == 8000
    assert m.memory.budget_bytes is None
    (config,) = m.models
    assert config.backend == "llamacpp"
    assert config.max_seq_len is None  # decided at load: min(4096, the model's own)
    assert config.max_num_seqs is None  # decided by the plan: 4, or what kv_cache_tokens holds
    assert config.replicas == 1 and config.kv_cache_dtype == "f16"


@pytest.mark.parametrize(("models", "key", "words"), [
    ([model(max_seq_len=8)], "models[0].max_seq_len", "between 16"),
    ([model(max_seq_len="big")], "models[0].max_seq_len", "expected int"),
    ([model(max_num_seqs=True)], "models[0].max_num_seqs", "expected int"),
    ([model(replicas=0)], "models[0].replicas", "between 1"),
    ([model(colour="red")], "models[0].colour", "unknown key"),
    ([model(name=None)], "models[0].name", "expected str"),
    ([{"path": "x.gguf"}], "models[0].name", "required"),
    ([model(), model()], "models[1].name", "already the name"),
    ([model(max_num_seqs=8, max_step_tokens=4)], "models[0].max_step_tokens", "at least"),
    ([], "models", "at least one"),
])
def test_model_errors_name_the_key(models: list, key: str, words: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.from_dict({"models": models})
    assert info.value.key == key
    assert words in str(info.value)


@pytest.mark.parametrize(("top", "key"), [
    ({"server": {"port": 70000}}, "server.port"),
    ({"server": {"host": ""}}, "server.host"),
    ({"server": {"api_keys": ["short"]}}, "server.api_keys[0]"),
    ({"server": {"api_keys_env": "LAYA_TEST_UNSET_VARIABLE"}}, "server.api_keys_env"),
    ({"memory": {"budget": "lots"}}, "memory.budget"),
    ({"memory": {"budget": "-3GiB"}}, "memory.budget"),
    ({"memory": {"budget": "1GiB", "swap": 1}}, "memory.swap"),
    ({"extra": 1}, "extra"),
    ({"server": 5}, "server"),
])
def test_table_errors_name_the_key(top: dict, key: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        parse(**top)
    assert info.value.key == key


def test_sizes_and_keys_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYA_TEST_KEYS", "env-key-0001, env-key-0002")
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key-0001\n")
    m = parse(memory={"budget": "1.5GiB"},
              server={"api_keys": ["inline-key-01"], "api_keys_env": "LAYA_TEST_KEYS",
                      "api_keys_file": str(key_file)})
    assert m.memory.budget_bytes == 3 * 2**29
    assert m.server.api_keys == ("inline-key-01", "env-key-0001", "env-key-0002",
                                 "file-key-0001")


def test_load_reports_toml_syntax(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[[models]\nname = 1")
    with pytest.raises(mf.ManifestError, match="not valid TOML"):
        mf.load(p)


def test_relative_model_paths_are_relative_to_the_manifest(tmp_path: Path) -> None:
    p = tmp_path / "laya.toml"
    p.write_text('[[models]]\nname = "m"\npath = "weights/model.gguf"\n')
    assert mf.load(p).models[0].path == str(tmp_path / "weights" / "model.gguf")


def test_resolve_finds_the_embedded_model_and_checks_plugins(tmp_path: Path) -> None:
    registry = load_registry()
    resolved = mf.resolve(parse(), registry)
    assert resolved.models[0].path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(resolved.models[0].path).is_file()
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(backend="nope")]}), registry)
    assert info.value.key == "models[0].backend" and "llamacpp" in info.value.message
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(path=str(tmp_path / "no.gguf"))]}), registry)
    assert info.value.key == "models[0].path" and "no such file" in info.value.message
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(path="embedded:nothing")]}), registry)
    assert info.value.key == "models[0].path"
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(parse(router={"impl": "psychic"}), registry)
    assert info.value.key == "router.impl"


def test_backend_options_and_model_files_are_checked(tmp_path: Path) -> None:
    registry = load_registry()
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(options={"n_thread": 2})]}), registry)
    assert info.value.key == "models[0].options.n_thread" and "n_threads" in info.value.message
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(path=str(tmp_path))]}), registry)
    assert info.value.key == "models[0].path" and "single .gguf file" in info.value.message
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(mf.ManifestError, match="not a GGUF file"):
        mf.resolve(mf.from_dict({"models": [model(path=str(tmp_path / "fake.gguf"))]}), registry)
    ok = mf.resolve(mf.from_dict({"models": [model(options={"n_threads": 1})]}), registry)
    assert ok.models[0].options == {"n_threads": 1}


@pytest.mark.parametrize(("key", "value", "said"), [
    ("n_threads", "lots", '"auto" or a whole number'), ("n_threads", 0, "from 1 to 1024"),
    ("n_threads", True, '"auto" or a whole number'), ("repack", "yes", '"auto", true or false'),
    ("use_mmap", 1, '"auto", true or false'), ("kv_unified", "auto", "true or false"),
])
def test_backend_option_values_are_checked(key: str, value: object, said: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(options={key: value})]}), load_registry())
    assert info.value.key == f"models[0].options.{key}" and said in info.value.message


def test_auto_and_explicit_backend_option_values_pass() -> None:
    options = {"n_threads": "auto", "repack": False, "use_mmap": "auto", "flash_attn": True}
    ok = mf.resolve(mf.from_dict({"models": [model(options=options)]}), load_registry())
    assert ok.models[0].options == options
