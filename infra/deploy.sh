#!/usr/bin/env bash
# Render one region's Kubernetes manifests, or apply them: infra/deploy.sh REGION [--apply] [--out DIR]
# (see infra/deploy.py). Uses the repository's virtual environment when there is one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
[ -x "$py" ] || py=python3
cd "$root"
exec "$py" -m infra.deploy "$@"
