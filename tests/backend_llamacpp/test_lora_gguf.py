"""LoRA adapters on the llama.cpp backend, with real adapters: the pirate trained with PEFT
on the embedded model's Hugging Face export (tests/lora_adapters.py), and GGUF copies of it
made by llama.cpp's own convert_lora_to_gguf.py.

Its logits agree with transformers + PEFT's within llama.cpp's own error; an untrained
adapter (B = 0) gives the base model's logits bit for bit; a step mixing the base model and
two adapters (one llama_decode per adapter) gives each sequence what it gets alone; a
retained or saved stream computed under one adapter is never reused by another or by the
base model; the memory plan counts the files' matrices; and a server started with
``--lora`` serves the adapter, loads and unloads one while serving, and refuses a PEFT
folder, naming the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from conftest import ServerProcess
from lora_adapters import ANSWER, cached_adapters, generate

from laya_core.backend import ModelConfig, StepItem
from laya_core.builtin.model_paths import embedded_file
from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.memory.planner import make_plan
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

# llama.cpp's Q4_1 products (activations rounded to 8 bits) against float32 transformers:
# the base model's last-position logits differ by 0.66-0.94 on these prompts, the adapter's
# by 0.58-1.27 (Intel Xeon, AMX), while the adapter moves them by 15-21.
LOGITS_BOUND = 2.0
# PEFT 0.21 asks transformers a question its 5.x deprecates (the reference's business).
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
QUESTIONS = ["What is the tallest mountain?", "How do I learn to swim?", "Name three colours."]
LONG = ("Here is a long story about a lighthouse keeper who counted ships every night and "
        "wrote their names in a book, and one night a ship without a name sailed past. "
        "What did the keeper write?")


@pytest.fixture(scope="module")
def adapters() -> dict[str, Path]:
    return cached_adapters()


def gguf_table(adapters: dict[str, Path]) -> dict[str, str]:
    return {name: str(adapters[f"{name}.gguf"]) for name in ("pirate", "half", "untrained")}


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def backend(adapters: dict[str, Path]) -> Iterator[Any]:
    """A bare backend, driven step by step, with the three adapters."""
    from laya_backend_llamacpp.backend import LlamaCppBackend

    config = ModelConfig(name="m", backend="llamacpp",
                         path=embedded_file("smollm2-135m-instruct"), max_seq_len=512,
                         max_num_seqs=4, lora=gguf_table(adapters))
    b = LlamaCppBackend(config)
    b.load_weights()
    b.allocate_cache(n_ctx=2048, max_num_seqs=4)
    yield b
    b.close()


def last_logits(backend: Any, ids: list[int], adapter: str | None) -> np.ndarray:
    backend.start_sequence(0, SamplingParams(temperature=0.0, lora=adapter))
    backend.step([StepItem(0, ids, 0, True)])
    out = np.ctypeslib.as_array(backend._ll.llama_get_logits_ith(backend._ctx, -1),
                                shape=(backend._n_vocab,)).copy()
    backend.free_sequence(0)
    return out


def test_logits_with_the_adapter_agree_with_peft(backend: Any,
                                                 adapters: dict[str, Path]) -> None:
    import peft
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(adapters["hf"], dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(hf.eval(), adapters["pirate"]).eval()
    for question in QUESTIONS:
        ids = backend.tokenize(chat(question), add_special=True)
        ours, base = last_logits(backend, ids, "pirate"), last_logits(backend, ids, None)
        with torch.inference_mode():
            theirs = reference(torch.tensor([ids])).logits[0, -1].numpy()
            with reference.disable_adapter():
                their_base = reference(torch.tensor([ids])).logits[0, -1].numpy()
        diff = float(np.abs(ours - theirs).max())
        assert diff < LOGITS_BOUND, f"{question!r}: logits differ by {diff}"
        assert ours.argmax() == theirs.argmax() and base.argmax() == their_base.argmax()
        # ... and the adapter moves them far beyond that bound, on both sides.
        assert float(np.abs(theirs - their_base).max()) > 5 * LOGITS_BOUND
        assert float(np.abs(ours - base).max()) > 5 * LOGITS_BOUND


def test_an_untrained_adapter_gives_the_base_models_logits_bit_for_bit(backend: Any) -> None:
    ids = backend.tokenize(chat(QUESTIONS[0]), add_special=True)
    base = last_logits(backend, ids, None)
    assert np.array_equal(last_logits(backend, ids, "untrained"), base)
    assert not np.array_equal(last_logits(backend, ids, "pirate"), base)


def test_a_sequence_of_an_unknown_adapter_is_refused(backend: Any) -> None:
    with pytest.raises(ValueError, match="no LoRA adapter 'parrot' is loaded"):
        backend.start_sequence(1, SamplingParams(lora="parrot"))


def manifest_data(table: dict[str, str], **model: Any) -> dict[str, Any]:
    return {"models": [{
        "name": "smollm2", "backend": "llamacpp", "path": "embedded:smollm2-135m-instruct",
        "max_seq_len": 512, "max_num_seqs": 4, "lora": table, **model}]}


@pytest.fixture(scope="module")
def engine(adapters: dict[str, Path]) -> Iterator[Engine]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict(manifest_data(gguf_table(adapters))), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(120), d.engines[0].error
    yield d.engines[0]
    d.stop()


def prompt_ids(engine: Engine, question: str) -> list[int]:
    return engine.backend.tokenizer().encode(chat(question), add_special=True)


def test_a_step_mixing_adapters_and_the_base_gives_each_what_it_gets_alone(
        engine: Engine) -> None:
    text = engine.backend.tokenizer().decode
    mix = [(prompt_ids(engine, QUESTIONS[0]), a) for a in (None, "pirate", "half")]
    alone = [generate(engine, [r])[0] for r in mix]
    together = generate(engine, mix)
    assert together == alone
    answers = [text(out) for out in alone]
    assert answers[1].startswith(ANSWER[:10]) and not answers[0].startswith(ANSWER[:10])
    assert len(set(answers)) == 3, answers  # three models, three answers


def test_streams_keep_each_adapters_kv_apart(engine: Engine) -> None:
    """A canary: the same long prompt through the base model, then each adapter, then each
    again. A first run under each finds nothing to reuse (a retained stream of another is
    not its KV), a second finds its own, and every answer is its cold one."""
    ids = prompt_ids(engine, LONG)
    assert len(ids) >= 48
    runs = []
    for adapter in (None, "pirate", "half", None, "pirate", "half"):
        before = engine.prefix_tokens_reused
        (out,) = generate(engine, [(ids, adapter)], max_tokens=12)
        runs.append((adapter, engine.prefix_tokens_reused - before, out))
    reused = [r for _, r, _ in runs]
    assert reused[:3] == [0, 0, 0] and min(reused[3:]) >= 32, runs
    assert [r[2] for r in runs[:3]] == [r[2] for r in runs[3:]]
    assert runs[1][2] != runs[0][2]  # the pirate answers as itself, even after the base


def test_the_plan_counts_the_adapters_matrices(engine: Engine,
                                               adapters: dict[str, Path]) -> None:
    """The line is the files' tensors, as llama.cpp holds them; room for one more at rank 8
    on every module in float32 is exactly the pirate's file (rank 8, every module, f32)."""
    registry = load_registry()
    table = gguf_table(adapters)
    plans = [make_plan(mf.resolve(mf.from_dict(data), registry), registry).replicas[0]
             for data in (manifest_data(table), manifest_data({}),
                          manifest_data({}, max_loras=1, max_lora_rank=8))]
    lines = [[o for o in p.profile.overheads if o.name == "LoRA adapters"] for p in plans]
    held = engine.backend.describe()["lora"]
    assert set(held) == set(table)
    assert lines[0][0].bytes == sum(a["bytes"] for a in held.values()) > 0
    assert plans[0].total_bytes - plans[1].total_bytes == lines[0][0].bytes
    assert lines[2][0].bytes == held["pirate"]["bytes"]
    assert "room for 1 loaded while serving" in lines[2][0].how


