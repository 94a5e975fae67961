"""One backward pass for a batch of output directions: ``torch.func.vmap`` over ``torch.autograd.grad``.

Why not ``torch.autograd.grad(..., is_grads_batched=True)``: it runs on torch's legacy vmap prototype,
which has no batching rule for the backward of silu, gelu, tanh, softmax or layer norm, nor for fused
attention, and calls each of them once per direction and stacks the results (on SmolLM2, 30 layers x
586 directions of silu and attention backward per 5-token analysis). functorch's vmap has rules for all
of these but one: the CPU flash-attention backward behind ``scaled_dot_product_attention``. Its rule
is registered here: it calls the same kernel once, with the directions folded into the kernel's own
batch dimension, so each direction's gradient is bit for bit what a call per direction gives (tested).

The fused attention kernels of CUDA (flash, memory-efficient, cuDNN) have no rule either; functorch
falls back to one call per direction there (as the legacy path did): slower, still exact.

The backward of an activation (silu, gelu, tanh, sigmoid) is the gradient times the activation's
derivative at the saved forward tensor, which every direction shares. functorch's own rule calls the
kernel on the batch, so the derivative (an exp or erf per value) is formed again for every direction:
on SmolLM2's shapes silu's backward took as long as three products (2.5 ms against 0.85 for 256
directions of 16 rows). The rule here forms it once, as the kernel itself gives it (the kernel of a
gradient of ones: each of these is linear in the gradient), and multiplies: the product's order
differs from the kernel's, so a direction's gradient may differ in its last bit (tested within
float32's rounding).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

try:  # functorch's internals (a rule has no public way to unwrap a level); without them: no rule
    from torch._C._functorch import _add_batch_dim, _unwrap_batched
    from torch._functorch.pyfunctorch import VmapInterpreter, retrieve_current_functorch_interpreter

    _INTERNALS = True
except ImportError:  # pragma: no cover - torch 2.13/2.14 have them
    _INTERNALS = False

_FLASH_CPU_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_TENSOR_ARGS = 6  # grad_out, query, key, value, out, logsumexp: each [N, ...]
_ATTENTION_DIMS = 4  # [N, heads, L, S] for a mask; one of fewer dims broadcasts over N


def _outside_this_level() -> torch._C._ExcludeDispatchKeyGuard:
    """Within a rule: ops on the unwrapped tensors skip vmap's key (its levels outside run as usual)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched))


