"""pipemlx: pipeline parallelism for mlx-lm models, with overlapped long-prompt prefill.

On every rank::

    pipemlx.shard_model(model, group)
    cache = mlx_lm.models.cache.make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, prompt, cache, step_size=512)
    for token, logprobs in mlx_lm.generate.generate_step(prompt[-1:], model, prompt_cache=cache): ...
"""

from .errors import (
    NotShardedError,
    PeerLostError,
    PipelineError,
    PipelineMismatchError,
    PipelineTimeoutError,
    PrefillCancelled,
)
from .models.loading import load_sharded
from .models.sharding import shard_model
from .runtime.batch import BatchGenerator
from .runtime.generate import generate_step, stream_generate
from .runtime.lean_decode import lean_generate_step
from .runtime.prefill import pipeline_prefill
from .runtime.send_mode import send_mode
from .runtime.send_queue import SendQueue
from .runtime.stage import PipelineStage, stage_of

__version__ = "0.1.0"

__all__ = [
    "BatchGenerator",
    "NotShardedError",
    "PeerLostError",
    "PipelineError",
    "PipelineMismatchError",
    "PipelineStage",
    "PipelineTimeoutError",
    "PrefillCancelled",
    "SendQueue",
    "generate_step",
    "lean_generate_step",
    "load_sharded",
    "pipeline_prefill",
    "send_mode",
    "shard_model",
    "stage_of",
    "stream_generate",
]
