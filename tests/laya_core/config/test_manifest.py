import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from laya_core.backend import Backend, ModelConfig
from laya_core.config import manifest as mf
from laya_core.plugins import Registered, Registry, load_registry


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
    assert config.backend == "auto"  # chosen from the installed backends by resolve()
    assert mf.resolve(m, load_registry()).models[0].backend == "llamacpp"  # GGUF's own
    assert config.max_seq_len is None  # decided at load: min(4096, the model's own)
    assert config.max_num_seqs is None  # decided by the plan: 4, or what kv_cache_tokens holds
    assert config.replicas == 1 and config.kv_cache_dtype == "f16"
    assert config.tool_call_format == "auto"  # the one the chat template shows
    assert config.stream_interval_ms == 20.0  # a token waits 20 ms at most for the next ones
    assert parse(models=[model(stream_interval_ms=0)]).models[0].stream_interval_ms == 0.0
    assert parse(models=[model(tool_call_format="mistral")]).models[0].tool_call_format \
        == "mistral"


@pytest.mark.parametrize(("models", "key", "words"), [
    ([model(max_seq_len=8)], "models[0].max_seq_len", "between 16"),
    ([model(tool_call_format="json")], "models[0].tool_call_format",
     "auto or one of hermes"),
    ([model(max_seq_len="big")], "models[0].max_seq_len", "expected int"),
    ([model(max_num_seqs=True)], "models[0].max_num_seqs", "expected int"),
    ([model(replicas=0)], "models[0].replicas", "between 1"),
    ([model(colour="red")], "models[0].colour", "unknown key"),
    ([model(name=None)], "models[0].name", "expected str"),
    ([{"path": "x.gguf"}], "models[0].name", "required"),
    ([model(), model()], "models[1].name", "already the name"),
    ([model(max_num_seqs=8, max_step_tokens=4)], "models[0].max_step_tokens", "at least"),
    ([model(stream_interval_ms=-1)], "models[0].stream_interval_ms", "between 0 and 1000"),
    ([model(stream_interval_ms="fast")], "models[0].stream_interval_ms", "expected int or float"),
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
    ("n_threads", "lots", '"auto" or a whole number'), ("n_threads", 0, "from 1 to 512"),
    ("n_threads", 100000, "from 1 to 512"),
    ("n_threads", True, '"auto" or a whole number'), ("repack", "yes", '"auto", true or false'),
    ("use_mmap", 1, '"auto", true or false'), ("kv_unified", "auto", "true or false"),
    ("use_mmap", "no", '"auto", true or false'), ("kv_unified", "maybe", "true or false"),
])
def test_backend_option_values_are_checked(key: str, value: object, said: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(options={key: value})]}), load_registry())
    assert info.value.key == f"models[0].options.{key}" and said in info.value.message


def test_auto_and_explicit_backend_option_values_pass() -> None:
    options = {"n_threads": "auto", "repack": False, "use_mmap": "auto", "flash_attn": True}
    ok = mf.resolve(mf.from_dict({"models": [model(options=options)]}), load_registry())
    assert ok.models[0].options == options


@pytest.mark.parametrize(("top", "key", "said"), [
    ({"server": {"max_body_bytes": "1" * 400}}, "server.max_body_bytes", "at most 20 digits"),
    ({"server": {"max_body_bytes": int("1" * 400)}}, "server.max_body_bytes", "more than 1 EiB"),
    ({"server": {"max_body_bytes": "0.5B"}}, "server.max_body_bytes",
     "'0.5B' is 0 bytes; this size must be a whole number of at least 1024 bytes"),
    ({"server": {"max_body_bytes": 100}}, "server.max_body_bytes", "at least 1024 bytes"),
    ({"memory": {"budget": "9" * 400 + "GiB"}}, "memory.budget", "at most 20 digits"),
    ({"memory": {"budget": 10**400}}, "memory.budget", "more than 1 EiB"),
    ({"memory": {"budget": "0.1KiB"}}, "memory.budget", "at least 1048576 bytes"),
    ({"memory": {"budget": True}}, "memory.budget", "expected str or int"),
])
def test_sizes_are_whole_bytes_within_bounds(top: dict, key: str, said: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        parse(**top)
    assert info.value.key == key and said in info.value.message


def test_fractional_sizes_are_exact_and_rounded_down() -> None:
    m = parse(server={"max_body_bytes": "1.5KiB"}, memory={"budget": "1.7GiB"})
    assert m.server.max_body_bytes == 1536
    assert m.memory.budget_bytes == 1825361100  # 1.7 x 2**30 = 1825361100.8


def test_api_keys_file_follows_the_api_keys_rules(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("  # a comment after blanks\n\n   file-key-0001  \n#also-a-comment\n")
    assert parse(server={"api_keys_file": str(key_file)}).server.api_keys == ("file-key-0001",)
    for text, line in (("a\n", 1), ("  # x\nshort\n", 2), ("good-key-01\nbad\x01key-01\n", 2)):
        key_file.write_text(text)
        with pytest.raises(mf.ManifestError) as info:
            parse(server={"api_keys_file": str(key_file)})
        assert info.value.key == "server.api_keys_file"
        assert f"line {line} of {key_file}: an API key" in info.value.message


def test_api_keys_env_follows_the_api_keys_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYA_TEST_KEYS", "env-key-0001,short")
    with pytest.raises(mf.ManifestError) as info:
        parse(server={"api_keys_env": "LAYA_TEST_KEYS"})
    assert info.value.key == "server.api_keys_env"
    assert "key 2 in LAYA_TEST_KEYS: an API key is a string of 8+" in info.value.message


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: p.write_bytes(b"key-0001\n\xff\xfe\x00binary"), "is not UTF-8 text (byte 9"),
    (lambda p: p.write_bytes(b"k" * (2**20 + 1)), "is larger than 1 MiB"),
    (lambda p: p.mkdir(), "is not a regular file"),
    (lambda p: os.mkfifo(p), "is not a regular file"),
    (lambda p: None, "cannot read"),
])
def test_api_keys_file_must_be_a_small_text_file(tmp_path: Path, make: Any, said: str) -> None:
    path = tmp_path / "keys"
    make(path)
    with pytest.raises(mf.ManifestError) as info:
        parse(server={"api_keys_file": str(path)})
    assert info.value.key == "server.api_keys_file" and said in info.value.message


