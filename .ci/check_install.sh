#!/usr/bin/env bash
# The README's install lines, as written, in a fresh venv made by each given Python with the
# pip that Python bundles (no upgrade of ours: the lines must do what they need), then the
# packages import and the CLIs start. Usage: .ci/check_install.sh [PYTHON ...] (default python3).
# Not part of `make test` (about 3 minutes a Python): `make check-install`, and .ci/run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LINES="$(awk '/^## Install/{s=1; next} s && /^```bash/{b=1; next} b && /^```/{exit} b' "$ROOT/README.md")"
if [ -z "$LINES" ]; then echo "check_install: no \`\`\`bash block under '## Install' in README.md" >&2; exit 1; fi
[ "$#" -gt 0 ] || set -- python3
for PY in "$@"; do
  VENV="$(mktemp -d /tmp/moc-install-check.XXXXXX)"
  trap 'rm -rf "$VENV"' EXIT
  "$PY" -m venv "$VENV"
  echo "check_install: $("$VENV/bin/python" --version) with its own $("$VENV/bin/python" -m pip --version | cut -d' ' -f1-2)"
  (
    cd "$ROOT"
    source "$VENV/bin/activate"
    set -x
    eval "$LINES"
    set +x
    python -c "import moc, lazarus, storage_backends, moc.integrations.transformers, moc.integrations.lightning, matplotlib"
    moc --help > /dev/null
    lazarus --help > /dev/null
  )
  echo "check_install: $PY: the README's install lines work"
  rm -rf "$VENV"
  trap - EXIT
done
