"""Many requests decoded together on a sharded model: a pipelined ``BatchGenerator``.

:class:`BatchGenerator` is shaped like mlx-lm's ``BatchGenerator``. Every rank must make the **same calls in the same
order with the same arguments** (an engine on rank 0 broadcasts the operations to the other ranks, as
``pipemlx.serve.broadcast`` does for requests): every decision (who joins, who finishes, who is dropped, which chunk of
which prompt each rank computes) is then made from data every rank has, so the ranks stay in step without asking each
other.

A tick (:mod:`pipemlx.runtime.batch.tick`) is one decode step of every active request plus at most one prefill chunk per
rank: queued prompts are prefilled in chunks that travel the ranks like a pipeline, *between* the decode steps of the
others, so a long prompt neither stalls the others nor waits for them. The tick's plan is a pure function of the queue
(:func:`pipemlx.schedule.batch_plan.plan_tick`) whose fingerprint the tick's all-gather carries, so ranks that planned
differently fail with :class:`PipelineMismatchError`. With ``decode_groups`` the rows are cut into decode groups in
flight, whose steps travel the ranks as the chunks do (each rank computes another group's step in a tick:
:func:`pipemlx.schedule.batch_plan.plan_groups`). Insertions, removals, completions and failures take effect at tick
boundaries only, and nothing is left in flight between calls. Greedy tokens of each request equal a solo run of it.
"""

from ..sampling import LogitsProcessor, Sampler
from .generator import BatchGenerator, Response
from .requests import FinishReason
from .rows import fill_rows

__all__ = ["BatchGenerator", "FinishReason", "LogitsProcessor", "Response", "Sampler", "fill_rows"]
