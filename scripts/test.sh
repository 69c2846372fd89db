#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, the long end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist), one per core of the 2-core machines CI runs on, a test file each at a time, in
# the order tests/conftest.py gives (longest first; xdist would otherwise hand out the files with most tests first)
# (so a file's module fixtures, e.g. the shared runs of test_e2e.py, are made once); LIT_ESS_TEST_WORKERS=0
# runs everything in this process (or pass -n 0).
exec .venv/bin/python -m pytest -n "${LIT_ESS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
