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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from workers.fisher.capture import UnsupportedArchitecture, capture_forward
from workers.fisher.directions import LinearGroup, SquareGroup, backprop_directions
from workers.fisher.first_moments import Factored, FirstMoment, in_piece, row_pieces
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


# values compared at a time: the difference is taken in float64, and a whole embedding table's worth of
# float64 temporaries was 5 GB of Qwen3-0.6B's certificate
COMPARED_AT_ONCE = 1 << 22


def _difference_and_scale(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |want|), the difference in float64, a slice of values at a time."""
    got, want = got.reshape(-1), want.reshape(-1)
    difference = scale = 0.0
    for start in range(0, want.numel(), COMPARED_AT_ONCE):
        part = slice(start, start + COMPARED_AT_ONCE)
        difference = max(difference, float((got[part].double() - want[part].double()).abs().max()))
        scale = max(scale, float(want[part].abs().max()))
    return difference, scale


def _larger(before: tuple[float, float] | None, now: tuple[float, float]) -> tuple[float, float]:
    """Two blocks' (max |difference|, max |expected|) as one, NaN kept."""
    if before is None:
        return now
    return _largest([before[0], now[0]]), _largest([before[1], now[1]])


def _formed(entry: Factored | torch.Tensor) -> torch.Tensor:
    return entry.form() if isinstance(entry, Factored) else entry


def _relative_errors(found: dict[str, tuple[float, float]], dtype: torch.dtype) -> dict[str, float]:
    """max |got - want| / max |want| per tensor, from each tensor's pair of maxima.

    The denominator is floored at the rounding level of the whole computation: a tensor whose
    sensitivity is zero up to rounding (OPT's key biases: softmax ignores a shift shared by every key)
    carries noise of about eps x the largest tensor in both computations, which says nothing about
    either. Float64: 1e-6 of the largest tensor; float32: 1.2e-2 of it.
    """
    scale = max((want for _, want in found.values()), default=0.0)
    floor = max(scale * min(0.1, max(1e-6, 1e5 * torch.finfo(dtype).eps)), torch.finfo(torch.float64).tiny)
    return {name: difference / max(want, floor) for name, (difference, want) in found.items()}


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
        # read and freed tensor by tensor (``_Compared``): not one array, held until the last
        [SquareGroup("square", v[None], torch.ones(1, dtype=torch.float64), in_one_array=False)],
        [LinearGroup("first", v)],
        [],
        memory_budget_bytes=memory_budget_bytes,
    )
    head = HeadTerms(layout, capture.hidden[position].detach(), jacobian.head_scale())
    engine_first = head.first_moment(results.linears.get("first"), u)
    head_only = head.first_moment(None, u)
    engine_square = head.second_moment(results.squares.get("square"), torch.zeros_like(u))
    del capture, results
    compared = _Compared(head_only, engine_first, engine_square)
    _each_autograd_gradient(model, ids, u, compared.visit)
    compared.judge(
        [name for name, _ in model.named_parameters()], next(model.parameters()).dtype, certificate
    )


_CHECKED = (
    "autograd's sensitivities",
    "autograd's squared input-side sensitivities",
    "the engine's first moments",
    "the engine's squares",
)


