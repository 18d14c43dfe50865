"""pipeline_prefill: carry out the prefill plan on a sharded model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .agreement import agree_on_step, handshake
from .caches import cache_state
from .errors import PipelineError
from .plan import Agree, Compute, Handshake, PrefillPlan, Progress, Recv, Send, build_plan, check_prefill_args
from .send_mode import send_mode
from .stage import PipelineStage, stage_of
from .waits import wait_for

ProgressCallback = Callable[[int, int], Any]


def pipeline_prefill(
    model: nn.Module,
    prompt: mx.array,
    cache: list[Any],
    *,
    step_size: int = 512,
    progress_callback: ProgressCallback | None = None,
    timeout: float | None = None,
) -> None:
    """Fill ``cache`` with ``prompt[:-1]``, the ranks working on different chunks at once.

    Call it on every rank with the same ``prompt`` (a 1-D integer array of M
    tokens) and ``step_size``. The prompt minus its last token is processed in
    chunks of ``step_size`` tokens, exactly as mlx-lm's ``generate_step`` does
    with ``prefill_step_size=step_size``; afterwards every rank's cache holds
    M-1 positions and decoding continues from ``prompt[-1:]`` (for instance
    ``generate_step(prompt[-1:], model, prompt_cache=cache)``), giving the tokens
    one process holding the whole model would give.

    ``progress_callback(processed, M)`` is called on every rank with the same
    sequence ``generate_step`` reports before its first token: ``(0, M)``, then
    ``(processed, M)`` as each chunk leaves the last rank, ending at ``(M-1, M)``.
    No logits are computed. It returns once every rank has done its part.

    ``timeout`` bounds every blocking wait (seconds); it defaults to the one
    given to :func:`pipemlx.shard_model`. Raises ``TypeError``/``ValueError`` for
    bad arguments before anything is sent, :class:`PipelineMismatchError` when
    the ranks disagree, :class:`PipelineTimeoutError`/:class:`PeerLostError` when
    a wait fails, and whatever ``progress_callback`` raises.
    """
    stage = stage_of(model)
    tokens = _check_prompt(prompt)
    check_prefill_args(tokens.size, step_size, stage.world_size)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if not isinstance(cache, list) or len(cache) != len(stage.layers):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(
            f"cache must be a list with one entry per local layer ({len(stage.layers)} on "
            f"{stage.describe()}); make it with mlx_lm.models.cache.make_prompt_cache(model) after sharding"
        )
    plan = build_plan(tokens.size, step_size, stage.world_size, stage.rank)
    mx.eval(tokens, cache_state(cache))
    runner = _PlanRunner(model, stage, plan, tokens, cache, progress_callback, timeout or stage.timeout)
    with send_mode(model, "queue"):
        runner.run()


def _check_prompt(prompt: Any) -> mx.array:
    if not isinstance(prompt, mx.array):
        raise TypeError(f"prompt must be an mx.array of token ids, got {type(prompt).__name__}")
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be 1-D (M tokens), got shape {tuple(prompt.shape)}")
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise TypeError(f"prompt must hold integer token ids, got dtype {prompt.dtype}")
    if prompt.size == 0:
        raise ValueError("the prompt is empty (0 tokens); pipeline_prefill needs at least 1 token")
    return prompt


class _PlanRunner:
    """Executes one rank's :class:`PrefillPlan`, action by action."""

    def __init__(
        self,
        model: nn.Module,
        stage: PipelineStage,
        plan: PrefillPlan,
        tokens: mx.array,
        cache: list[Any],
        progress_callback: ProgressCallback | None,
        timeout: float | None,
    ) -> None:
        self.model = model
        self.stage = stage
        self.plan = plan
        self.tokens = tokens
        self.cache = cache
        self.progress_callback = progress_callback
        self.timeout = timeout
        self.expected_receives = 0

    def run(self) -> None:
        for action in self.plan.actions:
            if isinstance(action, Handshake):
                handshake(self.stage, self.plan, self.timeout)
            elif isinstance(action, Send):
                self.send(action)
            elif isinstance(action, Recv):
                self.expected_receives += 1
            elif isinstance(action, Compute):
                self.compute(action)
            elif isinstance(action, Agree):
                self.agree(action)
            else:
                self.progress(action)
        if len(self.stage.send_queue) or self.stage.received:
            raise PipelineError(f"{self.stage.describe()}: the plan ended with sends or receives left over")

    def send(self, action: Send) -> None:
        queue = self.stage.send_queue
        if len(queue) != 1 or queue.pending[0].peer != action.peer:
            raise PipelineError(
                f"{self.stage.describe()}: plan says send chunk {action.chunk.index} to rank {action.peer}, "
                f"but the queue holds {[p.peer for p in queue.pending]}"
            )
        queue.flush()

    def compute(self, action: Compute) -> None:
        chunk, stage = action.chunk, self.stage
        with mx.stream(stage.compute_stream):
            self.model(self.tokens[None, chunk.start : chunk.stop], cache=self.cache)
        if len(stage.received) != self.expected_receives:
            raise PipelineError(
                f"{stage.describe()}: plan expects {self.expected_receives} receive(s) for chunk "
                f"{chunk.index}, the model made {len(stage.received)}"
            )
        if stage.received:
            peer = stage.rank - 1
            wait_for(stage.received, self.timeout, lambda: f"{stage.describe()} receiving chunk {chunk.index} from rank {peer}")
            stage.received.clear()
            self.expected_receives = 0
        queued = [p.array for p in stage.send_queue.pending]
        wait_for([cache_state(self.cache), queued], self.timeout, lambda: f"{stage.describe()} computing chunk {chunk.index}")

    def agree(self, action: Agree) -> None:
        stage, queue = self.stage, self.stage.send_queue
        wait_for(
            queue.in_flight(),
            self.timeout,
            lambda: f"{stage.describe()} completing its send to rank {stage.rank + 1} in step {action.step}",
        )
        queue.mark_complete()
        agree_on_step(stage, action.step, self.timeout)

    def progress(self, action: Progress) -> None:
        if self.progress_callback is not None:
            self.progress_callback(action.processed, action.total)
