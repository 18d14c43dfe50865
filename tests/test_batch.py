"""pipemlx.BatchGenerator: requests decoded together through the pipeline, each equal to its solo run.

The scenarios that keep the group alive run in one launch per world size (tests/ranks/batch.py with
"scenarios"), one after the other, each on its own sharded model and generator; each is then its own test,
checked on its own report. The fault scenarios (a killed or stalled rank) end their group: one launch each.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from conftest import run_ranks
from fakes import FakeGroup
from mlx_lm.models.cache import KVCache, make_prompt_cache

import pipemlx
from pipemlx.models.lending import LentHeadsCache, lend_feed_forwards
from pipemlx.runtime.batch import fill_rows
from pipemlx.runtime.stage import stage_of
from pipemlx.schedule.batch_plan import Admission, EqualCostChunks
from pipemlx.schedule.costmodel import LayerCosts
from pipemlx.testing import build_model, tiny_config

RANKS = Path(__file__).parent / "ranks"
REQUESTS: list[dict[str, Any]] = [
    {"M": 7, "max_tokens": 12, "insert_at": 0},
    {"M": 23, "max_tokens": 10, "insert_at": 2},
    {"M": 41, "max_tokens": 9, "insert_at": 5},
]
REMOVE = {"index": 1, "at": 8}  # request 1 has yielded 3 of its 10 tokens at S=2 (1 at S=3) when it is removed


def expected_tokens(
    solo: list[int], stops: list[int | list[int]], limit: int | None = None
) -> tuple[list[int], str | None]:
    """A request's solo tokens cut after the first that ends a stop (a token, or a sequence of its tokens), or at
    ``limit`` (a removal)."""
    tokens = solo[:limit]
    sequences = [[s] if isinstance(s, int) else s for s in stops]
    for i in range(len(tokens)):
        if any(tokens[max(0, i + 1 - len(s)) : i + 1] == s for s in sequences):
            return tokens[: i + 1], "stop"
    return tokens, "length" if limit is None else None


SCENARIOS: dict[int, dict[str, dict[str, Any]]] = {2: {}, 3: {}}
"""Per world size, the scenarios of its one launch, by name."""

Reports = Callable[[int, str], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def scenario_reports() -> Reports:
    """``scenario_reports(S, name)``: every rank's report of that scenario; the first call for S launches them all."""
    launched: dict[int, list[dict[str, Any]]] = {}

    def reports(world_size: int, name: str) -> list[dict[str, Any]]:
        if world_size not in launched:
            spec = {"scenarios": SCENARIOS[world_size]}
            launched[world_size] = run_ranks(world_size, "batch.py", spec, timeout=360)
        return [r["scenarios"][name] for r in launched[world_size]]

    return reports


EQUAL_COSTS = (0.0, 1.0, 0.05)  # seconds per chunk, token, query-key pair: chunks shrink from 8 to 6 by position 8
# shard_model(lend=1): the rank after each cut batches its first layer's cache and the
# lent heads' (a LentHeadsCache) as one layer's: merged, masked, filtered and extracted together.
LENT_HEADS = {"lend": 1}
BATCHED = [
    ("llama", 2, None, "fixed", {}),
    ("qwen3", 3, None, "equal-cost", {}),
    ("llama", 2, [2, 3], "fixed", {}),
    ("llama", 2, [2, 5, 2], "fixed", {}),  # a stop sequence of two tokens, as mlx-lm's BatchGenerator takes them
    ("qwen3", 3, None, "fixed", LENT_HEADS),
]


def batched_name(arch: str, stop_at: list[int] | None, chunking: str, shard: dict[str, Any]) -> str:
    return f"batched {arch} stop_at={stop_at} {chunking}" + (" lent heads" if shard else "")


for arch, world_size, stop_at, chunking, shard in BATCHED:
    SCENARIOS[world_size][batched_name(arch, stop_at, chunking, shard)] = {
        "shard": shard,
        "arch": arch,
        "requests": REQUESTS,
        "remove": [REMOVE],
        "steps": 22,
        "step_size": 8,
        "stop_at": stop_at,
        **({"chunking": chunking, "chunk": 8, "costs": EQUAL_COSTS, "steps": 30} if chunking != "fixed" else {}),
    }


@pytest.mark.parametrize(
    "arch,world_size,stop_at,chunking,shard", BATCHED, ids=[batched_name(a, s, c, sh) for a, _, s, c, sh in BATCHED]
)
def test_batched_requests_equal_their_solo_runs(
    scenario_reports: Reports,
    arch: str,
    world_size: int,
    stop_at: list[int] | None,
    chunking: str,
    shard: dict[str, Any],
) -> None:
    # equal-cost: smaller chunks than the fixed 8, so more ticks (28) until every request is done
    reports = scenario_reports(world_size, batched_name(arch, stop_at, chunking, shard))
    for report in reports:
        assert report == {**reports[0], "rank": report["rank"]}, "ranks disagree"
    report = reports[0]
    solo, stops = report["solo"], report["stops"]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        first = report["first"][i]
        removed_after = (
            (REMOVE["at"] - (first if first is not None else REMOVE["at"])) if i == REMOVE["index"] else None
        )
        assert (tokens, finish) == expected_tokens(solo[i], stops, removed_after), (i, tokens, finish, solo[i])
    assert report["shared_head_ticks"] > 0  # greedy rows: every rank applied its share of the head
    if stop_at is None:
        # Each prompt is one chunk (ticks t on rank 0, t+1 on rank 1 at S=2), its request joins at t+2 and its first
        # token comes at t+3 (the tick that feeds it); request 1 leaves at its removal (tick 8), the others after
        # their closing ticks.
        expected = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0, 0] if world_size == 2 else None
        assert expected is None or report["rows"] == expected, report["rows"]
        assert chunking != "fixed" or (report["first"][1] is not None and report["first"][1] < REMOVE["at"]), report
    else:
        assert "stop" in report["finish"], report
    if stop_at is not None and len(stop_at) == 3:  # the sequence, not its last token alone, stops a request
        alone = [s[-1] for s in stops]
        assert any(expected_tokens(t, alone) != expected_tokens(t, stops) for t in solo), (solo, stops)
    if chunking == "equal-cost":
        # Request 2 (41 positions to prefill) is prefilled while the others decode: each chunk as long as the
        # cost model allows for a first chunk's cost (ticks with nothing decoding take step_size chunks).
        sizes = EqualCostChunks(8, LayerCosts(*EQUAL_COSTS))
        filled = [0, *sorted(set(report["prefilled"]["2"]) - {0})]
        lengths = [b - a for a, b in zip(filled, filled[1:])]
        assert sum(lengths) == REQUESTS[2]["M"] - 1 and min(lengths) < 8, lengths
        for start, length in zip(filled, lengths[:-1]):
            assert length in (sizes.tokens_at(start), 8), (start, length, filled)
    assert report["left"] == 0


# Decode groups in flight (decode_groups=2: the rows in two groups, at S=3 too, whenever two are live; each rank
# computes another group's step in each tick): request 1 removed mid-decode, a stop sequence of two tokens (S=2).
GROUPED = [("llama", 2, [2, 5, 2]), ("qwen3", 3, None)]
GROUPED_REMOVAL = {2: 14, 3: 18}  # (a group's step every S ticks: later than REMOVE's tick 8)
for arch, world_size, stop_at in GROUPED:
    SCENARIOS[world_size][f"groups {arch}"] = {
        "arch": arch,
        "requests": REQUESTS,
        "remove": [{**REMOVE, "at": GROUPED_REMOVAL[world_size]}],
        "steps": 44,
        "step_size": 8,
        "chunk": 8,
        "stop_at": stop_at,
        "generator": {"decode_groups": 2},
    }


@pytest.mark.parametrize("arch,world_size,stop_at", GROUPED)
def test_decode_groups_in_flight_give_each_request_its_solo_tokens_on_every_rank(
    scenario_reports: Reports, arch: str, world_size: int, stop_at: list[int] | None
) -> None:
    reports = scenario_reports(world_size, f"groups {arch}")
    for report in reports:
        assert report == {**reports[0], "rank": report["rank"]}, "ranks disagree"
    report = reports[0]
    solo, stops = report["solo"], report["stops"]
    assert report["most_groups"] >= 2, report["most_groups"]  # the rows were split into groups in flight
    assert report["in_flight"] == {"1": True}, report["in_flight"]  # removed while its group's step was under way
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        removed_after = len(tokens) if i == REMOVE["index"] else None  # a prefix of its solo run, then removed
        assert (tokens, finish) == expected_tokens(solo[i], stops, removed_after), (i, tokens, finish, solo[i])
    removed = report["tokens"][REMOVE["index"]]
    assert 0 < len(removed) < REQUESTS[REMOVE["index"]]["max_tokens"], removed  # removed mid-decode
    assert stop_at is None or "stop" in report["finish"], report
    assert report["shared_head_ticks"] > 0 and report["left"] == 0


# decode_groups="auto" (issue 52): 16 requests at S=2, the fewest it may split. Once one group's steady ticks are
# timed it tries groups (a probe: nothing is measured of them yet), then keeps whichever is measured cheaper; which
# one depends on the machine, but every rank must decide the same ticks from the same gathered times.
AUTO_GROUPS: list[dict[str, Any]] = [{"M": 3 + i % 4, "max_tokens": 40, "insert_at": 0} for i in range(16)]
SCENARIOS[2]["groups auto"] = {
    "requests": AUTO_GROUPS,
    "remove": [],
    "steps": 80,
    "step_size": 8,
    "chunk": 8,
    "generator": {"decode_groups": "auto"},
}


def test_auto_decode_groups_are_tried_from_measured_ticks_and_decided_alike_on_every_rank(
    scenario_reports: Reports,
) -> None:
    reports = scenario_reports(2, "groups auto")
    for report in reports:
        assert report == {**reports[0], "rank": report["rank"]}, "ranks disagree"  # the same times, the same ticks
    report = reports[0]
    timings, solo = report["group_timings"], report["solo"]
    assert len(timings.get("one 16", [])) >= 3, timings  # one group's steady ticks at 16 rows timed first
    assert report["most_groups"] == 2 and report["group_switches"][0] >= 1, report  # then groups tried
    assert timings.get("groups 16") and all(s > 0 for v in timings.values() for _, s in v), timings
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        assert (tokens, finish) == (solo[i], "length"), (i, tokens, solo[i])
    assert report["left"] == 0


