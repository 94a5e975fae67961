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

IDS = torch.tensor([4, 9, 2, 4, 7, 12, 5])
FALLBACK = "performance drop because we have not yet implemented the batching rule"


def _targets(capture) -> list[torch.Tensor]:
    outputs = [use.output for block in capture.matrices for use in block.uses]
    outputs += [use.output for block in capture.embeddings for use in block.uses]
    return outputs + list(capture.generic.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_direction_gets_its_own_gradient_with_no_per_direction_fallback(family):
    model = tiny_model(family)
    capture = capture_forward(model, IDS)
    hidden, targets = capture.hidden[-1], _targets(capture)
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
