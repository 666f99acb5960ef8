#!/usr/bin/env bash
# Set up a virtual environment and run the CPU test suite (how long: SUITE_TIME below).
# Usage: bash scripts/test.sh [--no-browser] [pytest args]
#   --no-browser  install no system package: the report's headless-Chromium tests are then
#                 skipped with a reason when Chromium is missing (CI=true keeps them: they fail)
# Run as root on Debian/Ubuntu without Chromium, the script installs the `chromium` package
# with apt-get (about 300 MB), after saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

# The suite's time, the one statement of it: README.md's Tests section quotes it (tests/test_readme.py
# checks that they agree). Longer under load, shorter with more cores.
SUITE_TIME="about 18 minutes on an idle 2-core machine"

VENV=${VENV:-.venv}
browser=1
if [ "${1:-}" = "--no-browser" ]; then
    browser=0
    shift
fi
if [ "$browser" = 1 ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing the Debian package chromium with apt-get (the report tests open pages in" \
         "headless Chromium); skip it with: bash scripts/test.sh --no-browser" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
echo "test.sh: the CPU suite takes $SUITE_TIME" >&2
python3 -m venv "$VENV"
# torch is pinned so that a CPU-only machine gets the CPU build, not a multi-GB CUDA one.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
exec "$VENV/bin/python" -m pytest "$@"
