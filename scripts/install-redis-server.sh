#!/usr/bin/env bash
# Kept for callers of the old name: scripts/install-system-deps.sh installs every Debian package
# the tests need (redis-server, docker-compose).
exec "$(dirname "$0")/install-system-deps.sh" "$@"
