"""pipemlx.BatchGenerator on one live 2-rank group: random insert/step/remove sequences, and model errors.

Every answer is checked against the solo greedy run of each request (one-process mlx-lm on the same weights,
computed by each rank program at insert, with the request's logits processors, stop token and whole history):
every token a request got so far equals its solo run's, on both ranks, whatever else was in flight, inserted or
removed (mid-prefill or mid-decode). The machine also inserts several prompts at once, empty prompts and prompts
that never fit the memory budget (refused alike on every rank, nothing changed), continues finished or removed
requests from the caches the generator handed back, removes finished and unknown requests (nothing happens),
injects model errors on either rank, and runs under a memory budget (the batch must always fit it), some runs with
guesses (prompt lookup, or a draft model: the answers must still be the solo runs'). After every
step the generator holds exactly the live requests; at the end every request is stepped until it ends.

The machine explores: random sequences on every run, failures kept in the example database and replayed first
(tests/hypothesis_profiles.py; ``HYPOTHESIS_PROFILE=thorough`` for longer runs). Hypothesis replays and shrinks a run
by its choices alone, so each run depends on nothing but its own steps: it starts on a new generator with no fault
armed (uids from 0 again; a new group if a failure ended the last one), requests are picked by drawn indices into
the run's own lists, and every precondition reads only the run's own record.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hypothesis_profiles import live_settings
from live_group import LiveGroup

SPEC = {"timeout": 20.0, "step": 8, "chunk": 8}
UNKNOWN_UID = 10_000  # uids start at 0 in every run: never reached
INDEX = st.integers(0, 2**16)  # picks items[index % len(items)]: the same choices whatever the list holds
SEEN: Counter[str] = Counter()  # what the runs exercised (printed by the test: pytest -s)


def seen(what: str) -> None:
    SEEN[what] += 1
    if currently_in_test_context():
        event(what)


DRAIN_TICKS = 400  # far more than any drawn sequence needs to end every request


@dataclass
class Admission:
    """The memory budget as the ranks report it: a batch of n requests whose longest reserve is L positions costs
    n * L positions on every rank (pipemlx.BatchGenerator's documented rule)."""

    bytes_per_position: list[int]
    budget: list[int]

    def fits(self, reserves: list[int]) -> bool:
        positions = len(reserves) * max(reserves, default=0)
        return all(positions * b <= limit for b, limit in zip(self.bytes_per_position, self.budget))


@dataclass
class Requests:
    """The client's view: each request's solo tokens, how it must end, and the tokens it got so far."""

    solo: dict[int, list[int]] = field(default_factory=dict[int, list[int]])
    limit: dict[int, int] = field(default_factory=dict[int, int])
    finish: dict[int, str] = field(default_factory=dict[int, str])  # how its solo run ends: "length" or "stop"
    reserve: dict[int, int] = field(default_factory=dict[int, int])  # cache positions it may reach
    got: dict[int, list[int]] = field(default_factory=dict[int, list[int]])
    ended: dict[int, str] = field(default_factory=dict[int, str])  # "length", "stop", "error" or "removed"
    handed: dict[int, int] = field(default_factory=dict[int, int])  # caches handed back: positions they hold
    armed: dict[int, bool] = field(default_factory=dict[int, bool])  # rank -> a fault armed and not yet fired
    faults_fired: int = 0
    admission: Admission | None = None

    @property
    def done(self) -> set[int]:
        return set(self.ended)

    @property
    def live(self) -> list[int]:
        return sorted(u for u in self.got if u not in self.ended)

    def insert(self, group: LiveGroup, m: int, seed: int, max_tokens: int) -> int:
        (uid,) = self.insert_many(group, [{"M": m, "seed": seed, "max_tokens": max_tokens}])
        return uid

    def insert_many(self, group: LiveGroup, requests: list[dict[str, Any]]) -> list[int]:
        """Insert ``requests`` in one call; an empty prompt or one that never fits the budget refuses them all."""
        answers = group.ask({"op": "insert", "requests": requests})
        assert all({k: v for k, v in a.items() if k != "rank"} == {k: v for k, v in answers[0].items() if k != "rank"}
                   for a in answers), answers  # fmt: skip
        first = answers[0]
        reserves = [self.handed.get(r.get("after", -1), 0) + r["M"] + r["max_tokens"] for r in requests]
        never_fits = self.admission is not None and not all(self.admission.fits([n]) for n in reserves)
        if any(r["M"] == 0 for r in requests) or never_fits:
            assert "error" in first and first["error"].startswith("ValueError"), (requests, first)
            words = "would never fit the memory budget" if never_fits else "empty"
            assert words in first["error"] or any(r["M"] == 0 for r in requests), first
            seen("insert refused: " + ("never fits the budget" if never_fits else "an empty prompt"))
            return []
        assert "error" not in first, (requests, first)
        for r, uid, solo, finish, held, reserve in zip(
            requests, first["uids"], first["solo"], first["finish"], first["held"], reserves
        ):
            assert uid not in self.got, (uid, self.got)
            if r.get("after") is not None:
                assert held == self.handed.pop(r["after"]), (r, held)
            self.solo[uid], self.limit[uid], self.finish[uid], self.got[uid] = solo, r["max_tokens"], finish, []
            self.reserve[uid] = reserve
            if len(set(solo)) > 1:
                seen(
                    "a solo run of varied tokens"
                )  # the test asserts some: a model that repeats one token shows little
        return list(first["uids"])

    def step(self, group: LiveGroup) -> dict[str, Any]:
        answers = group.ask({"op": "step"})
        first = answers[0]
        ignored = ("rank", "error", "armed")
        for other in answers[1:]:
            assert {k: v for k, v in other.items() if k not in ignored} == {
                k: v for k, v in first.items() if k not in ignored
            }, answers
        for answer in answers:
            if self.armed.get(answer["rank"]) and not answer["armed"]:
                self.armed[answer["rank"]] = False
                self.faults_fired += 1
        if first["groups_in_flight"]:
            seen("decode groups in flight")
        for uid, token, reason in first["responses"]:
            assert uid in self.got and uid not in self.ended, (uid, first)
            if reason == "error":
                assert token == -1 and self.faults_fired > 0, (uid, first)  # no error without an injected fault
                seen("a request failed with an injected model error")
                self.ended[uid] = "error"
                continue
            self.got[uid].append(token)
            n = len(self.got[uid])
            assert self.got[uid] == self.solo[uid][:n], (uid, self.got[uid], self.solo[uid])
            if n == len(self.solo[uid]):
                assert reason == self.finish[uid], (uid, reason, self.finish[uid], self.got[uid])
            else:
                assert reason is None, (uid, reason, n, self.solo[uid])
            if reason is not None:
                seen(f"a request finished: {reason}")
                self.ended[uid] = reason
                assert first["handed"][str(uid)] >= n, (uid, first["handed"])  # its history, the last token too
                self.handed[uid] = first["handed"][str(uid)]
        live = set(first["active"]) | set(first["queued"])
        assert live == set(self.live), (live, self.ended)
        if self.admission is not None and first["queued"] and first["active"]:
            seen("a request waited under the memory budget")
        if self.admission is not None:  # the batch of decoding requests fits the budget on every rank
            assert self.admission.fits([self.reserve[u] for u in first["active"]]), (first["active"], self.reserve)
        return first

    def remove(self, group: LiveGroup, uid: int, return_caches: bool = False) -> None:
        live = uid in self.live
        answers = group.ask({"op": "remove", "uids": [uid], "return_caches": return_caches})
        assert all(a["left"] == len(self.live) - live for a in answers), (uid, answers)
        returned = [a["returned"] for a in answers]
        assert all(r == returned[0] for r in returned), returned
        if not live:  # finished, removed before or unknown: nothing happens, nothing handed back
            assert returned[0] == {}, (uid, returned)
            return
        self.ended[uid] = "removed"
        if return_caches:
            positions = returned[0][str(uid)]
            if positions is not None:
                seen("remove handed a cache back")
                self.handed[uid] = positions

    def drain(self, group: LiveGroup) -> None:
        """Step until every request has ended; each one ended as its solo run does, or by an injected error."""
        for _ in range(DRAIN_TICKS):
            if not self.live:
                break
            self.step(group)
        assert not self.live, f"requests {self.live} did not end in {DRAIN_TICKS} ticks"
        for uid, reason in self.ended.items():
            if reason in ("length", "stop"):
                assert self.got[uid] == self.solo[uid] and reason == self.finish[uid], uid
            elif reason == "error":
                assert self.faults_fired > 0
        status = group.ask({"op": "status"})
        assert all(s["len"] == 0 and s["active"] == [] and s["queued"] == [] for s in status), status


def checked(method: Callable[..., None]) -> Callable[..., None]:
    """A rule that marks the machine unclean while it runs: the final drain runs only after rules that passed (so
    that a failure is reported as it happened, not as the drain that followed it)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        self.clean = False
        method(self, *args, **kwargs)
        self.clean = True
        seen(f"ran {method.__name__}")

    return run


requests_drawn = st.fixed_dictionaries(
    {"M": st.integers(1, 40), "seed": st.integers(0, 5), "max_tokens": st.integers(1, 6)},
    optional={
        "stop_at": st.integers(0, 4),
        "processor": st.sampled_from(["penalty", "bias"]),
    },
)


def pick(items: list[int], index: int) -> int:
    return items[index % len(items)]


class BatchMachine(RuleBasedStateMachine):
    live_group: Callable[[], LiveGroup] | None = None  # the module's group (a new one if a failure ended it)
    group: LiveGroup | None = None

    @initialize(
        budget=st.one_of(st.none(), st.integers(20, 90), st.integers(40, 160)),
        groups=st.sampled_from([1, 2]),
        guessing=st.sampled_from([None, None, "lookup", "draft"]),
    )
    @checked
    def fresh(self, budget: int | None, groups: int, guessing: str | None) -> None:
        """Every run starts from a new, empty generator (no fault armed, no cache handed back, uids from 0), with no
        memory budget or one of ``budget`` positions, decoding as one group or (``groups`` 2) in two groups in flight
        whenever two rows are live, without guesses or (``guessing``) speculating by prompt lookup or with a draft
        model: the greedy rows without processors guess, and every answer must still be the solo run's."""
        assert BatchMachine.live_group is not None
        self.group = BatchMachine.live_group()
        seen(f"decode_groups={groups}")
        seen(f"guessing={guessing}")
        answers = self.group.ask(
            {"op": "reset", "budget_positions": budget, "decode_groups": groups, "guessing": guessing}
        )
        self.requests = Requests()
        assert all(a["left"] == 0 for a in answers), answers
        if budget is not None:
            self.requests.admission = Admission(answers[0]["bytes_per_position"], answers[0]["budget"])
            assert all(b > 0 for b in self.requests.admission.bytes_per_position), answers

    @property
    def ranks(self) -> LiveGroup:
        assert self.group is not None
        return self.group

    @rule(request=requests_drawn)
    @checked
    def insert(self, request: dict[str, Any]) -> None:
        self.requests.insert_many(self.ranks, [request])

    @rule(requests=st.lists(requests_drawn, min_size=2, max_size=3))
    @checked
    def insert_several(self, requests: list[dict[str, Any]]) -> None:
        self.requests.insert_many(self.ranks, requests)

    @rule(good=requests_drawn, at=st.integers(0, 1))
    @checked
    def insert_an_empty_prompt(self, good: dict[str, Any], at: int) -> None:
        """An empty prompt among good ones: every rank refuses the whole insert, and nothing changes."""
        requests = [good]
        requests.insert(at, {**good, "M": 0})
        self.requests.insert_many(self.ranks, requests)

    @precondition(lambda self: bool(self.requests.handed))
    @rule(index=INDEX, request=requests_drawn)
    @checked
    def continue_from_a_handed_back_cache(self, index: int, request: dict[str, Any]) -> None:
        """The next turn of a finished (or removed) request, on the cache the generator handed back."""
        after = pick(sorted(self.requests.handed), index)
        self.requests.insert_many(self.ranks, [{**request, "M": min(request["M"], 12), "after": after}])

    @rule(times=st.integers(1, 4))
    @checked
    def step(self, times: int) -> None:
        for _ in range(times):
            self.requests.step(self.ranks)

    @precondition(lambda self: bool(self.requests.live))
    @rule(index=INDEX, return_caches=st.booleans())
    @checked
    def remove(self, index: int, return_caches: bool) -> None:
        self.requests.remove(self.ranks, pick(self.requests.live, index), return_caches)

    @rule(index=INDEX, return_caches=st.booleans())
    @checked
    def remove_a_finished_or_unknown_request(self, index: int, return_caches: bool) -> None:
        uid = pick([UNKNOWN_UID, *sorted(self.requests.done)], index)
        self.requests.remove(self.ranks, uid, return_caches)

    @precondition(lambda self: not any(self.requests.armed.values()))
    @rule(rank=st.integers(0, 1), what=st.sampled_from(["decode", "chunk"]))
    @checked
    def inject_a_model_error(self, rank: int, what: str) -> None:
        """The rank's last layer raises on its next pass of that kind: the requests it computes fail, on every
        rank, with finish_reason "error"; the others go on."""
        self.ranks.ask({"op": "arm", "rank": rank, "what": what})
        self.requests.armed[rank] = True

    @invariant()
    @checked
    def the_generator_holds_exactly_the_live_requests(self) -> None:
        for status in self.ranks.ask({"op": "status"}):
            assert status["len"] == len(self.requests.live), (status, self.requests.live)
            assert set(status["active"]) | set(status["queued"]) == set(self.requests.live), status

    def teardown(self) -> None:
        if self.group is not None and getattr(self, "clean", False):
            self.requests.drain(self.group)


@pytest.fixture(scope="module")
def batch_group() -> Iterator[Callable[[], LiveGroup]]:
    """The module's live 2-rank group (one start-up for both tests), replaced if a failed test ended it; at the end
    every rank must exit with status 0."""
    groups: list[LiveGroup] = []

    def group() -> LiveGroup:
        if not groups or any(proc.poll() is not None for proc in groups[-1].procs):
            if groups:
                groups[-1].close()
            groups.append(LiveGroup(2, "batch_server.py", SPEC))
        return groups[-1]

    yield group
    if groups and all(proc.poll() is None for proc in groups[-1].procs):
        assert groups[-1].close() == [0, 0]


def test_random_insert_step_remove_sequences_equal_solo_runs(batch_group: Callable[[], LiveGroup]) -> None:
    BatchMachine.live_group = batch_group
    try:
        SEEN.clear()
        run_state_machine_as_test(BatchMachine, settings=live_settings(examples=8, steps=12))
        print("exercised:", dict(sorted(SEEN.items())))
        assert SEEN["a solo run of varied tokens"] > 0, SEEN
    finally:
        BatchMachine.live_group = None


def test_model_errors_fail_the_affected_requests_on_every_rank_and_the_rest_go_on(
    batch_group: Callable[[], LiveGroup],
) -> None:
    group = batch_group()
    group.ask({"op": "reset"})  # an empty generator without a budget, no fault armed
    requests = Requests()
    try:
        a = requests.insert(group, 9, 1, 12)
        b = requests.insert(group, 14, 2, 12)
        for _ in range(6):  # a: ticks 0-1 prefill (alone: one chunk), joins at 2, first token at 3; b behind it
            requests.step(group)
        assert requests.got[a] and requests.got[b], requests.got
        c = requests.insert(group, 30, 3, 4)  # prefilled in 8-position chunks while a and b decode
        group.ask({"op": "arm", "rank": 1, "what": "chunk"})
        requests.armed[1] = True
        errors: list[list[Any]] = []
        for _ in range(3):
            errors += [r for r in requests.step(group)["responses"] if r[2] == "error"]
        assert errors == [[c, -1, "error"]], errors
        assert a not in requests.done and b not in requests.done
        group.ask({"op": "arm", "rank": 0, "what": "decode"})
        requests.armed[0] = True
        answer = requests.step(group)
        assert sorted(r[0] for r in answer["responses"] if r[2] == "error") == sorted([a, b]), answer
        assert answer["active"] == [] and answer["queued"] == []
        d = requests.insert(group, 20, 4, 5)  # the group goes on after both failures
        while d not in requests.done:
            requests.step(group)
        assert requests.got[d] == requests.solo[d]
    except BaseException:
        group.kill()  # a later test starts a new group
        raise


def test_a_model_error_in_a_decode_group_in_flight_fails_that_group_only(
    batch_group: Callable[[], LiveGroup],
) -> None:
    """decode_groups=2: three requests decode in two groups in flight; rank 1 (the last) raises while it builds a
    group's step at the end of a tick (the step rank 0 computed in it): that group's requests fail with "error" on
    both ranks, in the next tick, and the other group's go on to their solo runs' ends."""
    group = batch_group()
    group.ask({"op": "reset", "decode_groups": 2})
    requests = Requests()
    try:
        uids = [requests.insert(group, m, seed, 12) for m, seed in ((9, 1), (14, 2), (5, 3))]
        in_flight = False
        for _ in range(30):
            in_flight |= requests.step(group)["groups_in_flight"]
            if all(requests.got[u] for u in uids):
                break
        assert in_flight and all(requests.got[u] for u in uids), requests.got
        group.ask({"op": "arm", "rank": 1, "what": "decode"})
        requests.armed[1] = True
        failed: list[int] = []
        for _ in range(3):
            failed += [r[0] for r in requests.step(group)["responses"] if r[2] == "error"]
        assert failed and set(failed) < set(uids), failed  # one group's requests, not every request
        requests.drain(group)
        assert all(requests.ended[u] == "length" for u in uids if u not in failed), requests.ended
    except BaseException:
        group.kill()  # a later test starts a new group
        raise
