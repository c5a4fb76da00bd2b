"""No input reaches the user as a traceback: `kvtier` on mutated configs and arbitrary
arguments exits 0, 1 or 2 (2 for bad input) with a one-line reason (issue 15, item 11).

In process (`kvtier.cli.main`) under Hypothesis, plus the reported cases as real
`python -m kvtier` processes. "internal error" is the last-resort message for an
exception kvtier did not expect: a fuzz case that reaches it has found a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cli import build_parser, main
from tests.helpers.paths import ROOT
from tiering.keys import make_key

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
NS = bytes(range(16))
EXAMPLES = [
    yaml.safe_load(p.read_text()) for p in sorted((ROOT / "configs").glob("*.yaml"))
]  # the shipped configs, as starting points of the mutations
ENV = {"REDIS_PASSWORD": "pw", "S3_ENDPOINT": "http://127.0.0.1:1", "KVTIER_DEMO_DIR": "/tmp/x"}
"""What the shipped configs' `${...}` name: without it every mutation of them would stop at
interpolation and the fuzzing would never reach the checks behind it."""


@pytest.fixture(autouse=True)
def _config_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def run_main(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """`main(argv)` with its exit code (argparse's SystemExit included) and output."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _stdin(stdin),
    ):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@contextlib.contextmanager
def _stdin(text: str) -> Iterator[None]:
    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def assert_clean(code: int, err: str, allowed: set[int]) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code:
        reason = [line for line in err.splitlines() if "error" in line or "nothing" in line]
        assert len(reason) == 1, err


# -- configs ---------------------------------------------------------------------------------------

weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**400, -1, 0, 1, 65536, 2**62, 2**62 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        ["lots", "5s", "-1s", "1e20", "1PiB", "9" * 400, "", "${UNSET_VAR}", "${REDIS_PASSWORD}"]
    ),
    st.sampled_from(["brotli", "weird", "maybe", "segments", "lz4", "crc32c", "0", "0B", "2d"]),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a parsed config (mappings and lists)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            found += _paths(inner, (*prefix, i))
    return found


@st.composite
def mutated_configs(draw: st.DrawFn) -> Any:
    config = json.loads(json.dumps(draw(st.sampled_from(EXAMPLES))))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(config)
        path = draw(st.sampled_from(paths))
        parent: Any = config
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not path:
            config = draw(weird) if action == "replace" else config
        elif action == "replace":
            parent[path[-1]] = draw(weird)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            name = draw(
                st.sampled_from(
                    ["codec", "layout", "concurrency", "direct", "ttl", "timeout", "address"]
                )
                | st.text(max_size=8)
            )
            parent[path[-1]][name] = draw(weird)
    return config


def _dump(config: Any) -> str:
    return yaml.safe_dump(config, allow_unicode=True)  # NaN as .nan, big ints in full


@FUZZ
@given(config=mutated_configs())
def test_validate_and_show_on_mutated_configs(config: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvtier.yaml"
        path.write_text(_dump(config))
        for command in ("validate", "show"):
            code, _, err = run_main([command, "--config", str(path)])
            assert_clean(code, err, {0, 2})


@FUZZ
@given(
    text=st.sampled_from([p.read_bytes() for p in sorted((ROOT / "configs").glob("*.yaml"))]),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=4)), max_size=4),
    cut=st.integers(0, 10_000),
)
def test_validate_on_damaged_yaml_text(
    text: bytes, edits: list[tuple[int, bytes]], cut: int
) -> None:
    for at, inserted in edits:
        at %= len(text) + 1
        text = text[:at] + inserted + text[at + 1 :]
    text = text[: max(cut, len(text) // 2)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvtier.yaml"
        path.write_bytes(text)
        code, _, err = run_main(["validate", "--config", str(path)])
        assert_clean(code, err, {0, 2})


# -- arguments ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A config of two file tiers (one holding three blocks) and a tiny trace."""
    import asyncio

    from tiering.testing import payload
    from tiers.file import BlockFileTier

    root = tmp_path_factory.mktemp("fuzz")
    config = root / "tiers.yaml"
    config.write_text(
        f"tiers:\n"
        f"  - {{name: a, type: file, path: '{root / 'a'}', min_free: 0}}\n"
        f"  - {{name: b, type: file, path: '{root / 'b'}', min_free: 0}}\n"
    )

    async def fill() -> None:
        async with BlockFileTier(namespace=NS, path=root / "a", min_free=0) as tier:
            await tier.put_many([(make_key(bytes([i]) * 32), payload(4096, i)) for i in range(3)])

    asyncio.run(fill())
    trace = root / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"input_length": 1024, "hash_ids": [i, i + 1]}) + "\n" for i in range(8))
    )
    return {"config": config, "trace": trace, "root": root}


SLOW = {"demo", "bench"}
"""Commands the fuzzer leaves out: each starts real work (a vLLM engine, a timed benchmark) on
any valid arguments; their argument handling is tested on its own (test_demo, test_bench)."""


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for name, sub in action.choices.items() if name not in SLOW}