class _Compared:
    """The engine's first moments and squares against autograd's, tensor by tensor as autograd's
    gradient of each arrives: neither side is ever held whole but the engine's squares (the one
    parameter-sized sum), and each tensor's pair is let go once compared; a large tensor (the embedding
    table) is compared a block of rows at a time, so that what is formed of it is a block's. What is
    kept per tensor: the largest difference and the largest expected value, for errors relative to the
    whole model's."""

    def __init__(self, head_only: FirstMoment, engine_first: FirstMoment, engine_square) -> None:
        self.head_only = head_only
        self.engine_first = engine_first
        self.engine_square: dict[str, torch.Tensor] = engine_square
        self.firsts: dict[str, tuple[float, float]] = {}  # name -> (max |difference|, max |expected|)
        self.squares: dict[str, tuple[float, float]] = {}
        # what was checked -> the tensors of it that are not finite -> how many NaN and infinite values
        self.non_finite: dict[str, dict[str, tuple[int, int]]] = {label: {} for label in _CHECKED}
        self.numel: dict[str, int] = {}

    def visit(self, name: str, plain: torch.Tensor) -> None:
        got_square = self.engine_square.pop(name)
        head, first = self.head_only.entry(name), self.engine_first.entry(name)
        self.numel[name] = plain.numel()
        for piece in row_pieces(name, tuple(plain.shape)).values():
            self._visit(
                name,
                in_piece(plain, piece),
                in_piece(head, piece),
                in_piece(first, piece),
                in_piece(got_square, piece),
            )

    def _visit(
        self,
        name: str,
        plain: torch.Tensor,
        head: Factored | torch.Tensor,
        first: Factored | torch.Tensor,
        got_square: torch.Tensor,
    ) -> None:
        # the input side: autograd's less the head's closed form, which only the head's tensors have
        closed_form = isinstance(head, Factored) and bool(head.terms)
        input_side = plain - _formed(head).to(plain.dtype) if closed_form else plain
        want_square = input_side.square()
        got_first = _formed(first)
        for label, tensor in zip(_CHECKED, (plain, want_square, got_first, got_square), strict=True):
            if not bool(torch.isfinite(tensor).all()):
                nan, inf = self.non_finite[label].get(name, (0, 0))
                self.non_finite[label][name] = (
                    nan + int(torch.isnan(tensor).sum()),
                    inf + int(torch.isinf(tensor).sum()),
                )
        if plain.numel():
            self.firsts[name] = _larger(self.firsts.get(name), _difference_and_scale(got_first, plain))
            self.squares[name] = _larger(
                self.squares.get(name), _difference_and_scale(got_square, want_square)
            )

    def judge(self, names: list[str], dtype: torch.dtype, certificate: Certificate) -> None:
        """The certificate's verdict: the first non-finite tensor (by what was checked, then the model's
        order), else the largest relative error against the tolerance."""
        for label in _CHECKED:
            failing = self.non_finite[label]
            if failing:
                name = next(n for n in names if n in failing)
                words = _non_finite_words(*failing[name], self.numel[name])
                _fail_at(certificate, name, f"{label} of {name} are not finite ({words})")
                return
        firsts = _relative_errors(self.firsts, dtype)
        squares = _relative_errors(self.squares, dtype)
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
    return _non_finite_words(int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum()), tensor.numel())


def _non_finite_words(nan: int, inf: int, numel: int) -> str:
    parts = [f"{nan} NaN"] * bool(nan) + [f"{inf} infinite"] * bool(inf)
    return f"{' and '.join(parts)} of {numel} values"


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


def _each_autograd_gradient(
    model: nn.Module, ids: torch.Tensor, u: torch.Tensor, visit: Callable[[str, torch.Tensor], None]
) -> None:
    """``visit(name, d(u^T z)/dtheta)`` at the last position, by one ordinary backward through the
    unmodified model, for each parameter as its gradient is accumulated (a parameter the output does
    not reach: zeros); the gradient is let go after its visit, so that the whole is never held."""
    named = list(model.named_parameters())
    seen: set[str] = set()

    def arrived(name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            assert param.grad is not None
            visit(name, param.grad)
            seen.add(name)
            param.grad = None

        return hook

    for _, param in named:
        param.grad = None
    handles = [param.register_post_accumulate_grad_hook(arrived(name)) for name, param in named]
    try:
        with torch.enable_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
            (logits @ u.to(logits.dtype)).backward()
    finally:
        for handle in handles:
            handle.remove()
        for _, param in named:
            param.grad = None
    for name, param in named:
        if name not in seen:
            visit(name, torch.zeros_like(param))
