"""Seeing what a prefill did: traces, timelines and the figures pipemlx reports.

- :mod:`.trace`: per-rank Chrome/Perfetto traces of a prefill, merged and read back as spans.
- :mod:`.timeline`: text Gantt charts of plans, traces of simulations, PNG timelines.
- :mod:`.metrics`: the one definition of prefill time, prefill tokens/s and decode tokens/s.
"""