def batched_grad(
    output: torch.Tensor, inputs: Sequence[torch.Tensor], grad_outputs: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """d(v_b . output)/d(input) for every row v_b of ``grad_outputs`` [B, *output.shape]: per input
    [B, *input.shape], or None where the input does not reach ``output``. The graph is kept."""

    def one(vector: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(output, inputs, grad_outputs=vector, retain_graph=True, allow_unused=True)

    return torch.func.vmap(one)(grad_outputs)


def _folded(tensor: torch.Tensor, batch_dim: int | None, size: int, sequences: int) -> torch.Tensor:
    """``tensor`` [N, ...] (or [size, N, ...] physically, the directions at ``batch_dim``) as
    [size * N, ...]: the directions folded into the kernel's batch of sequences."""
    tensor = tensor.expand(size, *tensor.shape) if batch_dim is None else tensor.movedim(batch_dim, 0)
    tensor = tensor.expand(size, sequences, *tensor.shape[2:])
    return tensor.reshape(size * sequences, *tensor.shape[2:])


def _folded_mask(mask: torch.Tensor, batch_dim: int | None, size: int, sequences: int) -> torch.Tensor:
    """The mask for the folded batch: as it is when it broadcasts over sequences and directions alike,
    else per folded sequence."""
    if batch_dim is None and (mask.dim() < _ATTENTION_DIMS or mask.shape[0] == 1):
        return mask
    mask = mask.movedim(batch_dim, 0) if batch_dim is not None else mask[None]
    while mask.dim() < _ATTENTION_DIMS + 1:  # the leading dims it broadcasts over, made explicit
        mask = mask.unsqueeze(1)
    return _folded(mask, 0, size, sequences)


def _batched_flash_cpu_backward(keyset, *args, attn_mask=None, scale=None):
    """vmap's rule: unwrap the directions' level, one kernel call on the folded batch, wrap the grads."""
    op = getattr(torch.ops.aten, _FLASH_CPU_BACKWARD).default
    interpreter = retrieve_current_functorch_interpreter()
    assert isinstance(interpreter, VmapInterpreter)  # registered under FuncTorchBatched: vmap's only
    level, size = interpreter.level(), interpreter.batch_size()
    unwrapped = [_unwrap_batched(a, level) if isinstance(a, torch.Tensor) else (a, None) for a in args]
    mask, mask_dim = _unwrap_batched(attn_mask, level) if attn_mask is not None else (None, None)
    tensors, dims = zip(*unwrapped[:_TENSOR_ARGS], strict=True)
    others = [a for a, _ in unwrapped[_TENSOR_ARGS:]]
    with _outside_this_level():
        if all(d is None for d in dims) and mask_dim is None:  # nothing batched at this level
            return op(*tensors, *others, attn_mask=mask, scale=scale)
        grad_out, grad_dim = unwrapped[0]
        sequences = grad_out.shape[1] if grad_dim == 0 else grad_out.shape[0]  # N of [N, heads, L, E]
        folded = [_folded(t, d, size, sequences) for t, d in zip(tensors, dims, strict=True)]
        if mask is not None:
            mask = _folded_mask(mask, mask_dim, size, sequences)
        grads = op(*folded, *others, attn_mask=mask, scale=scale)
    return tuple(_add_batch_dim(g.reshape(size, sequences, *g.shape[1:]), 0, level) for g in grads)


# backward(grad, saved, ...) = grad * derivative(saved): the saved tensor is the input (silu, gelu) or
# the output (tanh, sigmoid)
_ACTIVATION_BACKWARDS = ("silu_backward", "gelu_backward", "tanh_backward", "sigmoid_backward")


def _activation_rule(name: str):
    op = getattr(torch.ops.aten, name).default

    def rule(keyset, grad_output, saved, **kwargs):
        """vmap's rule: where only the gradient is batched, the derivative formed once and multiplied;
        else the kernel on the batch, as functorch's own rule calls it."""
        level = retrieve_current_functorch_interpreter().level()
        grad, grad_dim = _unwrap_batched(grad_output, level)
        value, value_dim = _unwrap_batched(saved, level)
        with _outside_this_level():
            if value_dim is None:
                if grad_dim is None:  # nothing batched at this level
                    return op(grad, value, **kwargs)
                derivative = op(torch.ones_like(value), value, **kwargs)
                return _add_batch_dim(grad.movedim(grad_dim, 0) * derivative, 0, level)
            value = value.movedim(value_dim, 0)
            grad = grad.movedim(grad_dim, 0) if grad_dim is not None else grad.expand(value.shape)
            return _add_batch_dim(op(grad, value, **kwargs), 0, level)

    return rule


def _register() -> torch.library.Library | None:
    """The rules (without what they are written with, functorch's own: slower, as exact). The attention
    rule unless this torch has its own; the activations' replace functorch's."""
    if not _INTERNALS:
        return None
    library = torch.library.Library("aten", "IMPL")
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_FLASH_CPU_BACKWARD}", "FuncTorchBatched"):
        library.impl(_FLASH_CPU_BACKWARD, _batched_flash_cpu_backward, "FuncTorchBatched", with_keyset=True)
    with warnings.catch_warnings():  # torch warns that a kernel it has is overridden: here on purpose
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        for name in _ACTIVATION_BACKWARDS:
            library.impl(name, _activation_rule(name), "FuncTorchBatched", with_keyset=True)
    return library


_LIBRARY = _register()  # held: the registration lasts as long as the library object
