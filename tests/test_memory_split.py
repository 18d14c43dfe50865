"""Split planning from parameter bytes and per-rank memory budgets."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from fakes import FakeGroup
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import setup_arg_parser
from safetensors import safe_open

import pipemlx
import pipemlx.cli.split as split_module
from pipemlx.cli.split import context_tokens, parameter_plan, step_tokens
from pipemlx.cli.split import main as plan_main
from pipemlx.demo import MODEL_DIR
from pipemlx.models.hub import memory_model_of
from pipemlx.models.parameters import model_bytes_from_model
from pipemlx.models.safetensors import model_bytes_from_dir, read_safetensors_header
from pipemlx.models.sharding import AUTO_PLANNED_STEP, find_layer_list
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.memory_model import Settings, format_context_plan, plan_balanced, plan_context
from pipemlx.schedule.memory_split import (
    MemoryPlanError,
    ModelBytes,
    format_plan,
    format_size,
    parse_size,
    plan_layers,
    plan_split,
    resolve_budgets,
)
from pipemlx.schedule.split import even_split
from pipemlx.testing import build_model, save_model_dir, tiny_config


@pytest.mark.parametrize(
    "text,expected",
    [
        ("24GB", 24 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512M", 512 * 10**6),
        ("1.5G", 1_500_000_000),
        ("1000", 1000),
        (7, 7),
        (" 2 kb ", 2000),
        (24e9, 24 * 10**9),  # a float of bytes (was AttributeError: 'float' object has no attribute 'strip')
        (1536.7, 1536),
    ],
)
def test_sizes_are_read_with_decimal_and_binary_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text,words",
    [
        ("24XB", "cannot read memory size '24XB'"),
        ("GB", "cannot read"),
        ("0GB", "must be positive"),
        ("-3", "cannot be negative"),
    ],
)
def test_bad_sizes_are_named(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_size(text)


def test_budgets_may_be_floats_or_numpy_numbers() -> None:
    import numpy as np

    assert resolve_budgets([3e9, np.int64(10**9)], 2) == (3 * 10**9, 10**9)
    assert resolve_budgets(8e9, 2) == (8 * 10**9,) * 2  # was TypeError: 'float' object is not iterable
    with pytest.raises(ValueError, match="must be finite"):
        parse_size(float("inf"))
    with pytest.raises(TypeError, match="a number of bytes or a string like '24GB', got None"):
        resolve_budgets([None, "8GB"], 2)  # type: ignore[list-item]


def test_equal_layers_go_in_proportion_to_the_budgets() -> None:
    assert plan_layers([10] * 12, [0, 0, 0], [24, 16, 8]) == (6, 4, 2)
    assert plan_layers([10] * 12, [0, 0, 0], [8, 16, 24]) == (2, 4, 6)


def test_fixed_bytes_take_room_from_a_rank() -> None:
    # Rank 0 also holds an embedding worth two layers: it gets two layers fewer.
    assert plan_layers([10] * 8, [20, 0], [1, 1]) == (3, 5)


def test_heavy_layers_are_balanced_by_bytes_not_count() -> None:
    assert plan_layers([1, 1, 1, 1, 1, 1, 6], [0, 0], [1, 1]) == (6, 1)


def brute_force(
    layer_bytes: list[int],
    fixed: list[int],
    budgets: list[int],
    allowed: Callable[[int, int, int], bool] | None = None,
) -> tuple[int, ...]:
    """Every contiguous split (that ``allowed`` allows every rank's part of); the smallest sorted loads, ties to
    the smallest last ranks; ``()`` when none is allowed."""
    n, world = len(layer_bytes), len(budgets)
    best: tuple[tuple[float, ...], tuple[int, ...]] | None = None
    answer: tuple[int, ...] = ()
    for cuts in itertools.combinations(range(1, n), world - 1):
        bounds = (0, *cuts, n)
        sizes = tuple(bounds[r + 1] - bounds[r] for r in range(world))
        if allowed is not None and not all(allowed(r, bounds[r], bounds[r + 1]) for r in range(world)):
            continue
        loads = tuple(
            sorted(
                ((fixed[r] + sum(layer_bytes[bounds[r] : bounds[r + 1]])) / budgets[r] for r in range(world)),
                reverse=True,
            )
        )
        key = (loads, tuple(reversed(sizes)))
        if best is None or key < best:
            best, answer = key, sizes
    return answer


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=9).flatmap(
        lambda layers: st.tuples(
            st.just(layers),
            st.integers(1, len(layers)).flatmap(
                lambda world: st.tuples(
                    st.lists(st.integers(0, 30), min_size=world, max_size=world),
                    st.lists(st.integers(1, 40), min_size=world, max_size=world),
                )
            ),
        )
    )
)
def test_plan_is_the_best_contiguous_split(case: tuple[list[int], tuple[list[int], list[int]]]) -> None:
    layers, (fixed, budgets) = case
    sizes = plan_layers(layers, fixed, budgets)
    assert len(sizes) == len(budgets) and sum(sizes) == len(layers) and min(sizes) >= 1
    assert sizes == brute_force(layers, fixed, budgets)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))), st.integers(1, 10**9))
def test_equal_layers_and_budgets_give_the_even_split(case: tuple[int, int], layer: int) -> None:
    layers, world = case
    assert plan_layers([layer] * layers, [0] * world, [1] * world) == even_split(layers, world)


def test_a_model_that_does_not_fit_is_named() -> None:
    model = ModelBytes(layers=(100,) * 4, embedding=50, head=60, tied=False)
    plan = plan_split(model, 2, [400, 300])
    assert [p.total for p in plan.ranks] == [310, 260] and plan.split == (2, 2)
    with pytest.raises(
        MemoryPlanError,
        match=r"does not fit: 510 B in 4 layers .* best split \[2, 2\] still puts rank 0 at 310 B, over its 300 B",
    ):
        plan_split(model, 2, [300, 300])
    with pytest.raises(ValueError, match="more ranks than layers: 5 ranks cannot share 4 layers"):
        plan_split(model, 5, None)


def test_tied_embedding_counts_on_every_rank() -> None:
    untied = ModelBytes(layers=(10,) * 6, embedding=30, head=5, tied=False)
    tied = ModelBytes(layers=(10,) * 6, embedding=30, head=5, tied=True)
    assert [untied.fixed(r, 3) for r in range(3)] == [35, 5, 5]
    assert [tied.fixed(r, 3) for r in range(3)] == [35, 35, 35]
    assert plan_split(untied, 3).split == (1, 3, 2)  # loads 45, 35, 25 (as good as 1, 2, 3; fewer on the last)
    assert plan_split(tied, 3).split == (2, 2, 2)


def test_sizes_print_in_decimal_units_from_their_first_whole_unit() -> None:
    cases = {
        0: "0 B",
        999: "999 B",
        1000: "1.00 KB",
        999_999: "1000.00 KB",
        10**6: "1.00 MB",
        1_234_567: "1.23 MB",
        999_999_999: "1000.00 MB",
        10**9: "1.00 GB",
        24 * 10**9 + 5 * 10**7: "24.05 GB",
        10**12: "1.00 TB",
        5_500 * 10**12: "5500.00 TB",
        -2_000: "-2.00 KB",
    }
    assert {n: format_size(n) for n in cases} == cases


def test_one_byte_is_a_size_and_an_unreadable_one_names_the_units() -> None:
    assert parse_size("1") == 1 and parse_size(1) == 1
    with pytest.raises(ValueError) as error:
        parse_size("12 parsecs")
    assert str(error.value) == (
        "cannot read memory size '12 parsecs': expected a number with an optional unit "
        "(B, K, KB, M, MB, G, GB, T, TB, KIB, MIB, GIB, TIB), e.g. '24GB' or '16GiB'"
    )


def test_the_plan_prints_as_a_table_with_the_models_bytes() -> None:
    """The table ``pipemlx split`` prints, written out by hand: rank 0 holds layers 0-2 (600 B) and the 50 B
    embedding with the 60 B head, 710 B of its 800 B (88.75%); rank 1 layer 3 and the head."""
    untied = ModelBytes(layers=(100, 200, 300, 400), embedding=50, head=60, tied=False)
    assert format_plan(plan_split(untied, 2, [800, 600])) == (
        "rank  layers  count  layer bytes  fixed bytes  total  budget  share\n"
        "0     0-2         3        600 B        110 B  710 B   800 B  88.8%\n"
        "1     3-3         1        400 B         60 B  460 B   600 B  76.7%\n"
        "model: 4 layers, 1.11 KB (embedding 50 B, norm/head 60 B); split [3, 1]"
    )
    tied = ModelBytes(layers=(1500,) * 3, embedding=2_000_000, head=1234, tied=True)
    assert format_plan(plan_split(tied, 3)) == (
        "rank  layers  count  layer bytes  fixed bytes    total  budget  share\n"
        "0     0-0         1      1.50 KB      2.00 MB  2.00 MB       -      -\n"
        "1     1-1         1      1.50 KB      2.00 MB  2.00 MB       -      -\n"
        "2     2-2         1      1.50 KB      2.00 MB  2.00 MB       -      -\n"
        "model: 3 layers, 2.01 MB (embedding 2.00 MB, norm/head 1.23 KB, tied); split [1, 1, 1]"
    )


def test_a_rank_filled_exactly_fits_and_the_error_names_the_fullest_rank() -> None:
    model = ModelBytes(layers=(100,) * 4, embedding=50, head=60, tied=False)
    assert [p.total for p in plan_split(model, 2, [310, 260]).ranks] == [310, 260]  # exactly full: fits
    # Split [2, 2] over budgets [300, 200]: rank 0 at 310 B (103%), rank 1 at 260 B (130%): rank 1 is named,
    # though rank 0 holds more bytes.
    with pytest.raises(MemoryPlanError) as error:
        plan_split(model, 2, [300, 200])
    assert str(error.value) == (
        "the model does not fit: 510 B in 4 layers (largest layer 100 B) over budgets ['300 B', '200 B'] "
        "(sum 500 B); every rank also holds 60 B of norm/head and rank 0 the 50 B embedding. The best split "
        "[2, 2] still puts rank 1 at 260 B, over its 200 B"
    )
    tied = ModelBytes(layers=(100,) * 4, embedding=50, head=60, tied=True)
    with pytest.raises(
        MemoryPlanError, match=r"60 B of norm/head and rank 0 and every other rank the 50 B embedding\."
    ):
        plan_split(tied, 2, [300, 300])
    with pytest.raises(ValueError) as wrong:
        plan_split(model, 2, [300])
    assert str(wrong.value) == "1 budgets for 2 ranks"
    for rank in (-1, 2):
        with pytest.raises(ValueError) as outside:
            model.fixed(rank, 2)
        assert str(outside.value) == f"rank {rank} is outside a group of 2"


def test_bad_plan_layers_arguments_are_named() -> None:
    for layers, fixed, budgets, message in (
        ([1, 2], [0, 0], [1, 0], "budgets must be positive, got [1, 0]"),
        ([1, 2], [0, 0], [1, -2], "budgets must be positive, got [1, -2]"),
        ([1, -2], [0, 0], [1, 1], "layer bytes must not be negative, got -2"),
        ([1, 2], [0], [1, 1], "fixed lists 1 ranks but budgets list 2"),
    ):
        with pytest.raises(ValueError) as error:
            plan_layers(layers, fixed, budgets)
        assert str(error.value) == message


def allowed_by(salt: int, spread: int) -> Callable[[int, int, int], bool]:
    """A made-up rule that rules out some (rank, start, stop) placements, depending on all three."""
    return lambda rank, start, stop: (salt + 7 * rank + 3 * start + 5 * stop) % spread != 0


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=8).flatmap(
        lambda layers: st.tuples(
            st.just(layers),
            st.integers(1, len(layers)).flatmap(
                lambda world: st.lists(st.integers(1, 40), min_size=world, max_size=world)
            ),
        )
    ),
    st.integers(0, 10),
    st.integers(2, 5),
)
def test_plan_with_rules_is_the_best_allowed_contiguous_split(
    case: tuple[list[int], list[int]], salt: int, spread: int
) -> None:
    layers, budgets = case
    allowed = allowed_by(salt, spread)
    seen: list[tuple[int, int, int]] = []

    def recorded(rank: int, start: int, stop: int) -> bool:
        seen.append((rank, start, stop))
        return allowed(rank, start, stop)

    fixed = [0] * len(budgets)
    expected = brute_force(layers, fixed, budgets, allowed)
    if not expected:
        with pytest.raises(MemoryPlanError, match=f"no split of {len(layers)} layers over {len(budgets)} ranks"):
            plan_layers(layers, fixed, budgets, recorded)
    else:
        assert plan_layers(layers, fixed, budgets, recorded) == expected
    assert all(0 <= start < stop <= len(layers) and 0 <= rank < len(budgets) for rank, start, stop in seen)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_model_dir(build_model(tiny_config("llama")), tiny_config("llama"), root / "llama", shards=3),
        "qwen3": save_model_dir(build_model(tiny_config("qwen3")), tiny_config("qwen3"), root / "qwen3", index=False),
    }


def test_header_reader_agrees_with_safetensors(saved_models: dict[str, Path]) -> None:
    for path in saved_models["llama"].glob("model*.safetensors"):
        header = read_safetensors_header(path)
        with safe_open(str(path), framework="numpy") as f:  # pyright: ignore[reportUnknownVariableType]
            names = sorted(f.keys())  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]
            assert sorted(header) == names
            for name in names:
                assert header[name]["shape"] == list(f.get_slice(name).get_shape())  # pyright: ignore[reportUnknownMemberType]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_bytes_from_headers_equal_bytes_of_the_model(saved_models: dict[str, Path], arch: str, tied: bool) -> None:
    model = build_model(tiny_config(arch))
    owner, attribute = find_layer_list(model)
    from_model = model_bytes_from_model(model, owner, owner[attribute])
    from_dir = model_bytes_from_dir(saved_models[arch])
    assert from_dir == from_model
    assert from_dir.tied is tied and len(from_dir.layers) == 6
    assert from_dir.total == sum(p.nbytes for p in _arrays(model))


def _arrays(model: object) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]  # type: ignore[attr-defined]


def test_missing_layers_and_files_are_named(tmp_path: Path, saved_models: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match="no model.*safetensors files"):
        model_bytes_from_dir(tmp_path)
    config = json.loads((saved_models["qwen3"] / "config.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((saved_models["qwen3"] / "model.safetensors").read_bytes())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    with pytest.raises(ValueError, match=r"hold no weights for layers \[6, 7\] of 8"):
        model_bytes_from_dir(broken)


def test_plan_command_prints_a_table(saved_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model = model_bytes_from_dir(saved_models["llama"])
    layer = model.layers[0]
    budget, small = model.embedding + model.head + 5 * layer, model.head + 3 * layer
    assert plan_main([str(saved_models["llama"]), "--ranks", "2", "--memory", f"{budget},{small}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["rank", "layers", "count"]
    rank0, rank1 = out[1].split(), out[2].split()
    expected = plan_split(model, 2, [budget, small])
    assert (rank0[1], rank0[2]) == (f"0-{expected.split[0] - 1}", str(expected.split[0]))
    assert rank1[2] == str(expected.split[1]) and rank1[-1].endswith("%")
    assert "split" in out[-1] and format_size(model.total) in out[-1]


def test_plan_command_errors(saved_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = str(saved_models["llama"])
    assert plan_main([path, "--ranks", "2", "--memory", "1KB,1KB"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert plan_main([path, "--memory", "2GB,lots"]) == 2
    assert "cannot read memory size 'lots'" in capsys.readouterr().err
    assert plan_main([path, "--ranks", "3", "--memory", "1GB,1GB"]) == 2
    assert "lists 2 budgets but the group has 3 ranks" in capsys.readouterr().err
    assert plan_main([path]) == 2
    assert plan_main([path, "--ranks", "3", "--memory", "1GB"]) == 0  # one budget for every rank
    assert plan_main(["--help"]) == 0


def test_shard_model_follows_the_memory_plan() -> None:
    config = tiny_config("llama", num_hidden_layers=8)
    model = build_model(config)
    owner, attribute = find_layer_list(model)
    bytes_ = model_bytes_from_model(model, owner, owner[attribute])
    budgets = [bytes_.total, bytes_.total // 2]
    expected = plan_split(bytes_, 2, budgets).split
    sharded = pipemlx.shard_model(model, FakeGroup(1, 2), lend="none", split="memory", memory=budgets)  # type: ignore[arg-type]
    assert stage_of(sharded).info.split == expected and expected[0] > expected[1]
    implied = pipemlx.shard_model(build_model(config), FakeGroup(0, 2), lend="none", memory=budgets)  # type: ignore[arg-type]
    assert stage_of(implied).info.split == expected
    balanced = pipemlx.shard_model(build_model(config), FakeGroup(0, 2), lend="none", split="memory")  # type: ignore[arg-type]
    assert stage_of(balanced).info.split == plan_split(bytes_, 2).split
    even = pipemlx.shard_model(build_model(config), FakeGroup(0, 3), lend="none", split="even")  # type: ignore[arg-type]
    assert stage_of(even).info.split == (3, 3, 2)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"split": [4, 4], "memory": ["1GB", "1GB"]}, ValueError, "only used with split='memory'"),
        (
            {"split": "fast"},
            TypeError,
            "split must be a sequence of ints .*'even' or 'memory' or 'balanced', got 'fast'",
        ),
        ({"memory": ["1GB"]}, ValueError, "memory lists 1 budgets but the group has 2 ranks"),
        ({"memory": ["1KB", "1KB"]}, MemoryPlanError, "does not fit"),
        ({"memory": ["1KB", "1XB"]}, ValueError, "cannot read memory size '1XB'"),
    ],
)
def test_bad_memory_split_arguments_leave_the_model_untouched(
    kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    model = build_model(tiny_config("llama"))
    layers = list(model.layers)
    with pytest.raises(error, match=words):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none", **kwargs)  # type: ignore[arg-type]
    assert list(model.layers) == layers


# --- pipemlx split's arguments (pipemlx/cli/split.py), one process ----------------------------------------------


def split_cli(argv: list[str], capsys: pytest.CaptureFixture[str], prog: str = "pipemlx split") -> tuple[int, str, str]:
    status = plan_main([str(MODEL_DIR), *argv], prog)
    out, err = capsys.readouterr()
    return status, out, err


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The calls ``pipemlx.cli.split`` makes of ``name``, which still runs."""
    real = getattr(split_module, name)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(split_module, name, recorded)
    return calls


@pytest.mark.parametrize(
    "text,expected",
    [("32768", 32768), ("32k", 32768), ("2K", 2048), (" 1 ", 1), (" 3 k ", 3072), ("-0k", None), ("0", None)],
)
def test_context_tokens_read_counts_and_thousands_of_1024(text: str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(argparse.ArgumentTypeError) as raised:
            context_tokens(text)
        assert str(raised.value) == f"must be at least 1 token, got {text!r}"
        return
    assert context_tokens(text) == step_tokens(text) == expected


@pytest.mark.parametrize("text", ["k", "1.5k", "32m", "2 000", "", "auto"])
def test_unreadable_token_counts_are_named(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        context_tokens(text)
    assert str(raised.value) == f"expected a number of tokens like 32768 or 32k, got {text!r}"
    if text != "auto":
        with pytest.raises(argparse.ArgumentTypeError):
            step_tokens(text)
    assert step_tokens("auto") == "auto"


def test_split_command_passes_mlx_lms_kv_defaults_and_every_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV settings default to mlx-lm's command line (``mlx_lm.generate``'s parser), ``auto`` is counted as
    ``AUTO_PLANNED_STEP``, and each flag reaches the plan; the table is the library's for those settings."""
    made = spy(monkeypatch, "Settings")
    status, out, _ = split_cli(["--ranks", "2", "--context", "1k", "--kv-bits", "8"], capsys)
    mlx_lm_defaults = setup_arg_parser().parse_args([])
    expected = Settings(
        1024, AUTO_PLANNED_STEP, 8, mlx_lm_defaults.kv_group_size, mlx_lm_defaults.quantized_kv_start, head="split"
    )
    assert status == 0 and len(made) == 1 and Settings(*made[0][0], **made[0][1]) == expected
    model = memory_model_of(str(MODEL_DIR))
    assert out == format_context_plan(plan_context(model, 2, expected, None, None)) + "\n"
    argv = ["--context", "2000", "--prefill-step-size", "1k", "--kv-bits", "4", "--kv-group-size", "32"]
    argv += ["--quantized-kv-start", "7", "--head", "last", "--fused-attention", "--ranks", "3"]
    status, out, _ = split_cli(argv, capsys)
    expected = Settings(2000, 1024, 4, 32, 7, head="last", fused_attention=True)
    assert status == 0 and Settings(*made[1][0], **made[1][1]) == expected
    assert out == format_context_plan(plan_context(model, 3, expected, None, None)) + "\n"
    status, _, _ = split_cli(["--ranks", "2", "--context", "1k", "--prefill-step-size", "300"], capsys)
    assert status == 0 and Settings(*made[2][0], **made[2][1]).step == 300


def test_split_command_tables_are_the_planners(capsys: pytest.CaptureFixture[str]) -> None:
    """Each way of asking prints the library's table: bytes balanced over budgets, a given split, speeds (by
    parameters, or by memory at a context), a given split at a context."""
    model = memory_model_of(str(MODEL_DIR))
    budgets = (30 * 10**6, 20 * 10**6)
    status, out, _ = split_cli(["--memory", "30MB,20MB"], capsys)
    assert status == 0 and out == format_plan(plan_split(model.bytes, 2, budgets)) + "\n"
    status, out, _ = split_cli(["--split", "6,,2,", "--memory", "30MB"], capsys)  # empty entries are skipped
    assert status == 0 and out == format_plan(parameter_plan(model.bytes, (6, 2), budgets[:1] * 2)) + "\n"
    status, out, _ = split_cli(["--speeds", "3, 1.5"], capsys)
    assert (
        status == 0
        and out == format_plan(parameter_plan(model.bytes, plan_balanced(model, 2, [3.0, 1.5]), None)) + "\n"
    )
    settings = Settings(1024, AUTO_PLANNED_STEP, head="split")  # the default head="auto" splits this model
    status, out, _ = split_cli(["--speeds", "3,1", "--memory", "30MB,20MB", "--context", "1k"], capsys)
    balanced = plan_balanced(model, 2, [3.0, 1.0], budgets, settings)
    assert status == 0 and out == format_context_plan(plan_context(model, 2, settings, budgets, balanced)) + "\n"
    # Budgets that bind: 4 MB holds five layers of rank 0's six; at a context of 256 tokens 7.5 MB holds five too
    # (by parameters alone it would hold six; the default head, split, leaves rank 0 only its rows of the embedding).
    status, out, _ = split_cli(["--speeds", "3,1", "--memory", "4MB,4MB"], capsys)
    small = (4 * 10**6, 4 * 10**6)
    assert plan_balanced(model, 2, [3.0, 1.0], small) == (5, 3) and plan_balanced(model, 2, [3.0, 1.0]) == (6, 2)
    assert status == 0 and out == format_plan(parameter_plan(model.bytes, (5, 3), small)) + "\n"
    status, out, _ = split_cli(["--speeds", "3,1", "--memory", "7.5MB,20MB", "--context", "256"], capsys)
    short, tight = Settings(256, AUTO_PLANNED_STEP, head="split"), (7_500_000, 20 * 10**6)
    assert plan_balanced(model, 2, [3.0, 1.0], tight, short) == (5, 3) and plan_balanced(
        model, 2, [3.0, 1.0], tight
    ) == (6, 2)
    assert status == 0 and out == format_context_plan(plan_context(model, 2, short, tight, (5, 3))) + "\n"
    status, out, _ = split_cli(["--split", "5,3", "--context", "1k"], capsys)
    assert status == 0 and out == format_context_plan(plan_context(model, 2, settings, None, (5, 3))) + "\n"
    status, out, _ = split_cli(["--ranks", "1"], capsys)  # one rank: the whole model
    assert status == 0 and out == format_plan(plan_split(model.bytes, 1, None)) + "\n"
    status, out, _ = split_cli(["--ranks", "3", "--memory", "30MB"], capsys)  # one budget for every rank
    assert status == 0 and out == format_plan(plan_split(model.bytes, 3, budgets[:1] * 3)) + "\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--memory", "30MB"], "give --ranks, or --memory / --split / --speeds with one entry per rank"),
        (["--ranks", "0"], "--ranks must be at least 1, got 0"),
        (["--ranks", "-2", "--split", "8"], "--ranks must be at least 1, got -2"),
        # The ranks come from the first list given: --split, then --speeds, then --memory.
        (["--split", "6,2", "--memory", "1GB,1GB,1GB"], "memory lists 3 budgets but the group has 2 ranks"),
        (["--speeds", "3,1", "--memory", "1GB,1GB,1GB"], "memory lists 3 budgets but the group has 2 ranks"),
        (["--split", "6,2", "--speeds", "1,1,1"], "give --split or --speeds, not both"),
        (["--ranks", "2", "--split", "4,4", "--speeds", "1,1"], "give --split or --speeds, not both"),
        (["--split", "a,b"], "--split: expected comma-separated numbers, got 'a,b'"),
        (["--split", "4.0,4"], "--split: expected comma-separated numbers, got '4.0,4'"),
        (["--speeds", "3,x"], "--speeds: expected comma-separated numbers, got '3,x'"),
        (["--ranks", "2", "--head", "last"], "--kv-bits, --head and --fused-attention need --context"),
        (["--ranks", "2", "--head", "split"], "--kv-bits, --head and --fused-attention need --context"),
        (["--ranks", "2", "--fused-attention"], "--kv-bits, --head and --fused-attention need --context"),
        (["--split", "4,4", "--kv-bits", "8"], "--kv-bits, --head and --fused-attention need --context"),
        (
            ["--split", "7,1", "--memory", "4MB,1MB"],
            "does not fit: rank 0 needs 4.66 MB of parameters but has 4.00 MB; split [7, 1]",
        ),
    ],
)
def test_split_command_names_bad_arguments_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for prog in ("pipemlx split", "pipemlx plan"):
        assert split_cli(argv, capsys, prog) == (2, "", f"{prog}: {message}\n")


