#!/usr/bin/env bash
# The tests need three Debian packages: redis-server (the prefix-index tests start a real one, no
# fakes), prometheus (tests/integration/test_prometheus.py scrapes a real cluster and evaluates the Grafana
# dashboard's queries) and docker-compose (tests/integration/test_deploy.py validates the compose files with
# `docker-compose config`; that needs no Docker daemon). Install whichever is missing.
set -euo pipefail

# command -> Debian package
declare -A PACKAGES=([redis-server]=redis-server [prometheus]=prometheus [docker-compose]=docker-compose)

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
# No recommends: docker-compose recommends docker.io (the daemon), which validating needs not;
# prometheus runs as a plain child process of the test, so its recommends are not needed either.
echo "installing Debian packages the tests need: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
for cmd in "${!PACKAGES[@]}"; do
  command -v "$cmd" >/dev/null
done
