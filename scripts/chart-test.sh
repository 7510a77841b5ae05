#!/usr/bin/env bash
# Chart tests with the real Helm engine, in a virtualenv made here from
# helm/requirements-test.txt (PyPI only; no helm binary needed).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${INTRAY_CHART_VENV:-.venv-chart}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q -r helm/requirements-test.txt
"$venv/bin/python" helm/test_chart.py
