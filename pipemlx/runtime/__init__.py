"""What runs on a rank at inference time.

- :mod:`.stage`: the per-rank state a sharded model carries (group, layers, send mode, streams).
- :mod:`.edges`: the first and last local layers, which receive from and send to the neighbouring ranks.
- :mod:`.send_mode` and :mod:`.send_queue`: immediate sends, or sends queued and issued when the plan says.
- :mod:`.protocol`: every message the ranks exchange to agree (kinds, statuses, named fields), declared once.
- :mod:`.failure`: the one stand-in, for a rank whose compute raised in the middle of a pass.
- :mod:`.prefill`: ``pipeline_prefill``, the executor of :mod:`pipemlx.schedule.plan`'s plans.
- :mod:`.agreement`: the prefill's handshake and agreement points, over :mod:`.protocol`.
- :mod:`.waits`, :mod:`.caches`: bounded waits, cache bookkeeping.
- :mod:`.generate`: ``generate_step`` and ``stream_generate``, a whole request as mlx-lm's API.
- :mod:`.decode`: one request's decode on one rank (speculation included); its ``DecodeStream`` says why it ended.
- :mod:`.stops`: stop sequences, one matcher for ``generate_step`` and ``BatchGenerator``.
- :mod:`.sampling`: greedy picking, samplers, logits processors, and the output head shared for greedy decodes.
- :mod:`.batch`: ``BatchGenerator``, many requests decoded together
  as one batch through the pipeline, one tick at a time.
- :mod:`.calibrate`: times the group for ``prefill_step_size="auto"`` and ``lend="auto"``.
- :mod:`.links`: each neighbour link's latency and bandwidth, for ``pipemlx doctor``.
- :mod:`.lean_decode`: ``lean_generate_step``, ``generate_step``'s token ids alone.
"""
