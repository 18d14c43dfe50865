"""load_sharded: each rank reads and holds only its part of an mlx-lm model directory.

The memory test saves a ~300 MB model (8 layers of ~35 MB, float32) and loads
it on 3 ranks: each rank's peak resident-set growth while loading must stay
within 15% of what it should hold (its layers, the norm and head, the
embedding on rank 0) and well under a full mlx-lm load measured the same way
in the same processes; the tokens must equal the full model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from conftest import run_ranks
from fakes import HELIUM_TIED, FakeGroup
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step

import pipemlx
from pipemlx.models.safetensors import model_bytes_from_dir
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.memory_model import fixed_bytes
from pipemlx.schedule.memory_split import plan_split
from pipemlx.schedule.split import layer_range
from pipemlx.testing import BASE_CONFIGS, build_model, save_model_dir, tiny_config, write_tokenizer

MARGIN = 1.15
BIG = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
}


pytestmark = pytest.mark.usefixtures("fake_groups_load_alone")  # conftest.py: FakeGroup loads skip the exchange


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("llama", **BIG)
    return save_model_dir(build_model(config, seed=1), config, tmp_path_factory.mktemp("big") / "llama", shards=2)


def test_each_rank_holds_only_its_share(big_model: Path) -> None:
    spec = {"path": str(big_model), "prompt": 12, "step": 4, "max_tokens": 4}
    reports = run_ranks(3, "load_memory.py", spec, timeout=300)
    planned = model_bytes_from_dir(big_model)
    assert planned.total > 250e6
    for report in reports:
        rank = report["rank"]
        where = f"rank {rank}: {json.dumps(report)}"
        local = layer_range(report["split"], rank)
        expected = sum(planned.layers[local.start : local.stop]) + planned.fixed(rank, 3)
        assert report["held"] == expected, where
        assert report["sharded_peak"] <= MARGIN * expected, where
        assert report["sharded_peak"] <= 0.6 * report["full_peak"], where
        assert report["full_peak"] >= 0.95 * planned.total, where  # the measurement sees a full load
        assert report["embedding"] == ("Embedding" if rank == 0 else "EmbeddingStandIn"), where
        assert report["tokens"] == report["ref_tokens"], where
        assert report["tokenizer_vocab"] == BIG["vocab_size"], where


SPLIT_VOCABULARY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 65536}


def test_a_split_vocabulary_is_read_by_rows(tmp_path: Path) -> None:
    """``head="split"``: each rank reads and holds only its half of a tied embedding that outweighs the layers. The
    peak of MLX's allocations while loading stays within the margin of what the rank holds (the matrix is never
    read whole: that alone would be twice its share), and its tokens equal mlx-lm's on the whole model. (The
    resident set grows by a fixed ~48 MB more while loading, threads and buffers, the same with ``head="all"``.)"""
    config = tiny_config("qwen2", **SPLIT_VOCABULARY)
    whole = build_model(config, seed=4)
    path = save_model_dir(whole, config, tmp_path / "qwen2")
    spec = {"path": str(path), "prompt": 9, "step": 4, "max_tokens": 4, "head": "split", "full": False}
    reports = run_ranks(2, "load_memory.py", spec, timeout=300)
    prompt = mx.random.randint(0, config["vocab_size"], (9,), key=mx.random.key(5)).astype(mx.int32)  # the ranks'
    ref_tokens = [int(t) for t, _ in generate_step(prompt, whole, prefill_step_size=4, max_tokens=4)]
    planned = model_bytes_from_dir(path)
    assert planned.tied and planned.embedding > 4 * sum(planned.layers)
    for report in reports:
        where = f"rank {report['rank']}: {json.dumps(report)}"
        local = layer_range(report["split"], report["rank"])
        share = planned.embedding // 2 + planned.head  # 65,536 rows: an even split; the norm whole
        assert report["fixed"] == share, where
        assert report["held"] == sum(planned.layers[local.start : local.stop]) + share, where
        assert report["mlx_peak"] <= MARGIN * report["held"] < planned.embedding, where
        assert report["embedding"] == "SplitEmbedding", where
        assert report["tokens"] == ref_tokens, where


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("small")
    paths: dict[str, Path] = {}
    for arch in ("llama", "qwen3"):
        config = tiny_config(arch)
        hf = save_model_dir(build_model(config, seed=2), config, root / f"{arch}_hf", shards=3, index=arch == "llama")
        paths[arch] = hf
        convert(str(hf), str(root / f"{arch}_4bit"), quantize=True, q_bits=4, q_group_size=32)
        paths[f"{arch}_4bit"] = root / f"{arch}_4bit"
    return paths


def test_loaded_shards_match_mlx_lm(small_models: dict[str, Path]) -> None:
    """Untied and tied, float and 4-bit (mlx-lm's convert), several files with and without an index; the default
    head (a split vocabulary: each rank holds its rows), decoded by mlx-lm's own generate_step."""
    qwen3 = model_bytes_from_dir(small_models["qwen3"])
    memory = [qwen3.total, qwen3.total // 2]
    models: list[dict[str, Any]] = [
        {"path": str(small_models["llama"]), "split": [2, 4]},
        {"path": str(small_models["qwen3"]), "split": "memory", "memory": memory},
        {"path": str(small_models["llama_4bit"])},
        {"path": str(small_models["qwen3_4bit"])},
    ]
    spec = {"models": models, "prompt": 14, "step": 4, "max_tokens": 6}
    reports = run_ranks(2, "load_equivalence.py", spec, timeout=300)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        rank = report["rank"]
        for entry, loaded in zip(models, report["models"]):
            where = f"rank {rank}: {loaded}"
            planned = model_bytes_from_dir(entry["path"])
            local = layer_range(loaded["split"], rank)
            assert loaded["tokens"] == loaded["ref_tokens"], where
            assert len(set(loaded["tokens"])) > 1, where
            assert loaded["head"] == "split", where  # head="auto" on a plain-head architecture, 2 ranks
            fixed = fixed_bytes(planned, rank, 2, "split")  # this rank's rows of the embedding and the head
            held = loaded["held"] - sum(planned.layers[local.start : local.stop])
            # The plan shares an untied model's final norm like the head's rows (tied: exact); the norm is whole here.
            norm = 4 * tiny_config("llama")["hidden_size"] // 2 if "llama" in entry["path"] else 0  # float32
            assert held == fixed + norm, where
            quantized = "4bit" in entry["path"]
            assert loaded["embeddings"] == [], where  # no whole embedding on any rank
            assert loaded["embedding_rows"] == ("QuantizedEmbedding" if quantized else "Embedding"), where
            assert (loaded["quantized_layers"] > 0) is quantized, where
    assert reports[0]["models"][0]["split"] == [2, 4]
    assert reports[0]["models"][1]["split"] == list(plan_split(qwen3, 2, memory).split)


def test_load_sharded_names_what_is_missing(tmp_path: Path, small_models: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        pipemlx.load_sharded(tmp_path / "nowhere", FakeGroup(0, 2), lend="none")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        pipemlx.load_sharded(tmp_path, FakeGroup(0, 2), lend="none")
    (tmp_path / "config.json").write_text((small_models["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"has no model\*.safetensors"):
        pipemlx.load_sharded(tmp_path, FakeGroup(0, 2), lend="none")


def test_load_sharded_on_a_fake_rank_keeps_its_layers(small_models: dict[str, Path]) -> None:
    model, tokenizer = pipemlx.load_sharded(small_models["llama"], FakeGroup(1, 3), lend="none", split=[1, 2, 3])
    stage = stage_of(model)
    assert stage.info.layers == range(1, 3) and len(model.layers) == 2
    assert tokenizer.encode("t5 t7", add_special_tokens=False) == [5, 7]
    with pytest.raises(ValueError, match=r"split \[1, 2\] has 2 entries but the group has 3 ranks"):
        pipemlx.load_sharded(small_models["llama"], FakeGroup(0, 3), lend="none", split=[1, 2])


def test_load_sharded_passes_allow_unregistered_on(tmp_path: Path) -> None:
    # helium is not in the registry: refused by default, loaded when asked (load_sharded had no way to ask).
    path = save_model_dir(build_model(dict(HELIUM_TIED)), HELIUM_TIED, tmp_path / "helium")
    with pytest.raises(pipemlx.PipelineError, match=r"pass allow_unregistered=True to shard_model \(or load_sharded\)"):
        pipemlx.load_sharded(path, FakeGroup(0, 2), lend="none")
    model, _ = pipemlx.load_sharded(path, FakeGroup(1, 2), lend="none", allow_unregistered=True)
    assert stage_of(model).info.layers == range(2, 4)


@pytest.mark.parametrize(
    "arch,config,kept",
    [
        ("llama", tiny_config("llama"), False),  # its own lm_head: the embedding goes on ranks > 0
        ("qwen3", tiny_config("qwen3"), True),  # tied: the embedding is the head
        ("helium", HELIUM_TIED, True),  # builds an lm_head but is tied: the flag decides
    ],
)
def test_embedding_is_dropped_only_where_it_is_not_the_head(arch: str, config: dict[str, Any], kept: bool) -> None:
    import mlx.core as mx

    whole = build_model(dict(config))
    # helium is not in the registry (not verified end to end): allowed explicitly for this check. head="all" (the
    # default "auto" splits the vocabulary of the registered ones: tests/test_vocab_split.py).
    model = pipemlx.shard_model(  # type: ignore[arg-type]
        build_model(dict(config)), FakeGroup(1, 2), lend="none", allow_unregistered=True, head="all"
    )
    assert (type(model.model.embed_tokens).__name__ == "Embedding") is kept
    assert (
        model.model.embed_tokens(mx.array([[1, 2, 3]])).shape == whole.model.embed_tokens(mx.array([[1, 2, 3]])).shape
    )
    first = pipemlx.shard_model(  # type: ignore[arg-type]
        build_model(dict(config)), FakeGroup(0, 2), lend="none", allow_unregistered=True, head="all"
    )
    assert type(first.model.embed_tokens).__name__ == "Embedding"


@pytest.mark.parametrize("arch", sorted(BASE_CONFIGS))
def test_every_tiny_config_saves_a_directory_mlx_lm_loads_a_tokenizer_from(tmp_path: Path, arch: str) -> None:
    # load_sharded and mlx_lm.load read the tokenizer through transformers, which validates config.json
    # against the architecture's config class: gemma2/gemma3's float query_pre_attn_scalar (16.0) was refused
    # ("Field 'query_pre_attn_scalar' expected int"), so save_model_dir wrote gemma directories nothing loaded.
    from mlx_lm.utils import load_tokenizer

    config = tiny_config(arch)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_tokenizer(tmp_path, int(config.get("vocab_size", 256)))
    tokenizer = load_tokenizer(tmp_path, eos_token_ids=config.get("eos_token_id"))
    if arch != "qwen2":  # transformers 5 swaps in its byte-level Qwen2Tokenizer for model_type qwen2
        assert tokenizer.encode("t5 t7", add_special_tokens=False) == [5, 7]


def make_adapters(model_dir: Path, folder: Path, num_layers: int, seed: int = 5) -> Path:
    """LoRA adapters for the last ``num_layers`` layers as mlx-lm's trainer saves them, with weights that change
    the output (a fresh adapter's lora_b is zero)."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    loaded: Any = load(str(model_dir))
    model = loaded[0]
    parameters = {"rank": 4, "scale": 8.0, "dropout": 0.0}
    linear_to_lora_layers(model, num_layers, parameters)
    mx.random.seed(seed)
    adapters = {
        name: mx.random.normal(value.shape) * 0.2
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), adapters)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": parameters}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_each_rank_holds_mlx_lm_s_adapters_of_its_layers(small_models: dict[str, Path], tmp_path: Path) -> None:
    """``adapter_path``: mlx-lm's load_adapters on the whole model, then each rank keeps its layers' adapters."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    adapters = make_adapters(small_models["llama"], tmp_path / "adapters", num_layers=3)
    whole: Any = load(str(small_models["llama"]), adapter_path=str(adapters))
    reference = dict(tree_flatten(whole[0].model.layers[-1].parameters()))
    assert any(name.endswith("lora_b") for name in reference)
    model, _ = pipemlx.load_sharded(small_models["llama"], FakeGroup(1, 2), adapter_path=adapters)
    assert stage_of(model).info.lending.mlp is False  # whole layers: LoRA wraps what lending cuts
    mine = dict(tree_flatten(model.layers[-1].parameters()))
    assert mine.keys() == reference.keys()
    for name, value in mine.items():
        assert mx.array_equal(value, reference[name]).item(), name
    with pytest.raises(ValueError, match="LoRA adapters need whole layers"):
        pipemlx.load_sharded(small_models["llama"], FakeGroup(1, 2), adapter_path=adapters, lend="mlp")


def test_generate_with_adapters_gives_mlx_lm_s_tokens(small_models: dict[str, Path], tmp_path: Path) -> None:
    """``pipemlx generate --ranks 2 --adapter-path`` gives the greedy tokens of mlx-lm loading the same adapters
    in one process, and other tokens than without them."""
    import subprocess
    import sys

    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load

    adapters = make_adapters(small_models["llama"], tmp_path / "adapters", num_layers=4)
    prompt = "t5 t17 t3 t99 t42 t8 t61 t23"
    argv = [sys.executable, "-m", "pipemlx", "generate", "--ranks", "2", "--model", str(small_models["llama"])]
    argv += ["--prompt", prompt, "--max-tokens", "8", "--json", "--ignore-chat-template", "--timeout", "60"]
    done = subprocess.run([*argv, "--adapter-path", str(adapters)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    def reference(adapter_path: str | None) -> list[int]:
        loaded: Any = load(str(small_models["llama"]), adapter_path=adapter_path)
        responses = stream_generate(
            loaded[0], loaded[1], prompt, max_tokens=8, prefill_step_size=report["largest_chunk"]
        )
        return [r.token for r in responses if r.finish_reason != "stop"]

    assert report["tokens"] == reference(str(adapters))
    assert report["tokens"] != reference(None), "the adapters change nothing: the test could not fail"
