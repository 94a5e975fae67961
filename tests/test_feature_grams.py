"""The Grams of a forward's recorded features, made once for every context read from it."""

from __future__ import annotations

import torch

from tests.tiny_models import tiny_llama
from workers.fisher.capture import capture_forward
from workers.fisher.feature_grams import FeatureGrams


def _gram(x: torch.Tensor) -> torch.Tensor:
    return x.double() @ x.double().T


def test_a_contexts_first_rows_read_the_leading_block_of_the_whole_arrays_gram():
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    grams = FeatureGrams()
    grams.add([x])
    whole = grams.of(x)
    for rows in range(1, 8):
        read = grams.of(x[:rows])
        torch.testing.assert_close(read, _gram(x[:rows]), rtol=1e-14, atol=1e-14)
        assert read.data_ptr() == whole.data_ptr()  # the block of the one Gram, not a Gram of its own


def test_a_longer_array_is_made_again_a_shorter_one_is_not_and_other_memory_is_its_own():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=generator)
    grams = FeatureGrams()
    grams.add([x[:2]])
    short = grams.of(x[:2])
    grams.add([x[:5], x[:3]])  # the longest of one memory is made; it covers the shorter
    longer = grams.of(x[:5])
    assert longer.data_ptr() != short.data_ptr()
    torch.testing.assert_close(grams.of(x[:3]), _gram(x[:3]), rtol=1e-14, atol=1e-14)
    grams.add([x[:4]])
    assert grams.of(x[:4]).data_ptr() == longer.data_ptr()
    same_shape = torch.randn(6, 4, generator=generator)
    grams.add([same_shape, x])
    torch.testing.assert_close(grams.of(same_shape), _gram(same_shape), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(grams.of(x), _gram(x), rtol=1e-14, atol=1e-14)


def test_every_context_read_from_a_forward_shares_its_grams():
    model = tiny_llama()
    whole = capture_forward(model, torch.arange(1, 9))
    whole.grams.add(block.feature for block in whole.matrices)
    context = whole.at(4)
    assert context.grams is whole.grams
    for block, longer in zip(context.matrices, whole.matrices, strict=True):
        read = context.grams.of(block.feature)
        assert read.shape == (5, 5)
        torch.testing.assert_close(read, _gram(block.feature), rtol=1e-12, atol=1e-12)
        assert read.data_ptr() == whole.grams.of(longer.feature).data_ptr()
