#!/usr/bin/env bash
# Installs Debian's Chromium and its WebDriver, so the report tests can open the page in a real browser.
# Needs root and apt-get; without them the browser test skips and says why.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-browser: needs root and apt-get; the browser test will skip" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
