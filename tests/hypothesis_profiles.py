"""Hypothesis profiles and the prefill-case strategy shared by the plan property tests.

Importing this module loads a profile, chosen by ``$HYPOTHESIS_PROFILE``; ``tests/conftest.py`` imports it,
so the profile is loaded before any test module is collected and every ``@settings`` decorator inherits it.
Every profile explores: examples are random on every run (never derandomized), and failing examples are
kept in a shared example database, ``.hypothesis/examples`` at the repository root (the folder CI caches),
or ``$PIPEMLX_HYPOTHESIS_DB``, and replayed first on the next run. A failure prints the
``@reproduce_failure`` blob that replays it; ``pytest --hypothesis-seed=N`` fixes the seed to reproduce a run.

- ``ci`` (the default): 60 examples per test and at most 8000 chunks x ranks
  per example, so that the simulator, property and mutation tests take well
  under two minutes on a 2-core CI machine (about 15 s of CPU). Prompt lengths
  still reach 100 000 when the step size is large enough, and step sizes and
  world sizes span their full ranges.
- ``thorough``: 300 examples per test and no bound on the work: a single
  example can be a 100 000-token prompt in chunks of 1 on 16 ranks (about 8
  million actions). About 20 minutes on the 2-core machine; run it by hand:
  ``HYPOTHESIS_PROFILE=thorough pytest tests/test_properties.py tests/test_mutations.py --hypothesis-show-statistics``.
- ``mutate``: 20 examples per test, for ``tests/mutate.sh`` (every mutant reruns the tests over its function;
  the examples that killed earlier mutants are replayed first from the database); no shrinking: a mutant needs
  one failing example, and shrinking and explaining one took minutes on the loaded machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

MAX_TOKENS = 100_000
MAX_STEP = 8192
MAX_RANKS = 16

DATABASE_DIR = Path(
    os.environ.get("PIPEMLX_HYPOTHESIS_DB") or Path(__file__).resolve().parent.parent / ".hypothesis" / "examples"
)
DATABASE = DirectoryBasedExampleDatabase(DATABASE_DIR)

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    derandomize=False,
    database=DATABASE,
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    derandomize=False,
    database=DATABASE,
)
settings.register_profile(  # tests/mutate.sh: each mutant reruns the tests over its function, so fewer examples
    "mutate",
    max_examples=20,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # a mutant needs one failure, not its smallest example
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    derandomize=False,
    database=DATABASE,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

# The stateful machines over live rank groups (tests/test_batch_stateful.py, tests/test_requests.py): every
# step is a round trip to real ranks, so they run fewer, shorter examples than the pure property tests; the
# thorough profile runs several times more of both.
LIVE_SCALE = {"ci": (1.0, 1.0), "thorough": (8.0, 2.5)}


def live_settings(examples: int, steps: int) -> settings:
    """Settings for a stateful machine on a live group: the loaded profile's (random, with the example database),
    with ``examples`` runs of ``steps`` steps in the ci profile, more in the thorough one."""
    more_examples, more_steps = LIVE_SCALE.get(PROFILE, LIVE_SCALE["ci"])
    return settings(
        settings.default,
        max_examples=round(examples * more_examples),
        stateful_step_count=round(steps * more_steps),
        suppress_health_check=list(HealthCheck),
    )


# Chunks x ranks allowed in one example: about 5 actions each, a few microseconds per action.
WORK_LIMITS = {"ci": 8000, "thorough": None}
WORK_LIMIT = WORK_LIMITS.get(PROFILE, WORK_LIMITS["ci"])


@dataclass(frozen=True)
class Case:
    """A prefill: ``num_tokens`` prompt tokens in chunks of ``step_size`` on ``world_size`` ranks."""

    num_tokens: int
    step_size: int
    world_size: int

    @property
    def num_chunks(self) -> int:
        return -(-(self.num_tokens - 1) // self.step_size)


@st.composite
def cases(draw: st.DrawFn, min_ranks: int = 1, min_chunks: int = 0) -> Case:
    """A :class:`Case` with M in 1..100 000, step in 1..8192, S in ``min_ranks``..16.

    Under a work limit, M is drawn up to ``step * (limit // S) + 1`` so the
    example has at most ``limit // S`` chunks per rank.
    """
    world_size = draw(st.sampled_from(range(min_ranks, MAX_RANKS + 1)))  # spread evenly, unlike integers()
    step_size = draw(st.integers(1, 64) | st.integers(1, MAX_STEP))  # many chunks as well as few
    top = MAX_TOKENS
    if WORK_LIMIT is not None:
        top = min(top, step_size * max(WORK_LIMIT // world_size, min_chunks) + 1)
    least = min(min_chunks * step_size + 1 - step_size + 1, top) if min_chunks else 1
    num_tokens = draw(st.integers(max(least, 1), top))
    return Case(num_tokens, step_size, world_size)


def note_size(case: Case) -> None:
    """Record the example's size (chunks x ranks, by order of magnitude) in hypothesis' statistics."""
    work = case.num_chunks * case.world_size
    event(f"chunks x ranks < 10^{len(str(work))}" if work else "chunks x ranks = 0")
