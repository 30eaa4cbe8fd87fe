"""A Llama-family decoder in plain PyTorch that reads and writes the core's paged KV pool.

One forward pass runs every item of a step: the tokens of all items are one flat batch
through the projections and the MLP (one matrix multiply each, whatever the mix of prefill
chunks and decodes), and only attention is per sequence. Each token's K and V are written
to its place in the pool (block ``table[p // 16]``, offset ``p % 16``) before attention reads
the sequence's whole history back through its block table, so a cached prefix shared by
several sequences is read, never copied. Decoding sequences attend together in one padded
call; a prefill chunk attends alone, causally from its start position; and the rows of a
draft's check that the backend names (``build_batch``'s ``checks``) one call each, every
row as a lone decode of its position.

On the CPU in bfloat16 the small operations between the products run in laya_torch_kernels
(``_forward_native``, ``build_batch``'s ``native``): four calls a layer, and every one-token
query, a decode's or a check's row, attends over its own history, so that a row's logits
are the same bits in any batch. Prompt chunks still attend through PyTorch. Where the CPU
has AVX2 the int8 output head runs there too (``native_head``: exact integer sums over
16-bit steps of each row, the weights prefetched), again a row at a time, as do the layers'
4-bit products on any path (``quant.Q4Linear``).

Covers RMSNorm, rotary embeddings (``rope.py``), grouped-query attention, the SwiGLU MLP,
tied embeddings and Qwen2's q/k/v biases. Weights are in the compute dtype (float32 or
bfloat16/float16), int8 per output channel (``quant.Int8Linear``), or the layers' in int4
groups (``quant.Q4Linear`` on the kernels, else ``quant.Int4Linear``) with the output head
in int8.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from laya_backend_torch.batch import Attention, Batch
from laya_backend_torch.checkpoint import LlamaConfig
from laya_backend_torch.lora import LoraRows
from laya_backend_torch.lora import apply as apply_lora
from laya_backend_torch.packed import GroupQuant
from laya_backend_torch.quant import Int8Linear, Linear, Q4Linear, dense, linear_kind
from laya_backend_torch.rope import cos_sin_table, rotate, signed


@attrs.define
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v stacked: [(heads + 2 kv_heads) x head_dim, hidden]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up stacked: [2 x intermediate, hidden]
    down: Linear


def native_kernels() -> Any:
    """The laya_torch_kernels module (plugins/backend_torch/kernels), or None where it is
    not installed: the eager operations then run every step."""
    try:
        import laya_torch_kernels
    except ImportError:
        return None
    return laya_torch_kernels


def _stacked(parts: list[Any]) -> Any:
    """Matrices sharing their input, stacked on their outputs: dense tensors, or a GPTQ or
    AWQ checkpoint's unpacked ones (packed.GroupQuant)."""
    if isinstance(parts[0], GroupQuant):
        return GroupQuant.stacked(parts)
    return torch.cat(parts)