INTERLEAVED: list[dict[str, Any]] = [
    {"M": 7, "max_tokens": 14, "insert_at": 0},
    {"M": 30, "max_tokens": 6, "insert_at": 1},  # removed mid-prefill
    {"M": 23, "max_tokens": 8, "insert_at": 2},  # removed mid-decode
    {"M": 41, "max_tokens": 6, "insert_at": 5},  # prefilled in 5 slices while the others decode
]
INTERLEAVED_REMOVALS = [{"index": 1, "at": 3}, {"index": 2, "at": 9}]


# gemma2: mlx-lm's attention took a batch cache's mask on the wrong axis (a registry fixup lines it up).
# llama_swa: sliding-window layers (window 5, shorter than every prompt): mlx-lm's rotating caches batched.
# llama with lend=1: the lent heads' cache is batched with its layer's (see LENT_HEADS).
INTERLEAVED_ARCHS = ["llama", "gemma2", "llama_swa", "llama lent heads"]
for name in INTERLEAVED_ARCHS:
    arch = name.split()[0]
    SCENARIOS[2][f"interleaved {name}"] = {
        "shard": LENT_HEADS if name.endswith("lent heads") else {},
        "arch": arch,
        "requests": INTERLEAVED,
        "remove": INTERLEAVED_REMOVALS,
        "steps": 22,
        "step_size": 8,
        "chunk": 8,
    }


@pytest.mark.parametrize("arch", INTERLEAVED_ARCHS)
def test_prompts_prefilled_between_decode_steps_equal_their_solo_runs(scenario_reports: Reports, arch: str) -> None:
    report = scenario_reports(2, f"interleaved {arch}")[0]
    solo = report["solo"]
    # (The tiny gemma2 settles into repeats sooner than llama, but no request of it is constant.)
    assert all(len(set(t)) > 1 for t in solo) and len({x for t in solo for x in t}) > 8, (
        f"the model repeats itself: the test loses its power: {solo}"
    )
    # Chunks of 8 positions, on rank 0 in tick t and on rank 1 in tick t+1; a request joins the tick after its
    # last chunk leaves rank 1 and returns its first token in the next. Request 1: 1 of its 4 chunks through both
    # ranks when removed (tick 3), no token. Request 2: chunks on rank 0 in ticks 3-5, joins in tick 7, removed
    # before tick 9 with 1 token. Request 3: chunks on rank 0 in ticks 6-10, joins in tick 12. Request 0 returns a
    # token in every tick from tick 3.
    assert report["tokens"][1] == [] and report["finish"][1] is None
    assert report["tokens"][2] == solo[2][:1] and report["finish"][2] is None
    for i in (0, 3):
        assert report["tokens"][i] == solo[i] and report["finish"][i] == "length", (i, report)
    assert report["rows"] == [0, 0, 0, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 0], report["rows"]
    assert report["partial"][:13] == [0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0], report["partial"]
    assert report["left"] == 0


# Logits processors (mlx-lm's make_logits_processors) per request: its own, the generator's default, none; and
# one whose first 20 prompt positions are in a reused cache, named to its processors by all_tokens.
PROCESSED: list[dict[str, Any]] = [
    {"M": 9, "max_tokens": 10, "insert_at": 0},
    {"M": 14, "max_tokens": 10, "insert_at": 0},
    {"M": 11, "max_tokens": 8, "insert_at": 0},
    {"M": 30, "max_tokens": 8, "insert_at": 2},
]
SCENARIOS[2]["processors"] = {
    "requests": PROCESSED,
    "remove": [],
    "steps": 26,
    "step_size": 8,
    "chunk": 8,
    "default_processors": {"presence_penalty": 2.0, "presence_context_size": 64},
    "processors": {
        "0": {"repetition_penalty": 1.8, "repetition_context_size": 64},
        "2": None,
        "3": {"repetition_penalty": 3.0, "repetition_context_size": 64, "logit_bias": {"7": 4.0}},
    },
    "all_tokens": {"3": 20},
}


SCENARIOS[2]["groups processors"] = {
    **SCENARIOS[2]["processors"],
    "steps": 40,
    "generator": {"decode_groups": 2},
}


@pytest.mark.parametrize("name", ["processors", "groups processors"])
def test_logits_processors_apply_per_request_as_in_single_device_mlx_lm(scenario_reports: Reports, name: str) -> None:
    """In groups in flight too (the last rank's logits of the group it finished reach every rank)."""
    reports = scenario_reports(2, name)
    assert name == "processors" or reports[0]["most_groups"] == 2, reports[0]["most_groups"]
    assert reports[0]["tokens"] == reports[1]["tokens"]
    report = reports[0]
    for i in (0, 1, 3):  # the processors change these requests' answers: the comparison has power
        assert report["solo"][i] != report["unprocessed"][i], (i, report["solo"][i])
    assert report["unprocessed"][2] is None
    assert report["tokens"] == report["solo"], report
    assert report["shared_head_ticks"] == 0  # rows with processors: the last rank applies the head
    assert report["finish"] == ["length"] * 4 and report["left"] == 0


# An engine's loop written once for mlx-lm's BatchGenerator, on pipemlx's and on mlx-lm's (tests/ranks/batch.py
# run_engine), then mlx-lm's own batch_generate() on both: at S=2 and S=3.
SCENARIOS[2]["engine"] = SCENARIOS[3]["engine"] = {
    "engine": True,
    "arch": "qwen3",
    "max_kv_size": 32,
    "decode_groups": 2,  # the engine loop once more with decode groups in flight (check_engine_report)
    "compiled_decode": True,  # and once more with each rank's layers' decode step compiled
}


