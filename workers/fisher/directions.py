"""Back-propagate many output directions to activations, then form per-weight moments per layer.

For a direction v in hidden space, d(v^T h)/dW for a linear y = W x is sum_t delta_t x_t^T, with
delta_t the gradient of v^T h at the layer output. Holding that for B directions and all P weights
costs B x P floats, so directions travel only to activations (one batched backward per chunk) and
each layer folds them into its own moments right away:

- a *square group* {(v_j, w_j)} accumulates sum_j w_j (d(v_j^T h)/dtheta)^2 (a Fisher),
- a *linear group* v accumulates d(v^T h)/dtheta (a first moment such as kbar),
- an *embedding-row probe* (v, c) keeps only row c of the input embedding's gradient (the tied
  cross term needs (w_c - wbar)^T u_{(c,k)} for prefix tokens c).

Squares of a linear weight are formed "direct" (materialize each direction's [o, i] gradient, cost
~ B o i t) or "ghost" (f_{o,i} = sum_{t,s} X_{t,i} X_{s,i} M_{o,t,s}, M = sum_j w_j delta_j delta_j^T,
cost ~ B o t^2 + o i t^2, memory o t^2), chosen per layer by flops within a memory budget.
Index conventions: b direction, t/s position, i module input, o module output, c token row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.fisher.capture import CapturedForward, CapturedModule, module_weight

Progress = Callable[[float], None]


@dataclass
class SquareGroup:
    name: str
    vectors: torch.Tensor  # [r, d]
    weights: torch.Tensor  # [r]


@dataclass
class LinearGroup:
    name: str
    vector: torch.Tensor  # [d]


@dataclass
class EmbeddingRowProbe:
    name: str
    token_id: int
    vector: torch.Tensor  # [d]


@dataclass
class DirectionResults:
    squares: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    linears: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    probes: dict[str, torch.Tensor] = field(default_factory=dict)  # [d] per probe


def _embedding_rows(module: CapturedModule, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Only rows of tokens present in the prefix have input-side gradient: ([c] ids, [b, c, o] rows)."""
    ids = module.feature[: delta.shape[1]]
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = delta.new_zeros(delta.shape[0], unique.numel(), delta.shape[2])
    rows.index_add_(1, inverse, delta)
    return unique, rows


