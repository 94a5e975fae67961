"""The batched backward of many directions: per-direction gradients exactly, with no per-direction loop.

torch's vmap falls back to one call per direction (and warns) for an op without a batching rule; the
CPU flash-attention backward is given one in ``workers.fisher.batched_backward``. Each family is run
through ``scaled_dot_product_attention`` as transformers loads it (Mistral and Gemma 3 with sliding
windows, so the kernel gets a mask), in float64 so that a different rounding order (vmapped layer norm
sums differently) stays far below the tolerance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.tiny_models import FAMILIES, tiny_model
from workers.fisher.batched_backward import batched_grad
from workers.fisher.capture import capture_forward
from workers.fisher.directions import direction_targets, first_chunk_directions

IDS = torch.tensor([4, 9, 2, 4, 7, 12, 5])
FALLBACK = "performance drop because we have not yet implemented the batching rule"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_direction_gets_its_own_gradient_with_no_per_direction_fallback(family):
    model = tiny_model(family)
    capture = capture_forward(model, IDS)
    hidden, targets = capture.hidden[-1], direction_targets(capture)
    vectors = torch.randn(5, hidden.shape[0], generator=torch.Generator().manual_seed(0), dtype=hidden.dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batched = batched_grad(hidden, targets, vectors)
    assert not [str(w.message) for w in caught if FALLBACK in str(w.message)]
    for b, vector in enumerate(vectors):
        alone = torch.autograd.grad(
            hidden, targets, grad_outputs=vector, retain_graph=True, allow_unused=True
        )
        for got, want in zip(batched, alone, strict=True):
            assert (got is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-14)


def test_the_attention_rule_is_bit_for_bit_the_kernel_called_per_direction():
    """The rule folds the directions into the kernel's batch: each gets the bits a call of its own gives."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=generator, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.randn(7, *out.shape, generator=generator)
    batched = batched_grad(out, [q, k, v], grads)
    for b in range(grads.shape[0]):
        alone = torch.autograd.grad(out, [q, k, v], grad_outputs=grads[b], retain_graph=True)
        for got, want in zip(batched, alone, strict=True):
            assert torch.equal(got[b], want)


def _attention(generator, sequences=1, heads=4, kv_heads=4, length=6, source=6):
    shape = (sequences, heads, length, 8)
    q = torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(
            sequences, kv_heads, source, 8, generator=generator, dtype=torch.float64, requires_grad=True
        )
        for _ in range(2)
    )
    return q, k, v


@pytest.mark.parametrize(
    "case",
    ["2-D mask", "4-D mask per sequence", "boolean mask per head", "grouped kv heads", "scale", "L != S"],
)
def test_the_attention_rule_handles_masks_heads_and_scales(case):
    """Each direction's gradient equals its own backward, whatever broadcasting the mask does."""
    generator = torch.Generator().manual_seed(2)
    sequences = 2 if case == "4-D mask per sequence" else 1
    kv_heads = 2 if case == "grouped kv heads" else 4
    source = 9 if case == "L != S" else 6
    q, k, v = _attention(generator, sequences, kv_heads=kv_heads, source=source)
    mask = None
    if case == "2-D mask":
        mask = torch.randn(6, source, generator=generator, dtype=torch.float64)
    elif case == "4-D mask per sequence":
        mask = torch.randn(sequences, 1, 6, source, generator=generator, dtype=torch.float64)
    elif case == "boolean mask per head":
        mask = torch.rand(1, 4, 6, source, generator=generator) > 0.3
        mask[..., 0] = True  # every query sees something
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and source == 6,
        scale=0.3 if case == "scale" else None,
        enable_gqa=kv_heads != 4,
    )
    grads = torch.randn(5, *out.shape, generator=generator, dtype=torch.float64)
    batched = batched_grad(out, [q, k, v], grads)
    for b in range(grads.shape[0]):
        alone = torch.autograd.grad(out, [q, k, v], grad_outputs=grads[b], retain_graph=True)
        for got, want in zip(batched, alone, strict=True):
            torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-14)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # the forward's own fallback, not ours