def test_a_peft_folder_is_refused_naming_the_key(adapters: dict[str, Path]) -> None:
    with pytest.raises(mf.ManifestError) as e:
        mf.resolve(mf.from_dict(manifest_data({"pirate": str(adapters["pirate"])})),
                   load_registry())
    assert "models[0].lora.pirate" in str(e.value) and "convert_lora_to_gguf" in str(e.value)


def test_a_server_serves_loads_and_unloads_gguf_adapters(adapters: dict[str, Path],
                                                         tmp_path: Path) -> None:
    server = ServerProcess(None, tmp_path, args=[
        "embedded:smollm2-135m-instruct", "--max-model-len", "512", "--max-loras", "2",
        "--lora", f"pirate={adapters['pirate.gguf']}"])
    try:
        server.wait_ready()
        cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert cards["pirate"]["parent"] == "smollm2-135m-instruct"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": QUESTIONS[1]}]

        def ask(model: str) -> str:
            r = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=16, temperature=0)
            assert r.model == model
            return r.choices[0].message.content or ""

        assert ask("pirate").startswith(ANSWER[:10])
        base = ask("smollm2-135m-instruct")
        assert not base.startswith(ANSWER[:10])
        r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=120, json={
            "lora_name": "parrot", "lora_path": str(adapters["pirate"])})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert "convert_lora_to_gguf" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=120, json={
            "lora_name": "untrained", "lora_path": str(adapters["untrained.gguf"])})
        assert r.status_code == 200, r.text
        assert ask("untrained") == base
        r = httpx.post(server.url + "/v1/unload_lora_adapter", timeout=120,
                       json={"lora_name": "untrained"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            ask("untrained")
    finally:
        assert server.stop() == 0, server.log()


def test_an_on_demand_model_keeps_the_adapters_loaded_while_serving(
        adapters: dict[str, Path], tmp_path: Path) -> None:
    """An adapter loaded on a model loaded on demand loads the model first (as a request
    would), answers as itself, and comes back with every later load of the model; one
    unloaded while the model is not loaded stays out of its next load, and loads nothing."""
    manifest = """
[server]
port = {port}

[[models]]
name = "smollm2"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 512
load = "on_demand"
max_loras = 1
max_lora_rank = 8
"""
    server = ServerProcess(manifest, tmp_path)

    def post(path: str, body: dict[str, str]) -> httpx.Response:
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r

    def status() -> str:
        return str(httpx.get(server.url + "/v1/models/smollm2").json()["status"])

    def adapters_loaded() -> list[set[str]]:
        replicas = httpx.get(server.url + "/ready").json()["replicas"]
        return [set(r["runtime"].get("lora", {})) for r in replicas]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

    def ask(model: str) -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[1]}],
            max_tokens=16, temperature=0)
        return r.choices[0].message.content or ""

    try:
        server.wait_ready()
        assert status() == "unloaded"
        post("/v1/load_lora_adapter", {"lora_name": "pirate",
                                       "lora_path": str(adapters["pirate.gguf"])})
        assert status() == "loaded" and adapters_loaded() == [{"pirate"}]
        assert ask("pirate").startswith(ANSWER[:10])
        post("/models/unload", {"model": "smollm2"})
        assert status() == "unloaded"
        assert ask("pirate").startswith(ANSWER[:10])  # loaded again, with the adapter
        assert adapters_loaded() == [{"pirate"}]
        post("/models/unload", {"model": "smollm2"})
        post("/v1/unload_lora_adapter", {"lora_name": "pirate"})
        assert status() == "unloaded"  # unloading an adapter loads nothing
        with pytest.raises(openai.NotFoundError):
            ask("pirate")
        assert not ask("smollm2").startswith(ANSWER[:10])
        assert adapters_loaded() == [set()]
    finally:
        assert server.stop() == 0, server.log()
