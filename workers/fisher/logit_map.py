"""The logit Jacobian J = dz/dh at one position (docs/design.md §3a).

Whatever a model does after its LM head belongs to the logits: z = g(l), l = W h (+ b), with g
elementwise (Gemma 2's final softcapping c tanh(l / c), a logit scale). Then every parameter outside
the head has kappa_{i,a} = j_a^T u_i with rows j_a = g'(l_a) w_a, and the head's own rows are closed
form with g'(l_c). g' is read off the model's graph by one backward from z to l, and g is checked to
be elementwise by a second one before anything uses it; a plain linear head has g' = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.fisher.capture import CapturedForward, UnsupportedArchitecture

# float64 rows per block: a block stays in cache and nothing [V, d] is allocated (1024 was the fastest of
# 256 to 2048 on SmolLM2's head)
ROWS_PER_BLOCK = 1024


@dataclass
class LogitJacobian:
    """Rows j_a = scale_a w_a of J (V x d); ``scale`` is None when z = l."""

    weight: torch.Tensor  # [V, d] LM-head rows, detached
    scale: torch.Tensor | None  # [V] float64 g'(l_a)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def head_scale(self) -> torch.Tensor:
        """[V] float64 g'(l): the factor of the head's own closed form (ones for a linear head, one value
        seen V times: each response position's record keeps it, 1.2 MB at Qwen3's vocabulary). Read only."""
        if self.scale is None:
            return torch.ones(1, dtype=torch.float64, device=self.weight.device).expand(self.vocab_size)
        return self.scale

    def rows(self, index: torch.Tensor | list[int] | int) -> torch.Tensor:
        """j_a for the given token ids, float64: [n, d] (or [d] for one int)."""
        rows = self.weight[index].to(torch.float64)
        if self.scale is None:
            return rows
        scale = self.scale[index]
        return rows * (scale[..., None] if rows.dim() > 1 else scale)

    def combine(self, coefficients: torch.Tensor) -> torch.Tensor:
        """sum_a c_a j_a for c [V] float64: [d] float64 (only tokens with c_a != 0 are read), a block of
        rows at a time: a full-support c (a mean shift mu - p) made the whole head float64 at once, a
        fresh [V, d] array per call."""
        support = (coefficients != 0).nonzero()[:, 0]
        out = torch.zeros(self.weight.shape[1], dtype=torch.float64, device=self.weight.device)
        for lo in range(0, support.numel(), ROWS_PER_BLOCK):
            index = support[lo : lo + ROWS_PER_BLOCK]
            out += coefficients[index] @ self.rows(index)
        return out


def logit_jacobian(capture: CapturedForward, position: int, weight: torch.Tensor) -> LogitJacobian:
    """J at ``position`` for head rows ``weight`` [V, d], g' from the captured graph (checked elementwise)."""
    if capture.logits is capture.head_output:
        return LogitJacobian(weight.detach(), None)
    z = capture.logits[0, position]
    ones = torch.ones_like(z)
    (grad,) = torch.autograd.grad(z, capture.head_output, grad_outputs=ones, retain_graph=True)
    scale = grad[0, position].to(torch.float64)
    probe = torch.randn(z.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (seen,) = torch.autograd.grad(z, capture.head_output, grad_outputs=probe.to(z), retain_graph=True)
    expected = torch.zeros_like(seen, dtype=torch.float64)
    expected[0, position] = probe.to(scale.device) * scale
    error = float((seen.to(torch.float64) - expected).abs().max())
    tolerance = 1e3 * torch.finfo(z.dtype).eps * float(expected.abs().max().clamp_min(1e-30))
    if error > tolerance:
        raise UnsupportedArchitecture(
            "the logits are not an elementwise function of the LM head's output "
            f"(off by {error:.3g}); the engine needs z = g(W h + b) with g elementwise"
        )
    return LogitJacobian(weight.detach(), scale)
