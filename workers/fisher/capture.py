"""One forward pass of the unmodified model that records where every parameter enters it.

Why at the level of torch functions, not modules: a ``TorchFunctionMode`` sees each call the model's
own code makes (``F.linear``, ``x @ W.T``, ``addmm``, ``F.embedding``, ``W[e]``) whatever module class
wraps it, and hands every result back untouched, so the forward computes exactly what it computes
without us (no patched ``forward``, no hook that returns anything).

A parameter gets a *form* when every use of it is a call whose per-weight sensitivity can be formed
from activations (docs/design.md §3a):

- matrix: ``y = x W^T`` (nn.Linear, fused qkv/gate_up, ``x @ W.T``) or ``y = x W`` (GPT-2's Conv1D
  via ``addmm``), on the whole matrix or on one slice ``W[e]`` of a 3-D expert tensor (the rows are
  then the tokens the router sent to expert e in this very forward);
- embedding: ``y = W[idx]`` (token and learned position tables, any offset or later scale; the row
  at ``padding_idx`` gets no gradient, as in autograd).

Every other parameter (norm weights in any of their forms, biases, anything unusual) is
differentiated by autograd directly: exact by construction, B x size memory per chunk of directions,
which for a vector is what a form would cost anyway. A form is used only if its captured tensors were
not modified in place after the call; otherwise the parameter falls back to autograd too.

Index conventions (einsum): ``r`` row (token, or token routed to an expert), ``i`` in, ``o`` out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from workers.fisher.feature_grams import FeatureGrams

_TensorBase = torch._C.TensorBase
_LINEAR = {torch._C._nn.linear}
_MATMUL = {torch.matmul, _TensorBase.matmul, _TensorBase.__matmul__, torch.mm, _TensorBase.mm}
_ADDMM = {torch.addmm, _TensorBase.addmm}
_TRANSPOSE = {torch.t, _TensorBase.t, torch.transpose, _TensorBase.transpose}
_TRANSPOSE_PROPERTIES = (_TensorBase.__dict__["T"], _TensorBase.__dict__["mT"])
_SAME_VALUE = {_TensorBase.float, _TensorBase.to, _TensorBase.type_as, _TensorBase.contiguous}


class UnsupportedArchitecture(ValueError):
    """A model this engine cannot make exact; the message names the module and says why."""


@dataclass(frozen=True)
class ParamView:
    """A tensor the model's code derived from a parameter without changing its values.

    ``slice``: index e of a 3-D expert tensor (the view is ``param[e]``), or None for the whole matrix;
    ``transposed``: the view is the transpose of that matrix.
    """

    name: str
    slice: int | None = None
    transposed: bool = False


@dataclass
class MatrixUse:
    """One call ``y = x M^T`` (``transposed=False``) or ``y = x M`` (``transposed=True``).

    M is the parameter's matrix: the parameter itself, or its slice ``param[e]``.
    """

    view: ParamView
    feature: torch.Tensor  # [r, i] the call's input, detached
    output: torch.Tensor  # [..., o] the call's output as the graph holds it
    versions: tuple[int, int]


@dataclass
class EmbeddingUse:
    name: str
    indices: torch.Tensor  # [r] rows looked up
    output: torch.Tensor  # [..., o]
    padding_idx: int | None
    versions: tuple[int, int]


@dataclass
class MatrixBlock:
    """Every use of one matrix (a parameter, or one expert slice of it), rows concatenated."""

    name: str
    slice: int | None
    transposed: bool
    uses: list[MatrixUse]

    @cached_property
    def feature(self) -> torch.Tensor:  # [r, i]
        # one array per block, so that terms of several directions (and positions) built on it share it
        # (``first_moments._shared_side``) and a first moment's terms over them make one product
        return torch.cat([use.feature for use in self.uses]) if len(self.uses) > 1 else self.uses[0].feature


@dataclass
class EmbeddingBlock:
    name: str
    uses: list[EmbeddingUse]

    @property
    def indices(self) -> torch.Tensor:  # [r]
        return torch.cat([use.indices for use in self.uses])


@dataclass
class CapturedForward:
    """The forward of one context, with everything the direction pass needs still in the graph."""

    hidden: torch.Tensor  # [t, d] input of the LM head (the final normalized hidden states)
    head_output: torch.Tensor  # [1, t, V] l = W h (+ b), the graph's own tensor (autograd needs it whole)
    logits: torch.Tensor  # [1, t, V] z = g(l), the model's own logits
    matrices: list[MatrixBlock] = field(default_factory=list)
    embeddings: list[EmbeddingBlock] = field(default_factory=list)
    generic: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the parameter itself
    routes: dict[str, str] = field(
        default_factory=dict
    )  # name -> matrix | expert | embedding | autograd | head
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # the analysed position's row: the last one, unless this is a longer forward read at an earlier
    # position (``at``)
    last: int | None = None
    # the Gram matrices of its recorded features, shared by the contexts read from it (``at``)
    grams: FeatureGrams = field(default_factory=FeatureGrams)

    @property
    def length(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def position(self) -> int:
        """The row of the analysed position: its context is rows 0..position."""
        return self.length - 1 if self.last is None else self.last

    def at(self, position: int) -> CapturedForward:
        """This forward read as the context that ends at row ``position``, its graph and records shared.

        Why this is the context's own forward: in a causal model the rows after ``position`` do not reach
        it, so their gradients from its directions are exact zeros and add nothing to any moment
        (``directions.check_causal`` asserts it on the gradients); the rows up to it are the ones a forward
        of the context alone computes, up to float rounding. One forward of a response then serves all its
        positions, where a forward per position cost as much as their first moments' backward."""
        if not 0 <= position < self.length:
            raise ValueError(f"position {position} is outside a forward of {self.length} rows")
        rows = position + 1
        matrices = [
            replace(block, uses=[_context_use(use, self.length, rows) for use in block.uses])
            for block in self.matrices
        ]
        embeddings = [
            replace(block, uses=[_context_use(use, self.length, rows) for use in block.uses])
            for block in self.embeddings
        ]
        return replace(self, last=position, matrices=matrices, embeddings=embeddings)