def test_the_attention_rule_folds_a_mask_that_vmap_batches():
    """Another torch.func user in the process: the gradient per mask of a batch of masks."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (t.detach() for t in _attention(generator))
    masks = torch.randn(3, 6, 6, generator=generator, dtype=torch.float64)

    def loss(query, mask):
        return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask).square().sum()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(q, masks)
    for m, mask in enumerate(masks):
        torch.testing.assert_close(batched[m], torch.func.grad(loss)(q, mask), rtol=1e-12, atol=1e-14)


ACTIVATIONS = {
    "silu": (torch.nn.functional.silu, "silu_backward", {}),
    "gelu": (torch.nn.functional.gelu, "gelu_backward", {}),
    "gelu tanh": (
        lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "gelu_backward",
        {"approximate": "tanh"},
    ),
    "tanh": (torch.tanh, "tanh_backward", {}),
    "sigmoid": (torch.sigmoid, "sigmoid_backward", {}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_an_activation_backward_takes_its_derivative_once_for_every_direction(activation, dtype):
    """Each direction's gradient is its own backward's within the rounding of a product's order, and is
    the gradient times the kernel's derivative (the kernel of a gradient of ones) bit for bit."""
    function, kernel, kwargs = ACTIVATIONS[activation]
    generator = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(4, 6, generator=generator, dtype=dtype)).requires_grad_()
    out = function(x)
    grads = torch.randn(5, *out.shape, generator=generator, dtype=dtype)
    (batched,) = batched_grad(out, [x], grads)
    saved = x if kernel in ("silu_backward", "gelu_backward") else out
    derivative = getattr(torch.ops.aten, kernel)(torch.ones_like(saved), saved.detach(), **kwargs)
    for b in range(grads.shape[0]):
        (alone,) = torch.autograd.grad(out, [x], grad_outputs=grads[b], retain_graph=True)
        torch.testing.assert_close(batched[b], alone)
        assert torch.equal(batched[b], grads[b] * derivative)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_an_activation_rule_batches_the_saved_tensor_and_nests(activation):
    """Another torch.func user: the gradient per input of a batch of inputs (the saved tensor batched),
    and a vmap inside a vmap (the rule hands the unwrapped tensors to the level outside its own)."""
    function, _, _ = ACTIVATIONS[activation]
    generator = torch.Generator().manual_seed(5)
    xs = torch.randn(2, 3, 4, 6, generator=generator, dtype=torch.float64)
    weights = torch.randn(4, 6, generator=generator, dtype=torch.float64)

    def loss(x):
        return (function(x) * weights).sum()

    per_input = torch.func.vmap(torch.func.grad(loss))(xs[0])
    nested = torch.func.vmap(torch.func.vmap(torch.func.grad(loss)))(xs)
    for i in range(xs.shape[1]):
        torch.testing.assert_close(per_input[i], torch.func.grad(loss)(xs[0, i]), rtol=1e-12, atol=1e-14)
        for j in range(xs.shape[0]):
            torch.testing.assert_close(nested[j, i], torch.func.grad(loss)(xs[j, i]), rtol=1e-12, atol=1e-14)


def test_the_first_chunk_for_partial_results_stays_within_the_memory_budget(monkeypatch):
    """A small first chunk gives an early partial result; where the budget holds fewer directions than
    that, the first chunk is the budget's chunk, never more."""
    from workers.fisher import directions
    from workers.fisher.directions import LinearGroup, SquareGroup, backprop_directions

    model = tiny_model("llama")
    capture = capture_forward(model, IDS)
    hidden = capture.hidden[-1]
    generator = torch.Generator().manual_seed(1)
    squares = [
        SquareGroup(
            "fisher",
            torch.randn(40, hidden.shape[0], generator=generator, dtype=hidden.dtype),
            torch.ones(40, dtype=hidden.dtype),
        )
    ]
    linears = [LinearGroup("common", torch.randn(hidden.shape[0], generator=generator, dtype=hidden.dtype))]
    sizes: list[int] = []
    original = directions.batched_grad

    def recording(hidden, targets, vectors):
        sizes.append(vectors.shape[0])
        return original(hidden, targets, vectors)

    monkeypatch.setattr(directions, "batched_grad", recording)
    per_direction = sum(t.numel() for t in direction_targets(capture)) * hidden.element_size() * 2
    small = 1 + directions.first_chunk_directions(len(IDS))  # the lead's one direction, then the squares'
    for budget_directions, first in ((100, small), (12, 12)):  # room for the small first chunk, then not
        sizes.clear()
        backprop_directions(
            capture,
            len(IDS) - 1,
            squares,
            linears,
            [],
            memory_budget_bytes=2 * budget_directions * per_direction,  # a chunk: half the workspace
            on_chunk=lambda snapshot, done: None,
        )
        assert sizes[0] == first and max(sizes) <= budget_directions and sum(sizes) == 41


