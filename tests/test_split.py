from __future__ import annotations

import numpy as np
import pytest

from pipemlx.schedule.split import even_split, layer_range, resolve_split


@pytest.mark.parametrize(
    "layers,ranks,expected",
    [(8, 2, (4, 4)), (7, 2, (4, 3)), (6, 4, (2, 2, 1, 1)), (5, 5, (1,) * 5), (3, 1, (3,))],
)
def test_even_split_puts_extra_layers_on_low_ranks(layers: int, ranks: int, expected: tuple[int, ...]) -> None:
    assert even_split(layers, ranks) == expected
    assert resolve_split(None, layers, ranks) == expected


def test_layer_ranges_are_contiguous_from_rank_zero() -> None:
    split = (3, 1, 2)
    assert [layer_range(split, r) for r in range(3)] == [range(0, 3), range(3, 4), range(4, 6)]


@pytest.mark.parametrize(
    "split,layers,ranks,error,words",
    [
        ([2, 2, 2], 6, 2, ValueError, r"split \[2, 2, 2\] has 3 entries but the group has 2 ranks"),
        ([6, 0], 6, 2, ValueError, r"split \[6, 0\] gives a rank no layers"),
        ([3, 2], 6, 2, ValueError, r"adds up to 5 layers but the model has 6"),
        ([3.0, 3], 6, 2, TypeError, "split must hold ints"),
        ([True, 5], 6, 2, TypeError, r"split must hold ints, got True in \[True, 5\]"),
        ([np.bool_(True), 5], 6, 2, TypeError, "split must hold ints, got np.True_"),
        ([np.float64(3), 3], 6, 2, TypeError, "split must hold ints, got np.float64"),
        (["3", 3], 6, 2, TypeError, "split must hold ints, got '3'"),
        ("33", 6, 2, TypeError, "split must be a sequence"),
        (None, 3, 4, ValueError, "more ranks than layers: 4 ranks cannot share 3 layers"),
        ([1, 1, 1, 0], 3, 4, ValueError, "more ranks than layers"),
    ],
)
def test_bad_splits_name_the_numbers(
    split: object, layers: int, ranks: int, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        resolve_split(split, layers, ranks)  # type: ignore[arg-type]


def test_integral_numbers_become_ints() -> None:
    """NumPy integers (any non-bool ``numbers.Integral``) are accepted and come back as plain ints."""
    split = resolve_split([np.int64(4), np.int32(2)], 6, 2)
    assert split == (4, 2)
    assert [type(v) for v in split] == [int, int]
    with pytest.raises(ValueError, match=r"split \[4, 4\] adds up to 8 layers but the model has 6"):
        resolve_split([np.int64(4), np.int64(4)], 6, 2)
