"""The sequence Fisher of a study (docs/design.md §7): F, U and M summed over sampled responses' positions.

Why not ``analyze_sequence``: off the policy it also forms the Fisher under p at every position (d more
directions, for rho), which a study never reports; under top-k 20 that is thirty times the work. Here a
position costs the directions of C_mu plus one for the mean shift (direction jbar_mu - jbar_p), and a
context shared by several responses of a prompt (always the prompt itself) is computed once and counted
as often as it occurs. The running sums hold P floats per statistic whatever the number of prompts,
responses and tokens, and the sums of two parts of a study (disjoint prompts) add up (``merge``).

Statistics (sums; divide by the number of responses for the averages of docs/design.md §7):
  fisher            F = sum_{n,k} sum_t Var_mu[kappa](s_t)
  mean_shift        M = sum_{n,k} sum_t (kbar^mu - kbar^p)(s_t)
  mean_shift_sq     sum_{n,k} sum_t (kbar^mu - kbar^p)(s_t)^2, so that U = F + mean_shift_sq
  mc_fisher         sum_{n,k} (d log pi(y_nk | x_n) / dtheta)^2      (the Monte Carlo Fisher)
  empirical_fisher  sum_n (d log pi(target_n | x_n) / dtheta)^2      (the empirical Fisher)
  policy_gradient   sum_{n,k} (r_nk - mean_k r_nk) d log pi(y_nk | x_n) / dtheta
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import partial
from pathlib import Path

import torch
from torch import nn

from backend.vocabulary import Method
from backend.workspace import between_chunks_bytes
from workers.fisher.block_squares import ghost_total
from workers.fisher.capture import CapturedForward, capture_forward
from workers.fisher.covariance import output_covariance
from workers.fisher.directions import (
    DirectionResults,
    EmbeddingRowProbe,
    LinearGroup,
    SquareGroup,
    backprop_directions,
)
from workers.fisher.first_moments import FirstMoment, Piece, formed_in_pieces, in_piece, largest_piece
from workers.fisher.logit_map import logit_jacobian
from workers.fisher.methods import SecondMomentPlan, second_moment_plan
from workers.fisher.nested_ghost import KeptGhost, NestedGhostSums, nested_bytes, nested_groups
from workers.fisher.parameter_arrays import parameter_arrays
from workers.fisher.position import HeadLayout, HeadTerms, head_rows, looked_up_rows
from workers.fisher.response import next_token_logits
from workers.fisher.sampler import (
    Sampler,
    model_distribution,
    sampler_distribution,
    uniform_distribution,
)
from workers.fisher.scratch_pool import summary_scratch
from workers.fisher.shards import current_shard

Params = dict[str, torch.Tensor]
Progress = Callable[[float], None]


class StudyStat(StrEnum):
    fisher = "fisher"
    mean_shift = "mean_shift"
    mean_shift_sq = "mean_shift_sq"
    mc_fisher = "mc_fisher"
    empirical_fisher = "empirical_fisher"
    policy_gradient = "policy_gradient"


UNCENTERED = "uncentered"  # F + mean_shift_sq, formed on demand (equal to F on-policy)


class Reference(StrEnum):
    """Distributions the Fisher at a context can be compared under (the paper's 0.16 is model/uniform)."""

    model = "model"  # p, the model's own probabilities
    uniform = "uniform"


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers: the same parts give the same seed on every machine and worker."""
    digest = hashlib.sha256(",".join(str(int(part)) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class StudySums:
    """Running sums of P floats per statistic, plus the counts they were summed over."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    device: torch.device
    sums: dict[str, Params] = field(default_factory=dict)
    responses: int = 0
    positions: int = 0  # response tokens, each counted once per response it belongs to
    contexts: int = 0  # distinct contexts whose moments were computed
    targets: int = 0
    directions: int = 0  # directions back-propagated by the exact pass
    direction_tokens: int = 0  # sum over computed contexts of directions x context length: the pass's
    # floor is 2 P direction_tokens flop (docs/design.md §3: about 2 r P T per context)
    # a folder where each statistic's sums are a memory-mapped file (on the CPU): pages the kernel can
    # write out and drop under memory pressure, where anonymous memory without swap cannot be
    backing: Path | None = None

    @classmethod
    def of(cls, model: nn.Module, backing: Path | None = None) -> StudySums:
        params = list(model.named_parameters())  # a tied weight is listed once
        first = params[0][1]
        # sums over thousands of positions need more than a half-precision mantissa
        dtype = torch.float32 if first.dtype in (torch.bfloat16, torch.float16) else first.dtype
        return cls(
            [name for name, _ in params],
            {name: tuple(p.shape) for name, p in params},
            dtype,
            first.device,
            backing=backing,
        )

    @property
    def n_params(self) -> int:
        return sum(int(torch.Size(shape).numel()) for shape in self.shapes.values())

    def _slot(self, stat: str, name: str) -> torch.Tensor:
        if stat not in self.sums:
            self.sums[stat] = self._zeros_table(stat)
        table = self.sums[stat]
        if name not in table:  # a table read from a part file may lack a tensor
            table[name] = torch.zeros(self.shapes[name], dtype=self.dtype, device=self.device)
        return table[name]

    def _zeros_table(self, stat: str) -> Params:
        """Zeros for every tensor, views of one array: in ``backing`` (a file of zeros, mapped) on the
        CPU, else in memory."""
        return parameter_arrays(self.names, self.shapes, self.dtype, self.device, self.backing, stat)

    def add(self, stat: str, params: Params, weight: float = 1.0) -> None:
        """sums[stat] += weight * params (in place: no P-sized temporary); a tensor ``params`` lacks adds
        nothing."""
        for name in self.names:
            if name in params:
                self.add_tensor(stat, Piece(name, self.shapes[name]), params[name], weight)

    def add_product(self, stat: str, name: str, left: torch.Tensor, right: torch.Tensor) -> None:
        """sums[stat][name] += left @ right, in the product itself."""
        self._slot(stat, name).addmm_(left.to(self.dtype), right.to(self.dtype))

    def add_tensor(self, stat: str, piece: Piece, value: torch.Tensor, weight: float = 1.0) -> None:
        """``add`` of one tensor's piece."""
        in_piece(self._slot(stat, piece.tensor), piece).add_(value.to(self.dtype), alpha=weight)

    def add_square(self, stat: str, params: Params, weight: float = 1.0) -> None:
        """sums[stat] += weight * params^2."""
        for name in self.names:
            self.add_square_tensor(stat, Piece(name, self.shapes[name]), params[name], weight)

    def add_square_tensor(self, stat: str, piece: Piece, value: torch.Tensor, weight: float = 1.0) -> None:
        """``add_square`` of one tensor's piece."""
        value = value.to(self.dtype)
        in_piece(self._slot(stat, piece.tensor), piece).addcmul_(value, value, value=weight)

    def has(self, stat: str) -> bool:
        if stat == UNCENTERED:
            return self.has(StudyStat.fisher)
        return stat in self.sums

    def stat(self, stat: str, name: str) -> torch.Tensor:
        """One statistic of one tensor; zeros for a statistic nothing was added to."""
        if stat == UNCENTERED:
            fisher = self.stat(StudyStat.fisher, name)
            shift_sq = self.sums.get(StudyStat.mean_shift_sq, {}).get(name)
            return fisher if shift_sq is None else fisher + shift_sq
        value = self.sums.get(stat, {}).get(name)
        if value is None:
            return torch.zeros(self.shapes[name], dtype=self.dtype, device=self.device)
        return value

    def iter_stat(self, stat: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.stat(stat, name)

    def total(self, stat: str) -> float:
        return sum(float(value.sum()) for _, value in self.iter_stat(stat))

    def merge(self, other: StudySums) -> None:
        """Add another part's sums and counts (the parts cover disjoint prompts)."""
        if other.names != self.names or other.shapes != self.shapes:
            raise ValueError("the two parts were computed on models with different parameters")
        for stat, table in other.sums.items():
            self.add(stat, table)
        self.responses += other.responses
        self.positions += other.positions
        self.contexts += other.contexts
        self.targets += other.targets
        self.directions += other.directions
        self.direction_tokens += other.direction_tokens


@dataclass
class ContextMoments:
    """The moments at the last position of one context (each dict parameter-shaped)."""

    fisher: Params  # Var_mu[kappa]
    # kbar^mu - kbar^p in its small form (``FirstMoment``); None on-policy, where it is zero by construction
    mean_shift: FirstMoment | None
    fisher_under: dict[str, Params]  # Var_q[kappa] for each reference distribution asked for
    directions: int
    # the Fisher's ghost blocks left as pair moments (``keep_ghost``): their tensors are not in ``fisher``
    kept_ghost: list[KeptGhost] = field(default_factory=list)
    kept_total: float = 0.0  # their squares' sum (float64, never formed)


def context_moments(
    model: nn.Module,
    layout: HeadLayout,
    context_ids: torch.Tensor,
    sampler: Sampler,
    method: Method,
    engine_model: nn.Module | None = None,
    references: Sequence[str] = (),
    *,
    memory_budget_bytes: int,
    progress: Progress | None = None,
    keep_ghost: bool = False,
    held_bytes: int = 0,
) -> ContextMoments:
    """Fisher under mu and mean shift at the next token of ``context_ids`` [t], in one direction pass.

    ``references``: names of ``Reference`` distributions whose Fisher is also wanted (same pass, same
    method); on-policy the model's one is the sampler's and costs nothing more. ``keep_ghost``: the
    Fisher's ghost blocks whose rows are the tokens stay pair moments (``ContextMoments.kept_ghost``);
    ``held_bytes``: what the caller holds meanwhile of the workspace's share between chunks.
    """
    capture = capture_forward(model, context_ids)
    position = capture.length - 1
    p, distributions = _next_token_distributions(capture, context_ids, sampler, engine_model, references)
    mu = distributions["fisher"]
    jacobian = logit_jacobian(capture, position, head_rows(model))
    table_rows = looked_up_rows(capture, layout.head_name) if layout.tied else []
    plans = {
        key: second_moment_plan(q, output_covariance(jacobian, q), jacobian, table_rows, method)
        for key, q in distributions.items()
    }
    linears = [] if sampler.is_on_policy else [LinearGroup("mean_shift", jacobian.combine(mu - p))]
    probes = [
        EmbeddingRowProbe(f"{key}:{c}", layout.head_name, c, vector)
        for key, plan in plans.items()
        for c, vector in plan.probes.items()
    ]
    results = backprop_directions(
        capture,
        position,
        [
            SquareGroup(key, plan.vectors, plan.weights, keep_ghost=keep_ghost and key == "fisher")
            for key, plan in plans.items()
        ],
        linears,
        probes,
        memory_budget_bytes=memory_budget_bytes,
        held_bytes=held_bytes,
        progress=progress,
    )
    h = capture.hidden[position].detach()
    kept = results.kept_ghost.get("fisher", [])
    # the kept blocks' totals from M against the features' Grams, one per array (q, k and v read one)
    capture.grams.add(block.feature for block in kept)
    kept_total = sum(ghost_total(block.moments, capture.grams.of(block.feature)) for block in kept)
    del capture
    head = HeadTerms(layout, h, jacobian.head_scale())
    second = {key: _second_moment(head, results, key, plan) for key, plan in plans.items()}
    fisher = second.pop("fisher")
    if Reference.model in references and sampler.is_on_policy:
        second[Reference.model] = fisher
    shift = None if sampler.is_on_policy else head.first_moment(results.linears.get("mean_shift"), mu - p)
    directions = sum(int(plan.vectors.shape[0]) for plan in plans.values()) + len(linears) + len(probes)
    return ContextMoments(fisher, shift, second, directions, kept, kept_total)


def _next_token_distributions(
    capture: CapturedForward,
    context_ids: torch.Tensor,
    sampler: Sampler,
    engine_model: nn.Module | None,
    references: Sequence[str],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(p, {"fisher": mu, reference: q}) at the last position; p is not repeated on-policy (mu is p)."""
    logits = capture.logits[0, capture.length - 1].detach()
    engine_logits = None if engine_model is None else next_token_logits(engine_model, context_ids)[-1]
    p = model_distribution(logits)
    distributions = {"fisher": sampler_distribution(sampler, logits, engine_logits)}
    for name in references:
        if name == Reference.uniform:
            distributions[name] = uniform_distribution(p.numel(), p.device)
        elif name == Reference.model and not sampler.is_on_policy:
            distributions[name] = p
        elif name != Reference.model:
            raise ValueError(
                f"unknown reference distribution {name!r}; choose from {[r.value for r in Reference]}"
            )
    return p, distributions


def _second_moment(head: HeadTerms, results: DirectionResults, key: str, plan: SecondMomentPlan) -> Params:
    """Input side plus the head's closed form plus, for a tied table, the cross term of the rows read."""
    owned = results.owns(key, head.layout.head_name)
    kept = {block.name for block in results.kept_ghost.get(key, [])}
    params = head.second_moment(results.squares.get(key), plan.head_coefficient, in_place=owned, absent=kept)
    name, h = head.layout.head_name, head.h
    for c in plan.probes:
        row = results.probes.get(f"{key}:{c}")
        if row is not None:
            params[name][c] += 2 * head.scale[c].to(h.dtype) * h * row.to(h.dtype)
    return params


def shared_contexts(responses: Sequence[Sequence[int]]) -> dict[tuple[int, ...], int]:
    """Every response prefix y_<t that a position conditions on, with how many responses share it.

    Ordered by length then ids, so the work (and Monte Carlo seeds) do not depend on response order.
    """
    counts: Counter[tuple[int, ...]] = Counter()
    for response in responses:
        for t in range(len(response)):
            counts[tuple(response[:t])] += 1
    return dict(sorted(counts.items(), key=lambda item: (len(item[0]), item[0])))


@dataclass
class PromptFisher:
    """Scalars of one prompt's exact pass (the per-parameter values went into the study's sums)."""

    response_totals: list[dict[str, float]]  # per response: fisher and uncentered over its positions
    compared: dict[str, float]  # Fisher totals where compared: "fisher" (mu) and each reference
    contexts: int
    directions: int


def add_prompt_fisher(
    sums: StudySums,
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: Sequence[Sequence[int]],
    sampler: Sampler,
    method: Method,
    engine_model: nn.Module | None = None,
    *,
    seed: int = 0,
    references: Sequence[str] = (),
    references_everywhere: bool = False,
    memory_budget_bytes: int,
    progress: Progress | None = None,
) -> PromptFisher:
    """Fold F, M and the squared shifts of every position of ``responses`` (after ``prompt_ids``) into
    ``sums``; a context shared by c responses is computed once and added c times.

    ``references`` are compared at the prompt itself, or at every context when ``references_everywhere``
    (weighted like F). Monte Carlo directions are seeded per (seed, context), not per call order.
    """
    layout = HeadLayout.of(model)
    contexts = shared_contexts(responses)
    context_totals: dict[tuple[int, ...], tuple[float, float]] = {}
    compared: defaultdict[str, float] = defaultdict(float)
    directions = direction_tokens = done = 0
    for group in nested_groups(contexts):
        longest = group[-1][0]
        # a context compared with references keeps its Fisher whole (the totals compared read it)
        nested = (
            None
            if references and (references_everywhere or not longest)
            else _nested_sums(sums, model, prompt_ids.numel() + len(longest), memory_budget_bytes)
        )
        for context, count in group:
            ids = torch.cat([prompt_ids, torch.tensor(context, dtype=torch.long, device=prompt_ids.device)])
            asked = references if (references_everywhere or not context) else ()

            def step(fraction: float, done: int = done) -> None:
                if progress is not None:
                    progress((done + fraction) / len(contexts))

            moments = context_moments(
                model,
                layout,
                ids,
                sampler,
                replace(method, seed=derived_seed(seed, *ids.tolist())),
                engine_model,
                asked,
                memory_budget_bytes=memory_budget_bytes,
                progress=step,
                keep_ghost=nested is not None and not asked,
                held_bytes=0 if nested is None else nested.held_bytes,
            )
            context_totals[context] = _add_context(sums, moments, count)
            if nested is not None:
                nested.add(moments.kept_ghost, count)
            if asked:
                _add_compared(compared, moments, count, fisher_total=context_totals[context][0])
            directions += moments.directions
            direction_tokens += moments.directions * ids.numel()
            done += 1
            del moments
        if nested is not None:
            nested.add_into(partial(sums.add_product, StudyStat.fisher))
    sums.contexts += len(contexts)
    sums.directions += directions
    sums.direction_tokens += direction_tokens
    sums.positions += sum(len(response) for response in responses)
    totals = _response_totals(responses, context_totals)
    return PromptFisher(totals, dict(compared), len(contexts), directions)


def _nested_sums(sums: StudySums, model: nn.Module, rows: int, budget_bytes: int) -> NestedGhostSums | None:
    """Where a group of nested contexts of at most ``rows`` rows sums its ghost blocks' pair moments:
    none under torchrun (each process holds a share of a context's directions) or where they would be
    more than half of what the workspace keeps between chunks (bounded by every matrix's larger side;
    the direction pass's moments between chunks have the rest)."""
    outputs = sum(max(p.shape) for _, p in model.named_parameters() if p.dim() == 2)
    held = nested_bytes(rows, outputs, torch.empty((), dtype=sums.dtype).element_size())
    if current_shard() is not None or held > between_chunks_bytes(budget_bytes) // 2:
        return None
    return NestedGhostSums(rows, sums.dtype, held)


def _add_context(sums: StudySums, moments: ContextMoments, count: int) -> tuple[float, float]:
    """Add one context's F, M and squared mean shift ``count`` times (of the Fisher's kept ghost blocks,
    their totals only: their squares are added by the group's ``NestedGhostSums``); its Fisher and
    uncentered totals (U = F + the squared mean shift)."""
    sums.add(StudyStat.fisher, moments.fisher, count)
    fisher_total = sum(float(v.sum()) for v in moments.fisher.values())
    fisher_total += moments.kept_total
    shift_sq_total = 0.0
    shift = moments.mean_shift
    if shift is None:
        return fisher_total, fisher_total
    # each tensor formed into one kept buffer a piece at a time, added and squared from there: forming
    # the whole shift was a fresh parameter-sized array per context, paid again in first-touch page faults
    dtype = next(iter(moments.fisher.values())).dtype  # the model's, as the small forms'
    scratch = summary_scratch.take(largest_piece(sums.shapes), dtype, sums.device)
    try:
        for name in sums.names:
            for piece, value in formed_in_pieces(name, shift.entry(name), scratch):
                sums.add_tensor(StudyStat.mean_shift, piece, value, count)
                sums.add_square_tensor(StudyStat.mean_shift_sq, piece, value, count)
                flat = value.reshape(-1)
                shift_sq_total += float(torch.dot(flat, flat))
    finally:
        summary_scratch.give(scratch)
    return fisher_total, fisher_total + shift_sq_total


def _add_compared(
    compared: defaultdict[str, float], moments: ContextMoments, count: int, fisher_total: float
) -> None:
    """Add one context's Fisher total under mu and under each reference, ``count`` times."""
    compared["fisher"] += count * fisher_total
    for name, params in moments.fisher_under.items():
        compared[name] += count * sum(float(v.sum()) for v in params.values())


def _response_totals(
    responses: Sequence[Sequence[int]], context_totals: dict[tuple[int, ...], tuple[float, float]]
) -> list[dict[str, float]]:
    """Per response, the Fisher and uncentered totals summed over the contexts of its positions."""
    totals = []
    for response in responses:
        seen = [context_totals[tuple(response[:t])] for t in range(len(response))]
        totals.append({"fisher": sum(f for f, _ in seen), "uncentered": sum(u for _, u in seen)})
    return totals


def relative_l2_error(
    sums: StudySums, estimate: str, estimate_count: int, reference: str, reference_count: int
) -> float:
    """||e / n_e - r / n_r|| / ||r / n_r|| over every coordinate: the averages compared."""
    error_sq = reference_sq = 0.0
    for name in sums.names:
        ref = sums.stat(reference, name).double() / reference_count
        est = sums.stat(estimate, name).double() / estimate_count
        error_sq += float((est - ref).square().sum())
        reference_sq += float(ref.square().sum())
    return (error_sq / reference_sq) ** 0.5 if reference_sq > 0 else float("nan")