def _context_use(use: MatrixUse | EmbeddingUse, length: int, rows: int):
    """A use's record cut to the context's first ``rows`` tokens where it has one row per token (a
    routed expert's rows are some tokens': kept whole, the later ones' gradients zero); its output, the
    graph's tensor, stays whole (``directions.context_rows`` cuts the gradients at it alike)."""
    if isinstance(use, MatrixUse):
        return replace(use, feature=use.feature[:rows]) if use.feature.shape[0] == length else use
    indices = use.indices.reshape(-1)
    return replace(use, indices=indices[:rows]) if indices.numel() == length else use


@dataclass
class _Call:
    output: object
    form: MatrixUse | EmbeddingUse | None
    others: list[str]  # parameters this call used in no recognised form


# argument types that hold no tensor
_NO_TENSORS = (int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout)


def _tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, nested ones included. Why not ``tree_leaves`` alone: it
    runs for every op of the forward, and most ops take tensors and numbers only (a 5-token forward of
    SmolLM2 spent a third of its 0.18 s flattening them)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif not isinstance(value, _NO_TENSORS):  # a container, or anything a pytree may open
            yield from (leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


class _UseRecorder(TorchFunctionMode):
    """Observe every torch call of the forward; note each parameter use, change nothing."""

    def __init__(self, params: dict[int, str]) -> None:
        super().__init__()
        self.views: dict[int, ParamView] = {key: ParamView(name) for key, name in params.items()}
        self.keep: list[torch.Tensor] = []  # views stay alive so their ids stay unique
        self.calls: list[_Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracked = [
            (leaf, self.views[id(leaf)]) for leaf in _tensors_in(args, kwargs) if id(leaf) in self.views
        ]
        if (
            not tracked
            or not _returns_tensor(out)
            or (isinstance(out, torch.Tensor) and id(out) in self.views)
        ):
            return out  # metadata, or a no-op that hands the parameter back (``w.float()`` in float32)
        view = self._derived_view(func, args, kwargs, out, tracked)
        if view is not None:
            self.views[id(out)] = view
            self.keep.append(out)
            return out
        form = self._form(func, args, kwargs, out)
        used = {v.name for _, v in tracked} - ({_form_name(form)} if form is not None else set())
        self.calls.append(_Call(out, form, sorted(used)))
        return out

    def _derived_view(self, func, args, kwargs, out, tracked) -> ParamView | None:
        if len(tracked) != 1 or not isinstance(out, torch.Tensor) or tracked[0][0] is not args[0]:
            return None
        source, view = tracked[0]
        if func in _SAME_VALUE and out.dtype == source.dtype and out.shape == source.shape:
            return view
        if _is_transpose(func, source, args, kwargs) and source.dim() == 2:
            return ParamView(view.name, view.slice, not view.transposed)
        if (
            func is _TensorBase.__getitem__
            and view.slice is None
            and not view.transposed
            and source.dim() == 3
        ):
            index = args[1]
            if isinstance(index, int) or (
                isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point()
            ):
                return ParamView(view.name, int(index))
        return None

    def _form(self, func, args, kwargs, out) -> MatrixUse | EmbeddingUse | None:
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        if func in _LINEAR:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            return self._matrix(x, weight, out, flip=True)
        if func in _MATMUL and len(args) == 2:
            return self._matrix(args[0], args[1], out, flip=False)
        if func in _ADDMM and len(args) == 3 and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            return self._matrix(args[1], args[2], out, flip=False)
        if func is F.embedding:
            return self._embedding(args, kwargs, out)
        return None

    def _matrix(self, x, weight, out, flip: bool) -> MatrixUse | None:
        """``y = x @ weight^T`` (flip, F.linear) or ``y = x @ weight``, weight a view of a parameter."""
        view = self.views.get(id(weight)) if isinstance(weight, torch.Tensor) else None
        if view is None or weight.dim() != 2 or not isinstance(x, torch.Tensor) or id(x) in self.views:
            return None
        # M is the parameter's matrix; y = x M^T when the call multiplies by M^T, else y = x M
        multiplies_by_transpose = flip != view.transposed
        feature = x.detach().reshape(-1, x.shape[-1])
        return MatrixUse(
            ParamView(view.name, view.slice, not multiplies_by_transpose),
            feature,
            out,
            (out._version, x._version),
        )

    def _embedding(self, args, kwargs, out) -> EmbeddingUse | None:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        weight, indices = bound.get("weight"), bound.get("input")
        if not isinstance(weight, torch.Tensor) or not isinstance(indices, torch.Tensor):
            return None
        view = self.views.get(id(weight))
        if view is None or view != ParamView(view.name):
            return None
        if bound.get("max_norm") is not None or bound.get("scale_grad_by_freq"):
            return None  # max_norm renormalizes the table in place; scaled gradients are not W[idx]
        padding = bound.get("padding_idx")
        if padding is not None and padding < 0:
            padding += weight.shape[0]
        return EmbeddingUse(view.name, indices.detach().reshape(-1), out, padding, (out._version, 0))


def _form_name(form: MatrixUse | EmbeddingUse) -> str:
    return form.view.name if isinstance(form, MatrixUse) else form.name


def _returns_tensor(out) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(out))


def _is_transpose(func, source: torch.Tensor, args, kwargs) -> bool:
    if (
        getattr(func, "__name__", "") == "__get__"
        and getattr(func, "__self__", None) in _TRANSPOSE_PROPERTIES
    ):
        return True
    if func in (torch.t, _TensorBase.t):
        return True
    if func in (torch.transpose, _TensorBase.transpose):
        dims = sorted(d % source.dim() for d in [*args[1:3], *kwargs.values()] if isinstance(d, int))
        return dims == [0, 1]
    return False


def model_part(model: nn.Module, accessor: str) -> nn.Module:
    """``model.<accessor>()`` (HF's get_input_embeddings, get_output_embeddings), checked."""
    get = getattr(model, accessor, None)
    part = get() if callable(get) else None
    if not isinstance(part, nn.Module):
        raise UnsupportedArchitecture(f"{type(model).__name__} has no {accessor}()")
    return part


def module_weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise UnsupportedArchitecture(f"{type(module).__name__} has no weight tensor")
    return weight


def capture_forward(model: nn.Module, input_ids: torch.Tensor) -> CapturedForward:
    """Run the whole model on ``input_ids`` [t], recording parameter uses and the LM head's input."""
    names = {id(p): n for n, p in model.named_parameters()}
    head = model_part(model, "get_output_embeddings")
    seen: dict[str, torch.Tensor] = {}

    def at_head(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen["hidden"], seen["head_output"] = inputs[0], output

    recorder = _UseRecorder(names)
    handle = head.register_forward_hook(at_head)
    try:
        with torch.enable_grad(), recorder:
            logits = model(input_ids=input_ids[None], use_cache=False).logits
    finally:
        handle.remove()
    if "hidden" not in seen:
        raise UnsupportedArchitecture(f"the output embedding {type(head).__name__} never ran in the forward")
    head_output = seen["head_output"]
    head_names = _head_parameter_names(model, head)
    calls = [call for call in recorder.calls if call.output is not head_output]
    if not any(call.output is head_output for call in recorder.calls):
        raise UnsupportedArchitecture(
            f"the output embedding {_module_name(model, head)} does not compute a linear map of its input"
        )
    capture = CapturedForward(hidden=seen["hidden"][0], head_output=head_output, logits=logits)
    _assign_routes(capture, model, calls, head_names)
    return capture


def _head_parameter_names(model: nn.Module, head: nn.Module) -> set[str]:
    own = {id(p) for p in head.parameters(recurse=False)}
    return {n for n, p in model.named_parameters() if id(p) in own}


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next((name for name, m in model.named_modules() if m is module), type(module).__name__)


def _assign_routes(
    capture: CapturedForward, model: nn.Module, calls: list[_Call], head_names: set[str]
) -> None:
    """Give each parameter a form when all its uses have one; every other parameter goes to autograd."""
    params = dict(model.named_parameters())
    matrix_uses: dict[str, list[MatrixUse]] = {}
    embedding_uses: dict[str, list[EmbeddingUse]] = {}
    unformed: set[str] = set()
    for call in calls:
        unformed.update(call.others)
        if isinstance(call.form, MatrixUse):
            matrix_uses.setdefault(call.form.view.name, []).append(call.form)
        elif isinstance(call.form, EmbeddingUse):
            embedding_uses.setdefault(call.form.name, []).append(call.form)
    for name, param in params.items():
        capture.shapes[name] = tuple(param.shape)
        matrices, embeddings = matrix_uses.get(name, []), embedding_uses.get(name, [])
        uses: list[MatrixUse | EmbeddingUse] = [*matrices, *embeddings]
        if name in unformed or (matrices and embeddings) or not all(map(_unchanged, uses)):
            route = "autograd"
        elif matrices and name in head_names:
            route = "autograd"  # a tied head used as a matrix on the input side: rows come from autograd
        elif embeddings:
            capture.embeddings.append(EmbeddingBlock(name, embeddings))
            route = "embedding"
        elif matrices and _add_matrix_blocks(capture, name, matrices):
            route = "expert" if matrices[0].view.slice is not None else "matrix"
        elif not uses and name in head_names:
            route = "head"
        else:
            route = "autograd"
        if route == "autograd" and param.requires_grad:
            capture.generic[name] = param
        capture.routes[name] = route


def _unchanged(use: MatrixUse | EmbeddingUse) -> bool:
    """The captured tensors are still what the call consumed and produced (no later in-place edit)."""
    feature = use.feature if isinstance(use, MatrixUse) else None
    return use.output._version == use.versions[0] and (feature is None or feature._version == use.versions[1])


def _add_matrix_blocks(capture: CapturedForward, name: str, uses: list[MatrixUse]) -> bool:
    """One block per (slice, orientation); mixed whole/slice or mixed orientations are left to autograd."""
    sliced = {use.view.slice is not None for use in uses}
    blocks: dict[int | None, list[MatrixUse]] = {}
    for use in uses:
        blocks.setdefault(use.view.slice, []).append(use)
    if len(sliced) > 1 or any(len({u.view.transposed for u in group}) > 1 for group in blocks.values()):
        return False
    for index, group in sorted(blocks.items(), key=lambda item: -1 if item[0] is None else item[0]):
        capture.matrices.append(MatrixBlock(name, index, group[0].view.transposed, group))
    return True
