#!/usr/bin/env bash
# Render one region's Kubernetes manifests, or apply them: infra/deploy.sh REGION [--apply] [--out DIR]
# (see infra/deploy.py). Uses the repository's virtual environment when there is one. Runs in the
# caller's directory, so that relative --catalog and --out paths are the caller's; -P keeps that
# directory off the import path (the repository's packages come from PYTHONPATH).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -P -m infra.deploy "$@"
