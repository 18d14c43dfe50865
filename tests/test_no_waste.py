"""No wasted work in prefill: no logits are computed, measured by MLX's peak memory.

One chunk's logits (256 tokens x 32000 vocab x 4 bytes = 32.8 MB) dwarf everything
else this tiny model allocates during a prefill, so a peak (above the memory the
weights already hold) below that proves they
were never materialised; the control run (mlx-lm calling the model and evaluating
its output) shows the measurement can see them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.testing import build_model, tiny_config

VOCAB, STEP = 32000, 256
LOGITS_BYTES = STEP * VOCAB * 4


def test_prefill_computes_no_logits() -> None:
    model = pipemlx.shard_model(build_model(tiny_config("llama", vocab_size=VOCAB)), mx.distributed.init())
    prompt = mx.arange(4 * STEP + 1, dtype=mx.int32) % VOCAB
    mx.eval(prompt)

    cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # the weights
    pipemlx.pipeline_prefill(model, prompt, cache, step_size=STEP)
    prefill_peak = mx.get_peak_memory() - before

    control_cache = make_prompt_cache(model)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(prompt[None, :STEP], cache=control_cache))
    control_peak = mx.get_peak_memory() - before

    assert control_peak >= LOGITS_BYTES, "the control should materialise one chunk's logits"
    assert prefill_peak < LOGITS_BYTES / 2, f"prefill peaked at {prefill_peak / 2**20:.1f} MB"
    assert {c.offset for c in cache} == {4 * STEP}
