#!/usr/bin/env bash
# Render one region's Kubernetes manifests, or apply them: infra/deploy.sh REGION [--apply] [--out DIR]
# (see infra/deploy.py). Uses the repository's virtual environment when there is one, else the
# host's python3 (3.10 or later, with PyYAML: nothing else is imported). Runs in the caller's
# directory, so that relative --catalog and --out paths are the caller's; PYTHONSAFEPATH keeps
# that directory off the import path (the repository's packages come from PYTHONPATH). Python
# 3.10 ignores PYTHONSAFEPATH (and has no -P): there the caller's directory comes first on the
# path, which matters only where it holds a package named infra, gateway, runtime or yaml.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
if [ ! -x "$py" ]; then
  py="$(command -v python3 || true)"
  if [ -z "$py" ]; then
    echo "deploy.sh: error: no python3 on PATH (and no $root/.venv): install Python 3.10 or later with PyYAML" >&2
    exit 2
  fi
fi
export PYTHONSAFEPATH=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# checked up front: a missing PyYAML was a traceback, an old Python a TypeError deep in an import
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "deploy.sh: error: $py is Python $("$py" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'), deploy needs 3.10 or later" >&2
  exit 2
fi
if ! "$py" -c 'import yaml' 2>/dev/null; then
  echo "deploy.sh: error: $py has no PyYAML: install it with \`$py -m pip install pyyaml\` (or your distribution's python3-yaml), or run \`make setup\` for the repository's .venv" >&2
  exit 2
fi
exec "$py" -m infra.deploy "$@"
