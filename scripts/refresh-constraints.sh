#!/usr/bin/env bash
# Refresh requirements/test-constraints.txt, the versions `scripts/test.sh` installs.
#
# The test suite is pinned so that a fresh machine tests what was tested here: a new
# pytest/xdist/mypy/ruff release changes results without any change of ours (pytest-xdist
# 3.8 once stopped the run with an INTERNALERROR the older one did not show). To move to
# newer releases on purpose: run this, run `bash scripts/test.sh`, commit both together.
#
#   bash scripts/refresh-constraints.sh            # resolve anew in a throw-away venv
set -euo pipefail
cd "$(dirname "$0")/.."
out=requirements/test-constraints.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q -U pip
# torch is pinned by hand (a CPU build here, your CUDA build on a GPU machine): it stays
# out of the file so that a CUDA build already installed is never replaced.
"$tmp/venv/bin/python" -m pip install -q torch==2.13.0
"$tmp/venv/bin/python" -m pip install -q -e '.[workload,dev]'
{
    echo "# The versions scripts/test.sh installs (pip -c). Written by scripts/refresh-constraints.sh"
    echo "# on $(date -u +%Y-%m-%d) with Python $("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())'); refresh with that script, never by hand."
    "$tmp/venv/bin/python" -m pip freeze --exclude-editable \
        | grep -v -i -E '^(torch|clusterkit)([=@ ]|$)' | grep -v '^-e ' | LC_ALL=C sort -f
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out ($(grep -vc '^#' "$out") pins)"
