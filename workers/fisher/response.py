"""Along a response: position t predicts y_t from s_t = x + y_<t; the moments add up over positions.

Each position is analysed on its own context (the exact cost therefore grows with the square of the
response length), folded into running sums, and dropped, so memory stays at one position's moments
plus the sums. The per-position scalars every summary needs are kept as they go. When partial results
are asked for, a cheap first pass over every position comes first (``_FirstPass``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from backend.vocabulary import Method, takes_a_first_pass
from backend.workspace import between_chunks_bytes
from workers.fisher.block_squares import CarriedSquares, carried_bytes, carries_to_a_forward_of_its_own
from workers.fisher.capture import CapturedForward, capture_forward
from workers.fisher.covariance import OutputCovariance, head_row_norms, mean_logit_rows
from workers.fisher.feature_grams import FeatureGrams
from workers.fisher.model_totals import TotalsGroups
from workers.fisher.parameter_arrays import SumsStorage
from workers.fisher.position import (
    FisherPlans,
    HeadLayout,
    KnownRows,
    PartialCallback,
    PositionInputs,
    PositionMoments,
    PositionWork,
    fisher_plans,
    position_jacobian,
    position_moments,
    positions_moments,
)
from workers.fisher.sampler import Sampler, model_distribution, sampler_distribution
from workers.fisher.shards import current_shard
from workers.fisher.stats import MomentSums, square_sums_of, square_total_of

Progress = Callable[[str, float], None]
SequencePartial = Callable[[Callable[[], "SequenceAnalysis"], float], None]


@dataclass
class PositionRecord:
    """What the summaries keep of one position after its moments are folded in."""

    context_length: int
    target_id: int | None
    p: torch.Tensor  # [V] float64
    mu: torch.Tensor  # [V] float64
    h: torch.Tensor  # [d]
    head_scale: torch.Tensor  # [V] float64 g'(l)
    moments_totals: dict[str, float]
    # C_mu's spectrum: None where only its most probable rows were read (a response's first pass)
    spectrum: CovarianceSpectrum | None
    trace: float  # trace(C_mu)
    support: int
    kept_share: float
    missing_estimate: float
    directions: int
    reward_mean: float | None
    reward_std: float | None


@dataclass
class CovarianceSpectrum:
    """C_mu's eigenvalues, centered and not, and its ranks (``OutputCovariance``)."""

    eigenvalues: torch.Tensor
    uncentered_eigenvalues: torch.Tensor
    numerical_rank: int
    effective_rank: float
    participation_ratio: float

    @staticmethod
    def of(cov: OutputCovariance) -> CovarianceSpectrum | None:
        if not cov.whole:
            return None
        return CovarianceSpectrum(
            eigenvalues=cov.eigenvalues,
            uncentered_eigenvalues=cov.uncentered_eigenvalues(),
            numerical_rank=cov.numerical_rank(),
            effective_rank=cov.effective_rank(),
            participation_ratio=cov.participation_ratio(),
        )


@dataclass
class SequenceAnalysis:
    sums: MomentSums
    positions: list[PositionRecord] = field(default_factory=list)
    accumulated_shift_sq: list[float] = field(default_factory=list)  # sum_i (sum_{t<=T'} m_i)^2
    sft_gradient: dict[str, torch.Tensor] | None = None  # d log pi(y|x)/dtheta (data sampler)
    directions: int = 0  # back-propagated by this process over all positions (a share under torchrun)
    # a partial result's summary part about the whole model: a response's first pass makes it from its
    # totals (``first_pass_model_part``); a reader of a prefix's partial records it (``SequencePartial``)
    model_part: dict | None = None


