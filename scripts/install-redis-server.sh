#!/usr/bin/env bash
# The tests start a real redis-server (no fakes). Install the Debian package when it is missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "redis-server is missing and apt-get is not available: install redis-server yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "installing redis-server (Debian package) for the prefix-index tests"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
command -v redis-server >/dev/null
