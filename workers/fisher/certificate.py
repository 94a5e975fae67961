"""The certificate of docs/design.md §3a: before a model is analysed, show that the engine is exact on it.

(0) Every parameter is finite, and the model is causal by behaviour: changing later tokens leaves
the logits at earlier positions as they were (an encoder with bidirectional attention fails here,
whatever its class is called). (1) The recorded forward reproduces the model's own logits. (2) For a
random direction u over the vocabulary at the last position, the engine's first moments
d(u^T z)/dtheta (LM-head closed form and logit map included) and its input-side squares
(d(v^T h)/dtheta)^2 with v = J^T u equal one plain autograd backward through the unmodified model,
tensor by tensor, within a tolerance set by the dtype. Every comparison is written so that NaN fails
(``not err <= tol``) and every number compared is first checked to be finite: ``NaN > tol`` is
False, and a model with a NaN weight must never read as exact. A model that fails is refused with
the module of its worst (or first non-finite) tensor named.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
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


def _error_floor(scale: float, dtype: torch.dtype) -> float:
    """The denominator's floor of ``_relative_error``, at the rounding level of the whole computation:
    a tensor whose sensitivity is zero up to rounding (OPT's key biases: softmax ignores a shift shared
    by every key) carries noise of about eps x the largest tensor (``scale``) in both computations,
    which says nothing about either. Float64: 1e-6 of the largest tensor; float32: 1.2e-2 of it."""
    return max(scale * min(0.1, max(1e-6, 1e5 * torch.finfo(dtype).eps)), torch.finfo(torch.float64).tiny)


def _relative_error(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """max |got - want| / max |want| (floored, ``_error_floor``)."""
    return float((got.double() - want.double()).abs().max()) / max(float(want.abs().max()), floor)


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
    if _refuse_non_finite_parameters(model, certificate):
        return
    device = next(model.parameters()).device
    vocab = int(head_rows(model).shape[0])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    plain_logits = _plain_logits(model, ids)
    if _refuse_non_finite_logits(model, ids, plain_logits, certificate):
        return
    certificate.reason = _causality_failure(model, ids, plain_logits, vocab, certificate.tolerance)
    if certificate.reason is not None:
        return
    _compare_with_autograd(model, ids, plain_logits, generator, memory_budget_bytes, certificate)


def _plain_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0]


def _compare_with_autograd(
    model: nn.Module,
    ids: torch.Tensor,
    plain_logits: torch.Tensor,
    generator: torch.Generator,
    memory_budget_bytes: int,
    certificate: Certificate,
) -> None:
    """Steps (1) and (2): the recorded forward, then the engine's moments against one backward."""
    layout = HeadLayout.of(model)
    vocab = plain_logits.shape[-1]
    capture = capture_forward(model, ids)
    certificate.routes = dict(Counter(capture.routes.values()))
    certificate.autograd_matrices = [n for n in capture.generic if len(capture.shapes[n]) >= 2]
    logits = capture.logits[0].detach()
    if not bool(torch.isfinite(logits).all()):
        certificate.reason = (
            f"the recorded forward's logits are not finite ({_non_finite_summary(logits)}) where the "
            "model's own are; is the model deterministic in eval mode?"
        )
        return
    certificate.logits_error = _relative_difference(logits, plain_logits)
    if not certificate.logits_error <= certificate.tolerance:
        certificate.reason = (
            f"the recorded forward does not reproduce the model's logits (max relative error "
            f"{certificate.logits_error:.2g}); is the model deterministic in eval mode?"
        )
        return
    position = capture.length - 1
    jacobian = logit_jacobian(capture, position, head_rows(model))
    u = torch.randn(vocab, generator=generator, dtype=torch.float64).to(ids.device)
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
    engine_first = head.first_moment(results.linears.get("first"), u)
    head_only = head.first_moment(None, u)
    engine_square = head.second_moment(results.squares.get("square"), torch.zeros_like(u))
    del capture, results
    plain = _autograd_gradient(model, ids, u)
    _compare_moments(model, plain, head_only, engine_first, engine_square, certificate)


def _compare_moments(
    model: nn.Module,
    plain: dict[str, torch.Tensor],
    head_only: Mapping[str, torch.Tensor],
    engine_first: Mapping[str, torch.Tensor],
    engine_square: dict[str, torch.Tensor],
    certificate: Certificate,
) -> None:
    """The engine's first moments and squares against autograd's, tensor by tensor: the expected
    squares and the engine's first moments are formed one tensor at a time (each is a copy of the
    model in all), and each pair is let go once compared."""

    def want_square(name: str) -> torch.Tensor:  # the input side: autograd's less the head's closed form
        return (plain[name] - head_only[name].to(plain[name].dtype)).square()

    for label, tensor_of in (
        ("autograd's sensitivities", plain.__getitem__),
        ("autograd's squared input-side sensitivities", want_square),
        ("the engine's first moments", engine_first.__getitem__),
        ("the engine's squares", engine_square.__getitem__),
    ):
        if _refuse_non_finite_tensors(certificate, label, plain, tensor_of):
            return
    dtype = next(model.parameters()).dtype
    first_floor = _error_floor(
        max((float(g.abs().max()) for g in plain.values() if g.numel()), default=0.0), dtype
    )
    square_floor = _error_floor(
        max((float(want_square(n).max()) for n, g in plain.items() if g.numel()), default=0.0), dtype
    )
    firsts: dict[str, float] = {}
    squares: dict[str, float] = {}
    for name in list(plain):
        if plain[name].numel():
            firsts[name] = _relative_error(engine_first[name], plain[name], first_floor)
            squares[name] = _relative_error(engine_square[name], want_square(name), square_floor)
        del plain[name], engine_square[name]
    certificate.first_moment_error = _largest(firsts.values())
    certificate.square_error = _largest(squares.values())
    worst_name, worst = max(
        ((n, _largest([firsts[n], squares.get(n, 0.0)])) for n in firsts), key=lambda item: item[1]
    )
    certificate.worst_parameter = worst_name
    if not worst <= certificate.tolerance:
        _fail_at(
            certificate,
            worst_name,
            f"the engine's sensitivities of {worst_name} differ from autograd by {worst:.2g} (relative, "
            f"tolerance {certificate.tolerance:g}); the module uses its parameters in a way the engine "
            "does not see",
        )
        return
    certificate.passed = True