@torch.no_grad()
def next_token_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[t, V] logits at every position, as the model computes them, widened to float64."""
    return model(input_ids=ids[None], use_cache=False).logits[0].double()  # exact for float32 too


def tensor_totals(
    m: PositionMoments, on_policy: bool, grams: FeatureGrams | None = None
) -> dict[str, dict[str, float]]:
    """A position's totals per tensor, by key: its Fisher, the squares of its first moments (the mean
    shift, the common component, kbar under mu off the policy and, with a reward, the policy gradient),
    and the bound. The squares are summed from the first moments' small forms (``square_sums_of``), on
    the Grams of the forward they read (``CapturedForward.grams``; none: made for this position)."""
    grams = FeatureGrams() if grams is None else grams  # the position's statistics read one forward
    totals = {
        "fisher": _fisher_totals(m),
        "common_sq": square_sums_of(m.kbar_p, grams),
    }
    if not on_policy:
        totals["mean_shift_sq"] = square_sums_of(m.kbar_mu.minus(m.kbar_p), grams)
        totals["kbar_mu_sq"] = square_sums_of(m.kbar_mu, grams)
    if m.policy_grad is not None and m.reward_std is not None:
        totals["policy_grad_sq"] = square_sums_of(m.policy_grad, grams)
        totals["bound"] = {
            name: m.reward_std * float(v.clamp_min(0).sqrt().sum()) for name, v in m.fisher.items()
        }
    return totals


def _fisher_totals(m: PositionMoments) -> dict[str, float]:
    """A position's Fisher summed per tensor (of a Fisher kept as totals, ``PositionWork.of``, those)."""
    return {name: float(v.sum()) for name, v in m.fisher.items()}


def _second_moment_totals(totals: dict[str, float]) -> dict[str, float]:
    """fisher, uncentered (fisher + sum m^2) and raw (fisher + sum kbar_mu^2; on the policy kbar_mu is
    the common component) from ``tensor_totals``' keys, over whatever they were summed over."""
    fisher = totals["fisher"]
    return {
        "fisher": fisher,
        "uncentered": fisher + totals.get("mean_shift_sq", 0.0),
        "raw": fisher + totals.get("kbar_mu_sq", totals["common_sq"]),
    }


def _position_totals(per_tensor: dict[str, dict[str, float]]) -> dict[str, float]:
    """The position's totals over the model (``tensor_totals`` added up)."""
    added = {key: sum(values.values()) for key, values in per_tensor.items()}
    totals = {
        **_second_moment_totals(added),
        "mean_shift_sq": added.get("mean_shift_sq", 0.0),
        "common_sq": added["common_sq"],
    }
    if "bound" in added:
        totals["policy_grad_sq"] = added["policy_grad_sq"]
        totals["bound"] = added["bound"]
    return totals


def analysed_positions(continuation_ids: torch.Tensor) -> int:
    """A response's positions, or the prefix's next token (one) without a response."""
    return max(1, continuation_ids.numel())


@dataclass
class SequenceForward:
    """The analysed context's forward: each position's target, p and mu, and its captured forward.

    Why one class: ``analyze_sequence`` and ``reward_pass.policy_gradient_pass`` must read the same
    logits, sampler and contexts, so that a reward answered without the Fisher equals the whole analysis.
    """

    model: nn.Module
    full: torch.Tensor  # prefix then continuation ids
    continuation_ids: torch.Tensor
    first: int  # index in ``full`` of the first analysed hidden state
    positions: int
    sampler: Sampler
    logits: torch.Tensor  # [t, V] float64
    engine_logits: torch.Tensor | None
    # the forward the logits came from, where captured (a single position's, a response's whole one for
    # its first pass), until ``capture`` hands it over
    captured: CapturedForward | None

    @classmethod
    def run(
        cls,
        model: nn.Module,
        prefix_ids: torch.Tensor,
        continuation_ids: torch.Tensor,
        sampler: Sampler,
        engine_model: nn.Module | None = None,
        *,
        capture_whole: bool = False,
    ) -> SequenceForward:
        """``capture_whole``: the whole context's forward is captured for a response's first pass."""
        full = torch.cat([prefix_ids, continuation_ids])
        positions = analysed_positions(continuation_ids)
        first = prefix_ids.numel() - 1
        context = full[: first + positions]
        # a captured forward gives the logits too (the same computation, bit for bit), so the model runs
        # once where one is needed: a single position's, a response's first pass's (~0.1-0.2 s on
        # SmolLM2: its weights are read once)
        captured = capture_forward(model, context) if positions == 1 or capture_whole else None
        logits = (
            next_token_logits(model, context) if captured is None else captured.logits[0].detach().double()
        )
        engine_logits = next_token_logits(engine_model, context) if engine_model is not None else None
        return cls(model, full, continuation_ids, first, positions, sampler, logits, engine_logits, captured)

    def context(self, t: int) -> torch.Tensor:
        return self.full[: self.first + t + 1]

    def target(self, t: int) -> int | None:
        return int(self.continuation_ids[t]) if self.continuation_ids.numel() else None

    def distributions(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, mu) over position t's next token."""
        index = self.first + t
        engine = None if self.engine_logits is None else self.engine_logits[index]
        return model_distribution(self.logits[index]), sampler_distribution(
            self.sampler, self.logits[index], engine, self.target(t)
        )

    def capture(self, t: int) -> CapturedForward:
        """Position t's context's captured forward: the one the logits came from where it is that
        context's (a single position's; the last position's, the whole context, which a response's first
        pass reads every position from), handed over once (its taker frees it when it is done)."""
        captured = self.captured
        if captured is not None and captured.length == self.first + t + 1:
            self.captured = None
            return captured
        return capture_forward(self.model, self.context(t))


