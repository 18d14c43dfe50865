"""The first run, as a new user meets it, on models shaped like published small LLMs (issue #47).

    python benchmarks/first_run.py [--shapes qwen2.5-0.5b,llama-3.2-1b] [--precisions fp32,4bit] [--ranks 2,3]
                                   [--prompt-tokens 818] [--max-tokens 32] [--head {auto,all,last,split}]
                                   [--models-dir DIR] [--out FILE]
                                   [--no-openblas] [--smoke]

For each shape and precision it builds a model with the published configuration (random weights, drawn by
:func:`pipemlx.testing.build_model`; 4-bit by mlx-lm's ``quantize_model``; saved by mlx-lm's ``save_model`` and
``save_config``, with a byte-level tokenizer: the prompt is ``--prompt-tokens`` letters, one token each),
then times, each as its own process from a cold start:

- ``mlx_lm.generate`` in one process pinned to one core (``taskset -c 0``): the reference;
- ``pipemlx generate --ranks S`` with an empty calibration cache (the first run), then again with the cache the
  first run left (the second run).

It reports per run the wall time (process start to exit), prefill and decode speed, and per rank the load time
(reading and sharding the model, ``lend="auto"`` included), the calibration time (timing costs and agreeing on them:
``stage.calibration_s``) and MLX's peak memory. mlx-lm prints no load time: its column holds the wall time less
prefill and decode. Every process gets :func:`common.bench_env` (OpenBLAS preloaded, one BLAS thread).

``--smoke`` swaps the shapes for tiny ones (a few seconds in all): to check the script, not to quote. The real
shapes need about 2 GB (Qwen2.5-0.5B) and 5 GB (Llama-3.2-1B) of disk each in full precision, and minutes per run
on a 2-core machine: time them on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_env, openblas_available  # noqa: E402

QWEN_2_5_0_5B: dict[str, Any] = {  # Qwen/Qwen2.5-0.5B's config.json (the fields mlx-lm reads)
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
LLAMA_3_2_1B: dict[str, Any] = {  # meta-llama/Llama-3.2-1B's config.json (the fields mlx-lm reads)
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
}
SHAPES = {"qwen2.5-0.5b": QWEN_2_5_0_5B, "llama-3.2-1b": LLAMA_3_2_1B}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {  # the same families, tiny: for checking the script only
    "qwen2.5-0.5b": {**QWEN_2_5_0_5B, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
    "llama-3.2-1b": {**LLAMA_3_2_1B, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512},
}  # fmt: skip
QUANTIZATION = {"bits": 4, "group_size": 64}
TIMEOUT_S = 3600


def build(config: dict[str, Any], precision: str, path: Path) -> Path:
    """An mlx-lm model folder at ``path`` (reused when it holds this configuration already)."""
    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save_config, save_model

    from pipemlx.testing import build_model

    wanted = {**config, **({"quantization": QUANTIZATION} if precision == "4bit" else {})}
    saved = path / "config.json"
    if saved.exists():
        held = json.loads(saved.read_text())
        if {k: held.get(k) for k in wanted} == wanted:
            return path
    shutil.rmtree(path, ignore_errors=True)
    model = build_model(config, seed=0)
    saved_config = dict(config)
    if precision == "4bit":
        model, saved_config = quantize_model(model, saved_config, QUANTIZATION["group_size"], QUANTIZATION["bits"])
    save_model(path, model)
    save_config(saved_config, path / "config.json")
    write_byte_tokenizer(path)
    del model
    mx.clear_cache()
    return path


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with no merges (each byte of the text one token, ids 0..255), which transformers loads
    for a qwen2 folder too (its own qwen2 tokenizer encodes a word-level vocabulary's words to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pyright: ignore[reportMissingTypeStubs]

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # pyright: ignore[reportUnknownMemberType]
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))  # pyright: ignore
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # pyright: ignore
    tokenizer.decoder = decoders.ByteLevel()  # pyright: ignore
    tokenizer.save(str(path / "tokenizer.json"))  # pyright: ignore
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "~"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def prompt_text(tokens: int) -> str:
    """A text of ``tokens`` tokens for :func:`write_byte_tokenizer`'s tokenizer: letters, one token each."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(letters[(i * 7) % len(letters)] for i in range(tokens))


