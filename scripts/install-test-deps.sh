#!/usr/bin/env bash
# Debian packages the test suite uses for real: chromium (headless report tests), and SLURM +
# munge (the jobqueue test; scripts/slurm-localhost.sh starts it). Needs root and apt-get; where
# they are missing (a laptop), it says so and the tests that need them skip locally.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld slurmd slurm-client munge)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-deps: missing ${need[*]} (needs root + apt-get); the tests that use them will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