def analyze_sequence(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    sampler: Sampler,
    method: Method,
    reward: torch.Tensor | None = None,
    engine_model: nn.Module | None = None,
    *,
    memory_budget_bytes: int,
    progress: Progress | None = None,
    on_partial: SequencePartial | None = None,
    observe: Callable[[PositionMoments], None] | None = None,
    fisher_under_p: bool = True,
    sums_storage: SumsStorage | None = None,
) -> SequenceAnalysis:
    """Analyse the prefix's next token, or every response position when a continuation is given.

    ``fisher_under_p``: off the policy, also the second moment under p at every position (d_model
    directions more each, which only rho needs); without it rho is not known (``MomentSums.has_rho``).

    ``on_partial(snapshot, kept_share)``: ``snapshot()`` is an analysis of what is done so far, to be
    read before ``on_partial`` returns. For a prefix (one position), after each chunk of directions but
    the last. For a response (one process), first after a pass over every position (``_FirstPass``),
    then after each position the exact pass finishes; ``kept_share`` is the share of the response's
    summed trace(C_mu) the directions carry. A response's snapshots carry the summary's part about the
    whole model in ``model_part``, made by the first pass from its totals (their model totals are the
    first pass's until the exact result); a prefix's reader may record it there. ``observe(moments)``: each
    position's moments before the running sums take them over (read, never keep or modify).
    ``sums_storage``: where a response's sums over positions are kept (in memory up to its budget, the
    rest mapped from files); a prefix's Fisher is its position's own array.
    """
    layout = HeadLayout.of(model)
    report = progress or (lambda stage, fraction: None)
    report("forward", 0.0)
    n_positions = analysed_positions(continuation_ids)
    first_pass_asked = on_partial is not None and _worth_a_first_pass(sampler, method, n_positions)
    forward = SequenceForward.run(
        model, prefix_ids, continuation_ids, sampler, engine_model, capture_whole=first_pass_asked
    )
    storage = sums_storage if n_positions > 1 else None
    result = SequenceAnalysis(MomentSums(layout.names, layout.shapes, storage=storage))
    first_pass = None
    if first_pass_asked and on_partial is not None:  # (the second: for the type checker)
        first_pass = _FirstPass.run(
            forward, layout, method, reward, fisher_under_p, memory_budget_bytes, report
        )
        on_partial(first_pass.snapshot, first_pass.kept_share())
        if first_pass.refine(report):
            on_partial(first_pass.snapshot, first_pass.kept_share())
        first_pass.release()
        # its first moments are whole: the exact pass adds the second moments and the squares
        first = first_pass.analysis
        result = SequenceAnalysis(
            first.sums.second_moments_over(storage), accumulated_shift_sq=list(first.accumulated_shift_sq)
        )
    for t in range(n_positions):
        target = forward.target(t)
        p, mu = forward.distributions(t)
        inputs = PositionInputs(forward.context(t), p, mu, reward, sampler.is_on_policy, fisher_under_p)
        capture = forward.capture(t)

        def chunk_progress(fraction: float, t: int = t) -> None:
            report("directions", (t + fraction) / n_positions)

        partial = None
        if on_partial is not None and n_positions == 1 and target is None:
            partial = _partial_analysis(layout, inputs, on_partial)
        moments = position_moments(
            model,
            inputs,
            method,
            capture,
            memory_budget_bytes=memory_budget_bytes,
            held_bytes=0 if first_pass is None else first_pass.held_after(t),
            progress=chunk_progress,
            on_partial=partial,
            planned=None if first_pass is None else first_pass.take_plans(t),
            carried=None if first_pass is None else first_pass.take_carried(t),
        )
        del capture
        record = _record(inputs, moments, target, tensor_totals(moments, inputs.on_policy))
        _fold_position(
            result, record, moments, sampler.is_on_policy, observe, first_moments=first_pass is None
        )
        del moments
        if first_pass is not None and on_partial is not None and t + 1 < n_positions:
            first_pass.finished(t, record)
            on_partial(first_pass.snapshot, first_pass.kept_share())
    if sampler.kind == "data" and continuation_ids.numel():
        result.sft_gradient = log_likelihood_gradient(model, prefix_ids, continuation_ids)
    return result


