"""The vocabulary shared by the HTTP layer, the engine and the backends."""

from __future__ import annotations

import enum

import attrs


def _non_negative(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _probability(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value}")


@attrs.frozen
class SamplingParams:
    """How one sequence picks its tokens. ``temperature == 0`` means greedy."""

    max_tokens: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    temperature: float = attrs.field(default=1.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, validator=_probability)
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # 0: no top-k cut
    min_p: float = attrs.field(default=0.0, validator=_probability)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Token ids that end the sequence besides the model's own end-of-generation tokens.
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties on tokens already generated (OpenAI's and vLLM's meaning): 0 and 1 mean off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    # Log-probabilities: None for none, else how many top alternatives besides the chosen token.
    logprobs: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(20))))
    # Prompt log-probabilities: None for none, else how many top alternatives per position.
    # Such a sequence prefills its whole prompt (KV from the prefix cache has no logits).
    prompt_logprobs: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(
            attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(20))))
    # The request's scheduling priority, vLLM's meaning: lower is served sooner. The default
    # scheduler (fcfs) ignores it; a scheduler plugin may order by it.
    priority: int = 0
    # Control tokens the output shows as their text, (id, text): a tool-call or reasoning
    # format's markup, which the front end's parser reads (laya_core/structured/markup.py).
    # Every other control token renders as nothing.
    shown_tokens: tuple[tuple[int, str], ...] = ()
    # Whether the deployment's speculative decoding may draft for this request (where the
    # model has it on): a request may opt out.
    speculative: bool = True
    # The LoRA adapter this sequence runs with (a name of ``ModelConfig.lora``); None: the
    # base model. Its KV is cached apart from the base's and other adapters'.
    lora: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen
class SpeculativeConfig:
    """A model's ``speculative`` table (spec/manifest.md; laya_core/engine/speculative.py
    drafts with it)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # method "draft": the draft model's path (laya_core/engine/draft_model.py)
    # No drafts in a step that runs more sequences than this (None: drafts at any batch size).
    disable_by_batch_size: int | None = None
    # The default of a manifest without ``speculative``: prompt lookup only where drafts
    # change nothing in the output (the replica's rows are exact in any batch,
    # ``batch_invariant``, or a draft's check gives its rows a lone decode's bits,
    # ``exact_drafts``) and for requests without an adapter; off elsewhere.
    auto: bool = False


# A model's speculative decoding when its manifest entry says nothing: prompt lookup of up to
# four tokens while a step runs at most two sequences (spec/manifest.md, docs/benchmarks.md).
AUTO_SPECULATIVE = SpeculativeConfig(disable_by_batch_size=2, auto=True)


class FinishReason(enum.Enum):
    """Why a sequence ended; the values are the OpenAI API's."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    CANCELLED = "cancelled"  # the client went away; never sent to a client
    ERROR = "error"  # the backend failed on this sequence
    REJECTED = "rejected"  # waited in the queue longer than allowed; never sent to a client


@attrs.frozen
class Sample:
    """One token, sampled or given (a prompt's), with its log-probability under the model
    when asked for."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + the number of tokens the model found likelier; prompt tokens


@attrs.frozen
class TokenEvent:
    """What one engine step produced for one sequence, sent to the request's asyncio side."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None
    timing: Timing | None = None  # set on the final event
    admitted: bool = False  # the marker sent once when the sequence joins the batch
    samples: tuple[Sample, ...] = ()  # with log-probabilities, when the request asked for them
    # With the first token, when asked for: the prompt's tokens from the second on, each with
    # its log-probability given the tokens before it.
    prompt_logprobs: tuple[Sample, ...] = ()
    usage: Usage | None = None  # set on the final event
    # With an ERROR finish: the replica itself went away (its worker process died), so a
    # retry, on another replica or after the restart, can succeed: the HTTP side says 503.
    replica_lost: bool = False


@attrs.frozen
class Usage:
    """The token counts of one finished sequence, as the engine counted them."""

    prompt_tokens: int
    completion_tokens: int  # tokens generated, the last (end-of-generation) one included
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@attrs.frozen
class Timing:
    """Where one request's time went, in seconds."""

    queue_s: float  # arrival until admitted to the batch
    prefill_s: float  # admitted until its first token
    decode_s: float  # first token until the last
    # Seconds between each token and the one before, as the engine thread handled them: one
    # fewer than the tokens generated. Their sum is the decode time up to the last token.
    token_gaps_s: tuple[float, ...] = ()
    # Layers of the backend's own, by name: an engine-level backend's time waiting on its
    # upstream server ("upstream"). Each is a Server-Timing entry and a laya_timing field.
    layers: tuple[tuple[str, float], ...] = ()
    # Speculative decoding: draft tokens checked for this request, and those it kept.
    draft_tokens: int = 0
    accepted_tokens: int = 0
