"""Start and stop a real Prometheus (Debian's package, tests/install_prometheus.sh) for the tests.

`running_prometheus(...)` writes a scrape config for the given targets, starts its own
Prometheus on a free loopback port with a temporary storage folder, behind a path prefix and
basic auth (as teams often run it), waits until it is ready, yields a `PrometheusServer`, then
stops it. When Prometheus is not installed or does not start it raises `ServerUnavailable`.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import bcrypt
import httpx
import yaml
from vllm_server import ServerUnavailable

from rooflib.serving import profiles

STARTUP_TIMEOUT_S = 60


@dataclass
class PrometheusServer:
    url: str  # with the path prefix
    user: str
    password: str
    log_path: Path

    def get(self, path: str, **params: str) -> httpx.Response:
        return httpx.get(self.url + path, params=params, auth=(self.user, self.password), timeout=30)


@contextmanager
def running_prometheus(work_dir: Path, targets: Sequence[str], scrape_interval_s: int = 1,
                       prefix: str = "/prom", user: str = "fleet", password: str = "s3cret-fleet",
                       target_labels: Mapping[str, str] | None = None, more_jobs: Sequence[dict] = ()
                       ) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping `targets` (host:port of the replicas) as job "vllm", with
    `target_labels` on them (as Kubernetes service discovery adds pod and namespace), and
    `more_jobs` (scrape_configs entries, e.g. a DCGM exporter's)."""
    binary = shutil.which("prometheus")
    if not binary:
        raise ServerUnavailable("prometheus is not installed: run sh tests/install_prometheus.sh")
    port = profiles.free_port()
    # Prometheus takes no scrape_timeout above the interval: a page slower than that is a failed
    # scrape (up == 0), which the tests wait out (tests/server/test_fleet.py, scraped_since).
    config = {"global": {"scrape_interval": f"{scrape_interval_s}s", "scrape_timeout": f"{scrape_interval_s}s",
                         "evaluation_interval": f"{scrape_interval_s}s"},
              "scrape_configs": [{"job_name": "vllm", "static_configs": [
                  {"targets": list(targets), **({"labels": dict(target_labels)} if target_labels else {})}]},
                  *more_jobs]}
    (work_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    (work_dir / "web.yml").write_text(yaml.safe_dump({"basic_auth_users": {user: hashed}}))
    log_path = work_dir / "prometheus.log"
    base = f"http://127.0.0.1:{port}{prefix}"
    cmd = [binary, f"--config.file={work_dir / 'prometheus.yml'}", f"--storage.tsdb.path={work_dir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", f"--web.route-prefix={prefix}",
           f"--web.external-url={base}", f"--web.config.file={work_dir / 'web.yml'}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = PrometheusServer(base, user, password, log_path)
    try:
        _wait_ready(server, proc)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(server: PrometheusServer, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ServerUnavailable(f"prometheus exited with {proc.returncode}: {tail}")
        try:
            if server.get("/-/ready").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ServerUnavailable(f"prometheus not ready after {STARTUP_TIMEOUT_S} s (log: {server.log_path})")
