"""`kvtier top`: metrics read from live endpoints, rates, and the live view in a real terminal
(tmux runs it; the test reads the screen)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.top import Endpoint, lines, parse, tier_rows
from tests.helpers.paths import ROOT
from tiering.manager.exported import series

START = time.monotonic()


def exposition() -> str:
    """What a running engine's /metrics shows of kvtier (two engines' labels on one tier, as
    vLLM's data-parallel ranks give): counters growing with time, gauges fixed."""
    t = time.monotonic() - START
    lines_ = [
        "# HELP vllm:kvtier_tier_found_total Lookups found.",
        "# TYPE vllm:kvtier_tier_found_total counter",
    ]
    for engine in ("0", "1"):
        labels = f'engine="{engine}",model_name="m",tier="nvme"'
        lines_ += [
            f"vllm:kvtier_tier_found_total{{{labels}}} {50 * t:.3f}",
            f"vllm:kvtier_tier_not_found_total{{{labels}}} {10 * t:.3f}",
            f"vllm:kvtier_tier_bytes_promoted_total{{{labels}}} {1e6 * t:.1f}",
            f"vllm:kvtier_tier_bytes_demoted_total{{{labels}}} {2e6 * t:.1f}",
        ]
    lines_ += [
        'vllm:kvtier_tier_usage_objects{engine="0",tier="nvme"} 1234',
        'vllm:kvtier_tier_usage_bytes{engine="0",tier="nvme"} 5e9',
        'vllm:kvtier_tier_capacity_bytes{engine="0",tier="nvme"} 1e10',
        'vllm:kvtier_tier_breaker_open{engine="0",tier="redis"} 1',
        'vllm:kvtier_tier_found_total{engine="0",tier="redis"} 0',
        'vllm:kvtier_primary_used_perc{engine="0"} 0.42',
        'vllm:kvtier_promotions_late_total{engine="0"} 7',
        'vllm:kvtier_warm_source{engine="0"} 1',
        'vllm:kvtier_warm_remaining{engine="0"} 0',
        'vllm:kvtier_blocks_warmed_total{engine="0"} 512',
        'vllm:num_requests_running{engine="0"} 3',
    ]
    return "\n".join(lines_) + "\n"


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = serve()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_name_top_reads_is_one_the_exporter_exports() -> None:
    """A renamed metric would leave top blank: hold its names to the exporter's list."""
    text = (ROOT / "kvtier" / "top.py").read_text()
    exported = series()
    used = {name for name in exported if name in text}
    for name in (
        "vllm:kvtier_tier_found_total",
        "vllm:kvtier_promotions_late_total",
        "vllm:kvtier_blocks_warmed_total",
    ):
        assert name in exported
    counters = ("found", "not_found", "bytes_promoted", "bytes_demoted")
    for counter in counters:
        assert f"vllm:kvtier_tier_{counter}_total" in exported
    assert used  # the literal names in top.py are exported ones
    for gauge in ("usage_objects", "usage_bytes", "capacity_bytes"):
        assert f"vllm:kvtier_tier_{gauge}" in exported


def test_parse_sums_engines_per_tier_and_keeps_only_kvtier() -> None:
    samples = parse(exposition())
    assert samples[("vllm:kvtier_tier_usage_objects", "nvme")] == 1234
    assert ("vllm:num_requests_running", "") not in samples
    found = samples[("vllm:kvtier_tier_found_total", "nvme")]
    assert found == pytest.approx(
        2 * float(exposition().split("found_total{")[1].split()[1]), rel=0.1
    )
    with pytest.raises(ValueError):
        parse("<html>not metrics</html>")


def test_rates_come_from_two_reads_and_a_restart_counts_from_zero(endpoint: str) -> None:
    e = Endpoint(endpoint)
    e.read(2.0)
    assert tier_rows(e)[0].hits is None  # one read: no rate yet
    time.sleep(0.5)
    e.read(2.0)
    nvme = next(r for r in tier_rows(e) if r.tier == "nvme")
    assert nvme.hits == pytest.approx(100, rel=0.3)  # two engines, 50/s each
    assert nvme.bytes_out == pytest.approx(4e6, rel=0.3)
    assert nvme.used == 5e9 and nvme.capacity == 1e10 and not nvme.breaker_open
    assert next(r for r in tier_rows(e) if r.tier == "redis").breaker_open
    e.before = e.now
    e.now.samples = {k: v / 100 for k, v in e.now.samples.items()}  # counters went back
    e.now.at = e.before.at + 1.0
    e.before.samples = {k: v * 100 for k, v in e.before.samples.items()}
    assert (e.rate("vllm:kvtier_tier_found_total", "nvme") or 0) >= 0


