#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, the long end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist), one per core of the 2-core machines CI runs on. Each takes a whole test file
# at a time (a file's module fixtures, e.g. the shared run of test_e2e.py, are made once), in the order
# tests/conftest.py gives, longest first (xdist would hand out the files with the most tests first, and
# the one-test demo file would run alone at the end). LIT_ESS_TEST_WORKERS=0 runs everything in this
# process.
exec .venv/bin/python -m pytest -n "${LIT_ESS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
