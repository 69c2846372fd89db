#!/usr/bin/env bash
# Install (if needed) and run the whole test suite, the long end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist), one per core of the 2-core machines CI runs on; LIT_ESS_TEST_WORKERS=0
# runs everything in this process (or pass -n 0).
exec .venv/bin/python -m pytest -n "${LIT_ESS_TEST_WORKERS:-2}" "$@"
