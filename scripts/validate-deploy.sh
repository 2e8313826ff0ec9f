#!/usr/bin/env bash
# Checks the Kubernetes files in deploy/ offline (docs/deploy.md): every
# manifest against the Kubernetes schemas of kubernetes-validate in strict
# mode (the ServiceMonitor against deploy/schemas/), every metric the
# dashboard, the HPA and the prometheus-adapter rules name against the
# governor's registrations, every `envelope govern`/`sweep` flag against the
# Rust sources, and the references between the files. See deploy/validate.py.
# Needs python3 with venv; PyPI only the first time (or when
# deploy/requirements-validate.txt changes). Exit 1 names file and field.
# Usage: scripts/validate-deploy.sh [--deploy DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "scripts/validate-deploy.sh: needs Python 3.11 or later (tomllib)" >&2
  exit 1
fi
venv=.venv-deploy
req=deploy/requirements-validate.txt
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$want" >"$venv/.requirements.sha256"
fi
PYTHONDONTWRITEBYTECODE=1 exec "$venv/bin/python" deploy/validate.py "$@"
