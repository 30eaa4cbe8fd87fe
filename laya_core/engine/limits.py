"""The length rule: what one sequence may hold.

A sequence holds its prompt and at most ``max_tokens`` generated tokens, together no more than
the replica's ``max_seq_len``. ``max_tokens`` is at least 1 (``SamplingParams`` checks that on
construction), so a prompt of ``max_seq_len`` tokens or more leaves no room at all.

The rule is checked where a request enters: the HTTP side before it submits (the prompt must
leave room; an absent ``max_tokens`` is the room left), and every engine client's ``submit``
(the engine's, and a worker's front end before it sends the request on). This module imports
nothing of the engine, so the HTTP side may use it.
"""

from __future__ import annotations


class RequestTooLongError(ValueError):
    """Prompt plus max_tokens exceeds what one sequence may hold."""


def room_to_generate(num_prompt_tokens: int, max_seq_len: int) -> int:
    """Tokens a sequence may still generate after its prompt (0 or less: none)."""
    return max_seq_len - num_prompt_tokens


def check_length(num_prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    """Raise :class:`RequestTooLongError` when prompt + max_tokens exceed max_seq_len."""
    if max_tokens > room_to_generate(num_prompt_tokens, max_seq_len):
        raise RequestTooLongError(
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} tokens in all, more than this model's "
            f"max_seq_len of {max_seq_len}; shorten the prompt or lower max_tokens")
