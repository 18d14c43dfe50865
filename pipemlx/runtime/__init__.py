"""What runs on a rank at inference time.

- :mod:`.stage`: the per-rank state a sharded model carries (group, layers, send mode, streams).
- :mod:`.edges`: the first and last local layers, which receive from and send to the neighbouring ranks.
- :mod:`.send_mode` and :mod:`.send_queue`: immediate sends, or sends queued and issued when the plan says.
- :mod:`.prefill`: ``pipeline_prefill``, the executor of :mod:`pipemlx.schedule.plan`'s plans.
- :mod:`.agreement`, :mod:`.waits`, :mod:`.caches`: agreement points, bounded waits, cache bookkeeping.
- :mod:`.calibrate`: measures the group for ``step_size="auto"``.
- :mod:`.batch`: ``BatchGenerator``, many requests decoded together as one batch through the pipeline.
- :mod:`.lean_decode`: ``lean_generate_step``, decoding in which only the last rank applies the head.
"""