@pytest.mark.slow  # runs laya check
def test_api_keys_file_at_dev_zero_or_a_fifo_fails_check_quickly(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    for keys in ("/dev/zero", str(tmp_path / "fifo")):
        out = laya_check(tmp_path, f'[server]\napi_keys_file = "{keys}"\n')
        assert out.returncode == 2, out.stderr
        assert f"server.api_keys_file: {keys} is not a regular file" in out.stderr


@pytest.mark.parametrize(("host", "said"), [
    ("999.1.1.1", "'999.1.1.1' is not a valid IP address"),
    ("1.2.3", "is not a valid IP address"),
    ("localhost:8000", "no port"),
    ("[::1]", "is not a valid IP address"),
    ("exa mple", "neither an IP address nor a valid host name"),
    (" 127.0.0.1", "neither an IP address nor a valid host name"),
    ("a" * 64 + ".example", "neither an IP address nor a valid host name"),
])
def test_host_must_be_an_ip_address_or_host_name(host: str, said: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        parse(server={"host": host})
    assert info.value.key == "server.host" and said in info.value.message


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost"])
def test_good_hosts_pass_check(host: str) -> None:
    assert mf.resolve(parse(server={"host": host}), load_registry()).server.host == host


def test_a_host_name_that_does_not_resolve_is_refused_at_check() -> None:
    with pytest.raises(mf.ManifestError) as info:  # .invalid never resolves (RFC 6761)
        mf.resolve(parse(server={"host": "no-such-host.invalid"}), load_registry())
    assert info.value.key == "server.host" and "does not resolve" in info.value.message


def laya_check(tmp_path: Path, head: str) -> subprocess.CompletedProcess[str]:
    manifest = tmp_path / "laya.toml"
    manifest.write_text(head + '[[models]]\nname = "m"\npath = "embedded:smollm2-135m-instruct"\n')
    return subprocess.run([sys.executable, "-m", "laya_core.cli.main", "check", str(manifest)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # runs laya check
@pytest.mark.parametrize(("head", "key"), [
    (f"[server]\nmax_body_bytes = {'1' * 400}\n", "server.max_body_bytes"),
    (f'[server]\nmax_body_bytes = "{"1" * 400}"\n', "server.max_body_bytes"),
    ('[server]\nmax_body_bytes = "0.5B"\n', "server.max_body_bytes"),
    (f"[memory]\nbudget = {'9' * 400}\n", "memory.budget"),
    ('[server]\nhost = "999.1.1.1"\n', "server.host"),
    ('[server]\nhost = "no-such-host.invalid"\n', "server.host"),
    ('[server]\napi_keys_file = "/usr/bin/env"\n', "server.api_keys_file"),
])
def test_check_exits_2_naming_the_key(tmp_path: Path, head: str, key: str) -> None:
    out = laya_check(tmp_path, head)
    assert out.returncode == 2 and f"laya: manifest error: {key}: " in out.stderr
    assert "Traceback" not in out.stderr


def test_allowed_hosts_are_names_addresses_domains_or_any() -> None:
    hosts = ["Laya.Example.com.", "10.0.0.5", "::1", ".example.org", "*"]
    assert parse(server={"allowed_hosts": hosts}).server.allowed_hosts == (
        "laya.example.com", "10.0.0.5", "::1", ".example.org", "*")
    assert parse().server.allowed_hosts == ()


@pytest.mark.parametrize(("value", "key", "said"), [
    ("laya.example.com", "server.allowed_hosts", "expected list"),
    (["laya.example.com:8000"], "server.allowed_hosts[0]", "no port"),
    (["ok.example", "[::1]"], "server.allowed_hosts[1]", "no brackets"),
    (["http://laya.example.com"], "server.allowed_hosts[0]", "is not a host"),
    ([""], "server.allowed_hosts[0]", "is not a host"),
    (["."], "server.allowed_hosts[0]", "is not a host"),
    ([7], "server.allowed_hosts[0]", "is not a host"),
])
def test_allowed_hosts_errors_name_the_entry(value: object, key: str, said: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        parse(server={"allowed_hosts": value})
    assert info.value.key == key and said in info.value.message, info.value


def with_backends(*backends: type[Backend]) -> Registry:
    """The installed registry with only ``backends`` as its backends."""
    registry = load_registry()
    return attrs.evolve(registry, backends={
        b.name: Registered("backend", b.name, b, "test") for b in backends})


def backend_class(name: str, preference: int = 0, takes: bool = True) -> type[Backend]:
    def check_model_path(cls: type[Backend], path: str) -> str | None:
        return None if takes else f"the {name} backend does not take {path}"

    return type(name.title(), (Backend,), {  # abstract: the manifest never builds one
        "name": name, "default_preference": preference,
        "check_model_path": classmethod(check_model_path)})


def test_a_model_without_backend_gets_an_installed_one() -> None:
    def chosen(*backends: type[Backend]) -> str:
        return mf.resolve(parse(), with_backends(*backends)).models[0].backend

    assert chosen(backend_class("solo")) == "solo"  # the only one installed
    assert chosen(backend_class("b"), backend_class("a")) == "a"  # ties: by name
    assert chosen(backend_class("a"), backend_class("z", preference=5)) == "z"
    # Of those that take the model, even where one that does not is preferred:
    assert chosen(backend_class("a", preference=9, takes=False), backend_class("b")) == "b"
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(parse(), with_backends())
    assert info.value.key == "models[0].backend"
    assert "no backend is installed" in info.value.message
    # A backend the manifest names is kept, whatever the preferences say.
    named = mf.from_dict({"models": [model(backend="a")]})
    assert mf.resolve(named, with_backends(backend_class("a"), backend_class(
        "z", preference=5))).models[0].backend == "a"


def test_a_plan_without_backends_keeps_the_generic_profile() -> None:
    resolved = mf.resolve(parse(), with_backends(), need_backends=False)
    assert resolved.models[0].backend == "auto"


def test_a_backends_threads_option_gives_its_cpu_threads() -> None:
    class Threads(Backend):
        threads_option = "workers"

    def config(**options: object) -> ModelConfig:
        return ModelConfig("m", "x", "p", options=options)

    assert Threads.cpu_threads(config(workers=3)) == 3
    assert Threads.cpu_threads(config(workers="auto")) is None
    assert Threads.cpu_threads(config(workers=True)) is None
    assert Backend.cpu_threads(config(workers=3)) is None  # no threads_option: not known


def test_kv_cache_dtype_is_one_the_chosen_backend_declares() -> None:
    exl = type("Exl", (Backend,), {"name": "exl", "kv_cache_dtypes": {
        "fp16": (1, 2), "q8": (32, 34), "q6": (32, 26), "q4": (32, 18)}})
    registry = with_backends(exl)
    ok = mf.resolve(mf.from_dict({"models": [model(kv_cache_dtype="q6")]}), registry)
    assert ok.models[0].kv_cache_dtype == "q6"
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(mf.from_dict({"models": [model(kv_cache_dtype="q8_0")]}), registry)
    assert info.value.key == "models[0].kv_cache_dtype"
    assert "fp16, q8, q6, q4" in info.value.message
    with pytest.raises(mf.ManifestError) as info:  # llama.cpp's are ggml's
        mf.resolve(mf.from_dict({"models": [model(kv_cache_dtype="q6")]}), load_registry())
    assert info.value.key == "models[0].kv_cache_dtype"
    assert "f32, f16, bf16, q8_0, q4_0" in info.value.message
    broken = type("Broken", (Backend,), {"name": "broken", "kv_cache_dtypes": {"f16": 2}})
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(parse(), with_backends(broken))
    assert info.value.key == "models[0].backend" and "kv_cache_dtypes" in info.value.message


def test_the_kv_pool_holds_at_least_one_block_of_the_backends() -> None:
    pages = type("Pages", (Backend,), {"name": "pages", "block_size": 256})
    small = mf.from_dict({"models": [model(kv_cache_tokens=128, max_seq_len=64)]})
    with pytest.raises(mf.ManifestError) as info:
        mf.resolve(small, with_backends(pages))
    assert info.value.key == "models[0].kv_cache_tokens"
    assert "less than one KV block of the pages backend (256 tokens)" in info.value.message
    assert mf.resolve(small, load_registry()).models[0].kv_cache_tokens == 128  # blocks of 16
