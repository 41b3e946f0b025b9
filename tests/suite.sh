#!/usr/bin/env bash
# The whole suite in two lanes side by side (`make test` runs this; docs/goldens.md
# "The suite"). The tests are CPU-bound at about one core each; the lanes keep
# both cores busy to the end:
#
# - the in-process real-weights lane (`-m "real and not own_blas"`): the engine
#   against live mlx-lm in one pytest process, with OpenBLAS preloaded and held to
#   one thread (its threads would spin against the other lane's work);
# - the rest (`-m "not real or own_blas"`), on the bundled BLAS the goldens were
#   recorded with, spread over two pytest-xdist workers, niced so that the first
#   lane, one sequential run, keeps most of a core. Real-weights tests whose
#   comparisons run in processes of their own (marker `own_blas`) go here; their
#   servers' OpenBLAS is held to one thread too, but for test_exit's, which needs
#   the threads that once hung a server at exit.
#
# The first lane's output is kept in a file and shown after the other's. Extra
# arguments go to both pytest runs. The exit code is the worse of the two.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
# the library `serve` would preload (server/serve.py), or none
openblas=$($BIN/python -c "from mlx_nursery.server.blas import find_openblas as f; print(f() or '')")
mkdir -p test-artifacts
real_log=test-artifacts/real-lane.log

env LD_PRELOAD="$openblas" OPENBLAS_NUM_THREADS=1 \
  $BIN/python -m pytest -m "real and not own_blas" -p no:xdist "$@" >"$real_log" 2>&1 &
real=$!
trap 'kill $real 2>/dev/null' EXIT

env -u LD_PRELOAD OPENBLAS_NUM_THREADS=1 nice -n 5 \
  $BIN/python -m pytest -m "not real or own_blas" -n 2 --dist worksteal "$@"
rest=$?

wait $real
real_rc=$?
trap - EXIT
echo
echo "============ the in-process real-weights lane (OpenBLAS, one thread) ============"
cat "$real_log"
[ $real_rc -eq 5 ] && real_rc=0  # nothing collected (no real weights cached): not a failure
echo "lanes: in-process real weights exit $real_rc, the rest exit $rest"
[ $real_rc -eq 0 ] && [ $rest -eq 0 ]