def test_once_prints_a_reading_and_json_gives_data(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", "--metrics", endpoint, "--once", "--interval", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "nvme" in out and "50%" in out and "OPEN" in out and "manifest" in out
    assert main(["top", "--metrics", endpoint, "--json", "--interval", "0.3"]) == 0
    (engine,) = json.loads(capsys.readouterr().out)
    nvme = next(t for t in engine["tiers"] if t["tier"] == "nvme")
    assert nvme["hits_per_s"] == pytest.approx(100, rel=0.3) and engine["down"] is None


def test_a_down_endpoint_is_said_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    assert main(["top", "--metrics", url, "--once", "--interval", "0.2"]) == 1
    out = capsys.readouterr().out
    assert "DOWN" in out and "Traceback" not in out


@pytest.mark.parametrize(
    "argv",
    [["--metrics", "localhost:8000"], ["--metrics", "http://x", "--interval", "0"]],
)
def test_bad_input_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err


def test_lines_fit_the_width(endpoint: str) -> None:
    e = Endpoint(endpoint)
    e.read(2.0)
    time.sleep(0.2)
    e.read(2.0)
    assert all(len(line) <= 80 for line in lines([e], 80, "12:00:00"))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="scripts/test.sh installs tmux")
def test_live_view_in_a_real_terminal(endpoint: str, tmp_path: Path) -> None:
    """tmux runs `kvtier top` in an 80x24 terminal against a live endpoint and one that is
    down; the screen shows both, the down one comes up when its server starts, q quits."""
    later = free_port()
    socket_name = f"kvtier-top-{tmp_path.name}"
    tmux = ["tmux", "-L", socket_name]
    command = (
        f"{sys.executable} -m kvtier top --interval 0.5 --metrics {endpoint} "
        f"http://127.0.0.1:{later}/metrics"
    )
    env_home = {"HOME": str(tmp_path), "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "80", "-y", "24", "-s", "top", command],
        check=True,
        env={**env_home, "PATH": "/usr/bin:/bin"},
    )
    server = None
    try:

        def screen() -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
            ).stdout

        def wait_for(*words: str) -> str:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                shown = screen()
                if all(w in shown for w in words):
                    return shown
                time.sleep(0.2)
            raise AssertionError(f"{words} never shown; the screen:\n{screen()}")

        shown = wait_for("kvtier top", "nvme", "hit/s", "DOWN")
        assert all(len(line) <= 80 for line in shown.splitlines())
        nvme = next(line for line in shown.splitlines() if line.strip().startswith("nvme"))
        assert "50%" in nvme and "closed" in nvme
        server = serve(later)
        deadline = time.monotonic() + 30
        while "DOWN" in screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "DOWN" not in screen()
        subprocess.run([*tmux, "send-keys", "-t", "top", "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run([*tmux, "has-session", "-t", "top"], capture_output=True)
            if alive.returncode != 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("q did not quit kvtier top")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        if server is not None:
            server.shutdown()
            server.server_close()


class _Trickle(BaseHTTPRequestHandler):
    """An endpoint that answers a byte at a time, for ever (a stalled engine, a slowloris)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_an_endpoint_that_trickles_is_down_not_waited_for(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each read of a socket ends within the timeout, but the answer never does: top bounds
    the whole answer, shows the endpoint down and the healthy one as usual."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    slow = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        began = time.monotonic()
        code = main(["top", "--metrics", endpoint, slow, "--once", "--interval", "0.5"])
        took = time.monotonic() - began
        out = capsys.readouterr().out
        assert code == 1 and took < 4, took
        assert f"{slow}  DOWN" in out and "nvme" in out
    finally:
        server.shutdown()
        server.server_close()
