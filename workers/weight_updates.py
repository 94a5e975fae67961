"""Where a fine-tuning run changed the weights: two checkpoints of one model compared tensor by tensor.

For every parameter: how many coordinates changed (the stored values differ), how many changed
visibly in bf16 (both values rounded to bfloat16 differ: the comparison the papers on the sparsity of
RL updates make, under which a change below about half a bf16 step, 2^-9 of the value, vanishes), and
the global top-q sets by |delta| (float32, exact thresholds, ties by index as in the Fisher masks). With
a Fisher mask file, each of these sets is laid over each of the file's masks: overlap and Jaccard beside
their values for an independent random set of the same density.

Why straight from the safetensors files, a block of rows at a time: two checkpoints of an 8B model are
64 GB in float32; read as slices of at most ``PIECE_VALUES`` values, the comparison holds a few blocks,
whatever the model's size. The model itself is built on the meta device, for its parameter names, the
head and the embedding (no weights are loaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.mask_files import MaskFile, MaskFileError
from backend.registry import ModelNotAvailable, UnknownModel, check_id, model_dir, model_info
from backend.vocabulary import PIECE_VALUES
from workers.fisher.concentration import Threshold, histogram, thresholds
from workers.fisher.grouping import layer_of, module_kind
from workers.fisher.position import HeadLayout
from workers.models.folder import sha256_digest, weight_files
from workers.models.loading import ModelLoadError, causal_lm_config

BF16_TOLERANCE = (
    "changed in bf16: the two values differ once each is rounded to bfloat16 (round to nearest even); "
    "a change smaller than about half a bf16 step (2^-9 of the value) can vanish"
)
EXACT_TOLERANCE = "changed: the two stored values differ (any change, compared in the wider dtype)"
DELTA = "|delta| = |after - before| in float32; top-q sets hold exactly ceil(q P) coordinates, ties by index"


class UpdatesError(ValueError):
    """Two checkpoints (or a mask file) that cannot be compared; the message says why and what to give."""


@dataclass(frozen=True)
class Checkpoint:
    """A model's weights on disk: a registered id's cache folder or a Hugging Face folder."""

    label: str
    folder: Path
    digest: str
    files: list[Path]
    trust_remote_code: bool = False

    @classmethod
    def open(cls, id_or_folder: str) -> Checkpoint:
        folder = Path(id_or_folder).expanduser()
        if folder.is_dir():
            files = _safetensors(folder)
            return cls(id_or_folder, folder, sha256_digest(files), files)
        try:
            check_id(id_or_folder)
            info = model_info(id_or_folder)
        except UnknownModel:
            raise UpdatesError(
                f"{id_or_folder!r} is neither a model folder nor a registered id; give a folder or an id "
                "from fisherscope models"
            ) from None
        except ModelNotAvailable:
            raise UpdatesError(
                f"{id_or_folder} is not in the cache yet; run fisherscope fetch {id_or_folder}"
            ) from None
        folder = model_dir(id_or_folder)
        return cls(id_or_folder, folder, info.digest, _safetensors(folder), info.trust_remote_code)

    def layout(self) -> HeadLayout:
        """Parameter names and shapes, the head and the embedding, from the config (meta device)."""
        from transformers import AutoModelForCausalLM

        try:
            config = causal_lm_config(str(self.folder), trust_remote_code=self.trust_remote_code)
        except ModelLoadError as error:
            raise UpdatesError(str(error)) from None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=self.trust_remote_code)
        return HeadLayout.of(model)


def _safetensors(folder: Path) -> list[Path]:
    """The folder's weight files, which must be safetensors (read a block of rows at a time)."""
    files = weight_files(folder)
    if not files or files[0].suffix != ".safetensors":
        raise UpdatesError(f"{folder} holds no *.safetensors weights; save the checkpoint as safetensors")
    return files


