#!/usr/bin/env bash
# The browser for the UI test (batch_pipeline_tests/system/test_ui_walkthrough.py): Debian's Chromium at
# /usr/bin/chromium and the Python `playwright` package in the given virtualenv. Idempotent: does
# nothing when both are there. Playwright's own browser download is never used (it cannot reach
# its CDN from the machines this project runs on, and Debian's build works).
#
#   scripts/install_browser.sh [VENV]      (default: .venv)
#
# Exits 0 even when Chromium cannot be installed (no root, no apt-get): the UI test then skips
# and says why.
set -euo pipefail

VENV="${1:-.venv}"
PLAYWRIGHT_SPEC="${PLAYWRIGHT_SPEC:-playwright>=1.49,<2}"

if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
    if [ "$SUDO" != "none" ]; then
      echo "install_browser: installing chromium with apt-get"
      if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; }; then
        echo "install_browser: apt-get could not install chromium; the UI test will skip" >&2
      fi
    else
      echo "install_browser: /usr/bin/chromium is missing and apt-get needs root; the UI test will skip" >&2
    fi
  else
    echo "install_browser: /usr/bin/chromium is missing and there is no apt-get; the UI test will skip" >&2
  fi
fi

if ! "$VENV/bin/python" -c "import playwright.sync_api" >/dev/null 2>&1; then
  echo "install_browser: installing $PLAYWRIGHT_SPEC into $VENV"
  "$VENV/bin/python" -m pip install --quiet "$PLAYWRIGHT_SPEC"
fi