# a response's first pass takes this many of a position's leading Fisher directions. Each goes back over
# the whole response's rows, whatever the position, so a prefix's first chunk (sized to its own context:
# 7 directions at 11 tokens) costs more than everything else the pass does. SmolLM2, 16 tokens, the first
# partial under top-k 50 / on the policy: the prefix's chunk 8.4 s with 47% of the trace / 13.6 s with
# 61%; 2 directions 7.4 s with 65% / 9.5 s with 48%; 1 direction 6.3 s with 49% / 8.2 s with 35%. The
# refining round brings every position to 90% soon after
FIRST_PASS_SQUARE_DIRECTIONS = 1
# none where they are more than this share of a position's directions (a top-k sampler's k - 1 when k is
# small): the first pass is then its first moments and the head's closed form alone
FIRST_PASS_CHUNK_SHARE = 0.1


def first_pass_directions(plan_directions: int) -> int:
    """Square directions a response's first pass takes at a position with ``plan_directions``."""
    keep = FIRST_PASS_SQUARE_DIRECTIONS
    return keep if keep <= FIRST_PASS_CHUNK_SHARE * plan_directions else 0


def _worth_a_first_pass(sampler: Sampler, method: Method, positions: int) -> bool:
    """A response's first pass (``takes_a_first_pass``), for one process: under torchrun no partial
    results are asked for."""
    return current_shard() is None and takes_a_first_pass(method, sampler, positions)


# positions whose jbar one read of the head makes (``_FirstPass._known_rows``): [2n, V] float64
# coefficients, 78 MB at Qwen3's vocabulary
MEAN_ROWS_AT_ONCE = 32
# a response's first pass reads C_q over its most probable rows where q draws more tokens
# (``leading_rows_covariance``): the leading directions of that lower bound, and C_q's spectrum with the
# refining round. On SmolLM2 its V d^2 Gram product was 5.4 s of a 16-token first pass on the policy.
# Fewer rows than d are decomposed in their own space (an n x n problem, not d x d): on SmolLM2, 16
# tokens on the policy, the first partial came at 4.4-4.7 s with 256 rows (its leading directions
# 31.7% of the trace), 5.7-6.2 s with 2048 (34.7%), 4.5-4.9 s with 128 (30.5%), in one process
FIRST_PASS_GRAM_ROWS = 256
# the share of every position's trace(C_mu) a response's refining round reaches (``_FirstPass.refine``)
REFINED_SHARE = 0.9
# a forward of a context costs about as much as this many directions back over it (SmolLM2, 2-core CPU:
# 0.1 s, directions at 15-20 ms); a position of the refining round whose directions would cost more
# than that over the response's rows beyond its own takes a forward of its own context
FORWARD_DIRECTIONS = 8


