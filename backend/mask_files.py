"""Fisher mask files read without torch: their densities and tensors, a heatmap of one tensor's mask,
and two files' masks compared.

Why here and in numpy: a mask file (``q<q>/<param name>``, uint8, 1 = in the mask, written by a study)
is what a researcher takes back to training, and what the API draws and compares; reading it needs
safetensors and numpy only, so the service answers without a worker, and the CLI without loading a
model. Every read goes tensor by tensor: a 1.7B-parameter model's mask is never held whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from backend.compare import set_comparison_from_counts


class MaskFileError(ValueError):
    """A file that is not a fisherscope mask file, or two that cannot be compared (the message says why)."""


MASK_FILE = (
    "a mask file holds uint8 tensors of 0 and 1 keyed 'q<q>/<param name>' with 0 < q <= 1; give a file "
    "from fisherscope study --masks or GET /api/v1/studies/{id}/masks"
)
MASK_DTYPE = "U8"  # safetensors' name of uint8


def mask_key(q: float, name: str) -> str:
    return f"q{q:g}/{name}"


def _parse_key(key: str) -> tuple[float, str] | None:
    """(q, name) of a mask key spelled as ``mask_key`` spells it, or None."""
    prefix, _, name = key.partition("/")
    if not name or not prefix.startswith("q"):
        return None
    try:
        q = float(prefix[1:])
    except ValueError:
        return None
    # NaN fails the comparison; another spelling of q ('q0.010') would not be found again by mask_key
    if not 0 < q <= 1 or key != mask_key(q, name):
        return None
    return q, name


@dataclass
class MaskFile:
    """The header of a mask file: densities, parameter names in file order, shapes, metadata.

    Opening checks every key and dtype, and that each density covers the same parameters; the values
    are checked (0 or 1) as each tensor is read."""

    path: Path
    fractions: list[float]
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]

    @classmethod
    def open(cls, path: Path) -> MaskFile:
        try:
            with safe_open(str(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
                keys = list(handle.keys())  # noqa: SIM118  (safe_open has keys(), not iteration)
                slices = {key: handle.get_slice(key) for key in keys}
                layout = {key: (item.get_dtype(), tuple(item.get_shape())) for key, item in slices.items()}
        except (OSError, SafetensorError) as error:
            raise MaskFileError(f"{path} is not a readable safetensors file ({error})") from None
        by_q: dict[float, dict[str, tuple[int, ...]]] = {}
        for key, (dtype, shape) in layout.items():
            parsed = _parse_key(key)
            if parsed is None:
                raise MaskFileError(f"{path} holds {key!r}, not a mask key; {MASK_FILE}")
            if dtype != MASK_DTYPE:
                raise MaskFileError(f"{path} holds {key!r} as {dtype}, not uint8; {MASK_FILE}")
            q, name = parsed
            by_q.setdefault(q, {})[name] = shape
        if not by_q:
            raise MaskFileError(f"{path} holds no masks; {MASK_FILE}")
        return cls(path, sorted(by_q), _same_parameters(path, by_q), metadata)

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes.values())

    @property
    def model_id(self) -> str | None:
        return self.metadata.get("model_id")

    def check_fraction(self, q: float) -> float:
        for known in self.fractions:
            if abs(known - q) <= 1e-12 * max(known, q):
                return known
        raise MaskFileError(f"no mask of density {q:g}; this file holds {_listed(self.fractions)}")

    def mask(self, q: float, name: str) -> np.ndarray:
        """uint8 array shaped like the parameter, 1 inside the mask."""
        return self.mask_rows(q, name, None)

    def mask_rows(self, q: float, name: str, rows: tuple[int, int] | None) -> np.ndarray:
        """Rows ``start:stop`` of one parameter's mask (all of it for None), read without the rest: a
        large table's mask is compared a block of rows at a time."""
        if name not in self.shapes:
            raise MaskFileError(f"no parameter {name!r} in {self.path.name}")
        key = mask_key(self.check_fraction(q), name)
        with safe_open(str(self.path), framework="numpy") as handle:
            found = handle.get_tensor(key) if rows is None else handle.get_slice(key)[rows[0] : rows[1]]
            return self._checked(key, found)

    def masks(self, q: float, names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """(name, mask) for every parameter at density q (in the order of ``names``, else the file's),
        one tensor in memory at a time."""
        q = self.check_fraction(q)
        with safe_open(str(self.path), framework="numpy") as handle:
            for name in self.shapes if names is None else names:
                key = mask_key(q, name)
                yield name, self._checked(key, handle.get_tensor(key))

    def count(self, q: float) -> int:
        """Coordinates in the mask of density q, counted in the tensors."""
        return sum(int(np.count_nonzero(mask)) for _, mask in self.masks(q))

    def _checked(self, key: str, mask: np.ndarray) -> np.ndarray:
        if mask.size and mask.max() > 1:
            raise MaskFileError(f"{self.path} holds {mask.max()} in {key!r}, not only 0 and 1; {MASK_FILE}")
        return mask


def _same_parameters(path: Path, by_q: dict[float, dict[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """The parameters every density covers, each with one shape (a density short of one would fail
    only when that mask is read)."""
    (first_q, shapes), *others = by_q.items()
    for q, other in others:
        if other != shapes:
            differing = sorted(set(shapes) ^ set(other)) or [n for n in shapes if shapes[n] != other[n]]
            raise MaskFileError(
                f"{path}: the masks of density {first_q:g} and {q:g} differ at {differing[0]!r}; a mask "
                "file holds every parameter, in one shape, at each of its densities"
            )
    return shapes


def _group_edges(n: int, groups: int) -> np.ndarray:
    """At most ``groups`` contiguous ranges covering 0..n, as edges (the first 0, the last n)."""
    groups = max(1, min(groups, n))
    return np.unique(np.linspace(0, n, groups + 1).round().astype(np.int64))


def mask_heatmap(mask: np.ndarray, rows: int, cols: int) -> dict:
    """Coordinates in the mask per block of one tensor, on at most rows x cols blocks: a matrix as
    itself, a vector as one row, a 3-D tensor (experts) with its leading axes stacked as rows."""
    matrix = mask.reshape(1, -1) if mask.ndim <= 1 else mask.reshape(-1, mask.shape[-1])
    row_edges = _group_edges(matrix.shape[0], rows)
    col_edges = _group_edges(matrix.shape[1], cols)
    counts = np.add.reduceat(
        np.add.reduceat(matrix.astype(np.int64), row_edges[:-1], axis=0), col_edges[:-1], axis=1
    )
    return {
        "shape": [int(n) for n in counts.shape],
        "row_edges": row_edges.tolist(),
        "col_edges": col_edges.tolist(),
        "values": counts.astype(float).tolist(),
    }


def compare_mask_files(a: MaskFile, b: MaskFile) -> dict:
    """Overlap and Jaccard of two files' masks at every density both hold, each beside chance.

    The two must cover the same parameter names and shapes (two samplers, prompt sets or estimators of
    one model); counted tensor by tensor."""
    if a.shapes != b.shapes:
        missing = sorted(set(a.shapes) ^ set(b.shapes))
        detail = f"{missing[0]!r} is in only one" if missing else "a parameter's shape differs"
        raise MaskFileError(
            f"the two mask files cover different parameters ({detail}); compare masks of one model"
        )
    common = sorted(set(a.fractions) & set(b.fractions))
    if not common:
        raise MaskFileError(
            f"the two files share no mask density ({_listed(a.fractions)} against {_listed(b.fractions)})"
        )
    counts = []
    for q in common:
        both = size_a = size_b = 0
        for (_, mask_a), (_, mask_b) in zip(a.masks(q), b.masks(q, a.shapes), strict=True):
            in_a, in_b = mask_a.astype(bool), mask_b.astype(bool)
            both += int(np.count_nonzero(in_a & in_b))
            size_a += int(np.count_nonzero(in_a))
            size_b += int(np.count_nonzero(in_b))
        counts.append((both, size_a, size_b))
    return set_comparison_from_counts(common, counts)


def _listed(fractions: list[float]) -> str:
    return ", ".join(f"{q:g}" for q in fractions)