@pytest.mark.parametrize(
    ("total", "lead", "chunk", "first", "bounds"),
    [
        (41, 1, 100, None, [0, 41]),
        (41, 1, 100, 32, [0, 33, 41]),
        (41, 1, 12, 32, [0, 12, 24, 36, 41]),
        # the lead fills the budget's chunk: it goes first, then a small chunk of square directions
        (100, 26, 26, 5, [0, 26, 31, 57, 83, 100]),
        (100, 30, 26, 32, [0, 26, 30, 56, 82, 100]),
        (200, 30, 100, 32, [0, 62, 162, 200]),
        (20, 3, 100, 32, [0, 20]),
    ],
)
def test_chunk_bounds(total, lead, chunk, first, bounds):
    from workers.fisher.directions import chunk_bounds

    got = chunk_bounds(total, lead, chunk, first)
    assert got == bounds
    assert max(b - a for a, b in zip(got, got[1:], strict=False)) <= chunk


def test_partial_results_come_only_once_square_directions_are_in():
    """Where the lead (first moments, probes) fills the first chunk, no partial comes after it."""
    from workers.fisher.directions import LinearGroup, SquareGroup, backprop_directions

    model = tiny_model("llama")
    capture = capture_forward(model, IDS)
    hidden = capture.hidden[-1]
    generator = torch.Generator().manual_seed(2)

    def vector():
        return torch.randn(hidden.shape[0], generator=generator, dtype=hidden.dtype)

    squares = [
        SquareGroup("fisher", torch.stack([vector() for _ in range(10)]), torch.ones(10, dtype=hidden.dtype))
    ]
    linears = [LinearGroup(f"first_{i}", vector()) for i in range(5)]
    per_direction = sum(t.numel() for t in direction_targets(capture)) * hidden.element_size() * 2
    done: list[list[int]] = []
    backprop_directions(
        capture,
        len(IDS) - 1,
        squares,
        linears,
        [],
        memory_budget_bytes=2 * 4 * per_direction,  # chunks of 4: half the workspace
        on_chunk=lambda snapshot, counts: done.append(counts),
    )
    # chunks [0, 4), [4, 5), [5, 9), [9, 13), [13, 15): none after the lead, none after the last
    assert done == [[4], [8]]


def test_chunks_and_snapshots_between_them_give_the_squares_of_one_chunk():
    """Ghost moments summed chunk by chunk (the compiled loop adding into the earlier chunks' moments)
    and snapshots taken between chunks: the same squares as all directions in one chunk."""
    from workers.fisher.block_squares import SquareAccumulator
    from workers.fisher.directions import SquareGroup, backprop_directions

    model = tiny_model("llama")
    capture = capture_forward(model, IDS)
    hidden = capture.hidden[-1]
    generator = torch.Generator().manual_seed(3)
    vectors = torch.randn(10, hidden.shape[0], generator=generator, dtype=hidden.dtype)
    weights = torch.rand(10, generator=generator, dtype=hidden.dtype)
    per_direction = sum(t.numel() for t in direction_targets(capture)) * hidden.element_size() * 2
    assert SquareAccumulator(capture, 10, per_direction * 10).ghost_blocks  # the ghost form is in play

    def run(budget_directions: int, snapshots: list) -> dict[str, torch.Tensor]:
        results = backprop_directions(
            capture,
            len(IDS) - 1,
            [SquareGroup("fisher", vectors, weights)],
            [],
            [],
            memory_budget_bytes=2 * budget_directions * per_direction,  # a chunk: half the workspace
            on_chunk=lambda snapshot, counts: snapshots.append(snapshot()),
        )
        return results.squares["fisher"]

    taken: list = []
    whole, chunked = run(64, []), run(3, taken)
    assert len(taken) >= 3
    for name, value in whole.items():
        torch.testing.assert_close(chunked[name], value, rtol=1e-12, atol=1e-14)


