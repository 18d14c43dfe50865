"""The pipemlx command: clean errors on bad input, and 2-rank runs that give single-device mlx-lm's tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from conftest import DEMO_RUN_TIMEOUT, DemoRun, check_demo_run, demo_reference_tokens
from fakes import HELIUM_TIED
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from pipemlx import cli
from pipemlx.cli import common
from pipemlx.cli import generate as generate_command
from pipemlx.cli import split as split_command
from pipemlx.demo import MODEL_DIR
from pipemlx.launch import free_ports
from pipemlx.testing import build_model, save_model_dir, tiny_config

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 180


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``pipemlx argv...`` in this process; returns the exit status and stderr."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["generate", "--model", "/no/such/model"], "model folder '/no/such/model' does not exist"),
        (["generate", "--ranks", "9"], "more ranks than layers: 9 ranks cannot share the 8 layers"),
        (["generate", "--prompt-file", "/no/such/prompt.txt"], "cannot read prompt file '/no/such/prompt.txt'"),
        (["generate", "--prompt", "   \n"], "the prompt is empty"),
        (["generate", "--rank", "0"], "--rank only goes with --hostfile"),
        (["generate", "--split", "5,5"], "--split: split [5, 5] adds up to 10 layers but the model has 8"),
        (
            ["generate", "--ranks", "3", "--split", "6,2"],
            "--split: split [6, 2] has 2 entries but the group has 3 ranks",
        ),
        (["bench", "--ranks", "9"], "more ranks than layers: 9 ranks"),
        (["bench", "--model", "/no/such/model"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    code, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith(f"pipemlx {argv[0]}: error: ") and words in err, err
    assert "Traceback" not in err


def test_folder_without_config_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "generate", "--model", str(tmp_path))
    assert code == 2 and "has no config.json; it is not an mlx-lm model folder" in err


def test_argument_types_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "generate", "--max-tokens", "0")
    assert code == 2 and "--max-tokens/-m: must be at least 1, or -1 for no limit, got 0" in err
    code, err = run_cli(capsys, "generate", "--prefill-step-size", "x")
    assert code == 2 and "--prefill-step-size: expected a whole number, got 'x'" in err
    for old, new in (("--step-size", "--prefill-step-size"), ("--lend-mlp", "--lend"), ("--lend-heads", "--lend")):
        code, err = run_cli(capsys, "generate", old, "4")
        assert code == 2 and f"{old} was renamed {new} in pipemlx 0.2.0" in err, err


@pytest.mark.parametrize(
    "content,words",
    [
        ("not json", "cannot read hostfile"),
        ("[1, 2]", 'must be a JSON list with one list of "ip:port" strings per rank'),
        ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', "ranks [0, 1] of"),
        # mlx.distributed_config's form
        ('{"a": 1}', "'hosts' must be a non-empty list"),
        ('{"backend": "jaccl", "hosts": [{"ssh": "a"}]}', "mlx.launch --hostfile"),
        ('{"backend": "ring", "hosts": [{"ssh": "a", "ips": []}]}', "host 0 ('a') has no 'ips'"),
        ('{"hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}], "envs": ["NOEQUALS"]}', "'envs' must be a list"),
        ('{"hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]}', "ranks [0, 1] of"),
    ],
)
def test_bad_hostfile(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, words: str) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(content)
    code, err = run_cli(capsys, "generate", "--hostfile", str(hostfile))
    assert code == 2 and words in err, err


def test_hostfile_of_distributed_config_gets_mlx_launch_ports(tmp_path: Path) -> None:
    """Ports as mlx.launch counts them: from 32323, one per rank and IP."""
    hostfile = tmp_path / "hosts.json"
    hosts = [{"ssh": "a", "ips": ["10.0.0.1", "10.1.0.1"], "rdma": []}, {"ssh": "b", "ips": ["10.0.0.2"]}]
    hostfile.write_text(json.dumps({"backend": "", "envs": [], "hosts": hosts}))
    assert common.read_hostfile(str(hostfile)) == [["10.0.0.1:32323", "10.1.0.1:32324"], ["10.0.0.2:32325"]]


def test_hostfile_without_this_host(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(common, "_is_local", lambda host: False)  # no address is this machine's: nothing may connect
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["host-a:5000"], ["host-b:5000"]]')
    code, err = run_cli(capsys, "generate", "--hostfile", str(hostfile))
    assert code == 2 and "no address in" in err and "belongs to this host; pass --rank R" in err


def test_loopback_is_a_local_address() -> None:
    assert common._is_local("127.0.0.1")  # pyright: ignore[reportPrivateUsage]


def test_rank_outside_the_hostfile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["127.0.0.1:1"], ["127.0.0.1:2"]]')
    code, err = run_cli(capsys, "generate", "--hostfile", str(hostfile), "--rank", "2")
    assert code == 2 and "--rank 2 is not a rank of" in err and "which has 2 ranks" in err


def test_png_without_matplotlib(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    code, err = run_cli(capsys, "bench", "--png", "timeline.png")
    assert code == 2 and "--png needs matplotlib: pip install matplotlib" in err


@pytest.mark.parametrize("command", ["split", "plan"])
def test_split_hands_its_arguments_over(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """`pipemlx split` (and `pipemlx plan`, its old name) hand their arguments to pipemlx.cli.split."""
    seen: list[tuple[list[str], str]] = []

    def split_main(argv: list[str], prog: str = "") -> int:
        seen.append((argv, prog))
        return 7

    monkeypatch.setattr(split_command, "main", split_main)
    code, _ = run_cli(capsys, command, "DIR", "--ranks", "3", "--memory", "24GB,16GB,8GB")
    assert code == 7 and seen == [(["DIR", "--ranks", "3", "--memory", "24GB,16GB,8GB"], f"pipemlx {command}")]


def test_generate_allow_unregistered_reaches_load_sharded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One rank in this process: an unregistered architecture is refused naming the flag, and runs with it."""
    path = save_model_dir(build_model(dict(HELIUM_TIED)), HELIUM_TIED, tmp_path / "helium")
    argv = ["generate", "--ranks", "1", "--model", str(path), "--prompt", "t1 t2 t3 t4 t5 t6", "--max-tokens", "3"]
    code, err = run_cli(capsys, *argv, "--temp", "0", "--json")
    assert code == 1 and "is not an architecture pipemlx has been verified on" in err, err
    assert "--allow-unregistered to pipemlx generate / serve / bench / doctor" in err
    code = cli.main([*argv, "--temp", "0", "--json", "--allow-unregistered"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["ranks"] == 1 and report["split"] == [4] and report["tokens"]


def test_a_prompt_that_encodes_to_no_tokens_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that encodes the prompt to no tokens (transformers' own byte-level tokenizer for a qwen2
    directory did, for the tiny word-level vocabulary's words): named in one line, exit 2, nothing sent."""
    path = save_model_dir(build_model(tiny_config("llama")), tiny_config("llama"), tmp_path / "llama")

    class FindsNothing:
        bos_token = None

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return []

    monkeypatch.setattr(generate_command, "load_tokenizer", lambda *args, **kwargs: FindsNothing())
    code, err = run_cli(capsys, "generate", "--ranks", "1", "--model", str(path), "--prompt", "t5 t7", "--json")
    assert code == 2 and "the prompt 't5 t7' encodes to no tokens" in err and "Traceback" not in err, err


def test_a_subprocess_error_has_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", "generate", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "pipemlx generate: error: model folder '/no/such/model' does not exist"


@pytest.mark.timeout(DEMO_RUN_TIMEOUT)
def test_generate_on_two_local_ranks_streams_single_device_text(demo_run: DemoRun) -> None:
    """`pipemlx generate --ranks 2` with its defaults (greedy, the auto step, lend="auto"): the streamed text is
    single-device mlx-lm's, and the summary names each rank. The session's one
    demo run (tests/conftest.py): from the installed wheel where it can be built, else from this checkout."""
    check_demo_run(demo_run)


@pytest.mark.parametrize(
    "guesses", [["--draft-model", "DRAFT"], ["--prompt-lookup", "2", "--num-draft-tokens", "auto"]]
)
def test_generate_speculating_gives_single_device_tokens(guesses: list[str]) -> None:
    """`pipemlx generate --ranks 2` with the demo's draft model or with prompt lookup: greedy tokens equal
    single-process mlx-lm's without speculation, and the report counts the confirmed guesses."""
    from pipemlx.demo import DRAFT_DIR

    argv = [str(DRAFT_DIR) if a == "DRAFT" else a for a in guesses]
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    command = ["generate", "--ranks", "2", "--prompt", prompt, "--max-tokens", "24", "--json", *argv]
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", *command], capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] == demo_reference_tokens(prompt, 512, 24)
    if "--draft-model" in guesses:  # the demo's draft guesses the demo model's tokens often
        assert report["confirmed_guesses"] > 0, report
    assert report["proposed_guesses"] >= report["confirmed_guesses"], report


def test_generate_with_a_missing_draft_model_says_so_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", "generate", "--ranks", "2", "--draft-model", "/no/such/draft"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines and all(line.startswith("pipemlx generate: error: cannot load the draft model") for line in lines)
    assert "Traceback" not in result.stderr


def test_generate_with_a_draft_model_and_prompt_lookup_says_so_in_one_line() -> None:
    from pipemlx.demo import DRAFT_DIR

    command = ["generate", "--ranks", "2", "--draft-model", str(DRAFT_DIR), "--prompt-lookup", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", *command], capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "pipemlx generate: error: --draft-model and --prompt-lookup both guess tokens: pass one of them, not both"
    ], result.stderr


def test_generate_with_a_hostfile_gives_single_device_tokens(tmp_path: Path) -> None:
    """Two processes started by hand with one ring hostfile, an uneven split, the cut inside rank 0's last layer
    (--lend 1: the feed-forward half and one of its 2 key-value heads) and greedy decoding. (--lend auto's
    count depends on the ranks' timings: tests/test_equivalence.py checks it with given layer costs.)"""
    parsed = cli.build_parser().parse_args(["generate", "--lend", "auto"])
    assert parsed.lend == "auto"
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    prompt = "It is a truth universally acknowledged, that a single man in possession"
    argv = [
        "generate",
        "--hostfile",
        str(hostfile),
        "--prompt",
        prompt,
        "--prefill-step-size",
        "4",
        "--max-tokens",
        "16",
        "--split",
        "6,2",
        "--temp",
        "0",
        "--json",
        "--lend",
        "1",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipemlx", *argv, "--rank", str(r)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs: list[tuple[str, str]] = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT))
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    assert outputs[1][0] == ""  # only rank 0 reports
    report: dict[str, Any] = json.loads(outputs[0][0])
    assert (
        report["ranks"] == 2 and report["split"] == [6, 2] and report["prefill_step_size"] == 4 and report["lend_mlp"]
    )
    assert report["lend_heads"] == 1
    assert [f["rank"] for f in report["per_rank"]] == [0, 1]
    assert [[f["layer_start"], f["layer_stop"]] for f in report["per_rank"]] == [[0, 6], [6, 8]]
    assert report["tokens"] == demo_reference_tokens(prompt, 4, 16)


@pytest.mark.slow  # the suite's time budget: run with -m slow
def test_bench_reports_both_sides_with_the_same_tokens(tmp_path: Path) -> None:
    """`pipemlx bench --json` (and `--png` where matplotlib is installed), with a head of rank 0's last layer on
    rank 1 (--lend 1, loaded by mlx-lm's loader) and the default auto step; no speed is asserted here."""
    try:
        import matplotlib  # noqa: F401  # pyright: ignore[reportMissingImports, reportUnusedImport]

        png: Path | None = tmp_path / "timeline.png"
    except ImportError:
        png = None
    argv = ["bench", "--prompt-tokens", "200", "--max-tokens", "8", "--json", "--lend", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "pipemlx", *argv, *(["--png", str(png)] if png else [])],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    assert report["ranks"] == 2 and report["prompt_tokens"] == 200
    assert report["prefill_step_size"] == "auto"
    for side in ("single", "pipeline"):
        figures = report[side]
        assert figures["prefill_s"] > 0 and figures["decode_tokens_per_s"] > 0
        assert len(figures["tokens"]) == 8
    # Both sides give single-process mlx-lm's greedy tokens for bench's prompt (seeded random ids), computed here.
    model, _ = load(str(MODEL_DIR))
    prompt = mx.random.randint(0, int(model.args.vocab_size), (200,), key=mx.random.key(0)).astype(mx.int32)
    expected = [int(t) for t, _ in generate_step(prompt, model, prefill_step_size=2048, max_tokens=8)]  # bench: auto
    assert len(set(expected)) > 1, expected
    assert report["single"]["tokens"] == expected and report["pipeline"]["tokens"] == expected
    assert report["same_tokens"] is True
    assert report["prefill_speedup"] > 0 and report["decode_ratio"] > 0
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_version_and_every_command_help_shows_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`pipemlx --version`; each command's --help shows the defaults of its options (one default per option
    everywhere: the prefill step auto, lend auto, 256 tokens, temperature 0, 120 s)."""
    import pipemlx

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"pipemlx {pipemlx.__version__}"
    for command in ("generate", "bench", "serve", "doctor"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: 120.0)" in text, command
        if command != "doctor":
            assert "(default: auto)" in text, command
        expected_tokens = {"generate": "(default: 100)", "serve": "(default: 512)", "bench": "(default: 256)"}
        assert command == "doctor" or expected_tokens[command] in text, command
    assert cli.main(["split", "--help"]) == 0
    assert "(default: auto)" in " ".join(capsys.readouterr().out.split())