COMMANDS = sorted(_subcommands())
"""Every command but the slow ones, from the parser: a new command is fuzzed as it lands."""
OPTIONS = sorted(
    {
        option
        for sub in _subcommands().values()
        for action in sub._actions
        for option in action.option_strings
        if option.startswith("--") and option not in ("--help", "--config")
    }
)
values = st.one_of(
    st.sampled_from(
        ["a", "b", "nowhere", NS.hex(), "0", "-1", "1", "3", "1e20", "100000000000000000000"]
    ),
    st.sampled_from(["7d", "soon", "nan", "inf", "1PiB", "lru", "arc,lfu", "", ",", "/", "-"]),
    st.sampled_from([make_key(bytes([1]) * 32).hex(), "zz", "0" * 64, "/dev/null", "a\nb"]),
    st.text(max_size=12),
)


@st.composite
def argvs(draw: st.DrawFn, workspace: dict[str, Path]) -> list[str]:
    command = draw(st.sampled_from(COMMANDS))
    argv = [command]
    if command in ("replay", "plan"):
        argv.append(str(workspace["trace"]))
    elif draw(st.integers(0, 9)):
        argv += ["--config", str(workspace["config"])]
    for _ in range(draw(st.integers(0, 5))):
        option = draw(st.sampled_from(OPTIONS))
        argv.append(option)
        if draw(st.integers(0, 3)):
            value = draw(values)
            if option == "--journal" and value not in ("/", "/dev/null", ""):
                value = str(workspace["root"] / "journals" / value.replace("/", "_"))
            argv.append(value)
    if command == "inspect" and draw(st.booleans()):
        argv.append(draw(values))
    return argv


@FUZZ
@given(data=st.data())
def test_arbitrary_arguments(data: st.DataObject, workspace: dict[str, Path]) -> None:
    argv = data.draw(argvs(workspace))
    code, _, err = run_main(argv)
    assert_clean(code, err, {0, 1, 2})


# -- the reported cases, as the user meets them ----------------------------------------------------


def _bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


SUBPROCESS_CASES: dict[str, tuple[bytes, list[str], str]] = {
    # name: (config file, arguments after the command's --config, message)
    "alias bomb": (_bomb().encode(), ["validate"], "expands to more than 100,000 values"),
    "nesting": (b"a: " + b"[" * 20_000 + b"]" * 20_000, ["validate"], "nested deeper than 64"),
    "not utf-8": (b"primary: {capacity: \xff}\n", ["validate"], "not UTF-8 text (byte 0xff"),
    "400 digits": (
        b"primary: {capacity: " + b"9" * 400 + b"}\n",
        ["validate"],
        "primary.capacity: too large",
    ),
    "nan timeout": (b"faults: {timeout: .nan}\n", ["validate"], "faults.timeout: expected a"),
    "codec": (
        b"tiers: [{name: a, type: memory, codec: brotli}]\n",
        ["validate"],
        "tiers[0].codec: expected one of raw, lz4, zstd, got 'brotli'",
    ),
    "bench sizes": (
        b"tiers: [{name: a, type: memory}]\n",
        ["bench", "--tier", "a", "--sizes", "1PiB"],
        "argument --sizes: '1PiB' is larger than a block may be",
    ),
    "journal /": (
        b"tiers: [{name: a, type: memory}, {name: b, type: memory}]\n",
        ["migrate", "--from", "a", "--to", "b", "--namespace", NS.hex(), "--journal", "/"],
        "journal /: is a directory",
    ),
}


@pytest.mark.parametrize("case", sorted(SUBPROCESS_CASES))
def test_reported_inputs_in_a_real_process(case: str, tmp_path: Path) -> None:
    text, argv, message = SUBPROCESS_CASES[case]
    config = tmp_path / "kvtier.yaml"
    config.write_bytes(text)
    command = [sys.executable, "-m", "kvtier", argv[0], "--config", str(config), *argv[1:]]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) <= 3  # argparse's usage line(s), then the reason


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "TRACE", "--capacity", "1e20"],
        ["replay", "TRACE", "--capacity", "100000000000000000000"],
        ["replay", "TRACE", "--capacity", "10", "--config", "CONFIG", "--block-bytes", "2GiB"],
        ["replay", "TRACE", "--capacity", "10", "--config", "CONFIG", "--engines", "300"],
        ["replay", "TRACE", "--capacity", "10", "--engines", "2", "--route", "sticky,random"],
        ["demo", "--conversations", "0"],
    ],
)
def test_reported_arguments_in_a_real_process(argv: list[str], workspace: dict[str, Path]) -> None:
    argv = [
        {"TRACE": str(workspace["trace"]), "CONFIG": str(workspace["config"])}.get(a, a)
        for a in argv
    ]
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"kvtier {argv[0]}: error: argument")


def test_purge_at_the_end_of_input_in_a_real_process(workspace: dict[str, Path]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "purge",
            "--config",
            str(workspace["config"]),
            "--tier",
            "b",
            "--namespace",
            NS.hex(),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.endswith("[y/N] \nkvtier purge: nothing deleted\n")