@dataclass(frozen=True)
class Block:
    """Rows ``start:stop`` (of the flattened leading axis) of one parameter in both checkpoints."""

    name: str
    before: torch.Tensor
    after: torch.Tensor
    rows: tuple[int, int] | None = None  # (start, stop); None: the whole tensor (a scalar)

    def delta(self) -> torch.Tensor:
        """|after - before| in float32, flattened."""
        return (self.after.float() - self.before.float()).abs_().reshape(-1)


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool: the values differ (NaN against NaN is unchanged; in the wider of the two dtypes)."""
    return (a != b) & ~(a.isnan() & b.isnan())


@dataclass
class Counts:
    params: int = 0
    changed: int = 0
    changed_bf16: int = 0

    def add(self, other: Counts) -> None:
        self.params += other.params
        self.changed += other.changed
        self.changed_bf16 += other.changed_bf16

    def as_dict(self) -> dict[str, int | float]:
        share = (lambda n: n / self.params) if self.params else (lambda n: 0.0)
        return {
            "params": self.params,
            "changed": self.changed,
            "changed_bf16": self.changed_bf16,
            "changed_share": share(self.changed),
            "changed_bf16_share": share(self.changed_bf16),
        }


@dataclass
class CheckpointPair:
    """Two checkpoints of one architecture, read a block of rows at a time."""

    before: Checkpoint
    after: Checkpoint
    layout: HeadLayout
    where: tuple[dict[str, Path], dict[str, Path]] = field(default_factory=lambda: ({}, {}))

    @classmethod
    def open(cls, before: str, after: str) -> CheckpointPair:
        first = Checkpoint.open(before)
        pair = cls(first, Checkpoint.open(after), first.layout())
        other = pair.after.layout()
        if other.names != pair.layout.names or other.shapes != pair.layout.shapes:
            differing = next(
                (n for n in pair.layout.names if pair.layout.shapes.get(n) != other.shapes.get(n)),
                next(iter(set(other.names) - set(pair.layout.names)), "?"),
            )
            raise UpdatesError(
                f"{before} and {after} are not one architecture (they differ at {differing!r}); compare two "
                "checkpoints of the same model"
            )
        pair.where = (pair._index(pair.before), pair._index(pair.after))
        return pair

    def _index(self, checkpoint: Checkpoint) -> dict[str, Path]:
        """Which file holds each parameter, its stored shape checked against the architecture's."""
        where: dict[str, Path] = {}
        for path in checkpoint.files:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        where[key] = path
                        shape = tuple(handle.get_slice(key).get_shape())
                        expected = self.layout.shapes.get(key)
                        if expected is not None and shape != expected:
                            raise UpdatesError(
                                f"{checkpoint.label} stores {key!r} as {list(shape)}, its config says "
                                f"{list(expected)}; the folder's config and weights disagree"
                            )
            except (OSError, SafetensorError) as error:
                raise UpdatesError(f"{path} is not a readable safetensors file ({error})") from None
        missing = [name for name in self.layout.names if name not in where]
        if missing:
            raise UpdatesError(
                f"{checkpoint.label} has no tensor {missing[0]!r}; is it a complete checkpoint?"
            )
        return where

    @property
    def n_params(self) -> int:
        return sum(math.prod(self.layout.shapes[name]) for name in self.layout.names)

    def blocks(self) -> Iterator[Block]:
        """Every parameter in the layout's order, in blocks of whole rows of at most ``PIECE_VALUES``."""
        with ExitStack() as stack:
            handles: dict[Path, object] = {}

            def handle(path: Path):
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                return handles[path]

            for name in self.layout.names:
                shape = self.layout.shapes[name]
                before = handle(self.where[0][name]).get_slice(name)  # type: ignore[attr-defined]
                after = handle(self.where[1][name]).get_slice(name)  # type: ignore[attr-defined]
                if not shape:
                    yield Block(name, before[:], after[:])
                    continue
                row = math.prod(shape[1:])
                rows = max(1, PIECE_VALUES // max(row, 1))
                for start in range(0, shape[0], rows):
                    stop = min(start + rows, shape[0])
                    yield Block(name, before[start:stop], after[start:stop], (start, stop))


def changed(block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """bool, flattened: the coordinates that changed, and those that changed visibly in bf16."""
    exact = differs(block.before, block.after)
    rounded = differs(block.before.to(torch.bfloat16), block.after.to(torch.bfloat16))
    return exact.reshape(-1), rounded.reshape(-1)


def block_counts(block: Block) -> Counts:
    exact, rounded = changed(block)
    return Counts(exact.numel(), int(exact.sum()), int(rounded.sum()))


@dataclass
class TopSets:
    """The global top-q sets of |delta|: each q's k = ceil(q P), its threshold, and how many coordinates
    above the threshold it holds (the rest are ties at it, taken by index)."""

    fractions: tuple[float, ...]
    thresholds: list[Threshold]
    above: list[int]

    def members(self, delta: torch.Tensor, ties_taken: list[int]) -> list[torch.Tensor]:
        """bool per q over one block's flattened |delta| (blocks in order); ``ties_taken`` is updated."""
        out = []
        for i, threshold in enumerate(self.thresholds):
            inside = delta > threshold.value
            need = threshold.k - self.above[i] - ties_taken[i]
            if need > 0:
                tied = (delta == threshold.value).nonzero()[:, 0][:need]
                inside[tied] = True
                ties_taken[i] += int(tied.numel())
            out.append(inside)
        return out


def counted_top_sets(pair: CheckpointPair, fractions: Sequence[float]) -> tuple[dict[str, Counts], TopSets]:
    """Each tensor's counts in the histogram's pass, then the exact thresholds from one pass over the
    boundary bins, then a count above each (three reads of both checkpoints)."""
    per_tensor = {name: Counts() for name in pair.layout.names}

    def counted() -> Iterator[torch.Tensor]:
        for block in pair.blocks():
            per_tensor[block.name].add(block_counts(block))
            yield block.delta()

    def deltas() -> Iterator[torch.Tensor]:
        return (block.delta() for block in pair.blocks())

    found = thresholds(histogram(counted()), deltas, fractions)
    above = [0] * len(found)
    for delta in deltas():
        for i, threshold in enumerate(found):
            above[i] += int((delta > threshold.value).sum())
    return per_tensor, TopSets(tuple(fractions), found, above)


@dataclass
class MaskOverlaps:
    """|S ∩ M|, |S| for each set S (changed, changed in bf16, each top-q) against each mask M of a file."""

    masks: MaskFile
    sets: list[str]
    both: list[list[int]]  # [set][mask density]
    sizes: list[int]
    mask_sizes: list[int]

    def as_dict(self, n_params: int) -> dict:
        def chance_jaccard(a: int, b: int) -> float:
            x, y = a / n_params, b / n_params
            union = x + y - x * y
            return x * y / union if union else 0.0

        rows = []
        for name, both, size in zip(self.sets, self.both, self.sizes, strict=True):
            rows.append(
                {
                    "set": name,
                    "size": size,
                    "in_mask": both,
                    # share of the set inside each mask, beside the mask's density (an independent set's)
                    "overlap": [b / size if size else 0.0 for b in both],
                    "chance_overlap": [m / n_params for m in self.mask_sizes],
                    "jaccard": [
                        b / (size + m - b) if size + m - b else 0.0
                        for b, m in zip(both, self.mask_sizes, strict=True)
                    ],
                    "chance_jaccard": [chance_jaccard(size, m) for m in self.mask_sizes],
                }
            )
        meta = self.masks.metadata
        return {
            "file": str(self.masks.path),
            "model_id": meta.get("model_id"),
            "digest": meta.get("digest"),
            "polarity": meta.get("polarity"),
            "q": list(self.masks.fractions),
            "mask_sizes": self.mask_sizes,
            "sets": rows,
        }


def checked_masks(path: Path, pair: CheckpointPair) -> MaskFile:
    """A mask file of this model: cut from either checkpoint (its digest), over its parameters."""
    try:
        masks = MaskFile.open(path)
    except MaskFileError as error:
        raise UpdatesError(str(error)) from None
    digest = masks.metadata.get("digest")
    if digest not in (pair.before.digest, pair.after.digest):
        raise UpdatesError(
            f"{path} holds masks of {masks.model_id} ({digest}), not of {pair.before.label} "
            f"({pair.before.digest}) or {pair.after.label}; give a mask file from a study of this model"
        )
    if set(masks.shapes) != set(pair.layout.names):
        raise UpdatesError(f"{path} covers other parameters than {pair.before.label}")
    return masks


Progress = Callable[[str, float], None]


@dataclass
class Comparison:
    """Two checkpoints and a mask file, checked against each other before anything is computed."""

    pair: CheckpointPair
    masks: MaskFile | None

    @classmethod
    def open(cls, before: str, after: str, masks_path: Path | None = None) -> Comparison:
        pair = CheckpointPair.open(before, after)
        return cls(pair, None if masks_path is None else checked_masks(masks_path, pair))


def compare_checkpoints(
    before: str,
    after: str,
    fractions: Sequence[float] | None = None,
    masks_path: Path | None = None,
    progress: Progress | None = None,
) -> dict:
    """The summary of what changed from ``before`` to ``after`` (docs/design.md §10)."""
    return summarize(Comparison.open(before, after, masks_path), fractions, progress)


def summarize(
    comparison: Comparison, fractions: Sequence[float] | None = None, progress: Progress | None = None
) -> dict:
    """Counts per tensor, layer and kind, the top-|delta| sets and their overlap with the masks."""
    report = progress or (lambda stage, fraction: None)
    pair, masks = comparison.pair, comparison.masks
    if fractions is None:
        fractions = tuple(masks.fractions) if masks is not None else (0.001, 0.01, 0.05)
    fractions = tuple(sorted(set(fractions)))
    layout, n_params = pair.layout, pair.n_params

    report("changed, top q", 0.0)
    per_tensor, top = counted_top_sets(pair, fractions)
    report("masks", 0.75)
    overlaps = None if masks is None else _overlaps(pair, masks, top)
    report("masks", 1.0)

    total = Counts()
    groups: dict[str, dict[str, Counts]] = {"layers": {}, "kinds": {}}
    for name in layout.names:
        counts = per_tensor[name]
        total.add(counts)
        for key, group in (
            ("layers", str(layer_of(name, layout.embedding_name))),
            ("kinds", module_kind(name, layout.head_name, layout.embedding_name)),
        ):
            groups[key].setdefault(group, Counts()).add(counts)
    return {
        "kind": "fisherscope.updates",
        "before": {"model": pair.before.label, "digest": pair.before.digest},
        "after": {"model": pair.after.label, "digest": pair.after.digest},
        "tolerance": {"changed": EXACT_TOLERANCE, "changed_bf16": BF16_TOLERANCE, "top_q": DELTA},
        "total": total.as_dict(),
        "tensors": {name: per_tensor[name].as_dict() for name in layout.names},
        **{key: [{"group": g, **c.as_dict()} for g, c in table.items()] for key, table in groups.items()},
        "top_q": [
            {"q": q, "k": t.k, "threshold": t.value}
            for q, t in zip(top.fractions, top.thresholds, strict=True)
        ],
        "masks": None if overlaps is None else overlaps.as_dict(n_params),
    }


def _overlaps(pair: CheckpointPair, masks: MaskFile, top: TopSets) -> MaskOverlaps:
    """One more pass: each block's sets against the same rows of every mask (read as such a block)."""
    names = ["changed", "changed_bf16", *(f"top {q:g} |delta|" for q in top.fractions)]
    both = [[0] * len(masks.fractions) for _ in names]
    sizes = [0] * len(names)
    mask_sizes = [0] * len(masks.fractions)
    ties_taken = [0] * len(top.fractions)
    for block in pair.blocks():
        delta = block.delta()
        rows = [
            torch.from_numpy(masks.mask_rows(q, block.name, block.rows)).reshape(-1).bool()
            for q in masks.fractions
        ]
        sets = [*changed(block), *top.members(delta, ties_taken)]
        for i, members in enumerate(sets):
            sizes[i] += int(members.sum())
            for j, mask in enumerate(rows):
                both[i][j] += int((members & mask).sum())
        for j, mask in enumerate(rows):
            mask_sizes[j] += int(mask.sum())
    return MaskOverlaps(masks, names, both, sizes, mask_sizes)
