"""Every per-parameter moment at one position s, computed without one backward per token.

Outside the LM head kappa_{i,a} = j_a^T u_i (J = dz/dh, rows j_a = g'(l_a) w_a), so
  fisher_i   = u_i^T C_mu u_i              (eigen-directions of C_mu, squared per block),
  kbar^q_i   = jbar_q^T u_i                (one direction each: q = mu, q = p),
  policy_grad_i = g^T u_i, g = sum_a mu_a (r_a - rbar) j_a.
The LM head is closed form (kappa_{(c,k),a} = 1[a=c] g'(l_c) h_k, its bias the same without h_k); a
tied embedding adds its input-side terms and the cross term 2 mu_c g'(l_c) h_k (j_c - jbar)^T u_{(c,k)}.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from backend.vocabulary import Method
from workers.fisher.block_squares import CarriedSquares
from workers.fisher.capture import (
    CapturedForward,
    UnsupportedArchitecture,
    capture_forward,
    model_part,
    module_weight,
)
from workers.fisher.covariance import (
    OutputCovariance,
    leading_rows_covariance,
    mean_logit_row,
    output_covariance,
)
from workers.fisher.directions import (
    ChunkCallback,
    DirectionResults,
    EmbeddingRowProbe,
    LinearGroup,
    SquareGroup,
    backprop_directions,
    backprop_positions,
)
from workers.fisher.first_moments import Factored, FirstMoment, HeadOuter, Whole
from workers.fisher.logit_map import LogitJacobian, logit_jacobian
from workers.fisher.methods import SecondMomentPlan, second_moment_plan

Params = dict[str, torch.Tensor]
PartialCallback = Callable[[Callable[[], "PositionMoments"], float], None]


@dataclass
class PositionInputs:
    """What defines one position: the context ids and the distributions over its next token."""

    context_ids: torch.Tensor  # [t] long
    p: torch.Tensor  # [V] float64, the model's softmax
    mu: torch.Tensor  # [V] float64, the sampler
    reward: torch.Tensor | None  # [V] float64 reward over next tokens, or None
    on_policy: bool  # mu == p by construction (the sampler's config, not a float comparison)
    # off the policy, also the second moment under p (d_model directions more), which only rho needs
    fisher_under_p: bool = True


@dataclass
class PositionMoments:
    """Base per-parameter moments at one position (name -> tensor shaped like the parameter).

    fisher: Var_mu[kappa]; fisher_p: Var_p[kappa] (the same dict on-policy; None off the policy when it
    was not asked for); kbar_mu, kbar_p: mean sensitivities; policy_grad: Cov_mu(r, kappa) when a reward
    is given.
    """

    fisher: Params
    fisher_p: Params | None
    kbar_mu: FirstMoment  # the first moments in their small form (``first_moments``)
    kbar_p: FirstMoment
    policy_grad: FirstMoment | None
    hidden: torch.Tensor  # [d] h(s)
    head_scale: torch.Tensor  # [V] float64 g'(l): the logit map's derivative (ones for a linear head)
    cov_mu: OutputCovariance
    plan_mu: SecondMomentPlan
    reward_mean: float | None = None
    reward_std: float | None = None
    fisher_zero: bool = False  # the centered Fisher is identically 0 (one-hot mu)
    directions: int = 0  # back-propagated by this process
    # per Fisher, what its directions leave for a later pass of this context (``PositionWork.of``'s
    # ``carry``): a response's refining round, for its exact pass
    carried: dict[str, CarriedSquares] | None = None


@dataclass
class HeadLayout:
    """Where the LM head lives among the named parameters, and whether it is the input embedding."""

    head_name: str
    head_bias_name: str | None
    embedding_name: str
    tied: bool
    names: list[str]
    shapes: dict[str, tuple[int, ...]]

    @staticmethod
    def of(model: nn.Module) -> HeadLayout:
        head = model_part(model, "get_output_embeddings")
        weight = module_weight(head)
        if weight.dim() != 2:
            raise UnsupportedArchitecture(f"the LM head weight has shape {tuple(weight.shape)}, not [V, d]")
        bias = getattr(head, "bias", None)
        embedding = module_weight(model_part(model, "get_input_embeddings"))
        names, shapes = [], {}
        found: dict[str, str] = {}
        for name, param in model.named_parameters():
            names.append(name)
            shapes[name] = tuple(param.shape)
            for key, tensor in (("head", weight), ("bias", bias), ("embedding", embedding)):
                if param is tensor:
                    found[key] = name
        if "head" not in found:
            raise UnsupportedArchitecture("the LM head weight is not among the model's parameters")
        return HeadLayout(
            found["head"], found.get("bias"), found.get("embedding", ""), weight is embedding, names, shapes
        )


def head_rows(model: nn.Module) -> torch.Tensor:
    return module_weight(model_part(model, "get_output_embeddings")).detach()


def looked_up_rows(capture: CapturedForward, name: str) -> list[int]:
    """Rows of a tied table that get input-side gradient: the ids its lookups read (no padding row; of a
    longer forward read at a position, the context's, ``CapturedForward.at``)."""
    if capture.routes.get(name) == "autograd":
        raise UnsupportedArchitecture(
            f"the tied table {name} is read by something other than an embedding lookup; its cross "
            "term with the LM head needs the rows it reads"
        )
    rows: set[int] = set()
    for block in capture.embeddings:
        if block.name == name:
            for use in block.uses:
                ids = set(use.indices.tolist())
                rows |= ids - {use.padding_idx}
    return sorted(rows)


def position_moments(
    model: nn.Module,
    inputs: PositionInputs,
    method: Method,
    capture: CapturedForward | None = None,
    *,
    memory_budget_bytes: int,
    held_bytes: int = 0,
    progress: Callable[[float], None] | None = None,
    on_partial: PartialCallback | None = None,
    planned: FisherPlans | None = None,
    carried: dict[str, CarriedSquares] | None = None,
) -> PositionMoments:
    """Every base moment at the last position of ``inputs.context_ids``.

    ``planned``: this position's ``fisher_plans``, when already made (a response's first pass makes
    them, cut to a first chunk of directions by ``FisherPlans.leading``, and its exact pass reuses them).
    ``carried``: per Fisher, its leading directions of ``planned`` as an earlier pass left them
    (``PositionWork.of``). ``held_bytes``: what the caller holds meanwhile of the workspace's share
    between chunks (``backprop_directions``).

    ``on_partial(moments, kept_share)``, when given, is called after each chunk of directions but the
    last: ``moments()`` assembles what the directions so far give (the result of C_q truncated to them:
    a lower bound but on a tied table's context rows, whose cross term has either sign; first moments
    exact; read before ``on_partial`` returns), ``kept_share`` is the share of trace(C_mu) they carry.
    """
    capture = capture or capture_forward(model, inputs.context_ids)
    work = PositionWork.of(model, inputs, method, capture, planned, carried=carried)
    results = backprop_directions(
        capture,
        capture.position,
        work.squares,
        work.linears,
        work.probes,
        memory_budget_bytes=memory_budget_bytes,
        held_bytes=held_bytes,
        progress=progress,
        on_chunk=None if on_partial is None else _partial_per_chunk(work.plan_mu, work.build, on_partial),
    )
    results.directions += work.earlier_directions
    return work.build(results)


def positions_moments(
    works: Iterable[PositionWork], memory_budget_bytes: int
) -> Iterator[tuple[PositionWork, PositionMoments]]:
    """``position_moments`` of positions read from one forward (``CapturedForward.at``), their directions
    back-propagated together (``backprop_positions``); each position's moments are made after the one
    before is taken (a position's Fisher is parameter-sized: the caller drops each before the next)."""
    taken: deque[PositionWork] = deque()

    def directions() -> Iterator[tuple]:
        for work in works:
            taken.append(work)
            yield work.capture, work.squares, work.linears, work.probes

    for results in backprop_positions(directions(), memory_budget_bytes):
        work = taken.popleft()
        yield work, work.build(results)


@dataclass
class PositionWork:
    """A position's directions (its Fisher's square groups, its first moments, the tied probes) and how
    its moments are made from what they bring back (``build``), before any backward runs."""

    inputs: PositionInputs
    capture: CapturedForward
    squares: list[SquareGroup]
    linears: list[LinearGroup]
    probes: list[EmbeddingRowProbe]
    plan_mu: SecondMomentPlan
    build: _Assembly
    # the Fisher's directions an earlier pass back-propagated (``carried``), counted as this position's
    earlier_directions: int = 0

    @classmethod
    def of(
        cls,
        model: nn.Module,
        inputs: PositionInputs,
        method: Method,
        capture: CapturedForward,
        planned: FisherPlans | None = None,
        fisher_totals: bool = False,
        *,
        carry: bool = False,
        carried: dict[str, CarriedSquares] | None = None,
    ) -> PositionWork:
        """``fisher_totals``: of each Fisher only its tensors' totals (float64 scalars), never formed
        (``SquareTotals``): what a response's first pass keeps of a position without a reward (the
        bound, std(r) sum sqrt(F), needs F per parameter). ``carry``: with them, what the directions
        leave for a later pass of the context (``PositionMoments.carried``).

        ``carried``: per Fisher, the leading directions of ``planned`` that an earlier pass did: only
        the others go back, added to what it left. Taken where ``capture`` has the same rows as the
        forward they were done on (``CarriedSquares.fits``), else every direction goes back."""
        if fisher_totals and inputs.reward is not None:
            raise ValueError("the bound needs the Fisher per parameter: not its totals alone")
        if carried is not None and planned is None:
            raise ValueError("carried directions are of given plans")
        carried = {name: c for name, c in (carried or {}).items() if c.fits(capture)}
        layout = HeadLayout.of(model)
        h = capture.hidden[capture.position].detach()
        jacobian = position_jacobian(model, capture)
        planned = planned or _fisher_plans(layout, inputs, capture, jacobian, method)
        cov_mu, p_row, plans = planned.cov_mu, planned.p_row, planned.plans
        done = {name: c.directions for name, c in carried.items()}
        squares = [
            SquareGroup(
                name,
                plan.vectors[done.get(name, 0) :],
                plan.weights[done.get(name, 0) :],
                fisher_totals,
                carry=carry,
                carried=carried.get(name),
            )
            for name, plan in plans.items()
        ]
        linears = [LinearGroup("kbar_mu", cov_mu.mean_row)]
        if not inputs.on_policy:
            linears.append(LinearGroup("kbar_p", p_row))
        reward_mean, reward_std, policy_grad = _reward_direction(inputs, jacobian)
        if policy_grad is not None:
            linears.append(policy_grad)
        probes = _tied_row_probes(layout, plans, carried)
        build = _Assembly(layout, h, jacobian, inputs, plans, cov_mu, reward_mean, reward_std, fisher_totals)
        earlier = sum(done.values())
        return cls(inputs, capture, squares, linears, probes, plans["fisher"], build, earlier)


@dataclass
class FisherPlans:
    """C_mu, p's mean logit row jbar_p (kbar_p's direction), and the directions of each Fisher:
    ``fisher`` under mu and, off-policy when asked, ``fisher_p`` under p."""

    cov_mu: OutputCovariance
    p_row: torch.Tensor
    plans: dict[str, SecondMomentPlan]
    # each covariance read every row of its q (``OutputCovariance.whole``): else the plans are a first
    # pass's lower bound, and the exact pass makes its own
    whole: bool = True

    def leading(self, count: int) -> FisherPlans:
        """Each Fisher's plan cut to its first ``count`` directions (``SecondMomentPlan.leading``)."""
        plans = {k: p.leading(count) for k, p in self.plans.items()}
        return FisherPlans(self.cov_mu, self.p_row, plans, self.whole)

    @property
    def directions(self) -> int:
        """The square directions of the Fisher under mu (of a first pass's lower bound, the most that C_mu
        can have: min(n - 1, d))."""
        if not self.whole:
            return min(self.cov_mu.support - 1, int(self.cov_mu.eigenvalues.numel()))
        return int(self.plans["fisher"].vectors.shape[0])

    def nbytes(self) -> int:
        """What keeping these plans holds: C_mu's eigenvectors (and its rows, where it was decomposed from
        them) and each plan's directions and probes."""
        arrays = [self.cov_mu.eigenvectors, self.p_row]
        if self.cov_mu.support_rows is not None:
            arrays.append(self.cov_mu.support_rows)
        for plan in self.plans.values():
            arrays += [plan.vectors, plan.head_coefficient, *plan.probes.values()]
        return sum(a.numel() * a.element_size() for a in arrays)


def fisher_plans(
    model: nn.Module,
    inputs: PositionInputs,
    capture: CapturedForward,
    method: Method,
    known: KnownRows | None = None,
) -> FisherPlans:
    """The plans ``position_moments`` makes at the last position of ``capture`` (to make them once);
    ``known``: what a response's first pass read of the head for several positions at once."""
    jacobian = position_jacobian(model, capture)
    return _fisher_plans(HeadLayout.of(model), inputs, capture, jacobian, method, known)


def position_jacobian(
    model: nn.Module, capture: CapturedForward, position: int | None = None
) -> LogitJacobian:
    """The logit Jacobian at ``position`` of ``capture`` (its last, where not given)."""
    return logit_jacobian(capture, capture.position if position is None else position, head_rows(model))


@dataclass
class KnownRows:
    """What a response's first pass gives a position's plans: jbar under mu and under p where read for
    several positions at once (``mean_logit_rows``; None: not read), and the number of most probable
    rows to read of a C_q whose q draws more (``leading_rows_covariance``; ``row_norms``: |w_a|^2)."""

    mu_row: torch.Tensor | None
    p_row: torch.Tensor | None
    rows: int
    row_norms: torch.Tensor


def _fisher_plans(
    layout: HeadLayout,
    inputs: PositionInputs,
    capture: CapturedForward,
    jacobian: LogitJacobian,
    method: Method,
    known: KnownRows | None = None,
) -> FisherPlans:
    """C_p itself is formed only for the Fisher under p: its V d^2 Gram product costs a second per
    position on SmolLM2."""
    table_rows = looked_up_rows(capture, layout.head_name) if layout.tied else []

    def covariance(q: torch.Tensor, mean_row: torch.Tensor | None) -> OutputCovariance:
        if known is not None and mean_row is not None and int((q > 0).sum()) > known.rows:
            return leading_rows_covariance(jacobian, q, known.rows, mean_row, known.row_norms)
        return output_covariance(jacobian, q)

    cov_mu = covariance(inputs.mu, None if known is None else known.mu_row)
    plans = {"fisher": second_moment_plan(inputs.mu, cov_mu, jacobian, table_rows, method)}
    if inputs.on_policy:
        return FisherPlans(cov_mu, cov_mu.mean_row, plans, cov_mu.whole)
    p_row = None if known is None else known.p_row
    if not inputs.fisher_under_p:
        return FisherPlans(
            cov_mu, mean_logit_row(jacobian, inputs.p) if p_row is None else p_row, plans, cov_mu.whole
        )
    cov_p = covariance(inputs.p, p_row)
    plans["fisher_p"] = second_moment_plan(inputs.p, cov_p, jacobian, table_rows, method)
    return FisherPlans(cov_mu, cov_p.mean_row, plans, cov_mu.whole and cov_p.whole)


def _reward_direction(
    inputs: PositionInputs, jacobian: LogitJacobian
) -> tuple[float | None, float | None, LinearGroup | None]:
    """The reward's mean and standard deviation under mu, and the policy gradient's direction
    g = sum_a mu_a (r_a - rbar) j_a; all None without a reward."""
    if inputs.reward is None:
        return None, None, None
    reward_mean = float(inputs.mu @ inputs.reward)
    centered_reward = inputs.reward - reward_mean
    reward_std = float((inputs.mu @ centered_reward.square()).sqrt())
    return reward_mean, reward_std, LinearGroup("policy_grad", jacobian.combine(inputs.mu * centered_reward))


def _tied_row_probes(
    layout: HeadLayout, plans: dict[str, SecondMomentPlan], carried: dict[str, CarriedSquares]
) -> list[EmbeddingRowProbe]:
    """The tied cross term's probes: per Fisher, one per table row the context reads. Of a Fisher whose
    leading directions were carried, a probe summed from coordinates takes the rest's and starts from
    the carried row (a probe with a backward of its own is whole without it)."""
    # a probe is summed from its group's per-direction rows where those directions are a complete basis
    # (exact, full-rank C_q): one backward per prefix token less (25 of 601 directions at 32 tokens)
    probes = []
    for group, (name, plan) in enumerate(plans.items()):
        earlier = carried.get(name)
        done = 0 if earlier is None else earlier.directions
        summed = plan.complete_basis or plan.probes_on_kept
        for c, vector in plan.probes.items():
            key = f"{name}:{c}"
            probes.append(
                EmbeddingRowProbe(
                    key,
                    layout.head_name,
                    c,
                    vector,
                    group=group,
                    coordinates=plan.vectors[done:] @ vector if summed else None,
                    start=earlier.probes[key] if summed and earlier is not None else None,
                )
            )
    return probes


def _partial_per_chunk(
    plan_mu: SecondMomentPlan, build: _Assembly, on_partial: PartialCallback
) -> ChunkCallback:
    """``on_partial`` after each chunk: the moments so far, and the share of trace(C_mu) they carry."""
    trace = float(plan_mu.weights.sum())

    def chunk_callback(snapshot: Callable[[], DirectionResults], done: list[int]) -> None:
        kept = float(plan_mu.weights[: done[0]].sum()) / trace if trace > 0 else 1.0
        on_partial(lambda: build(snapshot()), kept)

    return chunk_callback


@dataclass
class _Assembly:
    """Direction results plus the LM head's closed forms: every base moment, parameter-shaped."""

    layout: HeadLayout
    h: torch.Tensor
    jacobian: LogitJacobian
    inputs: PositionInputs
    plans: dict[str, SecondMomentPlan]
    cov_mu: OutputCovariance
    reward_mean: float | None
    reward_std: float | None
    # each Fisher as its tensors' totals (float64 scalars; ``PositionWork.of``)
    fisher_totals: bool = False

    def __call__(self, results: DirectionResults) -> PositionMoments:
        layout, h = self.layout, self.h
        head = HeadTerms(layout, h, self.jacobian.head_scale())
        if self.fisher_totals:
            return self._moments(
                results,
                head,
                {name: head.second_moment_totals(results, name, plan) for name, plan in self.plans.items()},
            )

        # the head's closed form goes into the results' own head tensor, a copy where a snapshot's is
        # still the running pass's sum
        def own(group: str) -> bool:
            return results.owns(group, layout.head_name)

        second: dict[str, Params] = {}
        for name, plan in self.plans.items():
            params = head.second_moment(results.squares.get(name), plan.head_coefficient, in_place=own(name))
            for c in plan.probes:  # tied cross term, rows the context reads only
                row = results.probes.get(f"{name}:{c}")
                if row is not None:
                    params[layout.head_name][c] += 2 * head.scale[c].to(h.dtype) * h * row.to(h.dtype)
            second[name] = params
        return self._moments(results, head, second)

    def _moments(
        self, results: DirectionResults, head: HeadTerms, second: dict[str, Params]
    ) -> PositionMoments:
        inputs = self.inputs
        kbar_mu = head.first_moment(results.linears.get("kbar_mu"), inputs.mu)
        kbar_p = kbar_mu if inputs.on_policy else head.first_moment(results.linears.get("kbar_p"), inputs.p)
        policy_grad = None
        if self.reward_mean is not None and inputs.reward is not None:
            centered = inputs.mu * (inputs.reward - self.reward_mean)
            policy_grad = head.first_moment(results.linears.get("policy_grad"), centered)
        plan_mu = self.plans["fisher"]
        return PositionMoments(
            fisher=second["fisher"],
            fisher_p=second["fisher"] if inputs.on_policy else second.get("fisher_p"),
            kbar_mu=kbar_mu,
            kbar_p=kbar_p,
            policy_grad=policy_grad,
            hidden=self.h,
            head_scale=self.jacobian.head_scale(),
            cov_mu=self.cov_mu,
            plan_mu=plan_mu,
            reward_mean=self.reward_mean,
            reward_std=self.reward_std,
            fisher_zero=self.cov_mu.support <= 1,  # a point mass has no variance: every Fisher is 0
            directions=results.directions,
            carried=results.carried or None,
        )


@dataclass
class HeadTerms:
    """Adds the LM head's closed form to the input-side moments (``first_moment``, ``second_moment``);
    a tensor the directions did not reach is zero."""

    layout: HeadLayout
    h: torch.Tensor  # [d]
    scale: torch.Tensor  # [V] float64 g'(l)

    def first_moment(self, input_side: FirstMoment | None, coefficient: torch.Tensor) -> FirstMoment:
        """The first moment with the head's closed form, still in its small form: the head's terms are
        coefficient_c g'(l_c) times h (the weight) and times 1 (the bias)."""
        h = self.h
        per_row = (coefficient * self.scale).to(h.dtype)  # [V]
        entries: dict[str, Factored | torch.Tensor] = {}
        given = input_side.entries if input_side is not None else {}
        for name in self.layout.names:
            entry = given.get(name)
            if entry is None:
                entry = Factored(self.layout.shapes[name], h.dtype, h.device)
            elif isinstance(entry, torch.Tensor):  # summed over processes: whole already
                entry = Factored(self.layout.shapes[name], h.dtype, h.device, (Whole(entry.to(h.dtype)),))
            if name == self.layout.head_name:
                entry = entry.plus(HeadOuter(per_row, h))
            if name == self.layout.head_bias_name:
                entry = entry.plus(HeadOuter(per_row, None))
            entries[name] = entry
        return FirstMoment(entries)

    def second_moment_totals(self, results: DirectionResults, group: str, plan: SecondMomentPlan) -> Params:
        """``second_moment`` with the tied cross term as each tensor's total (float64 scalars), from the
        square group's totals (``SquareTotals``): the head's closed form adds sum_c coefficient_c
        ||h||^2 (the bias: sum_c coefficient_c), the cross term 2 sum_c g'(l_c) h . probe_c."""
        h = self.h.double()
        coefficient = float(plan.head_coefficient.sum())
        given = results.squares.get(group, {})
        zero = torch.zeros((), dtype=torch.float64)
        out = {name: given.get(name, zero).double() for name in self.layout.names}
        out[self.layout.head_name] = out[self.layout.head_name] + coefficient * float(h @ h)
        if self.layout.head_bias_name is not None:
            out[self.layout.head_bias_name] = out[self.layout.head_bias_name] + coefficient
        for c in plan.probes:  # tied cross term, rows the context reads only
            row = results.probes.get(f"{group}:{c}")
            if row is not None:
                cross = 2 * float(self.scale[c]) * float(h @ row.double())
                out[self.layout.head_name] = out[self.layout.head_name] + cross
        return out

    def second_moment(
        self,
        input_side: Params | None,
        coefficient: torch.Tensor,
        in_place: bool = False,
        absent: Collection[str] = (),
    ) -> Params:
        """The squares with the head's closed form (``coefficient`` carries g'^2): coefficient_c h_k^2 on
        the weight, coefficient_c on the bias; zeros for tensors the directions did not reach, but those
        ``absent`` (whose squares the caller forms elsewhere), left out.
        ``in_place``: the head's closed form is added into ``input_side``'s head tensor, which the caller
        gives up (a fresh head-sized array costs a page fault per 4 kB, more than the addition)."""
        h, dtype = self.h, self.h.dtype
        per_row = coefficient.to(dtype)  # [V]
        features = h * h
        out: Params = {}
        for name in self.layout.names:
            if name in absent:
                continue
            value = (input_side or {}).get(name)
            if name == self.layout.head_name:
                if value is None:
                    value = torch.outer(per_row, features)
                else:
                    value = value.to(dtype)
                    value = value.addr_(per_row, features) if in_place else value.addr(per_row, features)
            elif value is None:
                value = torch.zeros(self.layout.shapes[name], dtype=dtype, device=h.device)
            else:
                value = value.to(dtype)
            if name == self.layout.head_bias_name:
                value = value + per_row
            out[name] = value
        return out
