"""The calibration cache and the first request: "auto" times nothing before a request (the timing functions are
counted, not timed), plans with the prior, refines it from the chunks the prefill ran and stores the result; the
next model (and process) reads it, a new key or a bad file refines again, and a model with the same layer shapes
plans with the stored layer figures."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import socket
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import pipemlx
from pipemlx.runtime import calibrate, calibration_cache, prefill
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def timings() -> calibrate.Timings:
    """Made-up timings (a calibration takes seconds on a loaded 2-core machine; what is counted here is whether it
    runs, not what it measures): a second per million tokens, plus attention."""
    at_start = [(n, 1e-4 + n * 1e-6) for n in calibrate.CALIBRATION_LENGTHS]
    far = [(n, 1e-4 + n * 2e-6) for n in calibrate.FAR_LENGTHS]
    return at_start, 1e-4 + calibrate.ATTENTION_CHUNK * 1.5e-6, far


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """A fresh cache folder, and counts of the calibrations (a stage's layers, one layer for lend="auto")."""
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    counts = {"stage": 0, "layer": 0}

    def stage(*args: Any) -> calibrate.Timings:
        counts["stage"] += 1
        return timings()

    def layer(*args: Any) -> calibrate.Timings:
        counts["layer"] += 1
        return timings()

    monkeypatch.setattr(calibrate, "time_local_layers", stage)
    monkeypatch.setattr(calibrate, "time_layer", layer)
    real_refine = prefill.refine

    def refine(*args: Any) -> None:
        counts["refine"] = counts.get("refine", 0) + 1
        real_refine(*args)

    monkeypatch.setattr(prefill, "refine", refine)
    return counts


def prefill_auto(config: dict[str, Any]) -> int:
    """Shard a fresh model on one rank and prefill with the default (auto) step; the step it took."""
    model = pipemlx.shard_model(build_model(config, seed=1), mx.distributed.init())
    cache = stage_of(model).new_cache(model, None)
    return pipemlx.pipeline_prefill(model, mx.arange(PROMPT, dtype=mx.int32) % 200, cache)


PROMPT = 160  # tokens: more than REFINE_MIN_TOKENS, so that the first prefill refines


def files(folder: Path, kind: str) -> list[Path]:
    return sorted(folder.glob(f"calibration-{kind}-*.json"))


def test_auto_step_times_nothing_refines_once_and_again_for_a_new_key(counted: dict[str, int], tmp_path: Path) -> None:
    config = tiny_config("llama")
    prefill_auto(config)  # planned with the prior; its chunks refine it
    assert counted["stage"] == 0 and counted["layer"] == 0, "a request timed a calibration"
    assert counted["refine"] == 1 and len(files(tmp_path, "stage")) == 1 and len(files(tmp_path, "shape")) == 1
    (path,) = files(tmp_path, "stage")
    stored = json.loads(path.read_text())
    assert len(stored["value"]) == len(calibrate.CALIBRATION_LENGTHS) + 2
    prefill_auto(config)  # a new model and stage: the same figures, read from the file, not refined again
    assert counted["refine"] == 1 and json.loads(path.read_text()) == stored
    prefill_auto({**config, "intermediate_size": config["intermediate_size"] * 2})  # another model: another key
    assert counted["refine"] == 2 and len(files(tmp_path, "stage")) == 2 and len(files(tmp_path, "shape")) == 2
    prefill_auto(config)
    assert counted["refine"] == 2 and counted["stage"] == 0 and counted["layer"] == 0


def test_a_model_with_the_same_layer_shapes_plans_with_their_stored_figures(counted: dict[str, int]) -> None:
    config = tiny_config("llama")
    prefill_auto(config)
    deeper = pipemlx.shard_model(
        build_model({**config, "num_hidden_layers": config["num_hidden_layers"] + 2}, seed=1), mx.distributed.init()
    )
    stage = stage_of(deeper)
    assert calibrate.cached_cost_model(deeper, stage) is None  # another model: no figures of its own
    n = len(calibrate.CALIBRATION_LENGTHS)
    stored = stage_of(pipemlx.shard_model(build_model(config, seed=1), mx.distributed.init()))
    shape_figures = calibrate.prior_figures(deeper, stage.info)
    assert shape_figures != calibrate.arithmetic_figures(deeper, stage.info)
    assert shape_figures == calibrate.prior_figures(deeper, stored.info)[: n + 1]
    assert counted["stage"] == 0


@pytest.mark.parametrize("damage", ["not json", "wrong key", "bad figures", "unreadable"])
def test_a_bad_cache_file_is_ignored_and_rewritten(counted: dict[str, int], tmp_path: Path, damage: str) -> None:
    config = tiny_config("llama")
    prefill_auto(config)
    (path,) = files(tmp_path, "stage")
    stored = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ truncated")
    elif damage == "wrong key":
        path.write_text(json.dumps({**stored, "key": {**stored["key"], "mlx": "0.0.1"}}))
    elif damage == "bad figures":
        path.write_text(json.dumps({**stored, "value": [float("nan")] * len(stored["value"])}))
    else:
        path.unlink()
        path.mkdir()  # a folder where the file should be: reading fails, writing fails, nothing raises
    prefill_auto(config)
    assert counted["refine"] == 2 and counted["stage"] == 0
    if damage != "unreadable":
        assert json.loads(path.read_text()) == {**stored, "value": json.loads(path.read_text())["value"]}
        prefill_auto(config)  # rewritten: read again
        assert counted["refine"] == 2


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(calibration_cache.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration_cache.cache_dir() == tmp_path / "xdg" / "pipemlx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibration_cache.cache_dir() == tmp_path / "home" / ".cache" / "pipemlx"
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(tmp_path / "mine"))
    assert calibration_cache.cache_dir() == tmp_path / "mine"


def test_hosts_ignore_the_ports_of_local_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Local ranks get new ports every run; the key names the machines only, so a second run hits the cache."""
    keys = []
    for ports in ((5000, 5001), (6000, 6001)):
        hostfile = tmp_path / f"hosts{ports[0]}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
        keys.append(calibration_cache.environment())
    assert keys[0] == keys[1] and keys[0]["hosts"] == ["127.0.0.1", "127.0.0.1"]
    hostfile = tmp_path / "other.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert calibration_cache.environment() != keys[0]


def test_lend_auto_times_nothing_then_reads_what_a_prefill_refined(counted: dict[str, int]) -> None:
    """lend="auto"'s layer costs (a group of one here): the prior before any prefill, the refined figures after."""
    model = build_model(tiny_config("llama"), seed=1)
    info = stage_of(pipemlx.shard_model(build_model(tiny_config("llama"), seed=1), mx.distributed.init())).info
    layer = model.layers[0]
    n = len(calibrate.CALIBRATION_LENGTHS)
    first = calibrate.group_layer_costs(model, layer, info, mx.distributed.init())
    prior = calibrate.arithmetic_figures(model, info)
    assert first == calibrate.layer_costs(calibrate.CALIBRATION_LENGTHS, prior[:n], prior[n])
    prefill_auto(tiny_config("llama"))
    second = calibrate.group_layer_costs(model, layer, info, mx.distributed.init())
    assert second != first and counted["layer"] == 0 and counted["stage"] == 0


def test_ranks_holding_different_figures_calibrate_again() -> None:
    assert calibrate.must_calibrate([0, 5])
    assert calibrate.must_calibrate([5, 6])
    assert not calibrate.must_calibrate([5, 5])


def test_the_stage_key_holds_what_each_cut_lends() -> None:
    """Two shardings alike but for what the cut lends (a feed-forward half, key-value heads) time differently: their
    figures are kept apart (#51: a key without the lent heads reused a wrong step)."""
    from fakes import FakeGroup

    config = tiny_config("llama", num_hidden_layers=4)
    keys: list[dict[str, Any]] = []
    for lend in ("none", "mlp", 1):  # (a 4-head model: 1 of its 2 key-value heads)
        model = pipemlx.shard_model(build_model(config, seed=1), FakeGroup(1, 2), lend=lend)  # type: ignore[arg-type]
        keys.append(calibrate.stage_key(model, stage_of(model)))
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3, keys


def test_the_fingerprint_tells_different_figures_apart_and_ignores_key_order() -> None:
    # What the ranks compare before trusting the figures each read: equal holdings agree, different ones do not.
    figures = {"stage": [1.0, 2.5e-6, 3e-9], "layers": [4, 5]}
    same = calibration_cache.fingerprint({"layers": [4, 5], "stage": [1.0, 2.5e-6, 3e-9]})
    assert calibration_cache.fingerprint(figures) == same
    others = [{**figures, "stage": [1.0, 2.5e-6, 4e-9]}, {**figures, "layers": [5, 4]}, None, [], {"stage": None}]
    prints = {calibration_cache.fingerprint(v) for v in [figures, *others]}
    assert len(prints) == 1 + len(others), prints
    assert all(0 < p < 2**31 for p in prints)
    assert calibration_cache.fingerprint({"dtype": mx.float16}) != calibration_cache.fingerprint({"dtype": mx.float32})


def test_a_keys_file_name_is_the_compact_sorted_json_of_the_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The name is the file format: a release that spelled the key otherwise would miss every file users hold.
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    key = {"world": 2, "split": [3, 3], "dtype": mx.bfloat16, "model": {"b": 1, "a": "x"}}
    text = '{"dtype":"mlx.core.bfloat16","model":{"a":"x","b":1},"split":[3,3],"world":2}'
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    assert calibration_cache.cache_path("stage", key) == tmp_path / f"calibration-stage-{digest}.json"
    calibration_cache.store("stage", key, [1.0, 2.0])
    assert calibration_cache.load("stage", dict(reversed(list(key.items())))) == [1.0, 2.0]


def test_the_environment_part_of_the_key_is_what_the_module_documents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/opt/blas/libopenblas.so.0")
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    environment = calibration_cache.environment()
    assert environment == {
        "format": calibration_cache.FORMAT,
        "pipemlx": pipemlx.__version__,
        "mlx": mx.__version__,
        "mlx-lm": importlib.metadata.version("mlx-lm"),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": "libopenblas.so.0",
        "hosts": [socket.gethostname()],
    }
    hostfile = tmp_path / "v6.json"  # addresses with colons of their own: only the port is cut off
    hostfile.write_text(json.dumps([["[fe80::1]:5000", "10.0.0.1:5001"], ["fe80::2:6000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert calibration_cache.hosts() == ["[fe80::1],10.0.0.1", "fe80::2"]
    monkeypatch.setenv("MLX_HOSTFILE", "/no/such/hostfile.json")  # unreadable: this host's name
    assert calibration_cache.hosts() == environment["hosts"]


def test_the_models_configuration_in_the_key_is_its_args_as_json() -> None:
    model = build_model(tiny_config("llama"), seed=0)
    config = calibration_cache.model_config(model)
    assert config == json.loads(json.dumps(vars(model.args), sort_keys=True, default=str))
    assert config["num_hidden_layers"] == tiny_config("llama")["num_hidden_layers"] and len(config) > 5
    assert calibration_cache.model_config(object()) == {}


def test_store_writes_the_whole_entry_atomically_into_a_new_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "a" / "b"  # made on the first store, parents too
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(folder))
    key = {"model": "x", "split": [2, 2]}
    assert calibration_cache.load("stage", key) is None
    calibration_cache.store("stage", key, [0.5, 1.5])
    (written,) = folder.iterdir()  # no temporary file left beside it
    assert written == calibration_cache.cache_path("stage", key)
    assert json.loads(written.read_text(encoding="utf-8")) == {"kind": "stage", "key": key, "value": [0.5, 1.5]}
    assert calibration_cache.load("stage", key) == [0.5, 1.5]
    assert calibration_cache.load("layer", key) is None  # another kind: another file
    calibration_cache.store("stage", key, [2.0])  # replaced
    assert calibration_cache.load("stage", key) == [2.0] and len(list(folder.iterdir())) == 1
    written.write_text(json.dumps({"kind": "layer", "key": key, "value": [1.0]}))  # the file says another kind
    assert calibration_cache.load("stage", key) is None
    written.write_text(json.dumps([1.0]))  # not an entry
    assert calibration_cache.load("stage", key) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(blocked / "cache"))  # cannot be made: ignored
    calibration_cache.store("stage", key, [1.0])
    assert calibration_cache.load("stage", key) is None


def test_figures_are_finite_non_negative_numbers_of_the_length_asked() -> None:
    got = calibration_cache.figures([1, 2.5, 0])
    assert got == [1.0, 2.5, 0.0] and all(type(v) is float for v in got or [])
    assert calibration_cache.figures([1.0, 2.0], length=2) == [1.0, 2.0]
    assert calibration_cache.figures([], length=0) == []
    for bad, length in (
        ([1.0], 2),
        ([1.0, 2.0, 3.0], 2),
        ([True], None),
        ([float("nan")], None),
        ([float("inf")], None),
        ([-1e-9], None),
        (["1"], None),
        ((1.0,), None),
        ({"a": 1.0}, None),
        (None, None),
    ):
        assert calibration_cache.figures(bad, length) is None, (bad, length)


def test_a_models_args_that_json_cannot_hold_enter_the_key_as_text() -> None:
    """An argument of a type JSON has no spelling for (a path, a tuple's nested object) is keyed by its text
    rather than failing the calibration."""

    class Args:
        def __init__(self) -> None:
            self.path = Path("/models/m")
            self.layers = 2
            self.rope = {"kind": Path("x")}

    class Model:
        args = Args()

    assert calibration_cache.model_config(Model()) == {"layers": 2, "path": "/models/m", "rope": {"kind": "x"}}


def test_store_writes_beside_its_file_and_the_same_key_in_any_order_gives_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The temporary file lies in the cache folder (``os.replace`` is atomic only within one file system; one made
    in the system's temporary folder fails to move on another, and the figures would silently not be kept),
    named after its file and ending ``.tmp`` (a writer's leftover says which file it was for). The file is the
    sorted JSON of the entry: two ranks (or runs) storing one key write the same bytes."""
    monkeypatch.setenv(calibration_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    moved: list[tuple[Path, Path]] = []
    replace = calibration_cache.os.replace

    def recorded(source: Any, target: Any) -> None:
        moved.append((Path(source), Path(target)))
        replace(source, target)

    monkeypatch.setattr(calibration_cache.os, "replace", recorded)
    key = {"split": [2, 2], "model": {"layers": 4, "dims": 8}}
    calibration_cache.store("stage", key, {"b": 1.0, "a": 2.0})
    ((source, target),) = moved
    assert target == calibration_cache.cache_path("stage", key) and source.parent == target.parent == tmp_path
    assert source.name.startswith(target.name) and source.name.endswith(".tmp") and source != target
    expected = json.dumps({"key": key, "kind": "stage", "value": {"a": 2.0, "b": 1.0}}, sort_keys=True)
    assert target.read_text(encoding="utf-8") == expected
    first = target.read_bytes()
    calibration_cache.store("stage", {"model": {"dims": 8, "layers": 4}, "split": [2, 2]}, {"a": 2.0, "b": 1.0})
    assert target.read_bytes() == first and len(moved) == 2


def test_the_stage_key_names_what_the_module_documents() -> None:
    """The key stored in every file, field by field (the module's docstring lists them): the environment, the
    model's configuration and quantization, the split, the world size, the hidden size, the activation dtype,
    what the calibration times, and what each cut lends. A field renamed would silently orphan every stored file."""
    from fakes import FakeGroup

    config = tiny_config("llama", num_hidden_layers=4)
    model = pipemlx.shard_model(build_model(config, seed=1), FakeGroup(1, 2), lend="mlp")  # type: ignore[arg-type]
    key = calibrate.stage_key(model, stage_of(model))
    assert {k: v for k, v in key.items() if k not in ("config", "settings", "lending")} == {
        **calibration_cache.environment(),
        "quantization": [],
        "split": [2, 2],
        "world_size": 2,
        "hidden_size": config["hidden_size"],
        "dtype": "mlx.core.float32",
    }
    assert key["config"]["hidden_size"] == config["hidden_size"] and key["config"]["num_hidden_layers"] == 4
    assert key["settings"]["lengths"] == calibrate.CALIBRATION_LENGTHS and key["lending"][:2] == [True, 0]