class LlamaModel:
    """The weights and the forward pass; the KV pool is given by ``allocate_kv``."""

    def __init__(self, config: LlamaConfig, tensors: Iterator[tuple[str, torch.Tensor]],
                 dtype: torch.dtype, device: torch.device, quantize: str = "none",
                 max_positions: int = 4096, rope_freqs: torch.Tensor | None = None,
                 attention_dtype: torch.dtype = torch.float32, chunk_rows: int = 0) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.attention_dtype = attention_dtype
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        raw: dict[str, torch.Tensor] = {}
        layers: list[Layer | None] = [None] * c.num_layers
        prefix = "model.layers."
        for name, tensor in tensors:
            raw[name] = tensor
            if name.startswith(prefix):  # build each layer as soon as its tensors are in
                i = int(name[len(prefix):].split(".", 1)[0])
                layer = self._layer(raw, f"{prefix}{i}.", linear_kind(quantize))
                if layer is not None:
                    layers[i] = layer
        missing = [i for i, layer in enumerate(layers) if layer is None]
        if missing:
            raise ValueError(f"the checkpoint lacks tensors of layers {missing[:5]}")
        self.layers: list[Layer] = layers  # type: ignore[assignment]
        embed = raw.pop("model.embed_tokens.weight")
        head = raw.pop("lm_head.weight", None)
        self.norm = self._dense(raw.pop("model.norm.weight"))
        # The head in int8 whenever the layers are quantized: an int4 matrix is no
        # embedding to look rows up in, and GGUF files keep it in 8 bits or more.
        head_kind = Linear if quantize == "none" else Int8Linear
        if head is None:  # tied: one matrix looks tokens up and gives the logits
            self.lm_head = head_kind.of(embed, None, dtype, device)
            self.embed = self.lm_head
        else:
            self.lm_head = head_kind.of(head, None, dtype, device)
            self.embed = Linear.of(embed, None, dtype, device)
        if chunk_rows and dtype != torch.float32:  # the 16-bit products (quant.ALIKE_ROWS)
            for linear in self._linears():
                if type(linear) is Linear:
                    linear.chunk_rows = chunk_rows
        cos, sin = cos_sin_table(c.head_dim, c.rope_theta, c.rope_scaling, max_positions,
                                 torch.float32, rope_freqs)
        # In the compute dtype once, where each pass cast the rows it took.
        self.cos = cos.to(device=device, dtype=dtype)
        self.signed_sin = signed(sin).to(device=device, dtype=dtype)
        self.kv_pool = torch.empty(0)
        # The small operations in laya_torch_kernels where it can take them, else why not
        # (``kernels_off``, which /ready's ``kernels`` shows).
        self.kernels_off = self._kernels_off(device, dtype, attention_dtype)
        self.kernels = None if self.kernels_off else native_kernels()
        if not self.kernels_off and self.kernels is None:
            self.kernels_off = ("laya_torch_kernels is not installed (pip install "
                                "plugins/backend_torch/kernels)")
        # The int8 output head on the kernels too, where the CPU has AVX2: torch's product
        # converts every weight to a float and waits on memory (``head_int8``).
        self.set_threads(torch.get_num_threads())
        self._layers_q4 = all(isinstance(m, Q4Linear) for m in self._layer_matrices())
        head = self.lm_head
        self.native_head = (
            self.kernels is not None and type(head) is Int8Linear and head.bias is None
            and head.weight.dtype == torch.int8 and head.scales.dtype == torch.bfloat16
            and head.weight.is_contiguous() and head.scales.is_contiguous()
            and c.hidden_size % 32 == 0
            and bool(getattr(self.kernels, "head_supported", lambda: False)()))

    def set_threads(self, threads: int) -> None:
        """The threads the kernels' products and attention take (the backend's n_threads,
        or what the thread governor leaves it)."""
        self.threads = threads
        for linear in self._linears():
            linear.threads = threads

    @property
    def products_native(self) -> bool:
        """Whether a native step's every matrix product runs in the kernels (the layers'
        4-bit ones and the head): PyTorch's own threads then have nothing to share out but
        sampling, whose operations are no faster on two threads (argmax and softmax over
        49,152 logits: 111 us on one or two, Intel Xeon with AMX), and whose OpenMP threads,
        spinning after each, would take the cores from the kernels' workers."""
        return self.native_head and self._layers_q4

    def int4_products(self) -> str:
        """Who multiplies the layers' 4-bit matrices (/ready's ``int4_products``)."""
        matrices = self._layer_matrices()
        q4 = [m for m in matrices if isinstance(m, Q4Linear)]
        if not q4:
            return "torch's int4 kernel"
        rest = "" if len(q4) == len(matrices) else \
            f" ({len(matrices) - len(q4)} of {len(matrices)} matrices on torch's or in int8)"
        return f"laya_torch_kernels ({q4[0].kernels.q4_path()}){rest}"

    def _layer_matrices(self) -> list[Linear]:
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                     layer.down)]

    def _kernels_off(self, device: torch.device, dtype: torch.dtype,
                     attention_dtype: torch.dtype) -> str:
        """Why the kernels cannot run this model, or "" where they can: bfloat16 on the
        CPU, float32 attention (not ``deterministic``'s float64), up to 16 query heads a
        K/V head and heads of up to 256, even (attend's kMaxGroup and kMaxChunks)."""
        c = self.config
        if device.type != "cpu" or dtype != torch.bfloat16:
            return "they take bfloat16 on the CPU"
        if attention_dtype != torch.float32:
            return "deterministic attends in float64"
        if c.head_dim % 2 or c.head_dim > 256 or c.num_heads // c.num_kv_heads > 16:
            return (f"they take heads of up to 256 and up to 16 query heads a K/V head "
                    f"(this model: {c.head_dim}, {c.num_heads // c.num_kv_heads})")
        return ""

    @property
    def native(self) -> bool:
        """Whether a step can run on ``kernels`` (``build_batch``'s ``native``): they are
        installed and the model takes them, with a bfloat16 or float16 KV pool."""
        return self.kernels is not None and self.kv_pool.dtype in (torch.bfloat16, torch.float16)

    def _linears(self) -> list[Linear]:
        return [self.lm_head, self.embed, *self._layer_matrices()]

    def _dense(self, t: torch.Tensor) -> torch.Tensor:
        return dense(t, self.dtype, self.device)

    def _layer(self, raw: dict[str, torch.Tensor], p: str,
               kind: type[Linear]) -> Layer | None:
        names = [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight",
                 *(f"{p}self_attn.{x}_proj.weight" for x in "qkvo"),
                 *(f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down"))]
        if self.config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        if any(n not in raw for n in names):
            return None
        t = {n[len(p):]: raw.pop(n) for n in names}
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([t[f"self_attn.{x}_proj.bias"] for x in "qkv"])
        try:
            qkv = _stacked([t[f"self_attn.{x}_proj.weight"] for x in "qkv"])
            gate_up = _stacked([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]])
        except ValueError as e:  # packed projections sharing an input, grouped unalike
            raise ValueError(f"{p}: {e}; this backend fuses q/k/v and gate/up") from None
        dt, dev = self.dtype, self.device
        return Layer(self._dense(t["input_layernorm.weight"]), kind.of(qkv, bias, dt, dev),
                     kind.of(t["self_attn.o_proj.weight"], None, dt, dev),
                     self._dense(t["post_attention_layernorm.weight"]),
                     kind.of(gate_up, None, dt, dev),
                     kind.of(t["mlp.down_proj.weight"], None, dt, dev))

    def allocate_kv(self, num_slots: int, kv_dtype: torch.dtype) -> None:
        """The pool, once: [layers, slots, 2 x kv_heads, head_dim], a slot's K heads then
        its V heads, so that one copy writes a step's K and V and one gather reads a
        history's. Zeroed, so its pages are resident from the start (the memory plan counts
        them)."""
        c = self.config
        shape = (c.num_layers, num_slots, 2 * c.num_kv_heads, c.head_dim)
        self.kv_pool = torch.zeros(shape, dtype=kv_dtype, device=self.device)

    def forward(self, batch: Batch, kv_pool: torch.Tensor | None = None,
                hidden: bool = False, lora: LoraRows = ()) -> torch.Tensor:
        """The float32 logits [R, vocab] of ``batch.logit_rows``; with ``hidden``, their
        final-norm hidden states [R, hidden_size] instead (embeddings). ``kv_pool``: the
        pool the batch's slots index, if not the model's (the embedding scratch).
        ``lora``: the LoRA adapters of the batch's rows (lora.rows_by_adapter)."""
        c = self.config
        pool = self.kv_pool if kv_pool is None else kv_pool
        if batch.attention.native:
            if lora:
                raise ValueError("a native batch takes no LoRA rows (build_batch's native)")
            return self._forward_native(batch, pool, hidden)
        # index_select, not t[ids]: advanced indexing costs 5 times as much on these small
        # gathers (20 us against 4 for a 150-token history, AMD EPYC), 60 times a step.
        h = self.embed.rows(batch.tokens)
        cos = self.cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self.signed_sin.index_select(0, batch.positions).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(x)
            if lora:
                qkv = apply_lora(qkv, x, lora, i, "qkv")
            qkv = qkv.view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
            heads = c.num_heads + c.num_kv_heads  # q and k rotated together: half the ops
            q, k = rotate(qkv[:, :heads], cos, sin).split((c.num_heads, c.num_kv_heads), dim=1)
            kv = torch.cat((k, qkv[:, heads:]), dim=1).to(pool.dtype)
            layer_pool = pool[i]
            layer_pool.index_copy_(0, batch.slots, kv)
            if not lora:
                h = h + layer.o(self._attend(layer_pool, q, batch.attention))
                x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
                gate, up = layer.gate_up(x).chunk(2, dim=-1)
                h = h + layer.down(F.silu(gate) * up)
                continue
            attended = self._attend(layer_pool, q, batch.attention)
            h = h + apply_lora(layer.o(attended), attended, lora, i, "o")
            x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
            gate, up = apply_lora(layer.gate_up(x), x, lora, i, "gate_up").chunk(2, dim=-1)
            act = F.silu(gate) * up
            h = h + apply_lora(layer.down(act), act, lora, i, "down")
        rows = h.index_select(0, batch.logit_rows)
        rows = F.rms_norm(rows, (c.hidden_size,), self.norm, c.rms_norm_eps)
        return rows.float() if hidden else self.lm_head(rows).float()

    def _forward_native(self, batch: Batch, pool: torch.Tensor, hidden: bool) -> torch.Tensor:
        """``forward`` with the small operations between the products in ``kernels``, each
        run of them one call on bfloat16 rows: 4 calls a layer where eager PyTorch made 32.
        The residual stream ``h`` is updated in place, and each layer's last add is the next
        one's first norm."""
        c, k, a = self.config, self.kernels, batch.attention
        assert k is not None and pool.dtype in (torch.bfloat16, torch.float16)
        # The kernels index the tables and the pool by these without bounds checks, where
        # PyTorch's index_select would raise: a wrong index must stay an error, not a write
        # into another sequence's memory.
        slots_read = batch.slots if a.lone_histories is None \
            else torch.cat((batch.slots, a.lone_histories))
        if int(batch.positions.max()) >= self.cos.shape[0] or int(slots_read.min()) < 0 \
                or int(slots_read.max()) >= pool.shape[1]:
            raise IndexError(f"a position or pool slot out of range: positions up to "
                             f"{self.cos.shape[0]}, slots up to {pool.shape[1]}")
        half = pool.dtype == torch.float16
        h = self.embed.rows(batch.tokens).contiguous()
        rows = h.shape[0]
        x = torch.empty_like(h)
        attended = torch.empty(rows, self.q_size, dtype=h.dtype, device=h.device)
        positions, slots = batch.positions.data_ptr(), batch.slots.data_ptr()
        lone = 0 if a.lone_rows is None else a.lone_rows.shape[0]
        spec = 0 if a.lone_rows is None else a.lone_rows.data_ptr()
        histories = 0 if a.lone_histories is None else a.lone_histories.data_ptr()
        cos, sin = self.cos.data_ptr(), self.signed_sin.data_ptr()
        threads, scale, eps = self.threads, c.head_dim ** -0.5, c.rms_norm_eps
        width = c.num_heads + 2 * c.num_kv_heads
        hp, xp, ap = h.data_ptr(), x.data_ptr(), attended.data_ptr()
        k.add_rms_norm(hp, 0, self.layers[0].input_norm.data_ptr(), xp, rows, c.hidden_size,
                       eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x).contiguous()
            layer_pool = pool[i]
            k.rope_store(qkv.data_ptr(), rows, positions, cos, sin, c.num_heads,
                         c.num_kv_heads, c.head_dim, layer_pool.data_ptr(), half, slots)
            if lone:
                k.attend(qkv.data_ptr(), width * c.head_dim, layer_pool.data_ptr(), half, spec,
                         histories, lone, ap, c.num_heads, c.num_kv_heads, c.head_dim, scale,
                         threads)
            if a.chunks:
                q = qkv.view(rows, width, c.head_dim)[:, :c.num_heads].to(torch.float32)
                self._attend_chunks(layer_pool, q, a.chunks, attended)
            o = layer.o(attended).contiguous()
            k.add_rms_norm(hp, o.data_ptr(), layer.post_norm.data_ptr(), xp, rows,
                           c.hidden_size, eps)
            gate_up = layer.gate_up(x).contiguous()
            act = torch.empty(rows, gate_up.shape[1] // 2, dtype=h.dtype, device=h.device)
            k.silu_mul(gate_up.data_ptr(), act.data_ptr(), rows, act.shape[1])
            down = layer.down(act).contiguous()
            norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            k.add_rms_norm(hp, down.data_ptr(), norm.data_ptr(), xp, rows, c.hidden_size, eps)
        out = x.index_select(0, batch.logit_rows)  # the final norm's, after the last layer
        if hidden:
            return out.float()
        if not self.native_head:
            return self.lm_head(out).float()
        head = self.lm_head
        logits = torch.empty(out.shape[0], head.weight.shape[0], dtype=torch.float32)
        k.head_int8(out.data_ptr(), out.shape[0], c.hidden_size, head.weight.data_ptr(),
                    head.scales.data_ptr(), logits.data_ptr(), logits.shape[1], threads)
        return logits

    def _attend(self, pool: torch.Tensor, q: torch.Tensor, a: Attention) -> torch.Tensor:
        """Attention output [T, heads x head_dim] for every row of ``q`` [T, heads, dim].

        In float32 whatever the compute dtype: the CPU's bfloat16 attention kernel took 5 to
        8 times as long (one decode over 120 positions: 119 us against 23; eight over 300:
        2.4 ms against 0.31, AMD EPYC, one thread), and q, K and V are small beside the
        weights. The float32 kernel's sums change in their last bits with the number of keys
        and queries in the call (a decode padded to a longer neighbour, a prompt in other
        chunks), which 30 layers of bfloat16 turn into other logits; in float64
        (``deterministic``) those bits stay below what the cast back keeps, at 2 to 3.5
        times the attention's cost. A draft's check needs no float64: its rows are
        attended one call each, as lone decodes (``checks``), which gives them a lone
        decode's bits at any precision."""
        dtype, q = q.dtype, q.to(self.attention_dtype)
        kv_heads = self.config.num_kv_heads  # pool: one layer's [slots, 2 kv_heads, dim]
        if a.decode_rows is not None:
            assert a.decode_slots is not None
            b = a.decode_slots.shape[0]
            alone = b == q.shape[0]  # decodes only, in row order (build_batch's)
            qd = self._grouped(q if alone else q.index_select(0, a.decode_rows))
            kvd = self._history(pool, a.decode_slots.view(-1), q.dtype, b)
            od = F.scaled_dot_product_attention(
                qd, kvd[:, :kv_heads], kvd[:, kv_heads:],
                attn_mask=a.decode_mask if b > 1 else None)
            if alone:  # the step's every row: no copy into a larger output
                return od.reshape(b, self.q_size).to(dtype)
            out = torch.empty(q.shape[0], self.q_size, dtype=q.dtype, device=q.device)
            out.index_copy_(0, a.decode_rows, od.reshape(b, self.q_size))
        else:
            out = torch.empty(q.shape[0], self.q_size, dtype=q.dtype, device=q.device)
        for row, n, slots, start in a.checks:  # each row as a lone decode (build_batch)
            kvc = self._history(pool, slots, q.dtype, 1)
            for j in range(n):
                k, v = kvc[:, :kv_heads, :start + j + 1], kvc[:, kv_heads:, :start + j + 1]
                oj = F.scaled_dot_product_attention(self._grouped(q[row + j:row + j + 1]), k, v)
                out[row + j] = oj.view(self.q_size)
        self._attend_chunks(pool, q, a.chunks, out)
        return out.to(dtype)

    def _attend_chunks(self, pool: torch.Tensor, q: torch.Tensor,
                       chunks: tuple[tuple[int, int, torch.Tensor, int], ...],
                       out: torch.Tensor) -> None:
        """Each prompt chunk's rows of ``q`` attended causally in one call, into ``out``."""
        kv_heads = self.config.num_kv_heads
        for row, n, slots, start in chunks:
            qc = q[row:row + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            kvc = pool.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            kc, vc = kvc[:, :kv_heads], kvc[:, kv_heads:]  # [1, kv_heads, end, dim]
            if start == 0:
                oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True,
                                                    enable_gqa=True)
            else:
                query_pos = torch.arange(start, start + n, device=q.device)
                mask = torch.arange(len(slots), device=q.device)[None, :] <= query_pos[:, None]
                oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask,
                                                    enable_gqa=True)
            out[row:row + n] = oc[0].transpose(0, 1).reshape(n, self.q_size)

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        """One-token queries [B, heads, dim] as [B, kv_heads, heads per kv head, dim]: each
        K/V head's queries as rows of one call, where ``enable_gqa`` would have repeated
        K and V for each (10 to 20% of a decode's attention call, 60 to 600 keys)."""
        c = self.config
        return q.view(q.shape[0], c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)

    @staticmethod
    def _history(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                 b: int) -> torch.Tensor:
        """K and V of ``slots`` (``b`` histories of equal length, one after another) as
        [b, 2 kv_heads, length, dim] in ``dtype``."""
        kv = pool.index_select(0, slots).to(dtype)
        return kv.view(b, -1, *pool.shape[1:]).transpose(1, 2)
