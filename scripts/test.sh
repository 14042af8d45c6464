#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, Python packages,
# pytest (including the real-sshd / real-Slurm test bed), ruff and mypy.
# Needs root for the namespace test bed and apt-get: it re-runs itself with sudo when
# started by another user; CI runs it as root.
set -euo pipefail
cd "$(dirname "$0")/.."

# One command for everyone: root (a container, CI) runs it as it is; anyone else is
# re-run through sudo, which the test bed needs (namespaces, sshd, slurmd, apt-get).
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo -E env "PATH=$PATH" bash "$0" "$@"
    fi
    echo "test.sh: needs root (namespaces, sshd, slurmd, apt-get) and sudo is not installed: run it as root" >&2
    exit 2
fi

SYSTEM_PACKAGES=(openssh-server openssh-client pdsh rsync slurm-wlm munge iproute2 procps psmisc util-linux)

install_system_packages() {
    local missing=()
    for pkg in "${SYSTEM_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -eq 0 ]; then return 0; fi
    echo "test.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # The Debian packages would start daemons on install; the test bed starts its own.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_python_packages() {
    # torch first and pinned: a plain `torch` requirement pulls several GB of CUDA wheels.
    python3 -c 'import torch' 2>/dev/null || python3 -m pip install -q torch==2.13.0
    # Everything else at the versions this suite was last run with (a new pytest or xdist
    # release must not change the result by itself); scripts/refresh-constraints.sh
    # moves them on purpose (docs/testbed.md).
    python3 -m pip install -q -c requirements/test-constraints.txt -e '.[workload,dev]'
}

compile_project() {
    # The project's bytecode once, here: where PYTHONDONTWRITEBYTECODE is set (many
    # container images set it) no process writes it, and every process of the suite (the
    # CLI calls, the ranks and agents' programs on the test bed) compiled the modules it
    # imports again. Reading cached bytecode is not affected by that variable.
    python3 -m compileall -q -j 0 clusterkit tests bench >/dev/null || true
}

build_jit_ops() {
    # DeepSpeed's shm comm op, which every DeepSpeed rank on CPU loads, built once here for
    # this interpreter (clusterkit's own `build`, as `clusterkit nodes build-ops` runs it
    # on a node). Otherwise the first test to start DeepSpeed builds it under the suite's
    # load (minutes: ninja, two C++ files), and the test bed's users, whose caches are
    # copies of root's (tests/testbed/users.py), could get a copy built for another
    # interpreter and build again in their ranks.
    echo '{}' | python3 -c 'import sys; from clusterkit.node.provision.jitops import main; sys.exit(main(["build"]))' \
        >/dev/null 2>&1 || echo "test.sh: building DeepSpeed's ops failed; the tests that need them will say why" >&2
}

cleanup() {
    # Whatever a crashed or interrupted run left behind: namespaces, sshd, slurmd, mounts.
    python3 -m tests.testbed down --all >/dev/null 2>&1 || true
}

install_system_packages
# With DeepSpeed already installed (README command 1), its op builds beside the pip
# install of the test tools (seconds of C++ on a fresh machine); `python3 -c` imports
# clusterkit from this tree, whatever pip is doing to the installed copy meanwhile.
ops_pid=
if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)' 2>/dev/null; then
    build_jit_ops &
    ops_pid=$!
fi
install_python_packages
compile_project
if [ -n "$ops_pid" ]; then wait "$ops_pid" || true; else build_jit_ops; fi
trap cleanup EXIT

# ruff and mypy run beside pytest at the lowest priority: the suite is CPU-bound but
# waits too (hang timeouts, a cut node's keepalives, xdist's last test), and they take
# those idle cycles instead of ~40 s of their own after it. Their output comes after
# pytest's, whole; their status counts the same.
lint_log=$(mktemp /tmp/clusterkit-lint.XXXXXX)
( s=0; nice -n 19 ruff check . || s=1; nice -n 19 mypy || s=1; exit "$s" ) >"$lint_log" 2>&1 &
lint_pid=$!

status=0
python3 -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests — treating as failure" >&2
    status=1
fi
wait "$lint_pid" || status=1
cat "$lint_log"
rm -f "$lint_log"
exit "$status"
