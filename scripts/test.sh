#!/usr/bin/env bash
# Set up .venv (see setup_env.sh) and run the test suite. Extra arguments go to pytest (both runs).
# The tests outside tests/integration are CPU-bound and share nothing across files: they run on every
# core (pytest-xdist, one file per worker). The integration tier shares one Ray session and its
# timeouts are wall-clock, so it runs after them, alone, in one process. A failure in either fails the
# suite; a run that selects no test (exit 5, e.g. `-k` naming tests of one side) is fine only while the
# other ran some, so the suite never passes with zero tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
set +e
.venv/bin/python -m pytest -q -n auto --dist loadfile tests --ignore=tests/integration "$@"
outside=$?
.venv/bin/python -m pytest -q tests/integration "$@"
integration=$?
for rc in $outside $integration; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$outside" -eq 5 ] && [ "$integration" -eq 5 ]; then exit 5; fi
exit 0
