"""One forward pass that keeps what the per-weight sensitivities need.

For every parameter outside the LM head, d(q^T h)/dtheta is a sum over positions of
(gradient at a module's output) x (a feature the forward pass saw): the module input for a linear
layer, the normalized input for a norm, the token one-hot for an embedding. This module runs the
decoder once, records those features, and keeps the module outputs in the autograd graph so that
many output directions q can later be back-propagated to *activations only* (never to the B x P
weight gradients).

Index conventions (einsum): ``t`` position, ``i`` module input, ``o`` module output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


class UnsupportedArchitecture(ValueError):
    """The model holds parameters in a module whose sensitivities this engine cannot form."""


@dataclass
class CapturedModule:
    """One parameter-owning module seen in the forward pass.

    kind: ``linear`` (weight [o, i], optional bias [o]), ``embedding`` (weight [V, o]) or
    ``norm`` (weight [o], optional bias [o]; y = weight * xhat + bias).
    feature: [t, i] input for linear, [t, o] normalized input for norm, [t] token ids for embedding.
    output: [1, t, o] module output exactly as the graph holds it (a view of it would be outside the
    graph that leads to h, so gradients are taken with respect to this tensor itself).
    """

    name: str
    kind: str
    module: nn.Module
    feature: torch.Tensor
    output: torch.Tensor


@dataclass
class CapturedForward:
    hidden: torch.Tensor  # [t, d] final normalized hidden states, attached to the graph
    modules: list[CapturedModule] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.hidden.shape[0])


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(
        getattr(module, "weight", None), nn.Parameter
    )


def _rms_eps(module: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    raise UnsupportedArchitecture(f"RMSNorm {type(module).__name__} has no epsilon attribute")


def _normalize_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # HF computes in float32 for low-precision inputs; float64 must stay float64 for exact references.
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xhat = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
    return xhat.to(x.dtype)


@contextlib.contextmanager
def _instrumented(decoder: nn.Module, records: list[CapturedModule]) -> Iterator[None]:
    """Hook linears, embeddings and layer norms; replace RMSNorm forwards by an exact-dtype copy."""
    handles = []
    patched: list[nn.Module] = []

    def record(name: str, kind: str, module: nn.Module, feature: torch.Tensor, output: torch.Tensor) -> None:
        # batch size is 1: drop it from the feature. [1, t, ...] -> [t, ...]
        records.append(CapturedModule(name, kind, module, feature[0].detach(), output))

    for name, module in decoder.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(
                module.register_forward_hook(lambda m, inp, out, n=name: record(n, "linear", m, inp[0], out))
            )
        elif isinstance(module, nn.Embedding):
            handles.append(
                module.register_forward_hook(
                    lambda m, inp, out, n=name: record(n, "embedding", m, inp[0], out)
                )
            )
        elif isinstance(module, nn.LayerNorm):

            def layer_norm_hook(m: nn.LayerNorm, inp: tuple, out: torch.Tensor, n: str = name) -> None:
                x = inp[0]
                xhat = nn.functional.layer_norm(x, m.normalized_shape, None, None, m.eps)
                record(n, "norm", m, xhat, out)

            handles.append(module.register_forward_hook(layer_norm_hook))
        elif _is_rms_norm(module):
            eps = _rms_eps(module)

            def rms_forward(
                x: torch.Tensor, m: nn.Module = module, n: str = name, e: float = eps
            ) -> torch.Tensor:
                xhat = _normalize_rms(x, e)
                out = module_weight(m) * xhat
                record(n, "norm", m, xhat, out)
                return out

            module.forward = rms_forward  # type: ignore[method-assign]
            patched.append(module)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del module.forward


def model_part(model: nn.Module, accessor: str) -> nn.Module:
    """``model.<accessor>()`` (HF's get_decoder, get_input_embeddings, get_output_embeddings), checked."""
    get = getattr(model, accessor, None)
    part = get() if callable(get) else None
    if not isinstance(part, nn.Module):
        raise UnsupportedArchitecture(f"{type(model).__name__} has no {accessor}()")
    return part


def module_weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise UnsupportedArchitecture(f"{type(module).__name__} has no weight tensor")
    return weight


def capture_forward(model: nn.Module, input_ids: torch.Tensor) -> CapturedForward:
    """Run the decoder on ``input_ids`` [t] and keep features and outputs of every parameter module."""
    decoder = model_part(model, "get_decoder")
    records: list[CapturedModule] = []
    with torch.enable_grad(), _instrumented(decoder, records):
        out = decoder(input_ids=input_ids[None], use_cache=False)
    hidden = out.last_hidden_state[0]  # [t, d]
    prefix = _prefix_of(model, decoder)
    for rec in records:
        rec.name = prefix + rec.name if rec.name else prefix.rstrip(".")
    return CapturedForward(hidden=hidden, modules=records)


def _prefix_of(model: nn.Module, decoder: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is decoder:
            return f"{name}." if name else ""
    raise UnsupportedArchitecture("decoder module not found inside the model")