def test_a_snapshot_adds_into_copies_of_the_running_sums_it_reads():
    """A snapshot's squares read the running sums; what it adds (ghost blocks' squares, an expert's slice)
    goes into copies of them, never into the sums the pass goes on with."""
    from workers.fisher.block_squares import ParameterSums

    running = ParameterSums({"dense": (2, 3), "experts": (2, 2, 3), "fresh": (3,)})
    running.add("dense", torch.ones(2, 3))
    running.add("experts", torch.ones(2, 2, 3))
    snapshot = running.borrowed()
    assert snapshot.values["dense"] is running.values["dense"]  # read, not copied
    snapshot.add("dense", torch.full((2, 3), 2.0))
    snapshot.add("experts", torch.full((2, 3), 3.0), index=1)
    snapshot.add("experts", torch.full((2, 3), 3.0), index=1)  # the copy's own from here on
    snapshot.add("fresh", torch.ones(3))
    torch.testing.assert_close(running.values["dense"], torch.ones(2, 3))
    torch.testing.assert_close(running.values["experts"], torch.ones(2, 2, 3))
    assert "fresh" not in running.values
    torch.testing.assert_close(snapshot.values["dense"], torch.full((2, 3), 3.0))
    torch.testing.assert_close(snapshot.values["experts"][0], torch.ones(2, 3))
    torch.testing.assert_close(snapshot.values["experts"][1], torch.full((2, 3), 7.0))
    running.add("dense", torch.ones(2, 3))  # the pass goes on: the snapshot keeps its own
    torch.testing.assert_close(snapshot.values["dense"], torch.full((2, 3), 3.0))


@pytest.mark.parametrize("budget_directions", [64, 3])
def test_a_probe_summed_from_a_complete_basis_is_its_own_backward(budget_directions):
    """Where a square group's directions are an orthonormal basis, a tied-table probe's row is the sum of
    their per-direction rows at the probe's coordinates: the row its own backward gives, in one chunk
    or many; a snapshot between chunks holds the directions done so far."""
    from tests.tiny_models import tiny_llama
    from workers.fisher.directions import EmbeddingRowProbe, SquareGroup, backprop_directions
    from workers.fisher.position import HeadLayout

    model = tiny_llama(tied=True)
    table = HeadLayout.of(model).head_name
    capture = capture_forward(model, IDS)
    hidden = capture.hidden[-1]
    generator = torch.Generator().manual_seed(4)
    basis = torch.linalg.qr(
        torch.randn(hidden.shape[0], hidden.shape[0], generator=generator, dtype=torch.float64)
    )[0].T
    weights = torch.rand(basis.shape[0], generator=generator, dtype=torch.float64)
    probe_vectors = {
        int(c): torch.randn(hidden.shape[0], generator=generator, dtype=torch.float64) for c in {4, 9, 12}
    }
    per_direction = sum(t.numel() for t in direction_targets(capture)) * hidden.element_size() * 2

    def run(summed: bool, directions: torch.Tensor, snapshots: list | None = None) -> dict[str, torch.Tensor]:
        probes = [
            EmbeddingRowProbe(f"fisher:{c}", table, c, u, coordinates=directions @ u if summed else None)
            for c, u in probe_vectors.items()
        ]
        results = backprop_directions(
            capture,
            len(IDS) - 1,
            [SquareGroup("fisher", directions, weights[: directions.shape[0]])],
            [],
            probes,
            memory_budget_bytes=2 * budget_directions * per_direction,  # a chunk: half the workspace
            on_chunk=None
            if snapshots is None
            else lambda snapshot, done: snapshots.append((snapshot(), done)),
        )
        return results.probes

    own, taken = run(False, basis), []
    summed = run(True, basis, taken)
    assert set(summed) == set(own) == {f"fisher:{c}" for c in probe_vectors}
    for name, row in own.items():
        # linear in the direction to the model's own rounding: Llama's RMSNorm computes in float32 even
        # in a float64 model (1e-7 apart here; 2e-16 where the backward is float64 throughout)
        scale = float(row.abs().max())
        torch.testing.assert_close(summed[name], row.to(torch.float64), rtol=1e-5, atol=1e-6 * scale)
    # a snapshot after every chunk but the last; with snapshots wanted the first chunk is the small one
    first = first_chunk_directions(len(IDS))
    assert bool(taken) == (min(budget_directions, first) < basis.shape[0])
    for snapshot, (done,) in taken:
        # the directions done so far, summed: what the same probes give over those directions alone
        partial = run(True, basis[:done])
        for name, row in partial.items():
            torch.testing.assert_close(snapshot.probes[name], row, rtol=1e-10, atol=1e-12)
