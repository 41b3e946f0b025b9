"""Replicas (``serve --replicas N``): several copies of one model behind an
existing prefix-aware router, on the one address users know. See
``docs/scale-out.md``, "Replicas".

Three kinds of process, all on loopback but the front (and remote replicas):

- **Replicas**: each a whole ``mlx-nursery serve`` of the model (its own
  engine, prompt cache and disk tier), started from the front's own flags on a
  fixed loopback port with the set's key (the front's ``--api-key``, else one
  the set makes), with ``--replica``. A replica that dies is started again on
  its port (``RESTART_BACKOFF``); one given by ``--replica-url`` runs elsewhere
  and is only watched.
- **The router**: SGLang's Model Gateway (``smg``, pinned in the project's
  dependencies), a Rust binary. By default (``sticky``) it pins each
  conversation to one replica by the key the front gives every request
  (``front.routing_key``: the session its client names, else a hash of how
  the conversation opens), and places a new conversation on the replica with
  the fewest requests in flight (its ``manual`` policy). It probes the
  replicas' ``/health`` every second and routes around one that fails.
- **The front** (``front.py``): our own server on the user's address: the
  host check, CORS and API key of a single server, a model name resolved as a
  single server resolves it, each generation request passed to the router and
  its answer streamed back, and ``/health``, ``/v1/models``, ``/stats``,
  ``/metrics`` and the dashboard over every replica.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from mlx_nursery.actors.disk_cache import KV_DIR_ENV, kv_root

from . import clients, launch
from .settings import API_KEY_ENV

log = logging.getLogger("mlx_nursery.server")

# How the router places requests (--router-policy). ``sticky`` (the default) is
# smg's ``manual`` policy over the key the front sets on every request
# (ROUTING_KEY): a conversation stays on the replica it was first placed on, a
# new one goes to the replica with the fewest requests in flight. smg 1.13's
# --routing-key-override does not pin anything under ``cache_aware`` on the
# HTTP route the front uses (measured: one key's requests, sent one at a time,
# land on both replicas), so cache_aware and the rest place by prefix or load
# alone; the last two are baselines that ignore prompts and conversations.
ROUTER_POLICY = "sticky"
POLICIES = ("sticky", "cache_aware", "power_of_two", "least_load", "round_robin", "random")
ROUTING_KEY = "x-smg-routing-key"  # the header smg's manual policy pins by
# cache_aware's spill gate: a worker the prefix chose is passed over for the least
# loaded one when it has SPILL_ABS more requests in flight than the least loaded
# and SPILL_REL times it (smg's defaults, 64 and 1.5, are sized for GPU fleets).
SPILL_ABS, SPILL_REL = 2, 1.25
# Headers a conversation is named by: ours, Claude Code's, Codex's (in that order).
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id")
HEALTH_EVERY = 0.5  # seconds between looks at each replica's /health
RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0)  # seconds before a dead replica's nth restart
ROUTER_ENDS, ROUTER_WINDOW = 3, 60.0  # a router that ends this often ends the set
SSH_ENV = "MLX_NURSERY_SSH"  # the ssh command for --replica-hostfile (default: ssh)
# The router runs under this guard: smg does not watch its parent, so a front
# that was killed (SIGKILL: no stop) would leave it running. The guard ends it
# when its own standard input closes (the front is gone) or on SIGTERM, and exits
# with the router's code (128 + N for signal N).
GUARD = """import os, signal, subprocess, sys, threading
router = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: router.terminate())
def watch():
    while os.read(0, 4096):
        pass
    router.terminate()
threading.Thread(target=watch, daemon=True).start()
code = router.wait()
os._exit(128 - code if code < 0 else code)
"""
STOP_GRACE = 30.0  # seconds a replica or the router gets to drain after SIGTERM
READY_TIMEOUT = 600.0  # seconds the set waits for its first replica and the router
# serve's flags the set sets for each replica itself (flag -> takes a value).
OWN_FLAGS = {
    "--replicas": True, "--replica-url": True, "--port": True, "--host": True,
    "--api-key": True, "--no-api-key": False, "--allowed-origins": True,
    "--allowed-hosts": True, "--protect-stats": False, "--prompt-cache-dir": True,
    "--memory-budget": True, "--replica": False, "--router-policy": True,
    "--replica-hostfile": True,
}  # fmt: skip


class RouterMissing(Exception):
    """The router's package is not installed (the message says what to run)."""


