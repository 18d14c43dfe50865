"""Many requests decoded together on a sharded model: a pipelined ``BatchGenerator``.

:class:`BatchGenerator` is shaped like mlx-lm's ``BatchGenerator``: :meth:`~BatchGenerator.insert` queues prompts and
returns their uids, :meth:`~BatchGenerator.next` runs one *tick* and returns one :class:`Response` per request that
decoded in it, :meth:`~BatchGenerator.remove` drops requests. Every rank must make the **same calls in the same order
with the same arguments** (an engine on rank 0 broadcasts the operations to the other ranks, as
``pipemlx.serve.broadcast`` does for requests): every decision (who joins, who finishes, who is dropped, which chunk of
which prompt each rank computes) is then made from data every rank has, so the ranks stay in step without asking each
other.

A tick (:mod:`pipemlx.runtime.batch.tick`) is one decode step of every active request plus at most one prefill chunk per
rank: queued prompts are prefilled in chunks that travel the ranks like a pipeline, *between* the decode steps of the
others (rank 0 computes chunk k while rank 1 computes chunk k-1), so a long prompt neither stalls the others nor waits
for them. Which chunk each rank computes in a tick, and when a prefilled request joins the batch, is plain data from a
pure function (:func:`pipemlx.schedule.batch_plan.plan_tick`) of the queue; the tick's all-gather carries its
fingerprint, so ranks that planned differently fail with :class:`PipelineMismatchError`. Insertions, removals,
completions and failures take effect at tick boundaries only.

The batch caches are mlx-lm's ``BatchKVCache`` (left-padded, merged and filtered as mlx-lm's ``BatchGenerator`` does);
each prompt is prefilled into its own ``KVCache`` per local layer, merged in when it joins. A finished or removed
request's row stays in them as a dead row until half the rows are dead; a joining request takes a dead row's place
(:mod:`.rows`). Nothing is left in flight between calls, and every wait is bounded by ``timeout``: a stalled peer raises
:class:`PipelineTimeoutError`, a dead one :class:`PeerLostError`, and the stage is then unusable (start every rank
again). Greedy tokens of each request equal a solo run of it.
"""

from ..sampling import LogitsProcessor, Sampler
from .generator import BatchGenerator, Response
from .requests import FinishReason
from .rows import fill_rows

__all__ = ["BatchGenerator", "FinishReason", "LogitsProcessor", "Response", "Sampler", "fill_rows"]
