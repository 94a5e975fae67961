"""The certificate of DESIGN.md 3a: before a model is analysed, show that the engine is exact on it.

(1) The recorded forward reproduces the model's own logits. (2) For a random direction u over the
vocabulary at the last position, the engine's first moments d(u^T z)/dtheta (LM-head closed form and
logit map included) and its input-side squares (d(v^T h)/dtheta)^2 with v = J^T u equal one plain
autograd backward through the unmodified model, tensor by tensor, within a tolerance set by the
dtype. A model that fails is refused with the module of its worst tensor named.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from workers.fisher.capture import UnsupportedArchitecture, capture_forward
from workers.fisher.directions import LinearGroup, SquareGroup, backprop_directions
from workers.fisher.logit_map import logit_jacobian
from workers.fisher.position import HeadLayout, HeadTerms, head_rows

# max relative error per tensor: rounding of the same sums taken in another order, per dtype
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
CERTIFICATE_TOKENS = 8


@dataclass
class Certificate:
    passed: bool
    dtype: str
    tolerance: float
    logits_error: float | None = None
    first_moment_error: float | None = None
    square_error: float | None = None
    worst_parameter: str | None = None
    failing_module: str | None = None
    reason: str | None = None
    routes: dict[str, int] = field(default_factory=dict)  # how many tensors each path forms
    autograd_matrices: list[str] = field(default_factory=list)  # >= 2-D tensors without a fast form
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Certificate:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})

    def line(self) -> str:
        """One line for a terminal: the verdict, the errors against autograd, the paths used."""
        if not self.passed:
            return f"refused: {self.reason}"
        paths = ", ".join(f"{count} {route}" for route, count in sorted(self.routes.items()))
        slow = f"; autograd path for {len(self.autograd_matrices)} matrices" if self.autograd_matrices else ""
        return (
            f"exact ({self.dtype}): logits {self.logits_error:.1e}, first moments "
            f"{self.first_moment_error:.1e}, squares {self.square_error:.1e} max relative error "
            f"(tolerance {self.tolerance:g}); tensors by path: {paths}{slow}"
        )


def _relative_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, float]:
    """max |got - want| / max |want| per tensor.

    The denominator is floored at the rounding level of the whole computation: a tensor whose
    sensitivity is zero up to rounding (OPT's key biases: softmax ignores a shift shared by every key)
    carries noise of about eps x the largest tensor in both computations, which says nothing about
    either. Float64: 1e-6 of the largest tensor; float32: 1.2e-2 of it.
    """
    scale = max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)
    floor = max(scale * min(0.1, max(1e-6, 1e5 * torch.finfo(dtype).eps)), torch.finfo(torch.float64).tiny)
    return {
        name: float((got[name].double() - w.double()).abs().max()) / max(float(w.abs().max()), floor)
        for name, w in want.items()
        if w.numel()
    }


def certify(
    model: nn.Module,
    memory_budget_bytes: int,
    tokens: int = CERTIFICATE_TOKENS,
    tolerance: float | None = None,
) -> Certificate:
    """Check the engine against plain autograd on ``model`` as it is (eval mode, its own dtype).

    ``tolerance`` replaces the dtype's own where the arithmetic is knowingly coarser (TF32 matmuls).
    """
    started = time.perf_counter()
    dtype = next(model.parameters()).dtype
    tolerance = tolerance if tolerance is not None else TOLERANCES.get(dtype, 5e-2)
    certificate = Certificate(passed=False, dtype=str(dtype).removeprefix("torch."), tolerance=tolerance)
    try:
        _check(model, tokens, memory_budget_bytes, certificate)
    except UnsupportedArchitecture as error:
        certificate.reason = str(error)
    except RuntimeError as error:  # autograd cannot differentiate something in the forward
        certificate.reason = f"the forward cannot be differentiated: {' '.join(str(error).split())[:300]}"
    certificate.seconds = time.perf_counter() - started
    return certificate


def _check(model: nn.Module, tokens: int, memory_budget_bytes: int, certificate: Certificate) -> None:
    layout = HeadLayout.of(model)
    device = next(model.parameters()).device
    vocab = int(head_rows(model).shape[0])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    with torch.no_grad():
        plain_logits = model(input_ids=ids[None], use_cache=False).logits[0]
    capture = capture_forward(model, ids)
    certificate.routes = dict(Counter(capture.routes.values()))
    certificate.autograd_matrices = [n for n in capture.generic if len(capture.shapes[n]) >= 2]
    logits = capture.logits[0].detach()
    certificate.logits_error = float((logits - plain_logits).abs().max() / plain_logits.abs().max())
    if certificate.logits_error > certificate.tolerance:
        certificate.reason = (
            f"the recorded forward does not reproduce the model's logits (max relative error "
            f"{certificate.logits_error:.2g}); is the model deterministic in eval mode?"
        )
        return
    position = capture.length - 1
    jacobian = logit_jacobian(capture, position, head_rows(model))
    u = torch.randn(vocab, generator=generator, dtype=torch.float64).to(device)
    u /= u.norm()
    v = jacobian.combine(u)  # J^T u
    results = backprop_directions(
        capture,
        position,
        [SquareGroup("square", v[None], torch.ones(1, dtype=torch.float64))],
        [LinearGroup("first", v)],
        [],
        memory_budget_bytes=memory_budget_bytes,
    )
    head = HeadTerms(layout, capture.hidden[position].detach(), jacobian.head_scale())
    engine_first = head.assemble(results.linears.get("first"), u)
    head_only = head.assemble(None, u)
    engine_square = head.assemble(results.squares.get("square"), torch.zeros_like(u), squared=True)
    del capture

    plain = _autograd_gradient(model, ids, u)
    input_side = {name: plain[name] - head_only[name].to(plain[name].dtype) for name in plain}
    dtype = next(model.parameters()).dtype
    firsts = _relative_errors(engine_first, plain, dtype)
    squares = _relative_errors(engine_square, {n: g.square() for n, g in input_side.items()}, dtype)
    certificate.first_moment_error = max(firsts.values())
    certificate.square_error = max(squares.values())
    worst_name, worst = max(
        ((n, max(firsts[n], squares.get(n, 0.0))) for n in firsts), key=lambda item: item[1]
    )
    certificate.worst_parameter = worst_name
    if worst > certificate.tolerance:
        certificate.failing_module = worst_name.rsplit(".", 1)[0]
        certificate.reason = (
            f"module {certificate.failing_module}: the engine's sensitivities of {worst_name} differ "
            f"from autograd by {worst:.2g} (relative, tolerance {certificate.tolerance:g}); the module "
            "uses its parameters in a way the engine does not see"
        )
        return
    certificate.passed = True


def _autograd_gradient(model: nn.Module, ids: torch.Tensor, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(u^T z)/dtheta at the last position by one ordinary backward through the unmodified model."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    with torch.enable_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
        grads = torch.autograd.grad(logits @ u.to(logits.dtype), params, allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads, strict=True)}
