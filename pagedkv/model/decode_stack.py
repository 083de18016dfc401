"""A decode step's decoder stack in one C++ call (kernels/csrc/decode_stack.cpp) on the CPU.

At one or a few rows each of a layer's kernels is short, and calling them from Python (a
layer's 11 ops with their views, the attention backend's choices, nn.Module glue) costs about
as much as the kernels: on SmolLM2-135M at one row, about 3 ms of a 7 ms step. `DecodeStack`
hands the whole stack to `torch.classes.pagedkv_cpu.DecodeStack`, which runs the same kernels
in the same order from C++, so the results are the Python forward's own.

Each linear module says which op its forward runs for a row count (`decode_call(rows)`
returning a `LinearCall`: the op's name and its arguments after x), so a new weight format
plugs in by giving that method; a fused linear whose parts are packed in different formats
(quant/parts_linear.py) gives `LinearParts`, one call per part, their outputs concatenated
along the last dim and its bias added once. A module without the method, or returning None,
keeps the model on the Python forward. The C++ stacks are built per row count on first use and
dropped when the weights are packed again.

Taken only where the Python forward would run exactly these kernels: the fused CPU kernels in
use, a Llama-family model (Llama, Mistral, Qwen2) whole on one process (no tensor parallelism),
no q/k norm, a KV cache of the model's dtype, and a step of decodes only whose attention the
fused decode kernel runs alone (cpu_native's route "native": no shared prefix attended apart,
no split over the context). Every other step runs the Python forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from torch import nn

    from pagedkv.model.attention import AttentionMetadata


class LinearCall(NamedTuple):
    """One op computing y = x W^T (+ bias) for a 2-D x: `op` ("namespace::name" or
    "namespace::name.overload") called with x as its argument `x_index`, its other arguments
    in schema order taken from `tensors` (Tensor and Tensor? arguments, None allowed for the
    optional ones), `ints` and `strs`; an optional scalar list is given empty, any other
    argument its default."""

    op: str
    tensors: tuple[torch.Tensor | None, ...]
    ints: tuple[int, ...] = ()
    strs: tuple[str, ...] = ()
    x_index: int = 0


class LinearParts(NamedTuple):
    """A linear as several ops on the same x: y = the concatenation of `calls`' outputs along
    the last dim, plus `bias` [N] (if any) added once after, in place."""

    calls: tuple[LinearCall, ...]
    bias: torch.Tensor | None = None


def _add_linear(stack: torch.ScriptObject, linear: nn.Module, rows: int) -> bool:
    """`linear`'s ops for `rows` rows as the stack's next linear (mutates `stack`); False, having
    added nothing, where the module gives none."""
    call = getattr(linear, "decode_call", lambda rows: None)(rows)
    if call is None:
        return False
    calls, bias = ((call,), None) if isinstance(call, LinearCall) else call
    for i, c in enumerate(calls):
        name, _, overload = c.op.partition(".")
        add = stack.add_linear_part if i else stack.add_linear
        add(name, overload, c.x_index, list(c.tensors), list(c.ints), list(c.strs))
    if bias is not None:
        stack.set_linear_bias(bias)
    return True


def _attention_layers(model: nn.Module) -> list:
    return [layer.self_attn for layer in model.layers]


class DecodeStack:
    """The C++ decode stacks of one model, by row count (see the module docstring). The model
    owns it and passes itself to each call (no reference back: no cycle for the collector)."""

    def __init__(self) -> None:
        """An empty stack cache; the model (a Llama-layer model whole on one process, without
        q/k norm: LlamaForCausalLM.pack_linear_weights decides) owns it."""
        self._stacks: dict[int, torch.ScriptObject | None] = {}

    @staticmethod
    def _build(model: nn.Module, rows: int) -> torch.ScriptObject | None:
        """The C++ stack of `model`'s layers for `rows` rows, or None where a linear gives no
        ops."""
        attn = model.layers[0].self_attn
        stack = torch.classes.pagedkv_cpu.DecodeStack(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, model.norm.eps, attn.scale,
            model.norm.weight.detach())
        for layer in model.layers:
            stack.add_layer(layer.input_layernorm.weight.detach(),
                            layer.post_attention_layernorm.weight.detach())
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if not _add_linear(stack, linear, rows):
                    return None
        return stack

    def stack_for(self, model: nn.Module, rows: int) -> torch.ScriptObject | None:
        """`model`'s stack for `rows` rows (built on first use; None: this row count cannot)."""
        if rows not in self._stacks:
            self._stacks[rows] = self._build(model, rows)
        return self._stacks[rows]

    def run(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of `model` (the one owning this stack) for a
        step of T decodes (writes each layer's new K/V into `kv_caches`, as the model's
        forward), or None, having done nothing, where this step needs the Python forward (see
        the module docstring)."""
        from pagedkv.model.backends.cpu_native import NativeAttentionMetadata

        rows = input_ids.shape[0]
        if (type(meta) is not NativeAttentionMetadata or meta.prefills or rows == 0
                or meta.num_decodes != rows or input_ids.device.type != "cpu"):
            return None
        dtype = model.norm.weight.dtype
        attns = _attention_layers(model)
        firsts = []
        for attn, (k_cache, _) in zip(attns, kv_caches, strict=True):
            if attn.kv_scales is not None or k_cache.dtype != dtype:
                return None
            first = meta.fused_decode_first(dtype, attn.num_heads, attn.head_dim, k_cache,
                                            attn.window)
            if first is None:
                return None
            firsts.append(first)
        stack = self.stack_for(model, rows)
        if stack is None:
            return None
        x = model.embed_tokens(input_ids)
        rope = model.rotary.inputs(positions, x.dtype)
        return stack.run(x, positions, rope.cos_table, rope.sin_table,
                         [k for k, _ in kv_caches], [v for _, v in kv_caches],
                         meta.decode_block_tables, firsts, meta.decode_seq_lens,
                         meta.slot_mapping)
