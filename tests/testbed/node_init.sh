#!/bin/bash
# PID 1 of one test-bed node. Started by tests/testbed/core.py as
#   nsenter --net=/run/netns/<ns> unshare --mount --uts --pid --fork --kill-child \
#       --mount-proc --propagation slave /bin/bash node_init.sh NAME CIDR ROOT MASK_BASHRC
# so it already runs in the node's own network, mount, UTS and PID namespaces.
# It sets the node up, starts sshd, then stays alive as the node's init: it
# reaps orphans and restarts sshd on SIGUSR1. The node dies when this process
# is SIGKILLed (the kernel then kills everything in the PID namespace).
set -eu
name=$1 cidr=$2 root=$3 mask_bashrc=$4
node=$root/nodes/$name

ip -batch - <<EOF
link set lo up
addr add $cidr dev eth0
link set eth0 up
EOF
hostname "$name"

# Our copy of the host's /run/netns mounts would pin every other node's network
# namespace (and the host's netns deletes would not free them): drop it. A lazy
# umount of the parent detaches the whole subtree in one syscall (umount -R goes
# mount by mount: ~50 ms per node at 128 nodes).
if mountpoint -q /run/netns; then umount -l /run/netns; fi
resolv=$(readlink -f /etc/resolv.conf)  # may point into /run, resolve before hiding /run
mount -t tmpfs -o mode=0755,size=16m tmpfs /run
mkdir -m 0755 /run/sshd
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount --bind "$node/scratch" "$root/scratch"
mount --bind "$root/etc/hosts" /etc/hosts
mkdir -p "$(dirname "$resolv")"
[ -e "$resolv" ] || : >"$resolv"
mount --bind "$root/etc/resolv.conf" "$resolv"
# A bed with an unprivileged user (tests/testbed/users.py): /root opened, the bed's
# passwd/group/shadow, and the node's private home on $root/home.
if [ -f "$root/etc/passwd" ]; then
    . "$(dirname "$0")/open_root.sh"
    open_root "$node/root-orig"
    bind_etc "$root"
    mount --bind "$node/home" "$root/home"
fi
mount --bind "$root/nodessh" /root/.ssh
if [ "$mask_bashrc" = 1 ] && [ -f /root/.bashrc ]; then
    mount --bind "$root/etc/empty" /root/.bashrc
fi
# Simulated nodes share the host's home directory; real nodes each have their own.
# root's ~/.bashrc runs `pyenv init`, whose `pyenv rehash` holds a lock file in the
# shims directory: shared by every node, it serializes every SSH login on every node
# (seen: 60 s waits, then "cannot rehash"). Each node gets a private copy instead.
shims=/root/.pyenv/shims
if [ -d "$shims" ]; then
    mkdir -p "$node/pyenv-shims"
    cp -a "$shims/." "$node/pyenv-shims/" && rm -f "$node/pyenv-shims/.pyenv-shim"
    mount --bind "$node/pyenv-shims" "$shims"
fi

start_sshd() {
    if [ -e /run/sshd.pid ] && kill -0 "$(cat /run/sshd.pid)" 2>/dev/null; then return; fi
    /usr/sbin/sshd -D -e -f "$node/sshd_config" &
}
trap start_sshd USR1
start_sshd
echo "node $name up"

# bash reaps every child (orphans included) from its SIGCHLD handler while it waits.
while :; do
    sleep infinity &
    keep=$!
    wait "$keep" || true
    kill "$keep" 2>/dev/null || true
done
