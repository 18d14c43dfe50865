"""pipemlx.BatchGenerator on one live 2-rank group: random insert/step/remove sequences, and model errors.

Every answer is checked against the solo greedy run of each request (one-process mlx-lm on the same weights,
computed by each rank program at insert): every token a request got so far equals its solo run's, on both
ranks, whatever else was in flight, inserted or removed (mid-prefill or mid-decode).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from live_group import LiveGroup

SPEC = {"timeout": 20.0, "step": 8, "chunk": 8}


class Requests:
    """The client's view: each request's solo tokens, max_tokens and the tokens it got so far."""

    def __init__(self) -> None:
        self.solo: dict[int, list[int]] = {}
        self.limit: dict[int, int] = {}
        self.got: dict[int, list[int]] = {}
        self.done: set[int] = set()

    def insert(self, group: LiveGroup, m: int, seed: int, max_tokens: int) -> int:
        answers = group.ask({"op": "insert", "M": m, "seed": seed, "max_tokens": max_tokens})
        assert answers[0]["uid"] == answers[1]["uid"] and answers[0]["solo"] == answers[1]["solo"], answers
        uid = answers[0]["uid"]
        self.solo[uid], self.limit[uid], self.got[uid] = answers[0]["solo"], max_tokens, []
        assert len(set(self.solo[uid])) > 1 or max_tokens < 3, f"the model repeats itself: {self.solo[uid]}"
        return uid

    def step(self, group: LiveGroup) -> dict[str, Any]:
        answers = group.ask({"op": "step"})
        first = answers[0]
        for other in answers[1:]:
            assert {k: v for k, v in other.items() if k not in ("rank", "error")} == {
                k: v for k, v in first.items() if k not in ("rank", "error")
            }, answers
        for uid, token, reason in first["responses"]:
            assert uid in self.got and uid not in self.done, (uid, first)
            if reason == "error":
                self.done.add(uid)
                continue
            self.got[uid].append(token)
            n = len(self.got[uid])
            assert self.got[uid] == self.solo[uid][:n], (uid, self.got[uid], self.solo[uid])
            assert (reason == "length") == (n == self.limit[uid]), (uid, reason, n)
            if reason is not None:
                self.done.add(uid)
        live = set(first["active"]) | set(first["queued"])
        assert live == {u for u in self.got if u not in self.done}, (live, self.done)
        return first

    def remove(self, group: LiveGroup, uid: int) -> None:
        group.ask({"op": "remove", "uids": [uid]})
        self.done.add(uid)


class BatchMachine(RuleBasedStateMachine):
    group: LiveGroup | None = None

    @initialize()
    def fresh(self) -> None:
        assert BatchMachine.group is not None
        BatchMachine.group.ask({"op": "reset"})
        self.requests = Requests()

    @property
    def live(self) -> list[int]:
        return sorted(u for u in self.requests.got if u not in self.requests.done)

    @rule(m=st.integers(1, 40), seed=st.integers(0, 5), max_tokens=st.integers(1, 6))
    def insert(self, m: int, seed: int, max_tokens: int) -> None:
        assert BatchMachine.group is not None
        self.requests.insert(BatchMachine.group, m, seed, max_tokens)

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        assert BatchMachine.group is not None
        for _ in range(times):
            self.requests.step(BatchMachine.group)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        assert BatchMachine.group is not None
        self.requests.remove(BatchMachine.group, data.draw(st.sampled_from(self.live)))


def test_random_insert_step_remove_sequences_equal_solo_runs() -> None:
    BatchMachine.group = LiveGroup(2, "batch_server.py", SPEC)
    try:
        run_state_machine_as_test(
            BatchMachine,
            settings=settings(
                max_examples=8,
                stateful_step_count=12,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            ),
        )
    finally:
        statuses = BatchMachine.group.close()
        BatchMachine.group = None
    assert statuses == [0, 0]


def test_model_errors_fail_the_affected_requests_on_every_rank_and_the_rest_go_on() -> None:
    group = LiveGroup(2, "batch_server.py", SPEC)
    requests = Requests()
    try:
        a = requests.insert(group, 9, 1, 12)
        b = requests.insert(group, 14, 2, 12)
        for _ in range(5):  # a: ticks 0-1 prefill (alone: one chunk), joins at 2; b behind it
            requests.step(group)
        assert requests.got[a] and requests.got[b], requests.got
        c = requests.insert(group, 30, 3, 4)  # prefilled in 8-position chunks while a and b decode
        group.ask({"op": "arm", "rank": 1, "what": "chunk"})
        errors: list[list[Any]] = []
        for _ in range(3):
            errors += [r for r in requests.step(group)["responses"] if r[2] == "error"]
        assert errors == [[c, -1, "error"]], errors
        assert a not in requests.done and b not in requests.done
        group.ask({"op": "arm", "rank": 0, "what": "decode"})
        answer = requests.step(group)
        assert sorted(r[0] for r in answer["responses"] if r[2] == "error") == sorted([a, b]), answer
        assert answer["active"] == [] and answer["queued"] == []
        d = requests.insert(group, 20, 4, 5)  # the group goes on after both failures
        while d not in requests.done:
            requests.step(group)
        assert requests.got[d] == requests.solo[d]
    finally:
        statuses = group.close()
    assert statuses == [0, 0]
