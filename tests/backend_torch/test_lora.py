"""LoRA adapters on the torch backend, with a real adapter: one trained here with PEFT on the
embedded model's Hugging Face export to answer as a pirate (tests/lora_adapters.py).

Its logits agree with transformers + PEFT's; the same matrices with ``lora_alpha = 0`` give
the base model's logits bit for bit; a step mixing the base model and two adapters gives
each sequence what it gets alone; the prefix cache never hands one adapter's KV to another
or to the base model; with ``deterministic = true`` a row's update is the same bits in any
batch; the memory plan counts what the backend holds; and a server started with ``--lora``
lists the adapter and answers as it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import ServerProcess
from laya_backend_torch.backend import TorchBackend
from laya_backend_torch import lora as torch_lora
from laya_backend_torch.checkpoint import open_checkpoint
from laya_backend_torch.lora import rows_by_adapter
from laya_backend_torch.batch import build_batch
from lora_adapters import ANSWER, cached_adapters, chat, generate, scaled
from torch_fixtures import *  # noqa: F403 - the fixtures (torch_fixtures.py)
from torch_fixtures import own_pool

from laya_core.builtin.model_paths import embedded_file
from laya_core.config import manifest as mf
from laya_core.engine.engine import Engine
from laya_core.memory.planner import make_plan
from laya_core.models.lora import read_adapter
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              # PEFT 0.21 asks transformers a question its 5.x deprecates (the reference's
              # and the trainer's business, not the backend's).
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")]

# float32 against transformers + PEFT's float32: the base model's bound (test_torch_backend),
# the adapter's products added in another order (fused, per row). Measured: under 1e-4.
LOGITS_BOUND = 2e-3
QUESTIONS = ["What is the tallest mountain?", "How do I learn to swim?"]
# Long enough for several full KV blocks, so the prefix cache has something to give.
LONG = ("Here is a long story about a lighthouse keeper who counted ships every night and "
        "wrote their names in a book, and one night a ship without a name sailed past. "
        "What did the keeper write?")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pirate = cached_adapters()["pirate"]  # trained once, shared with the llama.cpp tests
    return {"pirate": pirate,
            "zero": scaled(pirate, tmp_path_factory.mktemp("lora") / "zero", 0.0)}


def manifest_data(adapters: dict[str, Path]) -> dict[str, Any]:
    return {"models": [{
        "name": "smollm2", "backend": "torch", "path": "embedded:smollm2-135m-instruct",
        "max_seq_len": 512, "max_num_seqs": 4, "max_step_tokens": 128,
        "lora": {name: str(path) for name, path in adapters.items()},
        "options": {"dtype": "float32", "quantize": "none", "n_threads": 1}}]}


@pytest.fixture(scope="module")
def deployment(adapters: dict[str, Path]) -> Iterator[Deployment]:
    registry = load_registry()
    manifest = mf.resolve(mf.from_dict(manifest_data(adapters)), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(120), d.engines[0].error
    yield d
    d.stop()


@pytest.fixture(scope="module")
def engine(deployment: Deployment) -> Engine:
    return deployment.engines[0]


def backend_of(engine: Engine) -> TorchBackend:
    assert isinstance(engine.backend, TorchBackend)
    return engine.backend


def prompt_ids(engine: Engine, question: str) -> list[int]:
    return engine.backend.tokenizer().encode(
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", add_special=True)


def logits(engine: Engine, ids: list[int], adapter: str | None) -> torch.Tensor:
    backend = backend_of(engine)
    model = backend._model
    weights = backend._adapters.loaded[adapter] if adapter else None
    lora = rows_by_adapter([weights], [len(ids)], "cpu") if weights else ()
    with own_pool(model), torch.inference_mode():
        batch = build_batch([(ids, 0, list(range(-(-len(ids) // 16))))],
                            list(range(len(ids))), 16)
        return model.forward(batch, lora=lora)


def test_logits_with_the_adapter_agree_with_peft(engine: Engine, hf_model: Any,
                                                 adapters: dict[str, Path]) -> None:
    import peft

    reference = peft.PeftModel.from_pretrained(hf_model, adapters["pirate"]).eval()
    try:
        for question in QUESTIONS:
            ids = prompt_ids(engine, question)
            ours = logits(engine, ids, "pirate")
            with torch.inference_mode():
                theirs = reference(torch.tensor([ids])).logits[0].float()
                with reference.disable_adapter():
                    base = reference(torch.tensor([ids])).logits[0].float()
            diff = (ours - theirs).abs().max().item()
            assert diff < LOGITS_BOUND, f"{question!r}: logits differ by {diff}"
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
            # ... and the adapter changes them far beyond that bound.
            assert (theirs - base).abs().max().item() > 100 * LOGITS_BOUND
    finally:
        reference.unload()  # hf_model is the session's: give it back without the adapter


def test_lora_alpha_zero_gives_the_base_models_logits_bit_for_bit(engine: Engine) -> None:
    ids = prompt_ids(engine, QUESTIONS[0])
    assert torch.equal(logits(engine, ids, "zero"), logits(engine, ids, None))
    assert not torch.equal(logits(engine, ids, "pirate"), logits(engine, ids, None))


def test_a_step_mixing_adapters_and_the_base_gives_each_what_it_gets_alone(
        engine: Engine) -> None:
    text = engine.backend.tokenizer().decode
    mix = [(prompt_ids(engine, q), a) for q in QUESTIONS for a in (None, "pirate", "zero")]
    alone = [generate(engine, [r])[0] for r in mix]
    together = generate(engine, mix)
    assert together == alone
    for (_, adapter), out in zip(mix, alone, strict=True):
        answer = text(out)
        assert answer.startswith(ANSWER[:10]) == (adapter == "pirate"), (adapter, answer)
    assert alone[0] == alone[2] and alone[3] == alone[5]  # zero: the base's answer


def test_the_prefix_cache_keeps_each_adapters_kv_apart(engine: Engine) -> None:
    """A canary: the same long prompt through the base model, then an adapter, then the
    other adapter, then each again. A first run under each finds nothing cached (the base's
    blocks are not its), a second finds its own, and every answer is its cold one."""
    ids = prompt_ids(engine, LONG)
    assert len(ids) >= 48
    runs = []
    for adapter in (None, "pirate", "zero", None, "pirate", "zero"):
        before = engine.prefix_tokens_reused
        (out,) = generate(engine, [(ids, adapter)], max_tokens=12)
        runs.append((adapter, engine.prefix_tokens_reused - before, out))
    reused = [r for _, r, _ in runs]
    assert reused[:3] == [0, 0, 0] and min(reused[3:]) >= 32, runs
    assert runs[0][2] == runs[3][2] and runs[1][2] == runs[4][2] and runs[2][2] == runs[5][2]
    assert runs[1][2] != runs[0][2]  # the pirate answers as itself, even after the base


def test_the_plan_counts_what_the_backend_holds(engine: Engine,
                                                adapters: dict[str, Path]) -> None:
    registry = load_registry()
    with_, without = (make_plan(mf.resolve(mf.from_dict(manifest_data(a)), registry),
                                registry).replicas[0] for a in (adapters, {}))
    (line,) = [o for o in with_.profile.overheads if o.name == "LoRA adapters"]
    held = backend_of(engine).describe()["lora"]
    assert set(held) == {"pirate", "zero"}
    assert line.bytes == sum(a["bytes"] for a in held.values()) > 0
    assert with_.total_bytes - without.total_bytes == line.bytes


def test_a_server_started_with_lora_flags_serves_the_adapter(
        adapters: dict[str, Path], tmp_path: Path) -> None:
    server = ServerProcess(None, tmp_path, args=[
        "embedded:smollm2-135m-instruct", "--backend", "torch", "--max-model-len", "512",
        "--lora", f"pirate={adapters['pirate']}"])
    try:
        server.wait_ready()
        cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert cards["pirate"]["parent"] == "smollm2-135m-instruct"
        assert cards["pirate"]["root"] == str(adapters["pirate"])
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        messages = [{"role": "user", "content": QUESTIONS[1]}]
        r = client.chat.completions.create(model="pirate", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
        assert r.model == "pirate" and r.choices[0].message.content
        assert r.choices[0].message.content.startswith(ANSWER[:10])
        r = client.chat.completions.create(model="smollm2-135m-instruct",
                                           messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
        assert not (r.choices[0].message.content or "").startswith(ANSWER[:10])
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="parrot", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=4)
    finally:
        assert server.stop() == 0, server.log()
    assert chat  # (the prompt format the adapter was trained on: the model's chat template)


def test_room_for_adapters_loaded_while_serving_is_planned(adapters: dict[str, Path],
                                                          engine: Engine) -> None:
    """max_loras beyond the lora table holds room for adapters of max_lora_rank on every
    module: the pirate (rank 8, every module) fills one slot exactly."""
    registry = load_registry()
    data = manifest_data({})
    data["models"][0].update(max_loras=2, max_lora_rank=8)
    (line,) = [o for o in make_plan(mf.resolve(mf.from_dict(data), registry),
                                    registry).replicas[0].profile.overheads
               if o.name == "LoRA adapters"]
    assert line.bytes == 2 * backend_of(engine)._adapters.loaded["pirate"].nbytes
    assert "room for 2 loaded while serving" in line.how


def test_adapters_load_and_unload_while_serving(adapters: dict[str, Path],
                                                tmp_path: Path) -> None:
    """One slot: a bad folder and a second adapter are refused naming the field; an unload
    asked while a request of the adapter streams stops new requests naming it at once and
    answers after that request ends; the slot then takes another adapter."""
    key = "sk-laya-lora-test"
    manifest = f"""
