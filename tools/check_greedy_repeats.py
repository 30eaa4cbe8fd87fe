"""Ask a running server one greedy chat cold, then again beside neighbours that share its
system prompt, then alone from the prefix cache; print how many answers differ from the cold
one and how many quote a neighbour (issue 25's leak, issue 26's repeatability).

    python tools/check_greedy_repeats.py http://127.0.0.1:8000 --model smollm2

It sends traffic only to the URL given, which should be a server on this machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures

import httpx

SYSTEM = "You are a helpful assistant. Answer clearly and concisely. " * 4
QUESTION = "Why is the sky blue?"


def chat(url: str, model: str, content: str, max_tokens: int) -> tuple[str, int]:
    """The answer's text and its cached prompt tokens."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]})
    r.raise_for_status()
    body = r.json()
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["choices"][0]["message"]["content"], cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=5, help="each: 3 neighbours, 4 repeats")
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args()
    cold, _ = chat(args.url, args.model, QUESTION, args.max_tokens)
    differ = quoting = total = 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for r in range(args.rounds):
            neighbours = [pool.submit(chat, args.url, args.model,
                                      f"Neighbour {r}-{j}: write a poem about the number {r}",
                                      args.max_tokens) for j in range(3)]
            repeats = [pool.submit(chat, args.url, args.model, QUESTION, args.max_tokens)
                       for _ in range(4)]
            for f in repeats:
                text, _ = f.result()
                total += 1
                differ += text != cold
                quoting += "eighbour" in text or "poem" in text.lower()
            for f in neighbours:
                f.result()
    alone = [chat(args.url, args.model, QUESTION, args.max_tokens) for _ in range(5)]
    print(f"beside neighbours: {differ} of {total} differ from the cold answer, "
          f"{quoting} quote a neighbour")
    print(f"alone afterwards: {sum(t != cold for t, _ in alone)} of 5 differ; cached tokens "
          f"{[c for _, c in alone]}")


if __name__ == "__main__":
    main()
