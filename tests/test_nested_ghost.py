"""A study's ghost blocks summed over nested contexts (``workers.fisher.nested_ghost``): the pair layout,
the grouping of contexts, and a study's sums with one product per group equal to a product per context."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import BUDGET, tiny_model
from workers.fisher import study
from workers.fisher.block_squares import ghost_factors, pair_index
from workers.fisher.nested_ghost import KeptGhost, NestedGhostSums, nested_groups
from workers.fisher.sampler import Sampler
from workers.studies.prompts import EncodedPrompt
from workers.studies.runner import StudyModel, run_study_part
from workers.studies.spec import CompareAt, StudySpec

EOS = 3


@pytest.mark.parametrize(("rows", "within"), [(1, 1), (1, 5), (3, 5), (5, 5), (4, 9)])
def test_pair_index_puts_each_pair_of_a_prefix_where_the_longer_layout_has_it(rows, within):
    first, second = torch.triu_indices(within, within)
    index = pair_index(rows, within, torch.device("cpu"))
    own_first, own_second = torch.triu_indices(rows, rows)
    assert torch.equal(first[index], own_first)
    assert torch.equal(second[index], own_second)


def test_nested_groups_cover_every_context_once_each_a_prefix_of_its_last_in_any_response_order():
    responses = [[5, 6, 7], [5, 6, 9], [4], [5, 6, 7, 8]]
    contexts = study.shared_contexts(responses)
    groups = nested_groups(contexts)
    assert sorted(c for group in groups for c, _ in group) == sorted(contexts)
    for group in groups:
        longest = group[-1][0]
        assert [len(c) for c, _ in group] == sorted(len(c) for c, _ in group)
        assert all(longest[: len(c)] == c for c, _ in group)
        assert all(contexts[c] == count for c, count in group)
    assert groups == nested_groups(study.shared_contexts(responses[::-1]))


def test_a_context_longer_than_the_group_is_refused():
    sums = NestedGhostSums(rows=2, dtype=torch.float64, held_bytes=0)
    block = KeptGhost("w", torch.zeros(6, 3, dtype=torch.float64), torch.zeros(3, 4), False)
    with pytest.raises(ValueError, match="not a prefix"):
        sums.add([block], 1.0)


def _study(family: str, monkeypatch, nested: bool):
    """A study part of two prompts (4-token responses, top-k 5), the nested sums on or off; how many
    blocks the nested sums formed."""
    formed: list[int] = []
    if nested:
        add_into = NestedGhostSums.add_into

        def counting(self, add_product):
            formed.append(len(self.moments))
            add_into(self, add_product)

        monkeypatch.setattr(NestedGhostSums, "add_into", counting)
    else:
        monkeypatch.setattr(study, "_nested_sums", lambda *args: None)
    model = tiny_model(family, tied=True)
    spec = StudySpec(
        Sampler(temperature=0.8, top_k=5), samples=3, max_tokens=4, seed=3, compare_at=CompareAt.none
    )
    prompts = [EncodedPrompt(0, 1, [2, 5, 8], "odd", None), EncodedPrompt(1, 2, [2, 9], "odd", None)]
    part = run_study_part(
        StudyModel(model, lambda ids: " ".join(map(str, ids)), {EOS}),
        spec,
        prompts,
        memory_budget_bytes=BUDGET,
    )
    monkeypatch.undo()
    return part, sum(formed)


@pytest.mark.usefixtures("float64_reference")
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])
def test_a_study_with_one_product_per_group_equals_one_product_per_context(family, monkeypatch):
    """Llama's blocks, GPT-2's transposed ones (Conv1D), and an MoE whose experts' rows are the tokens
    routed to them (never summed over nested contexts: only its other blocks are)."""
    nested, formed = _study(family, monkeypatch, nested=True)
    each, _ = _study(family, monkeypatch, nested=False)
    assert formed > 0
    assert [r.continuation_ids for r in nested.responses] == [r.continuation_ids for r in each.responses]
    assert nested.sums.contexts == each.sums.contexts > len(nested.prompts)
    for stat in ("fisher", "uncentered", "mean_shift"):
        for name in nested.sums.names:
            torch.testing.assert_close(
                nested.sums.stat(stat, name), each.sums.stat(stat, name), rtol=1e-9, atol=1e-13
            )
    for got, want in zip(nested.responses, each.responses, strict=True):
        assert got.totals == pytest.approx(want.totals, rel=1e-9)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_sum_of_prefixes_is_each_contexts_ghost_squares_added_up(transposed):
    """Contexts of 2 and 3 rows of a group of 5 (the longest context took the block's direct form): one
    product over the 3 rows, each context's M weighted by its count, equals each context's own product."""
    torch.manual_seed(0)
    features = torch.randn(3, 4, dtype=torch.float64)  # the rows every context shares
    out = 6
    nested = NestedGhostSums(rows=5, dtype=torch.float64, held_bytes=0)
    want = torch.zeros((4, out) if transposed else (out, 4), dtype=torch.float64)
    for rows, count in ((2, 3.0), (3, 2.0)):
        moments = torch.randn(rows * (rows + 1) // 2, out, dtype=torch.float64)
        feature = features[:rows]
        left, right = ghost_factors(moments, feature, transposed)
        want += count * (left @ right)
        nested.add([KeptGhost("w", moments, feature, transposed)], count)
    got: dict[str, torch.Tensor] = {}
    nested.add_into(lambda name, left, right: got.setdefault(name, left @ right))
    torch.testing.assert_close(got["w"], want, rtol=1e-12, atol=1e-12)
    assert not nested.moments
