"""The errors pipemlx raises.

Every error that comes from the pipeline itself (as opposed to bad arguments,
which raise ``ValueError`` / ``TypeError``) derives from :class:`PipelineError`,
so an engine can catch the whole family in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class PipelineError(RuntimeError):
    """Base class of the errors raised by a running pipeline."""


class NotShardedError(PipelineError, TypeError):
    """A pipemlx function was given a model that :func:`pipemlx.shard_model` never sharded."""


class PipelineMismatchError(PipelineError):
    """Ranks disagree on what they are about to do (prompt length, step size, plan, layers, ...).

    Raised on every rank, before any activation is sent.
    """


class PipelineTimeoutError(PipelineError):
    """A blocking wait of the pipeline (receive, send completion, collective) ran out of time.

    Also raised when a peer process is gone. After it, the process's distributed
    group is unusable: a communication may still be blocked inside MLX. Exit the
    process and start the ranks again.
    """


class PeerLostError(PipelineError):
    """A peer process went away (MLX reported a lost connection) while this rank waited on it.

    As after a timeout, the group is unusable: exit the process and start the ranks again.
    """


class PrefillCancelled(PipelineError):
    """All ranks stopped the prefill together at an agreement point.

    Either some rank's ``should_cancel`` said yes (``cancelling_ranks``) or an
    error was raised on some rank (``failed_ranks``; that rank raises its own
    error instead). ``processed`` counts the positions *of this call's prompt*
    that every rank completed; ``prefix`` is how many positions the cache held
    before the call (a reused prefix, the same on every rank). When
    ``cache_trimmed`` is true every rank's cache holds exactly
    ``prefix + processed`` positions (never fewer than the prefix), otherwise
    the cache must be discarded. Nothing is left queued, and the model and
    group serve the next request as usual.
    """

    def __init__(
        self,
        message: str,
        *,
        processed: int = 0,
        cache_trimmed: bool = False,
        failed_ranks: list[int] | None = None,
        cancelling_ranks: list[int] | None = None,
        prefix: int = 0,
    ) -> None:
        super().__init__(message)
        self.processed = processed
        self.prefix = prefix
        self.cache_trimmed = cache_trimmed
        self.failed_ranks = failed_ranks or []
        self.cancelling_ranks = cancelling_ranks or []


def renamed(**old_to_new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose keyword arguments were renamed: an old name raises ``TypeError`` naming the new one.

    ``@renamed(step_size="prefill_step_size")`` keeps the signature (``inspect.signature`` follows
    ``__wrapped__``); a call passing ``step_size=`` raises ``TypeError: pipeline_prefill() got the keyword argument
    'step_size', renamed 'prefill_step_size' in pipemlx 0.2.0`` rather than Python's bare "unexpected keyword". The
    check runs before the function, so every rank raises it alike, before anything is sent.
    """

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        name = function.__qualname__.replace(".__init__", "")

        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            old = [key for key in kwargs if key in old_to_new]
            if old:
                raise TypeError(
                    f"{name}() got the keyword argument {old[0]!r}, renamed {old_to_new[old[0]]!r} in pipemlx 0.2.0"
                )
            return function(*args, **kwargs)

        return wrapper

    return decorate
