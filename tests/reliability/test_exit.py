"""The server always exits: SIGTERM right after a long request, many times.

Run as users run it: ``mlx-nursery serve`` re-executes itself with OpenBLAS
preloaded (where installed), the BLAS whose exit handler once hung the process
after "draining in-flight requests". After the drain the server ends with
``os._exit`` once its logs and the disk tier are flushed, and says so.

The golden llama's matmuls are too small to wake OpenBLAS's threads: 40 runs of
the first test never hung the server as it was before, so it checks the exit
path itself, a few times. SmolLM2 after a 950-token prompt did hang, 2 times in
10 (every thread on a futex); the real-weights set runs that case. What wakes
the threads is the prompt's prefill: a few answer tokens are enough.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import trio
from conftest import SERVER_TIMEOUT, free_port, model_path, wait_healthy

pytestmark = pytest.mark.slow

RUNS = 6
REAL_RUNS = 6  # SmolLM2: some 8 s each
ANSWER_TOKENS = 16
EXIT_WITHIN = 10.0  # seconds from SIGTERM to the process gone
LONG_PROMPT = "The harbour keeps forty lanterns and a map of the coast. " * 36  # ~2k tokens


async def serve_answer_and_terminate(
    log_path, model: list[str], prompt: str
) -> tuple[float, int, str]:
    port = free_port()
    # As users run it: OpenBLAS with its threads (tests/suite.sh holds it to one).
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "MLX_NURSERY_OPENBLAS", "OPENBLAS_NUM_THREADS")}  # fmt: skip
    argv = [sys.executable, "-m", "mlx_nursery.server.entry", "serve", "--port", str(port),
            *model, "--log-level", "INFO"]  # fmt: skip
    with open(log_path, "wb") as log:  # noqa: ASYNC230 (a child process writes it)
        proc = subprocess.Popen(argv, env=env, stderr=log)  # noqa: ASYNC220
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                with trio.fail_after(SERVER_TIMEOUT):
                    await wait_healthy(c, proc, lambda: log_path.read_text()[-2000:])
                body = {"prompt": prompt, "max_tokens": ANSWER_TOKENS}
                response = await c.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            try:
                code = await trio.to_thread.run_sync(proc.wait, EXIT_WITHIN)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return took, code, log_path.read_text()


async def terminate_many(tmp_path, runs: int, model: list[str], prompt: str) -> None:
    for run in range(runs):
        log_path = tmp_path / f"server-{run}.log"
        took, code, log = await serve_answer_and_terminate(log_path, model, prompt)
        assert code == 0, f"run {run}: still running {took:.1f} s after SIGTERM\n{log[-3000:]}"
        assert took < EXIT_WITHIN
        assert "got SIGTERM" in log
        assert "exiting (shut down), code 0" in log, log[-3000:]
        if run == 0:
            assert "OpenBLAS" in log or "bundled reference BLAS" in log  # run as users run it


async def test_sigterm_right_after_a_long_request_always_exits(tmp_path):
    await terminate_many(tmp_path, RUNS, ["--model", str(model_path("llama"))], LONG_PROMPT)


@pytest.mark.real
@pytest.mark.own_blas
async def test_smollm2_exits_after_a_long_request_where_openblas_once_hung_it(tmp_path):
    from mlx_nursery.actors.models import registry

    if not registry.DEFAULT.file.is_file():
        pytest.skip(f"{registry.DEFAULT.id} is not in the cache (`mlx-nursery models --fetch`)")
    prompt = " ".join(f"Line {i}: the harbour keeps lanterns and a map of the coast."
                      for i in range(60))  # fmt: skip
    await terminate_many(tmp_path, REAL_RUNS, [], prompt)  # the default model