def _largest(errors) -> float:
    """The largest error, with NaN counted as infinitely large (Python's max() may skip over it)."""
    return max((math.inf if math.isnan(e) else e for e in errors), default=0.0)


def _relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|; an all-zero ``want`` is compared absolutely, never as 0 / 0."""
    if not want.numel():
        return 0.0
    scale = max(float(want.abs().max()), torch.finfo(torch.float64).tiny)
    return float((got.double() - want.double()).abs().max()) / scale


# --- (0): finite numbers and causal behaviour -----------------------------------------------------


def _non_finite_summary(tensor: torch.Tensor) -> str:
    """How many NaN and infinite entries a tensor holds, in words."""
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    parts = [f"{nan} NaN"] * bool(nan) + [f"{inf} infinite"] * bool(inf)
    return f"{' and '.join(parts)} of {tensor.numel()} values"


def _refuse_non_finite_tensors(
    certificate: Certificate, label: str, names: Iterable[str], tensor_of: Callable[[str], torch.Tensor]
) -> bool:
    """Fail the certificate at the first parameter whose ``label`` holds a NaN or an infinity."""
    for name in names:
        tensor = tensor_of(name)
        if not bool(torch.isfinite(tensor).all()):
            _fail_at(certificate, name, f"{label} of {name} are not finite ({_non_finite_summary(tensor)})")
            return True
    return False


def _fail_at(certificate: Certificate, name: str, what: str) -> None:
    """Fail the certificate at parameter ``name``: its module is named first in the reason."""
    certificate.worst_parameter = name
    certificate.failing_module = name.rsplit(".", 1)[0]
    certificate.reason = f"module {certificate.failing_module}: {what}"


def _refuse_non_finite_parameters(model: nn.Module, certificate: Certificate) -> bool:
    """A NaN or infinite weight makes every comparison meaningless: refuse it by name first."""
    bad = [(n, p) for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if not bad:
        return False
    name, param = bad[0]
    more = f" (and {len(bad) - 1} more parameter tensors)" if len(bad) > 1 else ""
    _fail_at(
        certificate, name, f"parameter {name} is not finite ({_non_finite_summary(param.detach())}){more}"
    )
    return True


def _refuse_non_finite_logits(
    model: nn.Module, ids: torch.Tensor, logits: torch.Tensor, certificate: Certificate
) -> bool:
    """Finite weights whose logits are not (an overflow): name the first module that overflowed."""
    if bool(torch.isfinite(logits).all()):
        return False
    positions = torch.nonzero(~torch.isfinite(logits).all(-1)).flatten().tolist()
    module = _first_non_finite_output(model, ids)
    certificate.failing_module = module
    where = f"; the first non-finite output is module {module}'s" if module else ""
    certificate.reason = (
        f"the model's logits are not finite at positions {positions} ({_non_finite_summary(logits)}){where}"
    )
    return True


def _first_non_finite_output(model: nn.Module, ids: torch.Tensor) -> str | None:
    """The module whose output is non-finite first in the forward's order (hooks fire as modules end)."""
    found: list[str] = []

    def watch(name: str):
        def hook(_module, _inputs, output) -> None:
            outputs = output if isinstance(output, tuple) else (output,)
            if not found and any(
                isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                for t in outputs
            ):
                found.append(name)

        return hook

    handles = [module.register_forward_hook(watch(name)) for name, module in model.named_modules() if name]
    try:
        _plain_logits(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _causality_failure(
    model: nn.Module, ids: torch.Tensor, logits: torch.Tensor, vocab: int, tolerance: float
) -> str | None:
    """Why the model is not causal by behaviour, or None.

    The second half of the tokens is replaced: in a causal LM the logits at the first half's
    positions cannot move (up to the dtype's rounding), whatever the architecture is called; with
    bidirectional attention every position sees the change. The whole second half changes, not just
    the last token, so that the effect stays far above bfloat16's tolerance.
    """
    kept = ids.numel() // 2
    if kept < 1 or vocab < 2:
        return None
    changed = ids.clone()
    changed[kept:] = (ids[kept:] + 1) % vocab  # every later token different
    other = _plain_logits(model, changed)
    if not bool(torch.isfinite(other).all()):
        return f"the model's logits for other tokens are not finite ({_non_finite_summary(other)})"
    if other.shape != logits.shape:
        return (
            f"not a causal LM: the logits' shape changed from {tuple(logits.shape)} to "
            f"{tuple(other.shape)} when later tokens changed"
        )
    drift = _relative_difference(other[:kept], logits[:kept])
    if not drift <= tolerance:
        return (
            f"not a causal LM: the logits at positions 0-{kept - 1} change when only later tokens "
            f"change (max relative change {drift:.2g}, tolerance {tolerance:g}); models with "
            "bidirectional attention are refused"
        )
    return None


def _autograd_gradient(model: nn.Module, ids: torch.Tensor, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(u^T z)/dtheta at the last position by one ordinary backward through the unmodified model."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    with torch.enable_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
        grads = torch.autograd.grad(logits @ u.to(logits.dtype), params, allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads, strict=True)}
