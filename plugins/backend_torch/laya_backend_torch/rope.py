"""Rotary position embeddings: the inverse frequencies a config file asks for, and the
cos/sin table the model reads by position.

The variants are those Llama-family config files name in ``rope_scaling`` (Hugging Face's
``rope_type``): plain, ``linear`` (positions divided by ``factor``), ``dynamic`` (NTK-aware,
applied here at the table's length), ``llama3`` (low frequencies divided by ``factor``, a
smooth band between) and ``yarn`` (frequencies blended by wavelength, logits scaled by an
attention factor). A GGUF file stores Llama 3's scaling as per-frequency divisors instead
(``rope_freqs.weight``), which ``freq_factors`` takes.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
             max_positions: int, freq_factors: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, float]:
    """The ``head_dim // 2`` inverse frequencies (float64) and the attention factor that
    scales cos and sin (1.0 but for yarn)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    base = 1.0 / theta ** exponent
    if freq_factors is not None:
        return base / freq_factors.to(torch.float64), 1.0
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default" or scaling is None:
        return base, 1.0
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return base / factor, 1.0
    if kind == "dynamic":
        original = int(scaling.get("original_max_position_embeddings", max_positions))
        if max_positions <= original:
            return base, 1.0
        grown = theta * ((factor * max_positions / original) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        return 1.0 / grown ** exponent, 1.0
    if kind == "llama3":
        return _llama3(base, scaling, factor), 1.0
    if kind == "yarn":
        return _yarn(base, head_dim, theta, scaling, factor)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, dynamic, "
                     "llama3, yarn)")


def _llama3(base: torch.Tensor, scaling: dict[str, Any], factor: float) -> torch.Tensor:
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > original / low, base / factor, base)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any],
          factor: float) -> tuple[torch.Tensor, float]:
    original = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    extrapolate = 1 - ramp.clamp(0, 1)
    freqs = base / factor * (1 - extrapolate) + base * extrapolate
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return freqs, float(attention)


def cos_sin_table(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int, dtype: torch.dtype,
                  freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position below ``max_positions``: [positions, head_dim] each,
    both halves equal (the rotate-half layout of Hugging Face checkpoints)."""
    freqs, attention = inv_freq(head_dim, theta, scaling, max_positions, freq_factors)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), freqs)
    angles = torch.cat((angles, angles), dim=-1)
    return ((angles.cos() * attention).to(dtype), (angles.sin() * attention).to(dtype))


def signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., head_dim] with its first half negated: rotate-half's sign moved into the
    table, so that ``rotate`` needs a roll where it took a slice, a negation and a join."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, heads, head_dim] rotated by its positions' ``cos`` and ``signed(sin)``
    [tokens, 1, head_dim]: ``x cos + (-x2, x1) sin``, where ``-x2 sin`` is ``x2 (-sin)`` to
    the bit, with four operations instead of seven (decode runs this 30 times a token)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
