"""One backward pass for a batch of output directions: ``torch.func.vmap`` over ``torch.autograd.grad``.

Why not ``torch.autograd.grad(..., is_grads_batched=True)``: it runs on torch's legacy vmap prototype,
which has no batching rule for the backward of silu, gelu, tanh, softmax or layer norm, nor for fused
attention, and calls each of them once per direction and stacks the results (on SmolLM2, 30 layers x
586 directions of silu and attention backward per 5-token analysis). functorch's vmap has rules for all
of these but one: the CPU flash-attention backward behind ``scaled_dot_product_attention``. Its rule
is registered here: it calls the same kernel once, with the directions folded into the kernel's own
batch dimension, so each direction's gradient is bit for bit what a call per direction gives (tested).

The fused attention kernels of CUDA (flash, memory-efficient, cuDNN) have no rule either; functorch
falls back to one call per direction there: slower, still exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._functorch.autograd_function import custom_function_call_vmap_helper
from torch._functorch.pyfunctorch import VmapInterpreter, retrieve_current_functorch_interpreter

_FLASH_CPU_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_TENSOR_ARGS = 6  # grad_out, query, key, value, out, logsumexp: each [N, ...]


def batched_grad(
    output: torch.Tensor, inputs: Sequence[torch.Tensor], grad_outputs: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """d(v_b . output)/d(input) for every row v_b of ``grad_outputs`` [B, *output.shape]: per input
    [B, *input.shape], or None where the input does not reach ``output``. The graph is kept."""

    def one(vector: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(output, inputs, grad_outputs=vector, retain_graph=True, allow_unused=True)

    return torch.func.vmap(one)(grad_outputs)


def _folded(tensor: torch.Tensor, batch_dim: int | None, size: int) -> torch.Tensor:
    """[size, N, ...] (the directions first; broadcast when not batched) as [size * N, ...]."""
    tensor = tensor.movedim(batch_dim, 0) if batch_dim is not None else tensor.expand(size, *tensor.shape)
    return tensor.reshape(size * tensor.shape[1], *tensor.shape[2:])


def _flash_cpu_backward_rule(info, in_dims, *args, attn_mask=None, scale=None):
    size = info.batch_size
    tensors = [_folded(t, d, size) for t, d in zip(args[:_TENSOR_ARGS], in_dims[:_TENSOR_ARGS], strict=True)]
    if attn_mask is not None and attn_mask.shape[0] != 1:  # a mask per sequence: one per folded sequence
        attn_mask = attn_mask.repeat(size, *([1] * (attn_mask.dim() - 1)))
    op = getattr(torch.ops.aten, _FLASH_CPU_BACKWARD).default
    grads = op(*tensors, *args[_TENSOR_ARGS:], attn_mask=attn_mask, scale=scale)
    return tuple(g.reshape(size, g.shape[0] // size, *g.shape[1:]) for g in grads), (0,) * len(grads)


def _register() -> torch.library.Library | None:
    """The rule, unless this torch has its own."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_FLASH_CPU_BACKWARD}", "FuncTorchBatched"):
        return None
    op = getattr(torch.ops.aten, _FLASH_CPU_BACKWARD).default

    def batched(keyset, *args, **kwargs):
        interpreter = retrieve_current_functorch_interpreter()
        assert isinstance(interpreter, VmapInterpreter)  # registered under FuncTorchBatched: vmap's only
        return custom_function_call_vmap_helper(interpreter, _flash_cpu_backward_rule, op, *args, **kwargs)

    library = torch.library.Library("aten", "IMPL")
    library.impl(_FLASH_CPU_BACKWARD, batched, "FuncTorchBatched", with_keyset=True)
    return library


_LIBRARY = _register()  # held: the registration lasts as long as the library object
