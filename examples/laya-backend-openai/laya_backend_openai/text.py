"""How a prompt crosses Laya's replica seam to a server that takes text.

Laya's front end hands a replica token ids. An upstream server has its own tokenizer, which
this machine lacks, so the front end gets one whose ids are the prompt's UTF-8 bytes: what
it counts for the length rule and hashes for prefix routing is bytes, and the client decodes
them back to exactly the text the front end had. A chat is not rendered here: the model's
chat template writes the conversation as JSON behind a marker, and the client sends those
messages to the server's ``/chat/completions``, where the server applies its own template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from laya_core.models.tokenizer import Tokenizer

# The chat template's output: the marker, then the messages as JSON (jinja's tojson escapes
# <, >, & and ' as \u sequences, which JSON reads back as the same characters).
CHAT_MARKER = "<|laya-openai-chat|>"
CHAT_TEMPLATE = CHAT_MARKER + "{{ {'messages': messages} | tojson }}"


class ByteTokenizer(Tokenizer):
    """Token ids are the UTF-8 bytes of the text; no special tokens."""

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def special_tokens(self) -> frozenset[str]:
        return frozenset()

    def encode(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,))


def upstream_request(prompt_ids: Sequence[int]) -> tuple[str, dict[str, Any]]:
    """The server's path and the body's prompt part for a prompt of byte ids: a rendered
    chat goes to ``chat/completions`` as its messages, any other text to ``completions``.
    (A completion prompt that forges the marker only gets its own JSON read as a chat,
    which it could have sent as one.)"""
    text = bytes(prompt_ids).decode("utf-8", "replace")
    if text.startswith(CHAT_MARKER):
        try:
            messages = json.loads(text[len(CHAT_MARKER):])["messages"]
        except (ValueError, KeyError, TypeError):
            pass
        else:
            return "chat/completions", {"messages": messages}
    return "completions", {"prompt": text}