def _dense_rows(module: CapturedModule, unique: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Scatter [..., c, o] token rows into a full [..., V, o] embedding-shaped tensor."""
    vocab = module_weight(module.module).shape[0]
    dense = rows.new_zeros(*rows.shape[:-2], vocab, rows.shape[-1])
    dense[..., unique, :] = rows
    return dense


def _per_direction_gradients(module: CapturedModule, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(v_b^T h)/dtheta for each direction b: {param name: [b, *param shape]}. delta: [b, t, o].

    Dense in every parameter; for embeddings use only with a handful of directions.
    """
    weight_name = f"{module.name}.weight"
    x = module.feature[: delta.shape[1]]
    grads: dict[str, torch.Tensor] = {}
    if module.kind == "linear":
        grads[weight_name] = torch.einsum("bto,ti->boi", delta, x)
    elif module.kind == "norm":
        grads[weight_name] = torch.einsum("bto,to->bo", delta, x)
    elif module.kind == "embedding":
        grads[weight_name] = _dense_rows(module, *_embedding_rows(module, delta))
    if isinstance(getattr(module.module, "bias", None), torch.Tensor):
        grads[f"{module.name}.bias"] = delta.sum(dim=1)
    return grads


def _weighted_outer_per_output(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """M[o, t, s] = sum_b w_b delta[b, t, o] delta[b, s, o], weights >= 0 (eigenvalues, 1/S)."""
    t = delta.shape[1]
    if t <= 8:  # few positions: one broadcast product beats many tiny matmuls
        return torch.tensordot(weights, delta[:, :, None, :] * delta[:, None, :, :], dims=1).permute(2, 0, 1)
    scaled = (delta * weights.clamp_min(0).sqrt()[:, None, None]).permute(2, 1, 0).contiguous()  # [o, t, b]
    return torch.bmm(scaled, scaled.transpose(1, 2))


class _SquareAccumulator:
    """sum_j w_j (d(v_j^T h)/dtheta)^2 for one square group, every captured module."""

    def __init__(self, capture: CapturedForward, length: int, directions: int, ghost_budget_bytes: int):
        self.capture = capture
        self.length = length
        self.sums: dict[str, torch.Tensor] = {}
        self.ghost: dict[int, torch.Tensor] = {}  # module index -> M [o, t, s]
        budget = ghost_budget_bytes
        for index, module in enumerate(capture.modules):
            if module.kind != "linear":
                continue
            out, inp = module_weight(module.module).shape
            t = length
            direct_flops = directions * 2 * t * out * inp + directions * out * inp
            ghost_flops = directions * 2 * out * t * t + 2 * out * inp * t * t
            ghost_bytes = out * t * t * module.feature.element_size()
            if ghost_flops < direct_flops and ghost_bytes <= budget:
                budget -= ghost_bytes
                self.ghost[index] = module.feature.new_zeros(out, t, t)

    def add(self, index: int, module: CapturedModule, delta: torch.Tensor, weights: torch.Tensor) -> None:
        if index in self.ghost:
            self.ghost[index] += _weighted_outer_per_output(delta, weights)
            bias = getattr(module.module, "bias", None)
            if isinstance(bias, torch.Tensor):
                self._add(f"{module.name}.bias", torch.einsum("b,bo->o", weights, delta.sum(1).square()))
            return
        if module.kind == "embedding":
            unique, rows = _embedding_rows(module, delta)
            value = torch.einsum("b,bco->co", weights, rows.square())
            self._add(f"{module.name}.weight", _dense_rows(module, unique, value))
            return
        for name, grad in _per_direction_gradients(module, delta).items():
            self._add(name, torch.einsum("b,b...->...", weights, grad.square()))

    def _add(self, name: str, value: torch.Tensor) -> None:
        if name in self.sums:
            self.sums[name] += value
        else:
            self.sums[name] = value

    def finalize(self) -> dict[str, torch.Tensor]:
        for index, m in self.ghost.items():
            module = self.capture.modules[index]
            x = module.feature[: self.length]  # [t, i]
            pairs = (x[:, None, :] * x[None, :, :]).reshape(-1, x.shape[1])  # [t*s, i]
            self._add(f"{module.name}.weight", m.reshape(m.shape[0], -1) @ pairs)
        self.ghost.clear()
        return self.sums


def _chunk_size(capture: CapturedForward, length: int, memory_budget_bytes: int) -> int:
    width = sum(int(m.output.shape[-1]) for m in capture.modules)
    per_direction = length * width * capture.hidden.element_size() * 4  # grads + backward temporaries
    return max(1, min(256, memory_budget_bytes // max(per_direction, 1)))


def backprop_directions(
    capture: CapturedForward,
    position: int,
    squares: list[SquareGroup],
    linears: list[LinearGroup],
    probes: list[EmbeddingRowProbe],
    memory_budget_bytes: int = 1 << 30,
    progress: Progress | None = None,
) -> DirectionResults:
    """Run every direction from h[position] back to the activations and fold them per layer."""
    length = position + 1  # causal: nothing after ``position`` reaches h[position]
    hidden = capture.hidden[position]
    outputs = [m.output for m in capture.modules]
    dtype = hidden.dtype

    # one row per direction: (kind, group index, weight)
    rows: list[tuple[str, int, float | None]] = []
    vectors: list[torch.Tensor] = []
    for g, group in enumerate(squares):
        rows.extend(("square", g, None) for _ in range(group.vectors.shape[0]))
        vectors.append(group.vectors.to(dtype))
    for g, linear in enumerate(linears):
        rows.append(("linear", g, None))
        vectors.append(linear.vector.to(dtype)[None])
    for g, probe in enumerate(probes):
        rows.append(("probe", g, None))
        vectors.append(probe.vector.to(dtype)[None])
    if not rows:
        return DirectionResults()
    all_vectors = torch.cat(vectors, 0)  # [B, d]
    square_weights = [group.weights.to(dtype) for group in squares]
    square_offsets = _offsets([group.vectors.shape[0] for group in squares])

    accumulators = [
        _SquareAccumulator(
            capture, length, group.vectors.shape[0], memory_budget_bytes // max(len(squares), 1)
        )
        for group in squares
    ]
    results = DirectionResults()
    chunk = _chunk_size(capture, length, memory_budget_bytes)
    total = len(rows)
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        grads = torch.autograd.grad(
            hidden,
            outputs,
            grad_outputs=all_vectors[start:stop],
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )
        for index, (module, grad) in enumerate(zip(capture.modules, grads, strict=True)):
            if grad is None:
                continue
            delta = grad[:, 0, :length]  # [b, t, o]
            _fold_chunk(
                index,
                module,
                delta,
                rows[start:stop],
                start,
                squares,
                square_offsets,
                square_weights,
                accumulators,
                linears,
                probes,
                results,
            )
        if progress is not None:
            progress(stop / total)
    for group, acc in zip(squares, accumulators, strict=True):
        results.squares[group.name] = acc.finalize()
    return results


def _offsets(sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def _fold_chunk(
    index: int,
    module: CapturedModule,
    delta: torch.Tensor,
    rows: list[tuple[str, int, float | None]],
    start: int,
    squares: list[SquareGroup],
    square_offsets: list[int],
    square_weights: list[torch.Tensor],
    accumulators: list[_SquareAccumulator],
    linears: list[LinearGroup],
    probes: list[EmbeddingRowProbe],
    results: DirectionResults,
) -> None:
    kinds = [kind for kind, _, _ in rows]
    for g, acc in enumerate(accumulators):
        # a group's rows are one contiguous range: slice it (a view) rather than gather a copy
        lo = max(square_offsets[g], start)
        hi = min(square_offsets[g] + len(square_weights[g]), start + len(rows))
        if lo >= hi:
            continue
        weights = square_weights[g][lo - square_offsets[g] : hi - square_offsets[g]]
        acc.add(index, module, delta[lo - start : hi - start], weights)
    if "linear" in kinds:
        local = [b for b, (kind, _, _) in enumerate(rows) if kind == "linear"]
        grads = _per_direction_gradients(module, delta[torch.tensor(local)])
        for pos, b in enumerate(local):
            name = linears[rows[b][1]].name
            target = results.linears.setdefault(name, {})
            for pname, grad in grads.items():
                target[pname] = target[pname] + grad[pos] if pname in target else grad[pos].clone()
    if "probe" in kinds and module.kind == "embedding":
        ids = module.feature[: delta.shape[1]]
        for b, (kind, gi, _) in enumerate(rows):
            if kind != "probe":
                continue
            probe = probes[gi]
            row = delta[b][ids == probe.token_id].sum(0)  # [o]
            results.probes[probe.name] = results.probes.get(probe.name, 0) + row
