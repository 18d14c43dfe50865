# pyright: basic
# (training goes through mlx.optimizers / nn.value_and_grad, which carry no type information)
"""Train pipemlx's demo model: a small llama on *Pride and Prejudice*, saved as an mlx-lm model folder.

The text is Jane Austen's novel (1813, public domain; Project Gutenberg's
transcription, see ``extract_text.py``), shipped as ``pride_and_prejudice.txt.gz``.
The script trains a byte-level BPE tokenizer on it with the ``tokenizers``
package, then a llama-architecture mlx-lm ``Model`` from random weights with
AdamW on random windows of the text, and writes ``config.json``,
``model.safetensors`` and the tokenizer files into ``--out`` (by default
``./demo-model`` in the current folder; never inside the installed package),
where ``mlx_lm.load`` reads it like any downloaded model.

Reproduce the shipped model, then compare it with, or copy it over,
``pipemlx/demo/model`` in a clone of the repository::

    python -m pipemlx.demo.train --out demo-model

Seeds are fixed; the weights match the shipped ones up to floating-point
differences between BLAS libraries.

The demo's draft model (``pipemlx/demo/draft``, for speculative decoding) has
two layers and the demo's own tokenizer, and learns from the demo model rather
than from the text alone (distillation): on windows of the book and of the demo
model's own greedy continuations of it, it is trained towards the demo model's
next-token distribution, which is what its guesses are checked against::

    python -m pipemlx.demo.train --out demo-draft --layers 2 --distill pipemlx/demo/model
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
TEXT = HERE / "pride_and_prejudice.txt.gz"
DEFAULT_OUT = Path("demo-model")
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_MAX_LENGTH = 1 << 20  # no limit to speak of: RoPE has none (the model was trained on 256-token windows)


def model_config(vocab_size: int, layers: int = 8) -> dict[str, Any]:
    """The demo model's mlx-lm config: llama, 8 decoder layers, about 1.3 M parameters (its draft: 2 layers)."""
    return {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": layers,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style) with ``vocab_size`` entries, ``<|endoftext|>`` first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # pyright: ignore[reportAttributeAccessIssue]
    tokenizer.decoder = decoders.ByteLevel()  # pyright: ignore[reportAttributeAccessIssue]
    trainer = trainers.BpeTrainer(  # pyright: ignore[reportCallIssue]
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """``tokenizer.json`` plus the ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` reads."""
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TEXT,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def loss_of(model: nn.Module, inputs: mx.array, targets: mx.array) -> mx.array:
    """Mean next-token cross-entropy."""
    logits = model(inputs)
    return nn.losses.cross_entropy(logits, targets).mean()


def distillation_loss(model: nn.Module, inputs: mx.array, teacher_logits: mx.array) -> mx.array:
    """Mean KL divergence from the teacher's next-token distribution to the model's."""
    teacher = nn.log_softmax(mx.stop_gradient(teacher_logits), axis=-1)
    student = nn.log_softmax(model(inputs), axis=-1)
    return (mx.exp(teacher) * (teacher - student)).sum(axis=-1).mean()


def greedy_continuations(
    teacher: nn.Module, tokens: np.ndarray[Any, np.dtype[np.int32]], *, count: int, prompt: int, length: int, seed: int
) -> np.ndarray[Any, np.dtype[np.int32]]:
    """``count`` sequences of ``length`` tokens: a random ``prompt``-token window of the text, then the teacher's
    greedy continuation of it (what a draft guesses against when the teacher decodes)."""
    from mlx_lm.models.cache import make_prompt_cache

    rng = np.random.default_rng(seed)
    rows: list[np.ndarray[Any, np.dtype[np.int32]]] = []
    for start in range(0, count, 64):
        offsets = rng.integers(0, tokens.size - prompt, size=min(64, count - start))
        out = [np.stack([tokens[o : o + prompt] for o in offsets])]
        cache = make_prompt_cache(teacher)
        logits = teacher(mx.array(out[0]), cache=cache)
        for _ in range(length - prompt):
            step = mx.argmax(logits[:, -1], axis=-1)
            out.append(np.array(step, dtype=np.int32)[:, None])
            logits = teacher(step[:, None], cache=cache)
        rows.append(np.concatenate(out, axis=1))
    return np.concatenate(rows)


def train(
    model: nn.Module,
    tokens: np.ndarray[Any, np.dtype[np.int32]],
    *,
    steps: int,
    batch: int,
    seq: int,
    learning_rate: float,
    seed: int,
    report: Callable[[int, float, float], None],
    teacher: nn.Module | None = None,
    generated: np.ndarray[Any, np.dtype[np.int32]] | None = None,
) -> None:
    """AdamW with warm-up and cosine decay on random ``seq``-token windows of ``tokens``.

    With a ``teacher``: towards the teacher's next-token distribution (:func:`distillation_loss`) instead of the
    text's next token, on batches half of windows of ``tokens``, half of rows of ``generated``."""
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(0.0, learning_rate, warmup),
            optim.cosine_decay(learning_rate, steps - warmup, 0.1 * learning_rate),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(model, loss_of if teacher is None else distillation_loss)
    state = [model.state, optimizer.state]

    def step(inputs: mx.array, targets: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, inputs, targets)
        optimizer.update(model, grads)
        return loss

    compiled = mx.compile(step, inputs=state, outputs=state)  # pyright: ignore[reportUnknownVariableType]
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        from_text = batch if generated is None else batch - batch // 2
        offsets = rng.integers(0, tokens.size - seq - 1, size=from_text)
        rows = [tokens[o : o + seq + 1] for o in offsets]
        if generated is not None:
            rows += [generated[j, : seq + 1] for j in rng.integers(0, generated.shape[0], size=batch - from_text)]
        window = np.stack(rows)
        inputs = mx.array(window[:, :-1])
        targets = mx.array(window[:, 1:]) if teacher is None else teacher(inputs)
        loss = compiled(inputs, targets)
        mx.eval(loss, state)
        if i % 50 == 0 or i == steps:
            report(i, loss.tolist(), time.perf_counter() - start)  # pyright: ignore[reportArgumentType]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder to write (default ./demo-model)")
    parser.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary size")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256, help="training window in tokens")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the demo's draft model: 2)")
    parser.add_argument("--tokenizer", type=Path, help="a model folder whose tokenizer to keep (a draft's target)")
    parser.add_argument(
        "--distill",
        type=Path,
        help="a model folder to learn from (a draft's target): its tokenizer, and its next-token distribution",
    )
    parser.add_argument("--continuations", type=int, default=512, help="with --distill: the target's greedy texts")
    args = parser.parse_args()
    args.tokenizer = args.tokenizer or args.distill

    with gzip.open(TEXT, "rt", encoding="utf-8") as f:
        text = f.read()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")) if args.tokenizer else None
    tokenizer = tokenizer or train_tokenizer(text, args.vocab)
    tokens = np.array(tokenizer.encode(text).ids, dtype=np.int32)
    print(f"{len(text)} characters -> {tokens.size} tokens (vocabulary {tokenizer.get_vocab_size()})")

    mx.random.seed(args.seed)
    config = model_config(tokenizer.get_vocab_size(), args.layers)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # pyright: ignore[reportAssignmentType]
    count = sum(p.size for _, p in params)
    print(f"llama, {config['num_hidden_layers']} layers, {count / 1e6:.2f} M parameters")

    def report(step: int, loss: float, seconds: float) -> None:
        print(f"step {step:5d}  loss {loss:.3f}  ({math.exp(loss):.1f} ppl)  {seconds:.0f} s", flush=True)

    teacher, generated = None, None
    if args.distill:
        from mlx_lm.utils import load_model

        teacher = load_model(args.distill)[0]
        teacher.freeze()
        started = time.perf_counter()
        generated = greedy_continuations(
            teacher, tokens, count=args.continuations, prompt=32, length=args.seq + 1, seed=args.seed
        )
        print(f"{generated.shape[0]} greedy continuations of the target in {time.perf_counter() - started:.0f} s")
    train(
        model,
        tokens,
        teacher=teacher,
        generated=generated,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        learning_rate=args.lr,
        seed=args.seed,
        report=report,
    )
    save_model(args.out, model)
    (args.out / "model.safetensors.index.json").unlink(missing_ok=True)  # one file; the index is noise
    save_config(config, args.out / "config.json")
    save_tokenizer(tokenizer, args.out, TOKENIZER_MAX_LENGTH)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
