"""A step's items as the index tensors the forward pass reads (``build_batch``): the flat
tokens, their positions and pool slots, and where each row attends (``Attention``), with the
histories' pool slots found through each item's block table (``table[p // 16] * 16 + p % 16``).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import attrs
import torch


@attrs.frozen
class Attention:
    """Where one step's rows attend (``Batch``): the decoding rows together, and each
    prefill chunk on its own."""

    decode_rows: torch.Tensor | None  # [B] rows of single-token items
    decode_slots: torch.Tensor | None  # [B, L] pool slots of their histories (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] true where a slot is history
    # (first row, rows, pool slots of positions 0 .. end, start position) per chunk
    chunks: tuple[tuple[int, int, torch.Tensor, int], ...]
    # The same per draft check, whose rows attend one at a time (build_batch's ``checks``)
    checks: tuple[tuple[int, int, torch.Tensor, int], ...] = ()
    # The kernels' batch (build_batch's ``native``): every one-token query, a decode's row
    # or a check's, as (row, offset into lone_histories, length) [N, 3], and their pool
    # slots one history after another; decode_* and checks are then empty.
    native: bool = False
    lone_rows: torch.Tensor | None = None
    lone_histories: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Attention:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        def moved(parts: tuple[tuple[int, int, torch.Tensor, int], ...]) -> tuple[
                tuple[int, int, torch.Tensor, int], ...]:
            return tuple((r, n, s.to(device, non_blocking=True), st) for r, n, s, st in parts)

        return Attention(move(self.decode_rows), move(self.decode_slots),
                         move(self.decode_mask), moved(self.chunks), moved(self.checks),
                         self.native, move(self.lone_rows), move(self.lone_histories))


@attrs.frozen
class Batch:
    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: where each token's K and V go in the pool
    attention: Attention
    logit_rows: torch.Tensor  # [R] long: the rows whose next-token logits are wanted

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device`` (built on the CPU, where its indices are computed)."""
        if torch.device(device).type == "cpu":
            return self
        return Batch(self.tokens.to(device), self.positions.to(device),
                     self.slots.to(device), self.attention.to(device),
                     self.logit_rows.to(device))


def build_batch(items: Iterable[tuple[list[int], int, list[int]]],
                logit_rows: list[int], block_size: int,
                checks: Container[int] = (), native: bool = False) -> Batch:
    """``items``: (tokens, start position, block table) per item, in row order.

    ``checks``: the indices of items that check a draft. Their rows attend one at a time,
    each exactly as a one-token decode of its position alone does (``_attend``), so that a
    kept draft gives the bits that decoding its tokens one by one gives: the products are
    the same bits for a row in any number of rows (quant.two_rows), and only attention
    sums otherwise over several queries.

    ``native``: the batch for ``LlamaModel.kernels`` (``LlamaModel.native``), where every
    decode and check row is a one-token query of its own (``Attention.lone_rows``)."""
    tokens: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    decode: list[tuple[int, torch.Tensor]] = []
    chunks: list[tuple[int, int, torch.Tensor, int]] = []
    checked: list[tuple[int, int, torch.Tensor, int]] = []
    lone: list[tuple[int, int, int]] = []  # native: (row, offset, length) per query
    histories: list[torch.Tensor] = []
    offset = 0
    for i, (toks, start, table) in enumerate(items):
        row, end = len(tokens), start + len(toks)
        tokens += toks
        pos = torch.arange(end)
        history = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size \
            + pos % block_size
        positions.append(pos[start:])
        slots.append(history[start:])
        if native and (len(toks) == 1 or i in checks):
            lone += [(row + j, offset, start + j + 1) for j in range(len(toks))]
            histories.append(history)
            offset += end
            continue
        if len(toks) == 1:
            decode.append((row, history))
        else:
            (checked if i in checks else chunks).append((row, len(toks), history, start))
    if native:
        attention = Attention(None, None, None, tuple(chunks), native=True,
                              lone_rows=torch.tensor(lone, dtype=torch.long).view(-1, 3),
                              lone_histories=torch.cat(histories) if histories else None)
    elif decode:
        longest = max(len(h) for _, h in decode)
        padded = torch.zeros(len(decode), longest, dtype=torch.long)
        mask = torch.zeros(len(decode), 1, 1, longest, dtype=torch.bool)
        for i, (_, history) in enumerate(decode):
            padded[i, :len(history)] = history
            mask[i, ..., :len(history)] = True
        attention = Attention(torch.tensor([r for r, _ in decode]), padded, mask,
                              tuple(chunks), tuple(checked))
    else:
        attention = Attention(None, None, None, tuple(chunks), tuple(checked))
    return Batch(torch.tensor(tokens, dtype=torch.long), torch.cat(positions),
                 torch.cat(slots), attention, torch.tensor(logit_rows, dtype=torch.long))