def test_split_command_argparse_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = split_cli(["--context", "0"], capsys, "pipemlx plan")
    assert status == 2 and out == "" and err.startswith("usage: pipemlx plan ")
    assert "argument --context: must be at least 1 token, got '0'" in err
    assert plan_main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: pipemlx split ")
    status, _, err = split_cli(["--ranks", "2", "--step-size", "512"], capsys)  # pipemlx 0.1's name
    assert status == 2 and "--step-size was renamed --prefill-step-size in pipemlx 0.2.0" in err
    status, _, err = split_cli(["--ranks", "2", "--head", "middle"], capsys)
    assert status == 2 and "argument --head: invalid choice: 'middle'" in err
    status, _, err = split_cli(["--ranks", "two"], capsys)
    assert status == 2 and "argument --ranks: invalid int value: 'two'" in err
    status, _, err = split_cli(["--ranks", "2", "--context", "1k", "--prefill-step-size", "lots"], capsys)
    assert status == 2 and "argument --prefill-step-size: expected a number of tokens" in err
    status, out, _ = split_cli(["--ranks", "2", "--head", "auto"], capsys)  # the default head needs no context
    assert status == 0 and out


def test_a_given_split_fits_a_budget_it_fills_exactly() -> None:
    model = ModelBytes(layers=(10, 20, 30), embedding=5, head=7, tied=False)
    plan = parameter_plan(model, (2, 1), (42, 37))  # rank 0: 5 + 10 + 20 + 7 (the head on every rank), rank 1: 30 + 7
    assert [r.total for r in plan.ranks] == [42, 37] and plan.split == (2, 1)
    assert parameter_plan(model, (2, 1), None).ranks[0].budget is None
    with pytest.raises(MemoryPlanError) as raised:
        parameter_plan(model, (2, 1), (42, 36))
    assert str(raised.value) == "rank 1 needs 37 B of parameters but has 36 B; split [2, 1]"
