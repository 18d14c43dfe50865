"""pipemlx: pipeline parallelism for mlx-lm models, with overlapped long-prompt prefill.

On every rank of an ``mx.distributed`` group::

    model, tokenizer = pipemlx.load_sharded(path, group)  # this rank reads only its layers
    for token, logprobs in pipemlx.generate_step(prompt, model, prefill_step_size=512): ...

What is exported here is what an engine needs: loading and sharding (``load_sharded``,
``shard_model``), one request (``generate_step``, ``stream_generate``), many at once
(``BatchGenerator``), the prefill alone with mlx-lm's own decode after it
(``pipeline_prefill``, ``send_mode`` and its ``SendQueue``), and the errors. The
per-rank state stays reachable by module path for tools and tests
(``pipemlx.runtime.stage.stage_of``, ``pipemlx.runtime.stage.PipelineStage``), as does
``pipemlx.runtime.lean_decode.lean_generate_step``.
"""

from ._version import __version__
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
from .runtime.prefill import pipeline_prefill
from .runtime.send_mode import send_mode
from .runtime.send_queue import SendQueue

__all__ = [
    "__version__",
    "BatchGenerator",
    "NotShardedError",
    "PeerLostError",
    "PipelineError",
    "PipelineMismatchError",
    "PipelineTimeoutError",
    "PrefillCancelled",
    "SendQueue",
    "generate_step",
    "load_sharded",
    "pipeline_prefill",
    "send_mode",
    "shard_model",
    "stream_generate",
]