def close(got: list[list[float]], want: list[list[float]]) -> bool:
    return len(got) == len(want) and all(
        len(g) == len(w) and all(abs(x - y) <= 1e-4 for x, y in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_engine_loop_for_mlx_lm_runs_unchanged_with_mlx_lm_results_on_every_rank(
    scenario_reports: Reports, world_size: int
) -> None:
    """Per-request samplers (request 1 takes the second likeliest token: ignoring it would show), processors and
    stop sequences, ``logprobs[token]`` of every response, the caches handed back, ``max_kv_size``, and mlx-lm's
    ``batch_generate`` (token ids, texts, logprobs) on pipemlx's generator: mlx-lm's results on every rank; each
    rank's processors and samplers saw what mlx-lm's saw, once per token."""
    reports = scenario_reports(world_size, "engine")
    for report in reports:
        assert {"compiled max_kv_size=None", "compiled groups max_kv_size=None"} <= set(report), report["rank"]
        check_engine_report(report)
    # Rank 0's processor raised in some tick: every rank failed that tick's rows alike (one tick later, before
    # returning the token that tick decided), and served the next request; with one group and with groups.
    for name in ("raising", "raising groups"):
        raising = [r[name] for r in reports]
        assert all(r["responses"] == raising[0]["responses"] for r in raising), (name, raising)
        ends = {uid: reason for uid, _, reason in raising[0]["responses"] if reason is not None}
        assert ends[0] == "error" and ends[1] in ("error", "length"), raising  # 1 failed too if in that tick
        assert [t for u, t, _ in raising[0]["responses"] if u == 0][-1] == -1 and len(ends) == 2
        # Request 0 answered the tokens the ticks before the raising one decided: its first two (the processor's
        # first call is its prefill's last tick, which decides its first token).
        assert len([t for u, t, _ in raising[0]["responses"] if u == 0]) == 3, (name, raising)
        assert all(r["after"] == r["solo"] for r in raising), raising
        assert "the processor raised on rank 0" in raising[0]["error"]
        assert [r["error"] for r in raising[1:]] == ["None"] * (world_size - 1)
        # One collective per tick of its own: the tick's all-gather, which also says (a tick late) that rank 0's
        # sampling raised. The model's head is split (the default), whose logits take two more all-gathers in a
        # tick that decodes; a separate agreement on the samples would make 4.
        for r in raising:
            assert set(r["gathers"]) == {1, 3}, (name, r["gathers"])


def test_an_engine_loop_on_a_group_of_one_gives_mlx_lm_results() -> None:
    """A group of one (``shard_model(model, mx.distributed.init())`` without a launcher): the same engine loop and
    batch_generate, in this process, with the same results as at S=2 and S=3; and generate_step's tokens, logprobs
    and processor inputs are mlx-lm's."""
    import importlib.util

    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    spec = importlib.util.spec_from_file_location("batch_rank_program", RANKS / "batch.py")
    assert spec is not None and spec.loader is not None
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    group = mx.distributed.init()
    assert group.size() == 1
    one = {**SCENARIOS[2]["engine"], "decode_groups": None}  # a group of one decodes as one group
    report = program.run_engine(one, group, program.Solo())
    assert {"compiled max_kv_size=None", "compiled max_kv_size=32"} <= set(report)  # compiled, and rotating: eager
    check_engine_report(report)
    config = tiny_config("qwen3")
    runs: list[Any] = []
    for function, model in (
        (pipemlx.generate_step, pipemlx.shard_model(build_model(config), group)),
        (generate_step, build_model(config)),
    ):
        seen: list[list[int]] = []

        def record(tokens: mx.array, logits: mx.array, seen: list[list[int]] = seen) -> mx.array:
            seen.append(cast(list[int], tokens.tolist()))
            return logits

        mx.random.seed(5)
        steps = function(
            mx.arange(11, dtype=mx.int32), model, max_tokens=6, sampler=make_sampler(0.9), logits_processors=[record]
        )
        out = list(steps)
        runs.append(([int(t) for t, _ in out], [lp.tolist()[:8] for _, lp in out], seen))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] and close(runs[0][1], runs[1][1]), runs


def test_the_memory_budget_reserves_a_bounded_request_at_its_max_kv_size() -> None:
    """With max_kv_size (rotating caches: a request holds at most that many positions), admission reserves the
    bounded size: a request whose prompt + max_tokens is past the budget but whose caches are bounded within it is
    admitted and decodes mlx-lm's tokens; without the bound it is refused (group of one, in this process)."""
    from mlx_lm.generate import BatchGenerator as MlxBatchGenerator

    config = tiny_config("qwen3")
    model = pipemlx.shard_model(build_model(config), mx.distributed.init())
    probe = pipemlx.BatchGenerator(model, prefill_step_size=8, memory_budget="1GB")
    assert probe.admission is not None
    budget = 20 * probe.admission.bytes_per_position[0]  # 20 positions
    prompt = list(range(3, 15))  # 12 tokens + 20 to generate: 32 positions, 16 with max_kv_size=16
    with pytest.raises(ValueError, match="would never fit the memory budget"):
        pipemlx.BatchGenerator(model, prefill_step_size=8, memory_budget=budget).insert([prompt], [20])
    bounded = pipemlx.BatchGenerator(model, prefill_step_size=8, memory_budget=budget, max_kv_size=16)
    (uid,) = bounded.insert([prompt], [20])
    ours = [r.token for _ in range(40) for r in bounded.next() if r.uid == uid]
    reference = MlxBatchGenerator(build_model(config), prefill_step_size=8, max_kv_size=16)
    (theirs_uid,) = reference.insert([prompt], [20])
    theirs: list[int] = []
    while responses := reference.next_generated():
        theirs += [r.token for r in responses if r.uid == theirs_uid]
    assert len(ours) == 20 and ours == theirs, (ours, theirs)


def check_engine_report(report: dict[str, Any]) -> None:
    """One rank's run_engine report: pipemlx's results are mlx-lm's (see the test above)."""
    rank = report["rank"]
    grouped = ["groups max_kv_size=None", "groups max_kv_size=32"] if "groups max_kv_size=None" in report else []
    compiled = [name for name in ("compiled max_kv_size=None", "compiled max_kv_size=32") if name in report]
    if "compiled groups max_kv_size=None" in report:  # compiled, with decode groups in flight
        grouped.append("compiled groups max_kv_size=None")
        compiled.append("compiled groups max_kv_size=None")
    for size in compiled:  # compiled_decode=True: [steps run compiled, traces, distinct (rows, room) shapes]
        steps, traces, shapes = report[size]["pipemlx"]["compiled"]
        # Plain caches: every rank compiled its decode steps (rows joining and leaving, the next turns on the
        # caches handed back), traced once per shape, never per step; max_kv_size's rotating caches: all eager.
        assert (steps > 0) == size.endswith("None") and traces == shapes < 8, (rank, size, steps, traces, shapes)
    for size in dict.fromkeys(("max_kv_size=None", "max_kv_size=32", *grouped, *compiled)):
        ours, mlx = report[size]["pipemlx"], report[size]["mlx"]
        assert (ours["most_groups"] >= 2) == (size in grouped), (rank, size, ours["most_groups"])
        assert ours["tokens"] == mlx["tokens"], (rank, size, ours["tokens"], mlx["tokens"])
        assert [f[0] for f in ours["finished"]] == [f[0] for f in mlx["finished"]] == ["length", "length", "stop"]
        assert close(ours["logprobs"], mlx["logprobs"]), (rank, size)
        # Each processor and sampler saw what mlx-lm's saw, as often: once per token and once more for the step
        # after a request's last token (its closing tick), in both turns.
        assert ours["histories"] == mlx["histories"], (rank, size)
        assert all(close(o, m) for o, m in zip(ours["logits"], mlx["logits"], strict=True)), (rank, size)
        assert all(close(o, m) for o, m in zip(ours["draws"], mlx["draws"], strict=True)), (rank, size)
        assert [len(h) for h in mlx["histories"]] == [
            len(t) + 1 + len(f) + 1 for t, f in zip(mlx["tokens"], mlx["following"])
        ]
        # The caches handed back hold the whole conversation (the last token too), as mlx-lm's; all_tokens names it.
        assert [[f[2][0], *f[3:]] for f in ours["finished"]] == [[f[2][0], *f[3:]] for f in mlx["finished"]], rank
        assert all(f[4] for f in ours["finished"]), (rank, size)
        # The next turn on those caches gives mlx-lm's tokens and logprobs (from mlx-lm's own handed-back caches).
        assert [[t for t, _ in f] for f in ours["following"]] == [[t for t, _ in f] for f in mlx["following"]]
        assert close([[p for _, p in f] for f in ours["following"]], [[p for _, p in f] for f in mlx["following"]])
        # next_generated()'s grouping, the documented rule: a request returns a token in every call from the call
        # after it joined to its closing tick, and requests start in the order they were inserted (a chunk per
        # rank per tick); mlx-lm's prefill a batch of prompts together, so which call a request starts in differs.
        # (With decode groups in flight a call returns the requests of one group: each request's tokens in order.)
        for engine_calls, ordered in ((ours["calls"], True), (mlx["calls"], False)) if size not in grouped else ():
            present = [[k for k, uids in enumerate(engine_calls) if i in uids] for i in range(len(ours["tokens"]))]
            assert all(p == list(range(p[0], p[0] + len(t))) for p, t in zip(present, ours["tokens"])), engine_calls
            assert not ordered or [p[0] for p in present] == sorted(p[0] for p in present), engine_calls
        kinds = {kind for f in ours["finished"] for kind in f[1]}  # the lent heads' cache pairs the first one
        wanted = {"KVCache"} if size.endswith("max_kv_size=None") else {"RotatingKVCache"}
        assert {kind for f in mlx["finished"] for kind in f[1]} == wanted
        assert wanted <= kinds <= {*wanted, "LentHeadsCache"}, (rank, size, ours["finished"])
    ours, mlx = report["batch_generate"]["pipemlx"], report["batch_generate"]["mlx"]
    assert ours["token_ids"] == mlx["token_ids"] and ours["texts"] == mlx["texts"], (rank, ours, mlx)
    assert close(ours["logprobs"], mlx["logprobs"]) and ours["generation_tokens"] == mlx["generation_tokens"]
    assert [c[0] for c in ours["caches"]] == [c[0] for c in mlx["caches"]], (rank, ours, mlx)
    # max_kv_size=16, a request whose answer outgrows it: the batch caches rotate, as mlx-lm's, and the tokens and
    # logprobs are mlx-lm's BatchGenerator's (generate_step's: mlx-lm's generate_step's, whose caches keep their
    # first 4 positions). Prompts that outgrow it while prefilled (40 and 23 tokens): mlx-lm's BatchGenerator's
    # tokens and logprobs (its batch caches keep no first positions), generate_step's (300 tokens, "auto") and
    # stream_generate's (30 tokens) mlx-lm's (prefilled in mlx-lm's chunks).
    outgrow = report["outgrow"]
    ours, mlx = outgrow["pipemlx"]["got"], outgrow["mlx"]["got"]
    assert len(ours) == 20 and [t[::2] for t in ours] == [t[::2] for t in mlx], (rank, ours, mlx)
    assert close([[t[1] for t in ours]], [[t[1] for t in mlx]]), rank
    ours, mlx = outgrow["pipemlx"]["long"], outgrow["mlx"]["long"]
    assert [len(t) for t in ours] == [6, 5] and [[t for t, _ in r] for r in ours] == [[t for t, _ in r] for r in mlx]
    assert close([[p for _, p in r] for r in ours], [[p for _, p in r] for r in mlx]), (rank, ours, mlx)
    # generate_step reports its progress last: where its chunks ended; "auto" took mlx-lm's where they matter.
    pairs = {name: (outgrow[f"pipemlx_{name}"], outgrow[f"mlx_{name}"]) for name in ("step", "long_step", "stream")}
    assert pairs["long_step"][0][-1] == pairs["long_step"][1][-1] == [0, 299, 300], (rank, pairs["long_step"])
    for name, (ours, mlx) in pairs.items():
        if name != "stream":
            ours, mlx = ours[:-1], mlx[:-1]
        assert [t[::2] for t in ours] == [t[::2] for t in mlx], (rank, name, ours, mlx)
        assert close([[t[1] for t in ours]], [[t[1] for t in mlx]]), (rank, name, ours, mlx)
    assert [t[2] for t in outgrow["pipemlx_stream"]] == [None] * 5 + ["length"], rank
    # generate_step, four turns on one prompt_cache (the third stopped by its consumer after 3 tokens): the same
    # tokens, logprobs, positions and processor and sampler inputs as mlx-lm's generate_step on the whole model,
    # on every rank.
    ours, mlx = report["generate_step"]["pipemlx"], report["generate_step"]["mlx"]
    for o, m in zip(ours["turns"][::2], mlx["turns"][::2], strict=True):
        assert [t for t, _ in o] == [t for t, _ in m] and close([[p for _, p in o]], [[p for _, p in m]]), (rank, o, m)
    assert ours["turns"][1::2] == mlx["turns"][1::2] and ours["histories"] == mlx["histories"], (rank, ours, mlx)
    assert close(ours["draws"], mlx["draws"]), rank


# Prompt lookup in the batch (tests/ranks/batch.py run_speculative): greedy rows with guesses, one that opted out,
# a seeded sampled one, a stop inside a pass, a removal mid-run, against mlx-lm's BatchGenerator without guesses.
# "oracle": guesses from mlx-lm's answers (mostly right: long passes, a stop among kept guesses); "draft": a draft
# model (the target less its last layer: about half its guesses hold); else prompt lookup.
# head="split" at S=3: every position's logits gathered from every rank's rows of the head. S=2 "oracle" also
# compiles the decode step (compiled_decode=True): steps with guesses run eagerly, the others compiled.
SPECULATION = [(2, "lookup", "auto"), (2, "oracle", 3), (3, "oracle", 2), (2, "draft", 3), (3, "draft", "auto")]
for world_size, proposer, count in SPECULATION:
    SCENARIOS[world_size][f"speculation {proposer} {count}"] = {
        "speculate": True,
        "oracle": proposer == "oracle",
        "draft": proposer == "draft",  # a draft model in the batch (tests/ranks/batch.py half_draft)
        "num_draft_tokens": count,
        "head": "split" if (world_size, proposer) == (3, "oracle") else "all",
        "compiled_decode": (world_size, proposer) == (2, "oracle"),
    }


@pytest.mark.parametrize("world_size,proposer,count", SPECULATION, ids=[f"S{s}-{p}-{c}" for s, p, c in SPECULATION])
def test_prompt_lookup_in_the_batch_gives_mlx_lm_tokens_and_logprobs_on_every_rank(
    scenario_reports: Reports, world_size: int, proposer: str, count: int | str
) -> None:
    """Every request's tokens are mlx-lm's one-process BatchGenerator's without guesses, on every rank, and so are the
    log-probabilities wherever a rank holds them (the last rank always); a request removed mid-run hands back caches
    holding exactly the tokens it names."""
    reports = scenario_reports(world_size, f"speculation {proposer} {count}")
    shared = ("tokens", "want_tokens", "proposed", "confirmed", "ticks", "handed", "stopped_in_pass")
    for report in reports:
        assert {k: report[k] for k in shared} == {k: reports[0][k] for k in shared}, "ranks disagree"
    report = reports[0]
    tokens, want = report["tokens"], report["want_tokens"]
    assert tokens[:4] == want[:4]
    assert len(tokens[4]) >= 3 and tokens[4] == want[4][: len(tokens[4])] and len(want[4]) > len(tokens[4])
    offset, held, returned = report["handed"]
    prompt = report["removed_prompt"]
    assert offset == len(held) and held[: len(prompt)] == prompt, (offset, len(held))
    assert held[len(prompt) :] == want[4][: len(held) - len(prompt)] and returned == tokens[4][: len(returned)]
    assert report["proposed"] > 0 and report["confirmed"] > 0, "no guess held: the test loses its power"
    if proposer == "oracle":
        assert report["confirmed"] >= report["proposed"] // 2 and report["stopped_in_pass"] >= 1
    if proposer == "draft":  # guesses held and failed; every row's draft cache dropped once its request left
        assert report["confirmed"] < report["proposed"] and report["drafts_left"] == 0, report
        # A memory budget reserves the draft's keys and values per position too, on every rank: its 5 layers x 2
        # KV heads x 16 dims x (keys, values) x 4 bytes (the tiny llama less its last layer, float32).
        config = tiny_config("llama")
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        draft_bytes = (config["num_hidden_layers"] - 1) * config["num_key_value_heads"] * head_dim * 2 * 4
        for rank_report in reports:
            plain, with_draft = rank_report["admitted"]
            assert plain > 0 and with_draft == plain + draft_bytes, rank_report["admitted"]
    shared = report["shared"]  # head="split", greedy rows without logprobs: steps with guesses share the head
    if SCENARIOS[world_size][f"speculation {proposer} {count}"]["head"] == "split":
        assert all(r["shared"] == shared for r in reports), "ranks disagree"
        assert shared["tokens"] == shared["want"], shared  # mlx-lm's tokens without guesses
        assert shared["guesses"][1] > 0 and shared["shared_guess_ticks"] >= 3, shared
    if SCENARIOS[world_size][f"speculation {proposer} {count}"]["compiled_decode"]:
        assert all(r["compiled_steps"] > 0 for r in reports), [r["compiled_steps"] for r in reports]
    for rank_report in reports:
        last = rank_report["rank"] == world_size - 1
        for got, expected in zip(rank_report["logprobs"], rank_report["want_logprobs"]):
            assert not last or None not in got
            assert all(g is None or abs(g - w) <= 1e-4 for g, w in zip(got, expected)), (got, expected)


# mlx-lm's BatchGenerator API on the pipeline (tests/ranks/batch.py run_parity): insert's positional order with
# per-request stop sequences, completion_batch_size, logprobs, all_tokens, extract_cache, next_generated, stats,
# prompt_cache_nbytes and close.
SCENARIOS[2]["mlx-lm parity"] = {"parity": True, "step_size": 8, "chunk": 8}
PARITY_SHARED = ("tokens", "solo", "finish", "held_ok", "busy", "calls", "extracted", "after_close", "alone")


def test_the_generator_answers_mlx_lm_batch_generator_calls_as_mlx_lm_does(scenario_reports: Reports) -> None:
    reports = scenario_reports(2, "mlx-lm parity")
    for report in reports:
        assert {k: report[k] for k in PARITY_SHARED} == {k: reports[0][k] for k in PARITY_SHARED}, "ranks disagree"
    report = reports[0]
    solo, default, own = report["solo"], report["default"], report["own"]
    expected = [
        expected_tokens(solo[0], []),  # its own (no) stops replace the generator's
        expected_tokens(solo[1], own[1]),
        expected_tokens(solo[2], [own[2]]),  # a two-token sequence, as an mlx-lm StopSequences
        expected_tokens(solo[3], default),
    ]
    assert [(t, f) for t, f in zip(report["tokens"], report["finish"])] == expected, (report, expected)
    assert expected_tokens(solo[0], default) != expected[0], "the generator's stop token would not cut request 0"
    assert report["finish"][1] == "stop" and report["finish"][2] == "stop", report["finish"]
    assert all(report["held_ok"]), report["held_ok"]  # all_tokens: what the finished request's cache holds
    assert max(report["busy"]) == 2 and len(report["busy"]) == report["calls"], report["busy"]
    extracted = report["extracted"]  # a copy of request 1's row at 3 tokens; the request went on (tokens above)
    assert extracted["held"] and extracted["positions"] == extracted["count"] == 17 + 3, extracted
    assert report["after_close"] == [0, 0] and report["alone"] == report["alone_solo"], report
    for r in reports:
        assert r["holding"] > 0
        stats = r["stats"]
        assert stats["prompt_tokens"] == sum(m - 1 for m in (9, 17, 12, 5)), stats
        assert stats["generation_tokens"] == sum(len(t) for t in report["tokens"]), stats
        assert 0 < stats["generation_steps"] <= stats["generation_tokens"], stats
        prompt_time, decode_time, wall = stats["times"]
        assert 0 < prompt_time and 0 < decode_time and prompt_time + decode_time <= wall, stats
        if r["last"]:  # the log-probabilities the tokens were sampled from: single-device mlx-lm's
            assert r["logprobs_given"] == [True] * 3 and r["logprobs_gap"] < 1e-4, r
        else:
            assert r["logprobs_given"] == [False] * 3, r


# remove(..., return_prompt_caches=True): request 1 removed mid-prefill (chunks still travelling the ranks) and
# request 2 mid-decode; each goes on at once from the caches handed back, and its answer equals its solo run.
RESUMED: list[dict[str, Any]] = [
    {"M": 7, "max_tokens": 12, "insert_at": 0},
    {"M": 41, "max_tokens": 6, "insert_at": 1},
    {"M": 23, "max_tokens": 9, "insert_at": 1},
]
# With decode groups in flight ("groups"), request 2 is removed while its group's step is under way on some rank
# (S=2: tick 16; S=3: tick 21): the cache handed back holds what every rank agreed on, without that step.
RESUMED_RUNS = [("llama", 2, ""), ("qwen3", 3, ""), ("llama", 2, "groups "), ("qwen3", 3, "groups ")]
for arch, world_size, grouped in RESUMED_RUNS:
    SCENARIOS[world_size][f"{grouped}resumed {arch}"] = {
        "arch": arch,
        "requests": RESUMED,
        "remove": [
            {"index": 1, "at": 4, "resume": True},
            {"index": 2, "at": {"": 12, "groups ": 11 + 5 * (world_size - 1)}[grouped], "resume": True},
        ],
        "steps": 50 if grouped else 30,
        "step_size": 8,
        "chunk": 8,
        **({"generator": {"decode_groups": 2}} if grouped else {}),
    }


@pytest.mark.parametrize("arch,world_size,grouped", RESUMED_RUNS)
def test_removed_requests_hand_back_caches_that_go_on_exactly(
    scenario_reports: Reports, arch: str, world_size: int, grouped: str
) -> None:
    reports = scenario_reports(world_size, f"{grouped}resumed {arch}")
    assert not grouped or reports[0]["most_groups"] >= 2, reports[0]["most_groups"]
    assert not grouped or reports[0]["in_flight"] == {"1": False, "2": True}, reports[0]["in_flight"]
    for report in reports:
        resumed = report["resumed"]
        assert resumed["1"]["generated"] == 0 and 0 < resumed["1"]["held"] < RESUMED[1]["M"] - 1, resumed
        assert resumed["2"]["generated"] > 1, resumed  # removed mid-decode
        for entry in resumed.values():
            assert entry["matches"] and entry["positions"] == entry["held"], entry
        assert report["tokens"] == report["solo"], report
        assert report["finish"] == ["length"] * 3 and report["left"] == 0


# Request 0 finishes while request 1 decodes; its next turn (6 new tokens) is inserted on the
# cache its final response carried and joins the batch with request 1 still in it.
SCENARIOS[2]["follow-up"] = {
    "requests": [{"M": 9, "max_tokens": 5, "insert_at": 0}, {"M": 20, "max_tokens": 14, "insert_at": 0}],
    "remove": [],
    "steps": 24,
    "step_size": 8,
    "chunk": 4,
    "follow_up": {"of": 0, "M": 6, "max_tokens": 6},
}


SCENARIOS[2]["groups follow-up"] = {**SCENARIOS[2]["follow-up"], "steps": 44, "generator": {"decode_groups": 2}}


@pytest.mark.parametrize("name", ["follow-up", "groups follow-up"])
def test_a_finished_request_hands_back_its_cache_for_the_next_turn(scenario_reports: Reports, name: str) -> None:
    reports = scenario_reports(2, name)
    assert name == "follow-up" or reports[0]["most_groups"] == 2, reports[0]["most_groups"]
    assert reports[0]["follow_up"]["tokens"] == reports[1]["follow_up"]["tokens"]
    report = reports[0]
    assert report["tokens"] == report["solo"], report
    follow = report["follow_up"]
    assert follow["positions"] == 9 + 5, follow  # the prompt and every answer token, the last too (mlx-lm's)
    assert len(set(follow["solo"])) > 2, f"the model repeats itself: the test loses its power: {follow}"
    assert (follow["tokens"], follow["finish"]) == (follow["solo"], "length"), follow


DEAD_ROW_REQUESTS = [
    {"M": 9, "max_tokens": 5, "insert_at": 0},
    {"M": 20, "max_tokens": 14, "insert_at": 0},
    {"M": 14, "max_tokens": 12, "insert_at": 0},
    {"M": 11, "max_tokens": 7, "insert_at": 0},
]
SCENARIOS[2]["dead rows"] = {
    "requests": DEAD_ROW_REQUESTS,
    "remove": [{"index": 1, "at": 11}],
    "steps": 19,
    "step_size": 8,
    "chunk": 32,
    "follow_up": {"of": 0, "M": 6, "max_tokens": 6},
}


def test_finished_rows_left_in_the_batch_leak_into_no_answer(scenario_reports: Reports) -> None:
    # The four requests join in ticks 2, 4, 5 and 6 (first tokens in 3, 5, 6, 7). Request 0's closing tick is
    # tick 7, with 4 rows: its row stays in the batch caches (1 dead of 4) while its next turn is prefilled, which
    # then takes that row. Request 1, removed before tick 11, leaves a dead row before request 3, whose closing
    # tick is 13 (2 of 4 dead: compacted); then 1 of 2, then none left. Every answer, the next turn's included,
    # equals its solo run, and each finished request hands back its own row.
    reports = scenario_reports(2, "dead rows")
    for report in reports:
        assert report == {**reports[0], "rank": report["rank"]}, "ranks disagree"
    report = reports[0]
    solo, follow = report["solo"], report["follow_up"]
    assert all(len(set(t)) > 2 for t in [*solo, follow["solo"]]), "the model repeats itself: the test loses its power"
    assert report["first"] == [3, 5, 6, 7], report["first"]
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        removed_after = 11 - report["first"][i] if i == 1 else None
        assert (tokens, finish) == expected_tokens(solo[i], [], removed_after), (i, tokens, finish, solo[i])
    assert follow["positions"] == 9 + 5 and (follow["tokens"], follow["finish"]) == (follow["solo"], "length")
    # Prompt + every answer token (mlx-lm's): requests 0, 2, 3 and the next turn (14 positions + 6 inserted + 6).
    assert report["handed_back"] == [14, None, 14 + 12, 11 + 7, 14 + 6 + 6], report["handed_back"]
    # Answers per step, and the batch caches' rows after it (dead rows included).
    assert report["rows"] == [0, 0, 0, 1, 1, 2, 3, 4, 3, 3, 3, 3, 3, 3, 2, 2, 2, 1, 0], report["rows"]
    assert report["batch_rows"] == [0, 0, 1, 1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 1, 0, 0], report["batch_rows"]
    assert report["left"] == 0


# A request shorter than the batch's rows (written in place) and longer (the rows moved right first); qwen3_next's
# linear-attention layers' caches are extended and filtered instead. "llama lent heads": the whole model cut as
# lend=1 cuts it at [3, 3], layer 3's cache a LentHeadsCache (written in place part by part, so that it
# keeps the positions of the layers whose cache gives the mask).
@pytest.mark.parametrize(
    "arch,joining",
    [
        ("llama", 5),
        ("llama", 20),
        ("qwen3_next", 20),
        ("llama_swa", 20),
        ("llama lent heads", 5),
        ("llama lent heads", 20),
    ],
)
def test_a_joining_request_takes_a_dead_row_and_decodes_as_it_would_alone(arch: str, joining: int) -> None:
    # One process, the whole tiny model: rows 0-2 decode 3 steps, row 1 is then dead and a new request takes it.
    model = build_model(tiny_config(arch.split()[0]))
    lent = arch.endswith("lent heads")
    if lent:
        lend_feed_forwards(model.model.layers, (3, 3), 1)  # type: ignore[attr-defined]
    prompts = [mx.random.randint(0, 256, (n,), key=mx.random.key(n)).tolist() for n in (9, 14, 11, joining)]

    def prefilled(prompt: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        if lent:
            cache[3] = LentHeadsCache(cache[3], KVCache())
        mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
        return cache

    def decode(tokens: list[int], cache: list[Any]) -> list[int]:
        return mx.argmax(model(mx.array(tokens)[:, None], cache=cache)[:, -1, :], axis=-1).tolist()

    def solo(prompt: list[int], steps: int) -> list[int]:
        cache, tokens = prefilled(prompt), [prompt[-1]]
        for _ in range(steps):
            tokens.append(decode(tokens[-1:], cache)[0])
        return tokens[1:]

    firsts = [prefilled(p) for p in prompts[:3]]
    batch = [firsts[0][layer].merge([c[layer] for c in firsts]) for layer in range(len(firsts[0]))]
    inputs, got = [p[-1] for p in prompts[:3]], [[], [], [], []]
    for _ in range(3):
        inputs = decode(inputs, batch)
        for row in (0, 1, 2):
            got[row].append(inputs[row])
    fill_rows(batch, 3, [1], [prefilled(prompts[3])])
    inputs[1] = prompts[3][-1]
    for _ in range(4):
        inputs = decode(inputs, batch)
        for row, request in ((0, 0), (1, 3), (2, 2)):
            got[request].append(inputs[row])
    assert [got[0], got[2], got[3]] == [solo(prompts[0], 7), solo(prompts[2], 7), solo(prompts[3], 4)], got
    assert len(set(got[3])) > 1, f"the model repeats itself: the test loses its power: {got}"


PREFIXED: list[dict[str, Any]] = [
    {"M": 9, "max_tokens": 8, "insert_at": 0},
    {"M": 33, "max_tokens": 7, "insert_at": 0},  # 16 positions reused, 17 inserted
    {"M": 25, "max_tokens": 6, "insert_at": 2},  # 24 positions reused: only its last token is inserted
    {"M": 12, "max_tokens": 6, "insert_at": 3},  # 8 reused, joining while the others decode
]


# qwen3_next at S=3: rank 1 holds only linear-attention layers, whose caches cannot tell a prefix's length.
# llama lent heads: a reused cache of the rank after the cut holds the lent heads' positions too.
PREFIXED_RUNS = [("llama", 2), ("qwen3_next", 3), ("llama lent heads", 2)]
for name, world_size in PREFIXED_RUNS:
    SCENARIOS[world_size][f"prefixes {name}"] = {
        "shard": LENT_HEADS if name.endswith("lent heads") else {},
        "arch": name.split()[0],
        "requests": PREFIXED,
        "remove": [],
        "steps": 14,
        "step_size": 8,
        "prefixes": {"1": 16, "2": 24, "3": 8},
    }


@pytest.mark.parametrize("arch,world_size", PREFIXED_RUNS)
def test_requests_with_reused_prefixes_equal_solo_runs_of_their_whole_prompts(
    scenario_reports: Reports, arch: str, world_size: int
) -> None:
    reports = scenario_reports(world_size, f"prefixes {arch}")
    assert all(r["tokens"] == reports[0]["tokens"] for r in reports), "ranks disagree"
    report = reports[0]
    solo = report["solo"]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        assert tokens == solo[i] and finish == "length", (i, tokens, solo[i])
    assert report["left"] == 0


# Tiny llama at S=2: 3 layers per rank x 2 KV heads x 16 dims x (keys + values) x 4 bytes = 768 bytes per
# position. The budget holds 80 positions: requests 0 and 1 (19 and 33 reserved: 2 x 33 left-padded) fit
# together, request 2 (50) fits beside neither, so it starts only once request 0 has finished (tick 13). Whole
# layers (lend="none"): lending a head would move 128 of those bytes from rank 0 to rank 1.
SCENARIOS[2]["memory budget"] = {
    "shard": {"lend": "none"},
    "requests": REQUESTS,
    "remove": [REMOVE],
    "steps": 32,
    "step_size": 8,
    "memory_budget": 80 * 768,
}


def test_a_request_waits_in_the_queue_until_its_cache_fits_the_memory_budget(scenario_reports: Reports) -> None:
    reports = scenario_reports(2, "memory budget")
    report = reports[0]
    assert [r["admission"] for r in reports] == [[768, 768]] * 2
    solo = report["solo"]
    for i, (tokens, finish) in enumerate(zip(report["tokens"], report["finish"])):
        first = report["first"][i]
        removed_after = (
            (REMOVE["at"] - (first if first is not None else REMOVE["at"])) if i == REMOVE["index"] else None
        )
        assert (tokens, finish) == expected_tokens(solo[i], [], removed_after), (i, tokens, finish, solo[i])
    last_of_0 = report["first"][0] + REQUESTS[0]["max_tokens"] - 1
    # Request 2 starts once request 0's closing tick (14) freed its reservation: 5 chunks of 8 on rank 0 from
    # tick 15, the last through rank 1 in tick 20, joins in tick 21, its first token in tick 22.
    assert report["first"][2] == last_of_0 + 8 == 22, report["first"]
    assert max(report["rows"]) == 2 and report["left"] == 0
    assert "would never fit the memory budget" in report["too_big"], report["too_big"]


# The admission boundary, exactly (768 bytes per position on each rank, a budget of 32 positions: 24 KiB, no
# rounding). Requests 0 and 1 reserve 16 positions each (prompt + max_tokens): 2 x 16 = 32 fits, so they are
# prefilled and decode together. Requests 2 and 3, inserted once those are done, reserve 16 and 17: 2 x 17 = 34
# does not fit, so request 3 starts only once request 2 has finished. A reserve one position short would let
# request 3 in beside request 2; one position long would keep request 1 out until request 0 finished. Alone, a
# request of 32 positions is queued, one of 33 could never fit and is refused.
BOUNDARY_REQUESTS: list[dict[str, Any]] = [
    {"M": 9, "max_tokens": 7, "insert_at": 0},
    {"M": 11, "max_tokens": 5, "insert_at": 0},
    {"M": 10, "max_tokens": 6, "insert_at": 10},
    {"M": 10, "max_tokens": 7, "insert_at": 10},
]
SCENARIOS[2]["memory budget boundary"] = {
    "shard": {"lend": "none"},
    "requests": BOUNDARY_REQUESTS,
    "remove": [],
    "steps": 32,
    "step_size": 8,
    "memory_budget": 32 * 768,
    "boundary_inserts": [[20, 12], [20, 13], [21, 12]],
}


def test_the_memory_budget_admits_a_batch_that_fills_it_exactly_and_not_one_position_more(
    scenario_reports: Reports,
) -> None:
    reports = scenario_reports(2, "memory budget boundary")
    assert all(r["tokens"] == reports[0]["tokens"] for r in reports), "ranks disagree"
    report = reports[0]
    assert [r["admission"] for r in reports] == [[768, 768]] * 2
    reserves = [r["M"] + r["max_tokens"] for r in BOUNDARY_REQUESTS]
    assert reserves == [16, 16, 16, 17] and 2 * max(reserves[:3]) == 32 < 2 * reserves[3]
    first, limits = report["first"], [r["max_tokens"] for r in BOUNDARY_REQUESTS]
    assert first[1] <= first[0] + limits[0] - 1, ("request 1 waited though 2 x 16 positions fit the budget", first)
    assert report["tokens"] == report["solo"] and report["finish"] == ["length"] * 4, report
    last = [f + n - 1 for f, n in zip(first, limits)]
    assert max(report["rows"][: last[0] + 1]) == 2, report["rows"]
    assert first[3] > last[2], ("request 3 (17) was admitted beside request 2: 2 x 17 > 32", first)
    assert max(report["rows"][first[2] :]) == 1, report["rows"]
    # Request 1 (10 positions to prefill: 2 chunks of 8) starts in tick 1 beside request 0 and joins in tick 4
    # (first token in tick 5); request 3 starts in tick 20, after request 2's closing tick (19), and joins in
    # tick 23 (first token in tick 24).
    assert first == [3, 5, 14, 24], first
    # Alone: 20 + 12 = 32 positions is queued; 20 + 13 and 21 + 12 (a token more of answer or prompt) are refused.
    queued, *over = report["boundary_inserts"]
    assert queued == "queued", queued
    assert all("would never fit the memory budget" in o and "(33 positions" in o for o in over), over
    assert report["left"] == 0


# prefill_batch_size=1 at S=2: request 1 (22 positions to prefill, cut at 5 and 13 by insert_segments) starts
# only once request 0 has joined (without the cap it would start in tick 1, while rank 1 computes request 0's
# chunk), request 2 once request 1 has joined.
SCENARIOS[2]["prefill batch size and segments"] = {
    "requests": [
        {"M": 7, "max_tokens": 8, "insert_at": 0},
        {"M": 23, "max_tokens": 6, "insert_at": 0},
        {"M": 17, "max_tokens": 6, "insert_at": 1},
    ],
    "remove": [],
    "steps": 26,
    "step_size": 8,
    "chunk": 8,
    "generator": {"prefill_batch_size": 1},
    "segments": {"1": [5, 13]},
}


def test_prefill_batch_size_and_segments_across_the_ranks(scenario_reports: Reports) -> None:
    reports = scenario_reports(2, "prefill batch size and segments")
    assert all(r["tokens"] == reports[0]["tokens"] for r in reports), "ranks disagree"
    report = reports[0]
    assert report["tokens"] == report["solo"] and report["finish"] == ["length"] * 3, report
    assert max(report["prefilling"]) == 1, report["prefilling"]
    # Request 1's chunks as the last rank completed them: 0-5, 5-13 (segments), 13-21, 21-22 (chunks of 8).
    assert sorted(set(report["prefilled"]["1"]) - {0}) == [5, 13, 21, 22], report["prefilled"]
    assert report["first"][0] < report["first"][1] < report["first"][2] and report["left"] == 0, report["first"]


HELD_BACK_REQUESTS = [
    {"M": 7, "max_tokens": 12, "insert_at": 0},
    {"M": 9, "max_tokens": 3, "insert_at": 0},
    {"M": 11, "max_tokens": 12, "insert_at": 0},
    {"M": 20, "max_tokens": 10, "insert_at": 8},
]
SCENARIOS[2]["dead rows held back"] = {
    "shard": {"lend": "none"},  # whole layers: the budget's arithmetic counts 768 bytes per position on each rank
    "requests": HELD_BACK_REQUESTS,
    "remove": [],
    "steps": 22,
    "step_size": 8,
    "chunk": 32,
    "memory_budget": 100 * 768,
}


def test_dead_rows_are_filtered_out_when_they_hold_back_a_queued_request(scenario_reports: Reports) -> None:
    # 768 bytes per position, a budget of 100 positions. Requests 0-2 (19, 12 and 23 reserved) join in ticks 2-4
    # (first tokens in 3-5); request 1's closing tick is tick 6 (1 dead row of 3, kept). Request 3 (30 reserved),
    # inserted before tick 8, fits beside the two live rows (3 x 30) but not beside the dead row too (4 x 30):
    # the dead row is filtered out in tick 8 and request 3 starts at once, joining in tick 10.
    report = scenario_reports(2, "dead rows held back")[0]
    assert report["tokens"] == report["solo"] and report["first"] == [3, 4, 5, 11], report
    rows = report["batch_rows"]
    assert rows == [0, 0, 1, 2, 3, 3, 3, 3, 2, 2, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 0, 0], rows


@pytest.mark.parametrize(
    "world_size,groups,guessing",
    [
        pytest.param(2, 1, False, marks=pytest.mark.slow),
        (3, 1, False),
        pytest.param(3, 2, False, marks=pytest.mark.slow),
        (2, 1, True),
    ],
)  # -m slow: the suite's time budget
def test_a_killed_rank_fails_the_batch_on_every_survivor(world_size: int, groups: int, guessing: bool) -> None:
    # Killed before tick 4: request 0 decodes, request 1's prompt is in flight between the ranks. With decode
    # groups (killed before tick 9): requests 0 and 2 (a 2-token prompt) decode in two groups in flight.
    # ``guessing`` (issue 49): prompt lookup in the batch, every greedy row guessing 3 tokens in every step, so the
    # rank dies mid-pass (a step of 4 positions a row).
    lookup = {"prompt_lookup": 2, "num_draft_tokens": 3} if guessing else {}
    spec = {
        "requests": REQUESTS[:2] + ([{"M": 2, "max_tokens": 12, "insert_at": 0}] if groups > 1 else []),
        "remove": [],
        "steps": 12,
        "step_size": 8,
        "timeout": 5.0,
        "kill": {"rank": 1, "at": 4 if groups == 1 else 9},
        "generator": {"decode_groups": groups, **lookup},
        "always_guess": guessing,
    }
    reports = run_ranks(world_size, "batch.py", spec, timeout=60, expect_exit={1: 3})
    survivors = [survivor for rank, survivor in enumerate(reports) if rank != 1]
    for survivor in survivors:
        assert survivor["error"] in ("PeerLostError", "PipelineTimeoutError"), survivor
        assert f"rank {survivor['rank']}/{world_size}" in survivor["message"]
        assert survivor["waited"] <= 5.0 + 3.0, survivor
        assert survivor["guessing"] == guessing, survivor  # the failing tick was a pass with guesses, or not
    # The dead rank's ring neighbours see the lost connection (a survivor farther off may time out first),
    # also in ticks whose greedy rows share the output head (two collectives, each evaluated on its own).
    assert "PeerLostError" in [survivor["error"] for survivor in survivors], survivors


@pytest.mark.slow  # the suite's time budget: run with -m slow
def test_a_stalled_first_rank_fails_the_batch_on_every_other_rank_within_the_timeout() -> None:
    """Rank 0 alive but silent before tick 4: rank 1's next decode step starts with a receive that never
    comes. Issuing that forward pass (mx.async_eval of a graph of hundreds of operations) blocks behind the
    receive, so it must be bounded like every other wait; otherwise rank 1 would only learn of it when
    rank 0 exits (the stall outlasts the timeout by 8 s here)."""
    spec = {
        "requests": REQUESTS[:2],
        "remove": [],
        "steps": 8,
        "step_size": 8,
        "timeout": 3.0,
        "stall": {"rank": 0, "at": 4, "seconds": 11.0},
    }
    reports = run_ranks(2, "batch.py", spec, timeout=60, expect_exit={0: 3})
    survivor = reports[1]
    assert survivor["error"] == "PipelineTimeoutError", survivor
    assert "rank 1/2" in survivor["message"]
    assert survivor["waited"] <= 3.0 + 3.0, survivor


def fake_engine(**kwargs: Any) -> pipemlx.BatchGenerator:
    """A generator on rank 0 of a fake 2-rank group: for what happens before anything is sent (a fixed step and
    chunks: "auto" and "equal-cost", the defaults, calibrate the group when the generator is made)."""
    model = pipemlx.shard_model(build_model(tiny_config("llama")), FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    return pipemlx.BatchGenerator(model, **{"prefill_step_size": 8, "prefill_chunking": "fixed", **kwargs})


def test_bad_arguments_raise_before_anything_changes() -> None:
    engine = fake_engine(max_tokens=5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.insert([[1, 2], []])
    with pytest.raises(ValueError, match="2 prompts need one entry each .*got 1 max_tokens$"):
        engine.insert([[1, 2], [3]], max_tokens=[4])
    with pytest.raises(ValueError, match="got 2 caches$"):
        engine.insert([[1, 2]], caches=[None, None])
    with pytest.raises(ValueError, match="got 0 logits_processors, 3 all_tokens$"):
        engine.insert([[1, 2]], logits_processors=[], all_tokens=[[1], None, None])
    with pytest.raises(ValueError, match=r"caches\[0\] must be a list of 3 layer caches"):
        engine.insert([[1, 2]], caches=[[]])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.insert([[1, 2]], max_tokens=0)
    with pytest.raises(ValueError, match="got 2 stop_sequences$"):
        engine.insert([[1, 2]], stop_sequences=[None, [3]])
    with pytest.raises(ValueError, match="stop_sequences holds an empty sequence"):
        engine.insert([[1, 2]], stop_sequences=[[[4], []]])
    assert len(engine) == 0 and engine.insert([[1, 2], [3]]) == [0, 1]
    # A rank of recurrent layers only (0 bytes per position) could not reserve a reused prefix like the others.
    engine.admission = Admission(bytes_per_position=(768, 0), budget=(10**9, 10**9))
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] hold only recurrent layers"):
        engine.insert([[1, 2]], caches=[make_prompt_cache(engine.model)])
    assert len(engine) == 2
    with pytest.raises(TypeError, match="'prefill_budget', renamed 'prefill_chunk_tokens'"):  # its former name
        fake_engine(prefill_budget=0)
    for bad, named in (
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens"),
        ({"prefill_step_size": 0}, "prefill_step_size"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"timeout": -1.0}, "timeout"),
        ({"prefill_chunking": "even"}, "prefill_chunking"),
        ({"completion_batch_size": 0}, "completion_batch_size"),
        ({"decode_groups": 0}, "decode_groups must be 'auto' or a positive int, got 0"),
        ({"decode_groups": "many"}, "decode_groups must be 'auto' or a positive int, got 'many'"),
        ({"decode_groups": True}, "decode_groups must be 'auto' or a positive int, got True"),
    ):
        with pytest.raises(ValueError, match=named):
            fake_engine(**bad)
    # decode_groups: "auto" measured, from 8 live rows per group on; n >= 2 from n rows; 1 never.
    rule = fake_engine(decode_groups="auto")._group_rule  # pyright: ignore[reportPrivateUsage]
    assert (rule is not None) and (rule.most, rule.enter, rule.leave, rule.measured) == (2, 16, 16, True), rule
    rule = fake_engine(decode_groups=3)._group_rule  # pyright: ignore[reportPrivateUsage]
    assert (rule is not None) and (rule.most, rule.enter, rule.leave) == (2, 3, 3), rule
    assert fake_engine(decode_groups=1)._group_rule is None  # pyright: ignore[reportPrivateUsage]


def test_stop_tokens_may_be_given_as_mlx_lm_stop_sequences() -> None:
    """mlx-lm's BatchGenerator takes stop sequences ([[2], [7]]); one-token ones are stop tokens, an empty one refused
    (longer ones: the "stop sequence" batch scenario)."""
    from mlx_lm.generate import generate_step

    whole = build_model(tiny_config("llama"), seed=3)
    model = pipemlx.shard_model(build_model(tiny_config("llama"), seed=3), mx.distributed.init())  # one rank
    prompt = mx.random.randint(0, 256, (9,), key=mx.random.key(4)).tolist()
    solo = [t for t, _ in generate_step(mx.array(prompt), whole, max_tokens=8)]
    stop = solo[3]
    for stops in ([stop], [[stop]], ((stop,), [10**6])):
        engine = pipemlx.BatchGenerator(model, max_tokens=8, stop_tokens=stops)
        engine.insert([prompt])
        answers = [r for _ in range(12) for r in engine.next()]
        assert [r.token for r in answers] == solo[: solo.index(stop) + 1], (stops, answers, solo)
        assert answers[-1].finish_reason == "stop"
    with pytest.raises(ValueError, match="stop_tokens holds an empty sequence"):
        pipemlx.BatchGenerator(model, stop_tokens=[[1, 2], []])


def test_ranks_that_disagree_in_a_tick_leave_the_stage_refusing_further_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tick's messages went out before its all-gather showed the disagreement: the links are not trusted.

    At S=2, rank 0 inserting [1..5] and rank 1 [1, 2] raised PipelineMismatchError (plan) and every later
    generate_step on the group then gave wrong tokens, without an error (bytes left on the link). One rank
    here, the disagreement injected where the gathered headers are checked.
    """
    import pipemlx.runtime.batch.tick as batch_tick

    model = pipemlx.shard_model(build_model(tiny_config("llama")), mx.distributed.init())  # one rank
    engine = pipemlx.BatchGenerator(model, max_tokens=3)
    engine.insert([[1, 2, 3]])

    def disagree(table: Any, rows: int, sharing: bool, width: int = 1) -> Any:
        raise pipemlx.PipelineMismatchError("ranks disagree on the batch tick's plan: rank 0: 1, rank 1: 2")

    monkeypatch.setattr(batch_tick, "outcome_of", disagree)
    with pytest.raises(pipemlx.PipelineMismatchError, match="start every rank again"):
        engine.next()
    monkeypatch.undo()
    with pytest.raises(pipemlx.PipelineError, match="cannot communicate any more"):
        next(pipemlx.generate_step(mx.array([1, 2, 3]), model, max_tokens=2))


def tick_rows(*rows: tuple[dict[str, int], list[float]]) -> mx.array:
    """The all-gather of a batch tick's rows: each a header (by field name) and a payload."""
    from pipemlx.runtime.protocol import TICK

    return mx.concatenate([TICK.row(values, payload=[mx.array(payload)]) for values, payload in rows])


def test_ranks_that_cut_their_layers_differently_disagree_in_the_first_tick() -> None:
    """A rank with lend="mlp" and one without send the same shapes: only the tick's header can tell them apart."""
    from pipemlx.runtime.batch.tick import outcome_of
    from pipemlx.runtime.protocol import TICK

    def row(lend: int, heads: int = 0) -> tuple[dict[str, int], list[float]]:
        return {"tick": 0, "rows": 1, "lend_mlp": lend, "lend_heads": heads}, [7.0]

    def read(gathered: mx.array) -> Any:
        return TICK.read(gathered, 2, "batch tick 0")

    assert outcome_of(read(tick_rows(row(1), row(1))), 1, False)[0].tokens == [7]
    with pytest.raises(pipemlx.PipelineMismatchError, match="lend_mlp: rank 0: 1, rank 1: 0"):
        read(tick_rows(row(1), row(0)))
    with pytest.raises(pipemlx.PipelineMismatchError, match="lend_heads: rank 0: 1, rank 1: 0"):
        read(tick_rows(row(1, 1), row(1)))


def test_a_tick_that_shares_the_head_takes_the_largest_logits_id_when_the_last_rank_is_greedy() -> None:
    """Each rank adds [largest logit, its id] per row; the last rank's own tokens count when it sampled."""
    from pipemlx.runtime.batch.tick import outcome_of
    from pipemlx.runtime.protocol import TICK

    def row(greedy: int, tokens: list[float], pairs: list[float]) -> tuple[dict[str, int], list[float]]:
        return {"tick": 3, "rows": 2, "greedy": greedy}, tokens + pairs

    first = row(1, [0, 0], [2.5, 10, 1.0, 20])
    last = row(1, [0, 0], [2.5, 90, 3.0, 95])
    outcome, greedy = outcome_of(TICK.read(tick_rows(first, last), 2, "tick"), 2, True)
    assert outcome.tokens == [10, 95] and greedy  # a tie goes to the lower id; every rank greedy: share next
    sampled = row(0, [41, 42], [9.0, 90, 9.0, 95])
    outcome, greedy = outcome_of(TICK.read(tick_rows(first, sampled), 2, "tick"), 2, True)
    assert outcome.tokens == [41, 42] and not greedy


def test_a_step_with_guesses_that_shares_a_split_head_takes_every_position_s_largest_logit() -> None:
    """Two rows of two positions: each rank adds [largest logit, its id] per row and position, row by row; the
    rows' tokens are their first positions', the guessed positions' follow, row by row; the timings' mean."""
    from pipemlx.runtime.batch.tick import outcome_of
    from pipemlx.runtime.protocol import TICK

    def row(pairs: list[float], timing: int) -> tuple[dict[str, int], list[float]]:
        return {"tick": 3, "rows": 2, "greedy": 1, "last_tick_us": timing}, [0.0] * 4 + pairs

    first = row([2.5, 10, 1.0, 20, 4.0, 30, 0.5, 40], 900)
    last = row([2.0, 90, 3.0, 95, 4.0, 99, 0.5, 41], 1200)
    outcome, greedy = outcome_of(TICK.read(tick_rows(first, last), 2, "tick"), 2, True, 2)
    assert outcome.tokens == [10, 30] and outcome.ahead == [95, 40] and greedy and outcome.last_tick_us == 1050


def test_a_failed_sample_in_any_rank_s_header_fails_the_last_tick_s_rows_on_every_rank() -> None:
    """A rank before the last whose sampling raised says so in the next tick's header (``failed_sample``): every
    rank reads the same outcome from the gathered table, whichever rank said it."""
    from pipemlx.runtime.batch.tick import outcome_of
    from pipemlx.runtime.protocol import TICK

    def row(failed: int) -> tuple[dict[str, int], list[float]]:
        return {"tick": 5, "rows": 2, "failed_sample": failed}, [3.0, 4.0]

    for flags, failed in (((0, 0), False), ((1, 0), True), ((0, 1), True)):
        outcome, _ = outcome_of(TICK.read(tick_rows(*(row(f) for f in flags)), 2, "tick"), 2, False)
        assert outcome.failed_sample is failed and outcome.tokens == [3, 4], flags


def test_rows_whose_sampling_raised_here_are_left_out_of_this_rank_s_sampling_until_they_fail() -> None:
    """Their processors and sampler are not called again on the rank where they raised (which would raise again,
    failing the next tick's rows too); the other rows are sampled as before."""
    from pipemlx.runtime.batch.sample import sample

    called: list[int] = []

    class Row:
        def __init__(self, uid: int) -> None:
            self.uid, self.done, self.sampler, self.context = uid, False, None, [1]
            self.processors = (self.processor,)

        def processor(self, tokens: mx.array, logits: mx.array) -> mx.array:
            called.append(self.uid)
            return logits

    logits = mx.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    rows = [Row(7), Row(8)]
    tokens, _ = sample(logits, rows, None, frozenset({7}))  # pyright: ignore[reportArgumentType]
    assert called == [8] and tokens.tolist() == [1, 0]
    sample(logits, rows, None)  # pyright: ignore[reportArgumentType]
    assert called == [8, 7, 8]


def test_queued_requests_are_removed_without_communication() -> None:
    engine = fake_engine()
    uids = engine.insert([[1, 2, 3], [4, 5], [6]], max_tokens=[3, 4, 5])
    assert engine.queued_uids == uids and engine.active_uids == [] and len(engine) == 3
    engine.remove([uids[1], 99])
    assert engine.queued_uids == [uids[0], uids[2]] and engine.prefilled(uids[0]) == 0
    engine.remove(uids)
    assert len(engine) == 0 and engine.next() == []


def one_rank(arch: str, seed: int = 3) -> tuple[Any, Any]:
    """The whole tiny model and the same weights sharded on a group of one rank."""
    whole = build_model(tiny_config(arch), seed=seed)
    return whole, pipemlx.shard_model(build_model(tiny_config(arch), seed=seed), mx.distributed.init())


def solo_tokens(
    model: Any, prompt: list[int], max_tokens: int, max_kv_size: int | None = None, step_size: int = 8
) -> list[int]:
    """Greedy tokens of mlx-lm's single-device generate_step on the whole model (prefilled in chunks of
    ``step_size``: a rotating cache's tokens depend on the chunks once a prompt outgrows it, in mlx-lm too)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, max_kv_size=max_kv_size, prefill_step_size=step_size
    )
    return [int(t) for t, _ in steps]


def run_all(engine: pipemlx.BatchGenerator, later: dict[int, list[list[int]]], ticks: int = 60) -> dict[int, list[int]]:
    """Run ``ticks`` ticks, inserting ``later[t]``'s prompts before tick t (uids in insertion order): tokens per uid."""
    got: dict[int, list[int]] = {}
    for t in range(ticks):
        for uid in engine.insert(later[t]) if t in later else []:
            got[uid] = []
        for response in engine.next():
            got[response.uid].append(response.token)
    assert len(engine) == 0, "requests left after every tick"
    return got


# Sliding-window layers (rotating caches that keep no first positions): gemma3_text (window 4, a global layer
# every 3), gpt_oss (window 4, attention sinks).
@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_sliding_window_layer_caches_batch_and_equal_solo_mlx_lm_runs(arch: str) -> None:
    # Prompts longer than every window, prefilled in chunks of 8 between decode steps; request 1 finishes early
    # and request 3 (inserted before tick 6) takes its dead row (a rotating batch cache is extended and filtered).
    whole, model = one_rank(arch)
    prompts = [mx.random.randint(0, 256, (n,), key=mx.random.key(n)).tolist() for n in (9, 30, 17, 26)]
    limits = [12, 3, 12, 8]
    solo = [solo_tokens(whole, p, n) for p, n in zip(prompts, limits)]
    engine = pipemlx.BatchGenerator(model, prefill_chunk_tokens=8, prefill_step_size=8)
    assert "RotatingKVCache" in {type(c).__name__ for c in make_prompt_cache(model)}
    got: dict[int, list[int]] = {}
    for t in range(40):
        if t in (0, 6):
            chosen = (0, 1, 2) if t == 0 else (3,)
            for uid in engine.insert([prompts[i] for i in chosen], [limits[i] for i in chosen]):
                got[uid] = []
        for response in engine.next():
            got[response.uid].append(response.token)
    assert [got[i] for i in range(4)] == solo, (got, solo)
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"


def test_max_kv_size_makes_rotating_caches_and_prompts_that_outgrow_them_give_mlx_lm_tokens() -> None:
    """max_kv_size makes mlx-lm's RotatingKVCache(max_kv_size, keep=4) per layer (qwen3 makes no caches of its
    own; llama's make_cache ignores max_kv_size in mlx-lm too). An answer may outgrow it (the engine loop tests
    that against mlx-lm), and so may a prompt: mlx-lm's BatchGenerator prefills in its BatchRotatingKVCache, which
    has no ``keep``, so a prompt longer than max_kv_size loses its first positions there; pipemlx prefills each
    prompt in caches that keep none either, in its own chunks (7 here, mlx-lm's 8), with mlx-lm's tokens and
    logprobs. So with caches given to insert: empty ones (keep=4), and ones holding 25 positions already (rotated,
    their first 4 kept): mlx-lm's batch takes their last 16 and keeps none from then on, and so does pipemlx."""
    from mlx_lm.generate import BatchGenerator as MlxBatchGenerator
    from mlx_lm.generate import generate_step

    whole, model = one_rank("qwen3")
    short, long, longer = (mx.random.randint(0, 256, (n,), key=mx.random.key(n)).tolist() for n in (9, 30, 45))
    engine = pipemlx.BatchGenerator(model, prefill_step_size=8, max_kv_size=16)
    assert engine.max_kv_size == 16
    (uid,) = engine.insert([short], 7)  # 9 + 7 = 16 positions at most, its closing tick's included
    answers = [r for _ in range(12) for r in engine.next()]
    assert [r.token for r in answers] == solo_tokens(whole, short, 7, 16) and answers[-1].uid == uid
    cache = answers[-1].prompt_cache
    assert cache is not None and {type(c).__name__ for c in cache} == {"RotatingKVCache"}

    def given(m: Any, held: int) -> list[Any]:
        cache = make_prompt_cache(m, 16)
        for _ in generate_step(mx.array(longer[: held + 1]), m, prompt_cache=cache, max_tokens=0, prefill_step_size=8):
            pass
        return cache

    def run(generator: Any, m: Any) -> list[list[tuple[int, float]]]:
        uids = generator.insert([long, short, longer], [6, 8, 5])
        uids += generator.insert([long, longer[25:]], [5, 6], caches=[make_prompt_cache(m, 16), given(m, 25)])
        got: dict[int, list[tuple[int, float]]] = {u: [] for u in uids}
        while responses := generator.next_generated():
            for r in responses:
                got[r.uid].append((r.token, r.logprobs[r.token].item()))
        return [got[u] for u in uids]

    ours = run(pipemlx.BatchGenerator(model, prefill_step_size=8, prefill_chunk_tokens=7, max_kv_size=16), model)
    mlx = run(MlxBatchGenerator(whole, prefill_step_size=8, max_kv_size=16), whole)
    assert [len(t) for t in ours] == [6, 8, 5, 5, 6]
    assert [[t for t, _ in r] for r in ours] == [[t for t, _ in r] for r in mlx], (ours, mlx)
    assert all(abs(a[1] - b[1]) <= 1e-4 for o, m in zip(ours, mlx) for a, b in zip(o, m)), (ours, mlx)
    # The comparison has power: one process's generate_step, whose caches keep their first 4 positions, differs.
    assert [t for t, _ in mlx[0]] != solo_tokens(whole, long, 6, 16), "mlx-lm's batch keeps the first positions"
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_kv_size must be a positive int"):
            pipemlx.BatchGenerator(model, max_kv_size=bad)  # type: ignore[arg-type]


def test_the_auto_step_takes_mlx_lm_chunks_where_a_cache_keeping_its_first_positions_would_rotate() -> None:
    """``prefill_step_size="auto"`` cuts a 30-token prompt in chunks of its own, except where some cache is a
    RotatingKVCache keeping its first 4 positions (max_kv_size) that the prompt fills past its size: there the chunks
    decide what each position attends to, and it takes mlx-lm's generate_step default (2048: one chunk here). A
    cache that keeps none (mlx-lm's batch kind) or holds the whole prompt leaves the choice to "auto"."""
    _, model = one_rank("qwen3")
    prompt = mx.random.randint(0, 256, (30,), key=mx.random.key(30))
    kept_none = make_prompt_cache(model, 16)
    for c in kept_none:
        c.keep = 0
    for cache, forced in (
        (make_prompt_cache(model, 16), True),
        (make_prompt_cache(model, 64), False),
        (kept_none, False),
    ):
        progress: list[int] = []
        step = pipemlx.pipeline_prefill(model, prompt, cache, prompt_progress_callback=lambda d, _: progress.append(d))
        if forced:
            assert step == 2048 and progress == [0, 29], (step, progress)
        else:  # "auto" returns its largest chunk: at most the 29 positions prefilled
            assert step <= 29, (step, progress)


def test_prefill_batch_size_caps_the_requests_started_and_not_yet_decoding() -> None:
    # One rank: a one-token prompt needs no prefill and is ready at once, so without a cap all three join
    # together in tick 1; with prefill_batch_size=1 the next starts only when the one before joins.
    whole, model = one_rank("llama")
    prompts = [[5], [6], [7]]
    solo = [solo_tokens(whole, p, 4) for p in prompts]
    for cap, joined in ((None, [[], [0, 1, 2]]), (1, [[], [0], [0, 1], [0, 1, 2]]), (2, [[], [0, 1], [0, 1, 2]])):
        engine = pipemlx.BatchGenerator(model, max_tokens=4, prefill_batch_size=cap)
        uids = engine.insert(prompts)
        active: list[list[int]] = []
        got: dict[int, list[int]] = {u: [] for u in uids}
        for _ in range(10):
            for response in engine.next():
                got[response.uid].append(response.token)
            active.append(engine.active_uids)
        assert active[: len(joined)] == joined, (cap, active)
        assert [got[u] for u in uids] == solo, (cap, got, solo)
    assert pipemlx.BatchGenerator(model, completion_batch_size=2, prefill_batch_size=4).completion_batch_size == 4
    assert pipemlx.BatchGenerator(model, completion_batch_size=5, prefill_batch_size=4).completion_batch_size == 5
    assert pipemlx.BatchGenerator(model, prefill_batch_size=4).completion_batch_size is None
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="prefill_batch_size must be a positive int"):
            pipemlx.BatchGenerator(model, prefill_batch_size=bad)  # type: ignore[arg-type]


def test_the_stream_is_the_stages_compute_stream_and_another_device_is_refused() -> None:
    from mlx_lm.generate import generation_stream

    _, model = one_rank("llama")
    stage = stage_of(model)
    ours = stage.compute_stream.device
    for given in (None, generation_stream, mx.new_stream(ours), ours):
        assert pipemlx.BatchGenerator(model, stream=given).stream == stage.compute_stream
    other = mx.Device(mx.gpu if ours.type == mx.cpu else mx.cpu)
    with pytest.raises(ValueError, match=re.escape(f"device {other}: rank 0/1 (layers 0..5 of 6) computes on its own")):
        pipemlx.BatchGenerator(model, stream=other)
    with pytest.raises(ValueError, match="stream must be an mx.Stream"):
        pipemlx.BatchGenerator(model, stream="gpu")  # type: ignore[arg-type]


def test_segments_give_the_tokens_of_their_joined_prompt_and_no_chunk_crosses_their_ends() -> None:
    whole, model = one_rank("llama")
    prompt = mx.random.randint(0, 256, (14,), key=mx.random.key(14)).tolist()
    segments = [prompt[:3], [], prompt[3:10], prompt[10:], []]
    solo = solo_tokens(whole, prompt, 6)
    engine = pipemlx.BatchGenerator(model, max_tokens=6, prefill_step_size=8, prefill_chunk_tokens=8)
    (uid,) = engine.insert_segments([segments])
    filled: list[int] = []  # prefilled positions after each tick while queued: chunks 0-3, 3-10, 10-13
    got: list[int] = []
    for _ in range(12):
        got += [r.token for r in engine.next()]
        if uid in engine.queued_uids:
            filled.append(engine.prefilled(uid))
    assert got == solo and filled == [3, 10, 13], (got, solo, filled)
    assert run_all(engine, {0: [prompt]}) == {1: solo}  # insert of the joined prompt: the same tokens
    with pytest.raises(ValueError, match="request 1 has an empty prompt"):
        engine.insert_segments([[[1, 2]], [[], []]])
    with pytest.raises(ValueError, match="2 prompts need one entry each .*got 1 max_tokens$"):
        engine.insert_segments([[[1, 2]], [[3]]], max_tokens=[4])
    assert len(engine) == 0


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize("arch", ["deepseek_v2", "llama3_rope"])
def test_models_holding_lazily_built_arrays_batch_and_prefill_in_helper_threads(arch: str) -> None:
    """mlx-lm builds some RoPE frequencies lazily on the building thread's stream (llama 3's, deepseek_v2's
    yarn): every bounded wait evaluates in a helper thread, which cannot run those operations, so before
    shard_model evaluated them the first tick failed with "There is no Stream(cpu, 0) in current thread"."""
    config = tiny_config("llama", rope_scaling=LLAMA3_ROPE) if arch == "llama3_rope" else tiny_config(arch)
    whole = build_model(config, seed=3)
    model = pipemlx.shard_model(build_model(config, seed=3), mx.distributed.init(), timeout=60)
    prompts = [mx.random.randint(0, 256, (n,), key=mx.random.key(n)).tolist() for n in (9, 20)]
    solo = [solo_tokens(whole, p, 6) for p in prompts]
    assert all(len(set(t)) > 2 for t in solo), f"the model repeats itself: the test loses its power: {solo}"
    engine = pipemlx.BatchGenerator(model, prefill_chunk_tokens=8, prefill_step_size=8)
    got: dict[int, list[int]] = {uid: [] for uid in engine.insert(prompts, [6, 6])}
    for _ in range(30):
        for response in engine.next():
            got[response.uid].append(response.token)
    assert [got[uid] for uid in sorted(got)] == solo
    cache = make_prompt_cache(model)
    pipemlx.pipeline_prefill(model, mx.array(prompts[1]), cache, prefill_step_size=8, timeout=60)
    steps = pipemlx.generate_step(mx.array(prompts[1][-1:]), model, prompt_cache=cache, max_tokens=6, timeout=60)
    assert [int(t) for t, _ in steps] == solo[1]
