#!/usr/bin/env bash
# The dashboard's end-to-end test in headless Chromium (tests/browser/).
# Needs Debian's chromium (installed here with apt-get when missing and we
# are root), node and npm (playwright-core from package-lock.json), and a
# built intray binary (INTRAY_BIN, default target/debug/intray). Saves the
# screenshots under target/screenshots/ (SCREENSHOTS=docs refreshes the
# README's), so a test run leaves the tree clean. Fails naming whatever is
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$CHROMIUM" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "browser-test: installing Debian's chromium package" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
  fi
fi
if [ ! -x "$CHROMIUM" ]; then
  echo "browser-test: missing $CHROMIUM (Debian package chromium: apt-get install chromium)" >&2
  exit 1
fi
for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "browser-test: missing $tool (Debian packages nodejs and npm)" >&2
    exit 1
  fi
done

target=${CARGO_TARGET_DIR:-target}
export INTRAY_BIN=${INTRAY_BIN:-$target/debug/intray}
if [ ! -x "$INTRAY_BIN" ]; then
  cargo build --bin intray
fi
INTRAY_BIN=$(realpath "$INTRAY_BIN")
export CHROMIUM
mkdir -p "${SCREENSHOTS:=$target/screenshots}"
SCREENSHOTS=$(realpath "$SCREENSHOTS")
export SCREENSHOTS

cd tests/browser
npm ci --no-audit --no-fund --loglevel=error
node dashboard.test.mjs
