"""Pure planning: what the ranks will do, as data. No MLX arrays, nothing that runs on a rank.

- :mod:`.plan`: the prefill plan (the schedule): every rank's actions, in order, as plain data.
- :mod:`.simulate`: runs those very plans in a discrete-event simulator (deadlocks, mismatches, timing).
- :mod:`.costmodel`: predicted prefill time and bubble fraction, by simulating the plans with layer costs.
- :mod:`.autostep`: ``step_size="auto"``: the candidate step the cost model expects to be fastest.
- :mod:`.split` and :mod:`.memory_split`: the split (layers per rank): even, explicit, or planned from
  per-rank memory budgets and parameter bytes.

Words: *plan* or *schedule* is the prefill's; *split* is the layers per rank.
"""
