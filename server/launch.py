"""``serve --ranks N`` / ``--hostfile FILE``: one sharded server under ``mlx.launch``.

The command a user types becomes the *launcher*: it checks that the model can
be split that many ways, then runs ``mlx.launch --backend ring`` with the same
``serve`` command on every rank (loopback for ``--ranks``, the hostfile's
machines for ``--hostfile``). Inside the launch, rank 0 serves HTTP and the
others follow (``actors/ranks/``). SIGINT/SIGTERM to the launcher go to rank
0 alone, which drains, closes its followers' connections (they exit), and
exits; the launcher's exit status is 0 when every rank ended cleanly, 1 when
one was killed or exited with an error (``mlx.launch`` itself always exits 0).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("mlx_nursery.server")

# mlx.launch, as run by the launcher: see mlx_launch.
MLX_LAUNCH = "from mlx_nursery.server.launch import mlx_launch; mlx_launch()"
PIDFILE_ENV = "MLX_NURSERY_RANK0_PIDFILE"  # rank 0 writes its pid here for the launcher


def in_launch() -> bool:
    """Whether this process is one rank of an ``mlx.launch``."""
    return "MLX_RANK" in os.environ


def hostfile_hosts(hostfile: Path) -> list:
    """The host entries of an mlx.launch hostfile (``ssh_hostname``, ``ips``),
    read by mlx's own parser; a ValueError saying what is wrong with it."""
    from mlx._distributed_utils.common import Hostfile

    try:
        hosts = Hostfile.from_file(str(hostfile)).hosts
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{hostfile} is not an mlx.launch hostfile: {exc}") from None
    if not hosts:
        raise ValueError(f"{hostfile} names no hosts")
    return hosts


def hostfile_ranks(hostfile: Path) -> int:
    """How many ranks an mlx.launch hostfile names (one per host entry)."""
    return len(hostfile_hosts(hostfile))


def launch(argv: list[str], ranks: int, hostfile: Path | None) -> int:
    """Run ``serve argv`` on every rank under ``mlx.launch`` and wait for it."""
    pidfile = Path(tempfile.mkdtemp(prefix="mlx-nursery-")) / "rank0.pid"
    command = [sys.executable, "-c", MLX_LAUNCH, "--backend", "ring"]
    if hostfile is not None:
        command += ["--hostfile", str(hostfile)]
    else:
        command += ["--hosts", "127.0.0.1", "-n", str(ranks)]
    command += ["--env", f"{PIDFILE_ENV}={pidfile}"]
    command += ["--", sys.executable, "-m", "mlx_nursery.server.cli", *argv]
    log.info("launching %d ranks: %s", ranks, " ".join(command))
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    stopping = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        try:
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        except (OSError, ValueError):  # rank 0 not up yet: stop the launch itself
            proc.terminate()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while proc.poll() is None:
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    pidfile.parent.rmdir()
    return proc.returncode


def mlx_launch() -> None:
    """``mlx.launch`` (its own ``main``, arguments from ``sys.argv``), with its
    stdin forwarding turned off and its exit status made the ranks'.

    Its loops wait on each rank's stdin being writable, which a pipe always is,
    and on its own stdin being readable, which one at its end always is: the
    launch would spin a core for as long as it runs (half of a 2-core machine).
    No rank reads its stdin. And ``mlx.launch`` exits 0 whatever its ranks did,
    saying only in a warning that a rank was killed or exited with a code: those
    warnings are counted here, and any makes the launch exit 1, so ``serve
    --ranks`` reports a failed rank to whatever runs it."""
    import select

    from mlx._distributed_utils import launch as mlx

    def quiet_select(r, w, x, timeout=None):
        r = [fd for fd in r if fd != sys.stdin.fileno()]
        readable, _, exceptional = select.select(r, [], x, timeout)
        return readable, [], exceptional

    failed = False
    warn = mlx.log_warning

    def note_failed_rank(*words: object, **kwargs: object) -> None:
        nonlocal failed
        failed = failed or str(words[0] if words else "").startswith("Node with rank")
        warn(*words, **kwargs)

    mlx.select = quiet_select
    mlx.log_warning = note_failed_rank
    mlx.main()
    if failed:
        sys.exit(1)


def note_rank0_pid() -> None:
    path = os.environ.get(PIDFILE_ENV)
    if path:
        Path(path).write_text(str(os.getpid()))


def init_group(ranks: int):
    """This rank's ``mx.distributed`` group (ring backend, as launched)."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    if ranks and group.size() != ranks:
        raise SystemExit(f"mlx-nursery: launched {group.size()} ranks, but --ranks is {ranks}")
    return group
