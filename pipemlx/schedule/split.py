"""Which decoder layers each rank holds: a contiguous split, rank 0 first."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

SPLIT_NAMES = ("even", "memory", "balanced")  # the named splits shard_model accepts besides a list of layers per rank


def even_split(num_layers: int, world_size: int) -> tuple[int, ...]:
    """Layers per rank for an even split; the first ``num_layers % world_size`` ranks get one more."""
    check_world(num_layers, world_size)
    base, extra = divmod(num_layers, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def check_world(num_layers: int, world_size: int) -> None:
    """Every rank needs at least one layer."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if world_size > num_layers:
        raise ValueError(
            f"more ranks than layers: {world_size} ranks cannot share {num_layers} layers "
            "(every rank needs at least one layer)"
        )


def resolve_split(split: Sequence[int] | str | None, num_layers: int, world_size: int) -> tuple[int, ...]:
    """Return the layers per rank, checking an explicit ``split`` against the model and the group.

    ``None`` and ``"even"`` mean :func:`even_split` (``"memory"`` is planned by
    :mod:`pipemlx.schedule.memory_split`). Integral numbers (NumPy's too) become
    ``int``; bools, floats and non-numbers raise ``TypeError``, a bad count
    ``ValueError``, both naming the numbers.
    """
    check_world(num_layers, world_size)
    if split is None or split == "even":
        return even_split(num_layers, world_size)
    if isinstance(split, (str, bytes)) or not isinstance(split, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"split must be a sequence of ints (layers per rank), {' or '.join(map(repr, SPLIT_NAMES))}, got {split!r}"
        )
    given = tuple(split)
    for v in given:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"split must hold ints, got {v!r} in {list(given)}")
    values = tuple(int(v) for v in given)
    if len(values) != world_size:
        raise ValueError(f"split {list(values)} has {len(values)} entries but the group has {world_size} ranks")
    if any(v < 1 for v in values):
        raise ValueError(f"split {list(values)} gives a rank no layers; every rank needs at least one")
    if sum(values) != num_layers:
        raise ValueError(f"split {list(values)} adds up to {sum(values)} layers but the model has {num_layers}")
    return values


def layer_range(split: Sequence[int], rank: int) -> range:
    """Global indices of the layers that ``rank`` holds under ``split``."""
    start = sum(split[:rank])
    return range(start, start + split[rank])