def router_command() -> list[str]:
    """How to run the router: smg's own entry point, in this Python."""
    try:
        import smg  # noqa: F401 (only its presence is checked)
    except ImportError:
        raise RouterMissing(
            "--replicas needs SGLang's Model Gateway (the smg package), which the project's "
            "install step installs: run `make install` (or pip install 'smg==1.13.0')"
        ) from None
    return [sys.executable, "-m", "smg"]


def router_policy(policy: str) -> list[str]:
    """smg's flags for one of POLICIES."""
    if policy == "sticky":  # pinned by ROUTING_KEY; a new key to the least loaded
        return ["--policy", "manual", "--assignment-mode", "min_load"]
    return ["--policy", policy, "--balance-abs-threshold", str(SPILL_ABS),
            "--balance-rel-threshold", str(SPILL_REL)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.define(eq=False)
class Replica:
    """One copy of the model: where it answers, and how it fares."""

    index: int
    url: str
    argv: list[str] | None = None  # None: it runs elsewhere (--replica-url), watched only
    env: dict[str, str] = attrs.field(factory=dict)
    host: str | None = None  # --replica-hostfile: the ssh host it is started on
    process: trio.Process | None = None
    status: str = "starting"  # starting, serving, down, stopped
    restarts: int = 0
    deaths: int = 0  # exits nobody asked for
    stats: dict[str, Any] = attrs.field(factory=dict)  # its /stats, as last read
    serving: trio.Event = attrs.field(factory=trio.Event)  # first served

    @property
    def local(self) -> bool:
        return self.argv is not None

    def figures(self) -> dict[str, Any]:
        pid = self.process.pid if self.process is not None else None
        return {"index": self.index, "url": self.url, "status": self.status, "pid": pid,
                "local": self.local, "host": self.host, "restarts": self.restarts}  # fmt: skip

    def command(self) -> list[str]:
        """How the set starts it: ``serve`` in this Python, here or (``host``)
        over ssh with its key in the environment, in the same Python's path
        there (as ``mlx.launch`` starts ranks)."""
        assert self.argv is not None
        serve = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", *self.argv]
        if self.host is None:
            return serve
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        ssh = shlex.split(os.environ.get(SSH_ENV) or "ssh")
        return [*ssh, "-o", "BatchMode=yes", self.host, "env", *env,
                *(shlex.quote(a) for a in serve)]  # fmt: skip


@attrs.define(eq=False)
class ReplicaSet:
    """The replicas and the router in front of them, started, watched and
    stopped together (:meth:`run`)."""

    replicas: list[Replica]
    key: str  # the replicas' and the router's own
    router_port: int
    metrics_port: int
    policy: str = ROUTER_POLICY
    router: trio.Process | None = None
    router_restarts: int = 0
    client: httpx.AsyncClient = attrs.field(init=False)
    stopping: bool = False
    _nursery: trio.Nursery | None = None

    def __attrs_post_init__(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0),
            headers={"Authorization": f"Bearer {self.key}"},
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )  # fmt: skip

    @classmethod
    def of(cls, argv: Sequence[str], count: int, urls: Sequence[str], *, cache_dir: str | None,
           memory_budget: Any, policy: str = ROUTER_POLICY, key: str | None = None,
           hosts: Sequence[tuple[str, str, int]] = ()) -> ReplicaSet:  # fmt: skip
        """``count`` local replicas of ``serve`` with the front's flags (``argv``,
        less the set's own), each with its own port, disk tier and a share of the
        memory budget; the replicas at ``urls`` (running elsewhere, started
        with ``--replica`` and ``key``: the front's own API key, where it has one;
        else the set makes one); and one on each of ``hosts`` ((ssh host, address,
        port), from ``--replica-hostfile``), which the set starts over ssh."""
        flags = serve_flags(argv)
        key = key or secrets.token_urlsafe(24)
        share = replica_budget(memory_budget, count)
        replicas = []
        for i in range(count):
            port = free_port()
            own = [
                *flags,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--protect-stats",
                "--replica",
            ]
            env = {API_KEY_ENV: key}
            if cache_dir:  # the tier the flag names, a folder a replica
                own += ["--prompt-cache-dir", str(Path(cache_dir) / f"replica-{i}")]
            else:  # the default tier's root, a folder a replica
                env[KV_DIR_ENV] = str(kv_root() / f"replica-{i}")
            if share is not None:
                own += ["--memory-budget", share]
            replicas.append(Replica(i, f"http://127.0.0.1:{port}", own, env))
        for url in urls:
            replicas.append(Replica(len(replicas), url.rstrip("/")))
        for ssh, address, port in hosts:  # one replica a host, started over ssh
            own = [*flags, "--host", "0.0.0.0", "--port", str(port), "--protect-stats",
                   "--replica"]  # fmt: skip
            replicas.append(Replica(len(replicas), f"http://{address}:{port}", own,
                                    {API_KEY_ENV: key}, host=ssh))  # fmt: skip
        return cls(replicas, key, free_port(), free_port(), policy)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.status == "serving"]

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start every replica, then the router once they serve; report started
        when the router answers; then watch them all until :meth:`stop` (or
        cancelled: then stop them). A replica that dies before it ever served,
        or the router's end, ends the set with the reason."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for replica in self.replicas:
                    if replica.local:
                        nursery.start_soon(self._keep, replica)
                    nursery.start_soon(self._watch, replica)
                with trio.fail_after(READY_TIMEOUT):
                    await self._all_serving()
                    await self._start_router(nursery)
                task_status.started()
        except BaseExceptionGroup as group:  # one reason, not trio's wrapping
            leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
            if leaves:
                raise leaves[0] from group
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self.stop()
                await self.client.aclose()

    async def _all_serving(self) -> None:
        """Until every local replica serves (and one at least, where all are remote)."""
        local = [r for r in self.replicas if r.local]
        for replica in local:
            await replica.serving.wait()
        if not local:
            async with trio.open_nursery() as waiters:
                for replica in self.replicas:

                    async def wait(r: Replica = replica) -> None:
                        await r.serving.wait()
                        waiters.cancel_scope.cancel()

                    waiters.start_soon(wait)

    async def _keep(self, replica: Replica) -> None:
        """Run a replica the set starts (here, or over ssh); start it again
        whenever it dies. Its standard input is a pipe from this process: when
        it closes (the set stops, or this process is gone), the replica drains
        and exits (``serve --replica``), over ssh too."""
        command = replica.command()
        while not self.stopping:
            replica.status = "starting"
            replica.process = await trio.lowlevel.open_process(
                command, env={**os.environ, **replica.env}, start_new_session=True,
                stdin=subprocess.PIPE,
            )  # fmt: skip
            code = await replica.process.wait()
            if self.stopping:
                break
            if not replica.serving.is_set():  # it never served: its flags or model are bad
                raise RuntimeError(f"replica {replica.index} ended with code {code} before it "
                                   "served (its log above says why)")  # fmt: skip
            replica.status, replica.deaths = "down", replica.deaths + 1
            wait = RESTART_BACKOFF[min(replica.deaths - 1, len(RESTART_BACKOFF) - 1)]
            log.warning("replica %d (pid %d) ended with code %s: starting it again in %.0f s",
                        replica.index, replica.process.pid, code, wait)  # fmt: skip
            await trio.sleep(wait)
            replica.restarts += 1

    async def _watch(self, replica: Replica) -> None:
        """Keep ``replica.status`` and its figures current from its /health and /stats."""
        while True:
            try:
                r = await self.client.get(f"{replica.url}/health", timeout=5.0)
                up = r.status_code == 200
            except httpx.HTTPError:
                up = False
            alive = replica.process is None or replica.process.returncode is None
            if up and alive:
                if replica.status != "serving":
                    log.info("replica %d serving at %s", replica.index, replica.url)
                replica.status = "serving"
                replica.serving.set()
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    r = await self.client.get(f"{replica.url}/stats", timeout=5.0)
                    if r.status_code == 200:
                        replica.stats = r.json()
            elif replica.status == "serving":
                replica.status = "down" if replica.local else "unreachable"
                log.warning("replica %d at %s stopped answering", replica.index, replica.url)
            await trio.sleep(HEALTH_EVERY)

    async def _start_router(self, nursery: trio.Nursery) -> None:
        await self._launch_router()
        nursery.start_soon(self._keep_router)

    async def _launch_router(self) -> None:
        """The router, on its port, until it has registered the replicas it can reach."""
        command = [
            *router_command(), "launch", "--host", "127.0.0.1", "--port", str(self.router_port),
            "--worker-urls", *(r.url for r in self.replicas),
            *router_policy(self.policy),
            # what it sends the replicas; one argument with its flag (a random key may
            # begin with "-", which smg's parser took for a flag: code 2)
            f"--api-key={self.key}",
            "--control-plane-api-keys", f"front:mlx-nursery:admin:{self.key}",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
            # a replica that refuses a connection is left out at once (retries go elsewhere)
            "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
            "--shutdown-grace-period-secs", "5", "--log-level", "error",
        ]  # fmt: skip
        self.router = await trio.lowlevel.open_process(
            [sys.executable, "-c", GUARD, *command], start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        while True:  # until it has registered the replicas it can reach
            try:
                r = await self.client.get(f"{self.router_url}/workers", timeout=2.0)
                if r.status_code == 200 and r.json().get("total", 0) >= len(self.healthy()):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.router.returncode is not None:
                raise RuntimeError(f"the router (smg) ended with code {self.router.returncode} "
                                   "before it served")  # fmt: skip
            await trio.sleep(0.2)

    async def _keep_router(self) -> None:
        """The router, started again on its port when it ends under the set (the
        replicas keep what they run; its map of conversations goes with it, so
        each is placed afresh); one that ends ROUTER_ENDS times within
        ROUTER_WINDOW seconds ends the set with its code."""
        assert self.router is not None
        ends: list[float] = []
        while True:
            code = await self.router.wait()
            if self.stopping:
                return
            now = trio.current_time()
            ends = [t for t in ends if now - t < ROUTER_WINDOW] + [now]
            if len(ends) >= ROUTER_ENDS:
                raise RuntimeError(f"the router (smg) ended with code {code}, "
                                   f"{len(ends)} times in {ROUTER_WINDOW:.0f} s")  # fmt: skip
            log.error("the router (smg) ended with code %s; starting it again", code)
            self.router_restarts += 1
            await self._launch_router()

    async def router_workers(self) -> list[dict[str, Any]]:
        """The router's own view of its workers (health, load), for /stats."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await self.client.get(f"{self.router_url}/workers", timeout=2.0)
            if r.status_code == 200:
                return [{k: w.get(k) for k in ("url", "is_healthy", "status", "load")}
                        for w in r.json().get("workers", [])]  # fmt: skip
        return []

    async def stop(self) -> None:
        """SIGTERM to the router and every local replica (they drain), then wait;
        one that outlives ``STOP_GRACE`` is killed. Then the watchers end."""
        self.stopping = True
        processes = [p for p in [self.router, *(r.process for r in self.replicas)] if p]
        for replica in self.replicas:  # a closed stdin is a replica's word to drain
            if replica.process is not None and replica.process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await replica.process.stdin.aclose()
        for process in processes:
            if process.returncode is None and process not in self._ssh():
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE):
            for process in processes:
                await process.wait()
        for process in processes:
            if process.returncode is None:
                log.warning("process %d did not end on SIGTERM: killed", process.pid)
                process.kill()
                await process.wait()
        for replica in self.replicas:
            replica.status = "stopped"
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


    def _ssh(self) -> list[trio.Process]:
        """The ssh processes of replicas on other hosts: ended by their stdin."""
        return [r.process for r in self.replicas if r.host is not None and r.process]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


def serve_flags(argv: Sequence[str]) -> list[str]:
    """``serve``'s flags as given, less those the set gives each replica itself."""
    return [a for a in clients.serve_flags(argv, OWN_FLAGS) if a != "serve"]


def hostfile_hosts(hostfile: Path | None, port: int) -> list[tuple[str, str, int]]:
    """(ssh host, address, port) for each host of an mlx.launch hostfile: its
    first IP (else its ssh name), at ``port`` + 1 + its index."""
    if hostfile is None:
        return []
    return [(h.ssh_hostname, (h.ips or [h.ssh_hostname])[0], port + 1 + i)
            for i, h in enumerate(launch.hostfile_hosts(hostfile))]  # fmt: skip


def replica_budget(budget: Any, count: int) -> str | None:
    """Each local replica's memory budget: an even share of the front's (``auto``:
    of this machine's memory less 20%); None where there is no bound."""
    if budget is None or count == 0:
        return None
    if budget == "auto":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = int(total * 0.8)
    return str(int(budget) // count)