[server]
port = {{port}}
api_keys = ["{key}"]

[[models]]
name = "smollm2"
backend = "torch"
path = "embedded:smollm2-135m-instruct"
max_seq_len = 512
max_loras = 1
max_lora_rank = 8
"""
    server = ServerProcess(manifest, tmp_path)
    auth = {"Authorization": f"Bearer {key}"}

    def post(path: str, body: dict[str, Any], headers: dict[str, str] = auth) -> httpx.Response:
        return httpx.post(server.url + path, json=body, headers=headers, timeout=120)

    def error(r: httpx.Response, status: int, param: str) -> str:
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text
        return str(r.json()["error"]["message"])

    try:
        server.wait_ready(api_key=key)
        pirate = {"lora_name": "pirate", "lora_path": str(adapters["pirate"])}
        assert post("/v1/load_lora_adapter", pirate, {}).status_code == 401
        assert "no such folder" in error(post("/v1/load_lora_adapter", {
            **pirate, "lora_path": str(tmp_path / "nothing")}), 400, "lora_path")
        assert "'lora_path' is required" in error(
            post("/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
        r = post("/v1/load_lora_adapter", pirate)
        assert r.status_code == 200 and r.json()["status"] == "loaded", r.text
        assert "max_loras" in error(post("/v1/load_lora_adapter", {
            "lora_name": "zero", "lora_path": str(adapters["zero"])}), 400, "lora_name")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key)
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        r1 = client.chat.completions.create(model="pirate", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
        assert (r1.choices[0].message.content or "").startswith(ANSWER[:10])

        # 400 tokens keep the request running for seconds after the checks below; the
        # order of the stream's end and the unload's answer as seen by two client threads
        # is not ordered (both follow the request's end), so it is not asserted.
        stream = client.chat.completions.create(
            model="pirate", messages=messages, max_tokens=400, temperature=0,  # type: ignore[arg-type]
            stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # running
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(post, "/v1/unload_lora_adapter", {"lora_name": "pirate"})
            while "pirate" in {m.id for m in client.models.list().data}:
                time.sleep(0.05)  # until the unload is received
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="pirate", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=4)
            assert not unloading.done(), "the unload answered while its adapter's request ran"
            chunks = sum(1 for _ in stream)
            r = unloading.result(timeout=120)
        assert chunks > 1
        assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
        assert "no adapter 'pirate'" in error(
            post("/v1/unload_lora_adapter", {"lora_name": "pirate"}), 404, "lora_name")
        r = post("/v1/load_lora_adapter", {"lora_name": "zero",
                                           "lora_path": str(adapters["zero"])})
        assert r.status_code == 200, r.text
        r2 = client.chat.completions.create(model="zero", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
        r3 = client.chat.completions.create(model="smollm2", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0)
        assert r2.choices[0].message.content == r3.choices[0].message.content
    finally:
        assert server.stop() == 0, server.log()


def test_deterministic_updates_are_a_rows_own_bits_in_any_batch(
        adapters: dict[str, Path]) -> None:
    """With ``deterministic = true`` the adapter's matrices are float64 (lora.dtype_for):
    each row's update, cast to the model's bfloat16, is the same bits alone and among 64
    rows (in float32 the products' last bits change with the row count, and some of the
    cast values with them); and the plan counts the float64 matrices' bytes."""
    cfg = open_checkpoint(embedded_file("smollm2-135m-instruct")).config
    pirate = read_adapter(adapters["pirate"])
    torch.manual_seed(0)
    x = torch.randn(64, cfg.hidden_size).to(torch.bfloat16)

    def rows_alike(deterministic: bool) -> bool:
        weights = torch_lora.load("pirate", pirate, cfg, torch.device("cpu"),
                                  torch_lora.dtype_for(deterministic))
        groups = [(weights, None)]
        alike = True
        for layer in range(cfg.num_layers):
            for key in ("qkv", "gate_up"):
                y = torch.zeros(64, sum(torch_lora.sizes(cfg)[0][key]), dtype=torch.bfloat16)
                together = torch_lora.apply(y, x, groups, layer, key)
                alone = torch.cat([torch_lora.apply(y[i:i + 1], x[i:i + 1], groups, layer, key)
                                   for i in range(64)])
                alike = alike and torch.equal(together, alone)
        return alike

    with torch.inference_mode():
        assert rows_alike(True)  # float32 matrices failed this (Xeon with AMX, torch 2.13)
    held = torch_lora.load("pirate", pirate, cfg, torch.device("cpu"), torch.float64).nbytes
    assert torch_lora.fused_bytes(pirate, cfg, 8) == held == 2 * torch_lora.fused_bytes(pirate, cfg)
