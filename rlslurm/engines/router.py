"""The real sglang-router (0.3.2, a Rust gateway) as a child process, and its worker REST API.

Measured behaviour this module is built around (docs/sglang-behaviour.md, "Router"):
- it binds `--host`, which must be an IP literal reachable by the rollout driver;
- its `/health` is 200 before any worker is usable: readiness of workers is polled on
  `GET /workers` (`is_healthy`);
- `POST /workers {"url", "api_key"}` and `DELETE /workers/{id}` are asynchronous (202);
  without `"api_key"` in the body the router calls a keyed worker unauthenticated;
- with `--api-key K` the router rejects its own clients without `Bearer K`;
- Prometheus binds 0.0.0.0:29000 unless told otherwise: here 127.0.0.1 and a free port;
- a dead worker is marked unhealthy only after the health-check interval (default 60 s);
  retries (on by default) re-send its in-flight requests to another worker meanwhile.
The api key reaches the router through the environment, not argv, and is masked in its log
(see engines/engine.py).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlslurm.buffer.atomic import open_log
from rlslurm.engines.engine import ENV_API_KEY, ROUTER_MODULE, wait_group_gone
from rlslurm.engines.log_scrub import rotate_env
from rlslurm.engines.sglang_client import TRUST_ENV, auth_headers
from rlslurm.errors import ConfigError
from rlslurm.net import check_ip_literal, free_port

OWNED_FLAGS = ("--host", "--port", "--api-key", "--prometheus-host", "--prometheus-port", "--worker-urls",
               "--health-check-interval-secs")
HTTP_TIMEOUT_S = 10.0
# The router (Rust reqwest) would send its calls to the engines through these.
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def check_owned(args: list[str] | tuple[str, ...]) -> None:
    """--router-<flag> passthrough must not set what rlslurm sets on the router itself."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise ConfigError(f"--router-{flag[2:]}: rlslurm sets {flag} on the router itself; "
                              f"remove it from the passthrough flags")


@functools.lru_cache(maxsize=1)
def router_cli_flags() -> frozenset[str]:
    """Every `--flag` of the installed sglang-router's launcher (its own parser)."""
    import argparse

    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser)
    return frozenset(o for o in parser._option_string_actions if o.startswith("--"))


class RouterError(RuntimeError):
    """The router did not start, or a worker REST call failed; names the URL and status."""


@dataclass
class RouterProcess:
    host: str
    port: int
    log_path: Path
    api_key: str | None = None
    policy: str = "round_robin"
    health_check_interval_s: int = 10
    extra_args: tuple[str, ...] = ()          # --router-* passthrough, prefix stripped
    prometheus_port: int | None = None        # None: a free port on 127.0.0.1
    proc: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.host = check_ip_literal(self.host, where="router host")
        self.log_path = Path(self.log_path)
        self.extra_args = tuple(self.extra_args)
        if self.health_check_interval_s < 1:
            raise ConfigError(f"router health-check interval must be >= 1 s, got {self.health_check_interval_s}")
        check_owned(self.extra_args)
        self._http = httpx.Client(timeout=HTTP_TIMEOUT_S, headers=auth_headers(self.api_key), trust_env=TRUST_ENV)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        if self.prometheus_port is None:
            self.prometheus_port = free_port("127.0.0.1")
        return [sys.executable, "-m", "rlslurm.engines.engine", ROUTER_MODULE,
                "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                "--health-check-interval-secs", str(self.health_check_interval_s),
                # a worker added before it is healthy is otherwise re-checked only every 30 s
                "--worker-startup-check-interval", "1",
                # INFO logs two lines per proxied request; --router-log-level info brings them back
                "--log-level", "warn",
                *self.extra_args]

    # --- process --------------------------------------------------------------------------
    def start(self, *, timeout: float = 60.0) -> None:
        """Start the router and wait until it answers an authenticated `GET /workers`."""
        self.spawn()
        self.wait_ready(timeout=timeout)

    def spawn(self) -> None:
        """Start the router process and return at once (its start-up overlaps the engines')."""
        if self.is_alive():
            raise RouterError(f"router {self.url}: already running (pid {self.proc.pid})")
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
        env.pop(ENV_API_KEY, None)
        if self.api_key:
            env[ENV_API_KEY] = self.api_key
        env.update(rotate_env(self.log_path))  # the log filter bounds the log (engines/log_scrub.py)
        argv = self.argv()
        with open_log(self.log_path) as log:
            log.write(f"\n==== rlslurm: router start at {time.ctime()}: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, *, timeout: float = 60.0) -> None:
        """Wait until the spawned router answers an authenticated `GET /workers`; kill it on timeout."""
        if self.proc is None:
            raise RouterError(f"router {self.url}: wait_ready before spawn")
        deadline = time.monotonic() + timeout
        while True:
            if not self.is_alive():
                wait_group_gone(self.proc.pid)  # the log filter writes the router's last words
                raise RouterError(f"router {self.url} exited with code {self.proc.returncode} at start; "
                                  f"log {self.log_path}:\n{_tail(self.log_path)}")
            try:
                if self._http.get(f"{self.url}/workers", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RouterError(f"router {self.url} not ready after {timeout:g} s; log {self.log_path}:\n"
                                  f"{_tail(self.log_path)}")
            time.sleep(0.2)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, *, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=timeout)

    def close(self) -> None:
        self.kill()
        self._http.close()

    # --- workers --------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        url = self.url + path
        try:
            r = self._http.request(method, url, **kw)
        except httpx.HTTPError as e:
            raise RouterError(f"{method} {url}: no response: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise RouterError(f"{method} {url}: HTTP {r.status_code}: {r.text[:300]}")
        return r

    def add_worker(self, url: str, api_key: str | None) -> str:
        """Queue `url` for registration (with the key the router must use towards it); returns its id."""
        body: dict[str, Any] = {"url": url}
        if api_key:
            body["api_key"] = api_key
        return str(self._call("POST", "/workers", json=body).json()["worker_id"])

    def remove_worker(self, worker_id: str) -> None:
        self._call("DELETE", f"/workers/{worker_id}")

    def workers(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/workers").json().get("workers", []))

    def worker_ids(self, url: str) -> list[str]:
        return [w["id"] for w in self.workers() if w.get("url") == url]

    def wait_workers_healthy(self, urls: list[str], timeout: float, *, poll_s: float = 0.2) -> dict[str, str]:
        """Block until every url in `urls` is registered and healthy; returns url -> worker id."""
        deadline = time.monotonic() + timeout
        while True:
            healthy = {w["url"]: w["id"] for w in self.workers() if w.get("is_healthy")}
            if all(u in healthy for u in urls):
                return {u: healthy[u] for u in urls}
            if time.monotonic() > deadline:
                missing = [u for u in urls if u not in healthy]
                raise RouterError(f"router {self.url}: workers not healthy after {timeout:g} s: {missing}")
            time.sleep(poll_s)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