def env_for(openblas: bool, cache_dir: Path | None = None) -> dict[str, str]:
    env = {**os.environ, **bench_env(openblas)}
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(name, None)
    if cache_dir is not None:
        env["PIPEMLX_CACHE_DIR"] = str(cache_dir)
    return env


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run ``command``; its wall seconds and stdout (raises with its stderr when it fails)."""
    began = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - began
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return wall, out.stdout + out.stderr


def run_mlx_lm(model: Path, prompt: str, max_tokens: int, openblas: bool) -> dict[str, Any]:
    """``mlx_lm.generate`` in one process pinned to core 0."""
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    command = [*pin, sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", prompt]
    command += ["--max-tokens", str(max_tokens), "--ignore-chat-template", "--verbose", "True"]
    wall, output = timed(command, env_for(openblas))

    def figure(pattern: str) -> float:
        found = re.search(pattern, output)
        if found is None:
            raise RuntimeError(f"mlx_lm.generate printed no {pattern!r}:\n{output[-2000:]}")
        return float(found.group(1))

    prompt_tokens = figure(r"Prompt: (\d+) tokens")
    prefill_tps = figure(r"Prompt: \d+ tokens, ([\d.]+) tokens-per-sec")
    generated = figure(r"Generation: (\d+) tokens")
    decode_tps = figure(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec")
    prefill_s = prompt_tokens / prefill_tps if prefill_tps else 0.0
    decode_s = generated / decode_tps if decode_tps else 0.0
    text = re.search(r"==========\n(.*)\n==========", output, re.S)
    return {
        "run": "mlx_lm.generate, 1 process, 1 core",
        "text": text.group(1) if text else None,
        "wall_s": wall,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prefill_tps,
        "decode_tokens_per_s": decode_tps,
        "per_rank": [
            {
                "rank": 0,
                "load_s": max(0.0, wall - prefill_s - decode_s),  # the rest of the wall time
                "calibration_s": 0.0,
                "peak_memory_mb": figure(r"Peak memory: ([\d.]+) GB") * 1000,
            }
        ],
    }


def run_pipemlx(
    model: Path,
    prompt: str,
    max_tokens: int,
    ranks: int,
    cache_dir: Path,
    openblas: bool,
    which: str,
    head: str = "auto",
) -> dict[str, Any]:
    """``pipemlx generate --ranks S [--head H]`` with the calibration cache in ``cache_dir``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as file:
        file.write(prompt)
    try:
        command = [sys.executable, "-m", "pipemlx", "generate", "--ranks", str(ranks), "--model", str(model)]
        command += ["--prompt-file", file.name, "--max-tokens", str(max_tokens), "--ignore-chat-template", "--json"]
        command += ["--head", head] if head != "auto" else []  # the default: split where the model allows
        wall, output = timed(command, env_for(openblas, cache_dir))
    finally:
        os.unlink(file.name)
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"pipemlx generate printed no report:\n{output[-2000:]}")
    report = json.loads(lines[-1])
    return {
        "run": f"pipemlx generate --ranks {ranks}{'' if head == 'auto' else f' --head {head}'}, {which}",
        "wall_s": wall,
        "prefill_s": report["prefill_s"],
        "prefill_tokens_per_s": report["prefill_tokens_per_s"],
        "decode_tokens_per_s": report["decode_tokens_per_s"],
        "chunks": report.get("largest_chunk"),
        "text": report.get("text"),
        "per_rank": report["per_rank"],
    }


def row(shape: str, precision: str, result: dict[str, Any]) -> str:
    per_rank = result["per_rank"]

    def each(key: str, fmt: str) -> str:
        return " / ".join(fmt.format(r.get(key, 0.0)) for r in per_rank)

    return (
        f"| {shape} {precision} | {result['run']} | {result['wall_s']:.1f} s | {each('load_s', '{:.1f}')} s | "
        f"{each('calibration_s', '{:.2f}')} s | {result['prefill_s']:.1f} s ({result['prefill_tokens_per_s']:.0f} "
        f"tok/s) | {result['decode_tokens_per_s']:.1f} tok/s | {each('peak_memory_mb', '{:,.0f}')} MB | "
        f"{'yes' if result.get('same_text_as_mlx_lm') else 'NO'} |"
    )


HEADER = (
    "| model | run | wall | load (per rank) | calibration (per rank) | prefill | decode | peak memory (per rank) "
    "| text = mlx-lm's |\n|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-0.5b,llama-3.2-1b")
    parser.add_argument("--precisions", default="fp32,4bit")
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--prompt-tokens", type=int, default=818)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--head", default="auto", choices=("auto", "all", "last", "split"), help="pipemlx generate --head"
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="where the models are built (kept); default: a temporary folder"
    )
    parser.add_argument("--out", type=Path, default=None, help="write every result as JSON here too")
    parser.add_argument("--no-openblas", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (not to quote)")
    args = parser.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    openblas = not args.no_openblas and openblas_available()
    work = Path(tempfile.mkdtemp(prefix="pipemlx-first-run-"))
    models_dir = args.models_dir or work / "models"
    results: list[dict[str, Any]] = []
    print(
        f"OpenBLAS: {'preloaded' if openblas else 'no'}; prompt {args.prompt_tokens} tokens, {args.max_tokens} generated"
    )
    print(HEADER, flush=True)
    try:
        for shape in args.shapes.split(","):
            config = shapes[shape]
            for precision in args.precisions.split(","):
                model = build(config, precision, models_dir / f"{shape}-{precision}{'-smoke' if args.smoke else ''}")
                prompt = prompt_text(args.prompt_tokens)
                runs = [run_mlx_lm(model, prompt, args.max_tokens, openblas)]
                for ranks in (int(r) for r in args.ranks.split(",")):
                    cache_dir = work / f"cache-{shape}-{precision}-{ranks}"  # empty: the first run
                    for which in ("first run", "second run"):
                        runs.append(
                            run_pipemlx(model, prompt, args.max_tokens, ranks, cache_dir, openblas, which, args.head)
                        )
                for result in runs:
                    result["same_text_as_mlx_lm"] = result["text"] == runs[0]["text"]
                    print(row(shape, precision, result), flush=True)
                    results.append({"shape": shape, "precision": precision, **result})
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the models too, unless --models-dir keeps them elsewhere
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
