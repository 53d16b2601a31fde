#!/usr/bin/env bash
# promtool for the alert rules' test (batch_pipeline_tests/service/test_alerts.py: `promtool check rules` and
# the rule unit tests in deploy/prometheus/alerts.test.yaml), from Debian's `prometheus` package.
# Idempotent: does nothing when promtool is on the PATH. Exits 0 when it cannot be installed (no
# root, no apt-get): that one test then skips and says why; the rest of test_alerts.py still runs.
set -euo pipefail

command -v promtool >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_promtool: promtool is missing and there is no apt-get; the promtool test will skip" >&2
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "install_promtool: promtool is missing and apt-get needs root; the promtool test will skip" >&2
  exit 0
fi
echo "install_promtool: installing Debian's prometheus package (for promtool) with apt-get"
# --no-install-recommends: promtool needs no exporters; in a container nothing starts the server.
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
  echo "install_promtool: apt-get could not install prometheus; the promtool test will skip" >&2
fi