@dataclass
class _FirstPass:
    """A response's first pass: every position with its first moments, the head's closed forms and the
    leading directions of its Fisher (the largest eigenvalues of C_mu, ``first_pass_directions``; none
    where they would be more than a tenth of them). Its snapshot is a partial result that
    covers every position: first moments, mean shift, policy gradient, chi^2 and the SFT identity
    complete, each Fisher a lower bound (but on a tied table's context rows) with its position's kept
    share. A refining round (``refine``) then takes every position to ``REFINED_SHARE`` of its trace.
    As the exact pass finishes positions, their records replace these; the model's totals stay the
    first pass's until the exact result.

    One forward of the response serves every position (``CapturedForward.at``), whose directions go
    back together (``positions_moments``). What it keeps: the first moments summed in their small form
    (the exact pass takes them over, ``MomentSums.second_moments_over``), and of the Fisher and the
    squares only each tensor's totals (``tensor_totals``; without a reward the Fisher is never formed),
    from which the snapshot's model part is made (``first_pass_model_part``): all that a partial
    result's light summary reads.

    Why a pass of its own rather than positions in rounds: the exact pass must see each position's
    whole Fisher at once (the bound and the kept roots take its square root), and keeping a paused
    position's sums would hold a parameter-sized array per position. What it costs: its leading directions
    again, ``FIRST_PASS_SQUARE_DIRECTIONS`` per position (1 of ~576 on SmolLM2), and the refining
    round's directions. Each position's plans (C_mu's V d^2 Gram product and its eigendecomposition) are
    made once for all passes: by the first pass where mu draws at most ``FIRST_PASS_GRAM_ROWS`` tokens,
    else (the first pass reading C_mu over the most probable of them, a lower bound) by the refining
    round, or by the exact pass for a position the round does not take.
    """

    analysis: SequenceAnalysis
    # each position's plans (C_mu and its eigen-directions: d x d), made once for all passes
    plans: list[FisherPlans | None]
    forward: SequenceForward
    whole: CapturedForward | None  # the response's forward, until the first pass and its round are done
    layout: HeadLayout
    method: Method
    reward: torch.Tensor | None
    fisher_under_p: bool
    memory_budget_bytes: int
    per_tensor: list[dict[str, dict[str, float]]] = field(default_factory=list)  # each position's totals
    row_norms: torch.Tensor | None = None  # |w_a|^2 of the head's rows, read once
    kept_for: dict[int, int] = field(default_factory=dict)  # position -> the bytes its plans and squares kept
    # position -> its refining round's directions as the exact pass continues them, per Fisher
    carried: dict[int, dict[str, CarriedSquares]] = field(default_factory=dict)

    @classmethod
    def run(
        cls,
        forward: SequenceForward,
        layout: HeadLayout,
        method: Method,
        reward: torch.Tensor | None,
        fisher_under_p: bool,
        memory_budget_bytes: int,
        report: Progress,
    ) -> _FirstPass:
        whole = forward.capture(forward.positions - 1)  # the whole context: every position's rows
        first = cls(
            SequenceAnalysis(MomentSums(layout.names, layout.shapes)),
            [],
            forward,
            whole,
            layout,
            method,
            reward,
            fisher_under_p,
            memory_budget_bytes,
        )
        first._pass(report)
        return first

    def _inputs(self, t: int) -> PositionInputs:
        forward = self.forward
        p, mu = forward.distributions(t)
        on_policy = forward.sampler.is_on_policy
        return PositionInputs(forward.context(t), p, mu, self.reward, on_policy, self.fisher_under_p)

    def _pass(self, report: Progress) -> None:
        forward, analysis, budget = self.forward, self.analysis, self.memory_budget_bytes
        assert self.whole is not None
        whole = self.whole

        def works() -> Iterator[PositionWork]:
            known: list[KnownRows] = []
            for t in range(forward.positions):
                inputs = self._inputs(t)
                capture = whole.at(forward.first + t)
                if not known:
                    known = self._known_rows(t)
                planned = fisher_plans(forward.model, inputs, capture, self.method, known.pop(0))
                self.plans.append(None)
                self._keep_plans(t, planned)
                leading = planned.leading(first_pass_directions(planned.directions))
                # of the Fisher its totals alone where no bound needs it per parameter
                yield PositionWork.of(
                    forward.model, inputs, self.method, capture, leading, self.reward is None
                )

        # every position reads the first rows of the whole response's features: their Grams' leading
        # blocks (``FeatureGrams``), made once here for every position and statistic
        whole.grams.add(block.feature for block in whole.matrices)
        for t, (work, moments) in enumerate(positions_moments(works(), budget)):
            inputs = work.inputs
            per_tensor = tensor_totals(moments, inputs.on_policy, whole.grams)
            self.per_tensor.append(per_tensor)
            analysis.positions.append(_record(inputs, moments, forward.target(t), per_tensor))
            analysis.directions += moments.directions
            analysis.sums.add_first_moments(moments)
            if not inputs.on_policy:
                shifts = analysis.sums.sums["mean_shift"]
                analysis.accumulated_shift_sq.append(square_total_of(shifts, whole.grams))
            del work, moments
            report("first pass", (t + 1) / forward.positions)
        self._model_part()

    def _known_rows(self, start: int) -> list[KnownRows]:
        """What positions ``start`` on (``MEAN_ROWS_AT_ONCE`` of them) read of the head at once: jbar
        under each full-support distribution (``mean_logit_rows``), for C_q over its most probable
        ``FIRST_PASS_GRAM_ROWS`` (``leading_rows_covariance``) and, off the policy, kbar_p."""
        forward, whole = self.forward, self.whole
        assert whole is not None
        positions = range(start, min(start + MEAN_ROWS_AT_ONCE, forward.positions))
        jacobians = [position_jacobian(forward.model, whole, forward.first + t) for t in positions]
        if self.row_norms is None:
            self.row_norms = head_row_norms(jacobians[0].weight)
        wanted: list[tuple[int, str, torch.Tensor]] = []  # (position, which, q)
        for k, t in enumerate(positions):
            p, mu = forward.distributions(t)
            if int((mu > 0).sum()) > FIRST_PASS_GRAM_ROWS:
                wanted.append((k, "mu", mu))
            if not forward.sampler.is_on_policy:
                wanted.append((k, "p", p))
        read = (
            mean_logit_rows([jacobians[k] for k, _, _ in wanted], [q for *_, q in wanted]) if wanted else None
        )
        rows: list[dict[str, torch.Tensor]] = [{} for _ in positions]
        for i, (k, which, _) in enumerate(wanted):
            assert read is not None
            rows[k][which] = read[i]
        on_policy = forward.sampler.is_on_policy
        return [
            KnownRows(
                found.get("mu"),
                found.get("mu") if on_policy else found.get("p"),
                FIRST_PASS_GRAM_ROWS,
                self.row_norms,
            )
            for found in rows
        ]

    def _keeps(self, t: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more are kept for position t's later pass: what the passes keep (plans,
        carried squares) stays within the workspace's share between chunks (``backend.workspace``; a
        64-token response on a 2048-wide model would hold 4 GB of plans alone), which the exact pass's
        ghost moments share (``held_after``)."""
        if self.kept_bytes + nbytes > between_chunks_bytes(self.memory_budget_bytes):
            return False
        self.kept_for[t] = self.kept_for.get(t, 0) + nbytes
        return True

    @property
    def kept_bytes(self) -> int:
        """What the kept plans and carried squares hold, for every position."""
        return sum(self.kept_for.values())

    def held_after(self, t: int) -> int:
        """What is kept for the positions after t: held while position t's exact pass runs, so its ghost
        moments have the rest of the share (position t's own carried moments are among them)."""
        return sum(nbytes for position, nbytes in self.kept_for.items() if position > t)

    def _keep_plans(self, t: int, planned: FisherPlans) -> None:
        """Keep position t's plans for later passes where whole (not a first pass's lower bound) and within
        the kept workspace (``_keeps``); the others are made again."""
        if planned.whole and self._keeps(t, planned.nbytes()):
            self.plans[t] = planned

    def _model_part(self) -> None:
        summed: dict[str, dict[str, float]] = {}  # key -> tensor -> the positions' totals
        for per_tensor in self.per_tensor:
            for key, values in per_tensor.items():
                into = summed.setdefault(key, {})
                for name, value in values.items():
                    into[name] = into.get(name, 0.0) + value
        grams = None if self.whole is None else self.whole.grams
        self.analysis.model_part = first_pass_model_part(self.analysis.sums, summed, self.layout, grams)

    def refine(self, report: Progress) -> bool:
        """A round that takes every position below ``REFINED_SHARE`` of its trace(C_mu) to it: the
        leading directions that reach it, from the response's one forward, in shared backward passes,
        the Fisher as totals. Its snapshot replaces those positions' records (the first moments and
        their squares stay the first pass's). Whether it ran: not with a reward, whose bound would need
        each position's Fisher per parameter, nor where every position is there already.

        A position whose directions would cost more over the response's rows than a forward of its own
        context saves (``FORWARD_DIRECTIONS``) runs on that forward instead: on the policy a position
        takes tens to a hundred directions to 90%.

        Why: the exact pass finishes positions one after another, so the last reached 90% of its trace
        only at the end. The exact pass continues from what a position's round directions leave
        (``CarriedSquares``, kept within the workspace, ``_keeps_carried``) and spends them again only
        where that was not kept."""
        records = self.analysis.positions
        todo = [t for t, record in enumerate(records) if record.kept_share < REFINED_SHARE]
        if self.reward is not None or not todo or self.whole is None:
            return False
        forward, whole = self.forward, self.whole

        def works() -> Iterator[PositionWork]:
            for t in todo:
                inputs = self._inputs(t)
                capture = whole.at(forward.first + t)
                planned = self.plans[t]
                if planned is None:  # a lower bound, or beyond what the workspace keeps
                    planned = fisher_plans(forward.model, inputs, capture, self.method)
                    self._keep_plans(t, planned)
                leading = planned.leading(planned.plans["fisher"].directions_reaching(REFINED_SHARE))
                rows = capture.position + 1
                if leading.directions * (whole.length - rows) > FORWARD_DIRECTIONS * whole.length:
                    capture = capture_forward(forward.model, inputs.context_ids)
                carry = self._keeps_carried(t, capture)
                yield PositionWork.of(forward.model, inputs, self.method, capture, leading, True, carry=carry)

        for done, (t, (work, moments)) in enumerate(
            zip(todo, positions_moments(works(), self.memory_budget_bytes), strict=True)
        ):
            per_tensor = dict(self.per_tensor[t])
            per_tensor["fisher"] = _fisher_totals(moments)
            self.per_tensor[t] = per_tensor
            records[t] = _record(work.inputs, moments, forward.target(t), per_tensor)
            if moments.carried is not None:
                self.carried[t] = moments.carried
            self.analysis.directions += moments.directions
            del work, moments
            report("refining", (done + 1) / len(todo))
        self._model_part()
        return True

    def _keeps_carried(self, t: int, capture: CapturedForward) -> bool:
        """Whether position t's round keeps what its directions leave for the exact pass: where its plans
        are kept (the exact pass's directions are then the same), a forward of the context alone has
        the same rows, and within the kept workspace (``_keeps``). First come, first kept: the shortest
        contexts, whose moments cost the fewest bytes per direction saved."""
        planned = self.plans[t]
        if planned is None or not carries_to_a_forward_of_its_own(capture):
            return False
        return self._keeps(t, len(planned.plans) * carried_bytes(capture))  # each Fisher's moments

    def release(self) -> None:
        """The response's forward is no longer needed (the exact pass captures each context)."""
        self.whole = None

    def take_plans(self, t: int) -> FisherPlans | None:
        """Position t's plans, handed over once to the exact pass."""
        planned, self.plans[t] = self.plans[t], None
        return planned

    def take_carried(self, t: int) -> dict[str, CarriedSquares] | None:
        """Position t's refining directions as the exact pass continues them, handed over once."""
        return self.carried.pop(t, None)

    def finished(self, t: int, record: PositionRecord) -> None:
        """Position t is exact: its record replaces the first pass's."""
        self.analysis.positions[t] = record

    def snapshot(self) -> SequenceAnalysis:
        return self.analysis

    def kept_share(self) -> float:
        """The share of the positions' summed trace(C_mu) that their directions so far carry."""
        traces = [(r.kept_share, r.trace) for r in self.analysis.positions]
        total = sum(trace for _, trace in traces)
        return sum(kept * trace for kept, trace in traces) / total if total > 0 else 1.0


def first_pass_model_part(
    sums: MomentSums,
    summed: dict[str, dict[str, float]],
    layout: HeadLayout,
    grams: FeatureGrams | None = None,
) -> dict:
    """A light summary's model part (``model_summary``: totals per tensor, layer, kind and model, no
    curve) of a response's first pass: the first moments' squares from ``sums``, the Fisher's and the
    squares summed over positions from each position's ``tensor_totals`` (``summed``). rho, a ratio per
    parameter, is not known (None). ``grams``: those of the forward the sums read (``FeatureGrams``)."""
    moments = {key: square_sums_of(table, grams) for key, table in sums.sums.items()}
    with_reward = "policy_grad" in sums.sums
    grouped = TotalsGroups(layout.shapes, layout.head_name, layout.embedding_name)
    for name in layout.names:
        squares = {key: values.get(name, 0.0) for key, values in summed.items()}
        totals: dict[str, float | None] = {
            **_second_moment_totals(squares),
            "mean_shift_sq": moments.get("mean_shift", {}).get(name, 0.0),
            "common_sq": moments["common"][name],
            "rho_mean": None,
        }
        if with_reward:
            totals["policy_grad_sq"] = moments["policy_grad"][name]
            totals["bound"] = squares["bound"]
        grouped.add(name, totals, math.prod(layout.shapes[name]))
    return {**grouped.groups(), "concentration": None, "top_coordinates": None, "overlap": None}


def _partial_analysis(
    layout: HeadLayout, inputs: PositionInputs, on_partial: SequencePartial
) -> PartialCallback:
    """A single position's moments so far passed on as the analysis they give (``_single``)."""

    def partial(moments_so_far: Callable[[], PositionMoments], kept: float) -> None:
        on_partial(lambda: _single(layout, inputs, moments_so_far()), kept)

    return partial


def _fold_position(
    result: SequenceAnalysis,
    record: PositionRecord,
    moments: PositionMoments,
    on_policy: bool,
    observe: Callable[[PositionMoments], None] | None = None,
    first_moments: bool = True,
) -> None:
    """Keep a position's record, show its moments to ``observe``, then fold them into the running sums
    (and, off the policy, the squared mean shift accumulated so far). ``first_moments=False``: sums
    whose first moments (and accumulated shift) a first pass folded in already take its second moments
    and the squares of its first."""
    result.positions.append(record)
    result.directions += moments.directions
    if observe is not None:
        observe(moments)
    if not first_moments:
        result.sums.add_second_moments(moments)
        return
    result.sums.add(moments)
    if not on_policy:
        result.accumulated_shift_sq.append(square_total_of(result.sums.sums.get("mean_shift", {})))


def _single(layout: HeadLayout, inputs: PositionInputs, moments: PositionMoments) -> SequenceAnalysis:
    """The analysis of one position from its moments (a partial result's snapshot)."""
    sums = MomentSums(layout.names, layout.shapes)
    sums.add(moments)
    record = _record(inputs, moments, None, tensor_totals(moments, inputs.on_policy))
    return SequenceAnalysis(sums, positions=[record], directions=moments.directions)


def _record(
    inputs: PositionInputs, m: PositionMoments, target: int | None, per_tensor: dict[str, dict[str, float]]
) -> PositionRecord:
    cov = m.cov_mu
    return PositionRecord(
        context_length=int(inputs.context_ids.numel()),
        target_id=target,
        p=inputs.p,
        mu=inputs.mu,
        h=m.hidden.to(torch.float64),
        head_scale=m.head_scale,
        moments_totals=_position_totals(per_tensor),
        spectrum=CovarianceSpectrum.of(cov),
        trace=cov.trace,
        support=cov.support,
        kept_share=m.plan_mu.kept_share,
        missing_estimate=m.plan_mu.missing_estimate,
        directions=int(m.plan_mu.vectors.shape[0]),
        reward_mean=m.reward_mean,
        reward_std=m.reward_std,
    )


def log_likelihood_gradient(
    model: nn.Module, prefix_ids: torch.Tensor, continuation_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """d log pi(y | x) / dtheta by one ordinary backward pass (the SFT gradient)."""
    full = torch.cat([prefix_ids, continuation_ids])
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    with torch.enable_grad():
        logits = model(input_ids=full[None, :-1], use_cache=False).logits[0]  # [L-1, V]
        start = prefix_ids.numel() - 1
        logp = torch.log_softmax(logits[start:].to(torch.float64), dim=-1)
        total = logp.gather(1, continuation_ids[:, None]).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True)
    return {
        n: (torch.zeros_like(p) if g is None else g.detach())
        for n, p, g in zip(names, params, grads, strict=True)
    }
