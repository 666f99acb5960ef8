#!/usr/bin/env bash
# Set up a virtual environment and run the whole CPU test suite.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# The HTML report tests open the report in headless Chromium (Debian package `chromium`).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
python3 -m venv "$VENV"
# torch is pinned so that a CPU-only machine gets the CPU build, not a multi-GB CUDA one.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
exec "$VENV/bin/python" -m pytest "$@"
