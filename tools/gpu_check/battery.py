"""The OpenAI battery: the official ``openai`` client against a served model of any backend.

    python tools/gpu_check/battery.py URL MODEL MAX_SEQ_LEN

The model's weights are random, so the checks hold for any text: the API's shapes, token
counts, streaming, a cancelled stream freeing its sequence, several streams at once, and
errors in OpenAI's form. tests/integration/test_openai_client.py checks the text itself on
the embedded model; this is its subset that holds for any model. A greedy stream that
differs from the same request unstreamed is a note, not a failure: the second request
prefills over a cached prefix, whose 16-bit sums may round another way on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Callable
from typing import Any

CHAT = [{"role": "user", "content": "Name three colours."}]
NO_EOS = {"ignore_eos": True}  # Laya's (and vLLM's) extension: exactly max_tokens tokens


class Battery:
    def __init__(self, url: str, model: str, max_seq_len: int) -> None:
        import openai

        self.url, self.model, self.max_seq_len = url, model, max_seq_len
        self.openai = openai
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    timeout=120)
        self.notes: dict[str, str] = {}

    def models_listed(self) -> None:
        ids = [m.id for m in self.client.models.list().data]
        assert self.model in ids, f"GET /v1/models lists {ids}, not {self.model!r}"

    def chat_completion(self) -> None:
        r = self.client.chat.completions.create(model=self.model, messages=CHAT,
                                                max_tokens=16, temperature=0)
        choice = r.choices[0]
        assert choice.message.role == "assistant", choice.message
        assert isinstance(choice.message.content, str), choice.message
        assert choice.finish_reason in ("stop", "length"), choice.finish_reason
        assert r.usage is not None and 0 < r.usage.completion_tokens <= 16, r.usage
        assert r.usage.prompt_tokens > 5, r.usage

    def chat_stream(self) -> None:
        whole = self.client.chat.completions.create(
            model=self.model, messages=CHAT, max_tokens=16, temperature=0, extra_body=NO_EOS)
        chunks = list(self.client.chat.completions.create(
            model=self.model, messages=CHAT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS))
        assert chunks and chunks[0].choices[0].delta.role == "assistant", chunks[:1]
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length", finals
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16, \
            chunks[-1].usage
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        if text != whole.choices[0].message.content:
            self.notes["chat_stream"] = "streamed greedy text differs from the unstreamed one"

    def completion(self) -> None:
        r = self.client.completions.create(model=self.model, prompt="The memory plan",
                                           max_tokens=8, temperature=0, extra_body=NO_EOS)
        assert r.choices[0].finish_reason == "length", r.choices[0]
        assert r.usage is not None and r.usage.completion_tokens == 8, r.usage
        pieces = [c.choices[0].text for c in self.client.completions.create(
            model=self.model, prompt="The memory plan", max_tokens=8, temperature=0,
            stream=True, extra_body=NO_EOS) if c.choices]
        if "".join(pieces) != r.choices[0].text:
            self.notes["completion"] = "streamed greedy text differs from the unstreamed one"

    def cancelled_stream_frees_its_sequence(self) -> None:
        import httpx

        stream = self.client.chat.completions.create(
            model=self.model, messages=CHAT, max_tokens=max(16, self.max_seq_len - 64),
            temperature=0, stream=True, extra_body=NO_EOS)
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        stream.close()
        deadline = time.monotonic() + 15
        running = -1
        while time.monotonic() < deadline:
            replicas = httpx.get(f"{self.url}/ready", timeout=10).json().get("replicas", [])
            running = sum(r.get("running", 0) + r.get("waiting", 0) for r in replicas)
            if running == 0:
                break
            time.sleep(0.2)
        assert running == 0, f"{running} sequences still running 15 s after the client left"
        self.completion_of(4)  # and the server still serves

    def concurrent_streams(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            counts = list(pool.map(lambda _: self.completion_of(16), range(8)))
        assert counts == [16] * 8, counts

    def unknown_model_is_404(self) -> None:
        try:
            self.client.chat.completions.create(model="no-such-model", messages=CHAT,
                                                max_tokens=4)
        except self.openai.NotFoundError as e:
            assert isinstance(e.body, dict) and e.body.get("message"), e.body
            return
        raise AssertionError("a request for an unknown model succeeded")

    def too_long_is_400(self) -> None:
        try:
            self.client.completions.create(model=self.model, prompt="x",
                                           max_tokens=self.max_seq_len + 1)
        except self.openai.BadRequestError:
            return
        raise AssertionError(f"max_tokens={self.max_seq_len + 1} over max_seq_len was served")

    def completion_of(self, n: int) -> int:
        chunks = list(self.client.completions.create(
            model=self.model, prompt="Once upon a time", max_tokens=n, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))
        usage = chunks[-1].usage
        return usage.completion_tokens if usage else -1

    def checks(self) -> list[Callable[[], None]]:
        return [self.models_listed, self.chat_completion, self.chat_stream, self.completion,
                self.cancelled_stream_frees_its_sequence, self.concurrent_streams,
                self.unknown_model_is_404, self.too_long_is_400]


def run(url: str, model: str, max_seq_len: int) -> dict[str, Any]:
    """{"passed": [names], "failed": {name: why}, "notes": {name: what}}."""
    try:
        battery = Battery(url, model, max_seq_len)
    except ImportError as e:
        return {"passed": [], "failed": {"openai": f"the openai client is not importable ({e}):"
                                                   " carry tools/gpu_check/wheels"}, "notes": {}}
    passed, failed = [], {}
    for check in battery.checks():
        try:
            check()
            passed.append(check.__name__)
        except Exception as e:  # noqa: BLE001 - each check's failure is reported, all run
            failed[check.__name__] = f"{type(e).__name__}: {str(e)[:300]}"
    return {"passed": passed, "failed": failed, "notes": battery.notes}


def summary(result: dict[str, Any]) -> str:
    total = len(result["passed"]) + len(result["failed"])
    text = f"battery {len(result['passed'])}/{total}"
    if result["failed"]:
        text += " (failed: " + ", ".join(result["failed"]) + ")"
    return text


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3])), indent=1))
