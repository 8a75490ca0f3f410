#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test || exit 1
. .venv/bin/activate
python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
