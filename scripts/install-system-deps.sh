#!/usr/bin/env bash
# The tests need two Debian packages: redis-server (the prefix-index tests start a real one, no
# fakes) and docker-compose (tests/test_deploy.py validates the compose files with
# `docker-compose config`; that needs no Docker daemon). Install whichever is missing.
set -euo pipefail

# command -> Debian package
declare -A PACKAGES=([redis-server]=redis-server [docker-compose]=docker-compose)

missing=()
for cmd in "${!PACKAGES[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${PACKAGES[$cmd]}")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing ${missing[*]} and apt-get is not available: install them yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
# No recommends: docker-compose recommends docker.io (the daemon), which validating needs not.
echo "installing Debian packages the tests need: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
for cmd in "${!PACKAGES[@]}"; do
  command -v "$cmd" >/dev/null
done
