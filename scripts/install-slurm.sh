#!/usr/bin/env bash
# Installs Debian's Slurm and munge, so the tests can start a real one-node Slurm cluster on loopback.
# Needs root and apt-get; without them the Slurm tests skip and say why.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-slurm: needs root and apt-get; the Slurm tests will skip" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
