#!/bin/bash
# Run a command as the test bed's unprivileged user on the host (tests/testbed/users.py):
#   unshare --mount --propagation private -- /bin/bash as_user.sh ROOT USER CMD...
# In this private mount namespace (nothing is seen outside it), /root is opened and the
# bed's passwd/group/shadow are bound over /etc's, so ssh and Python find the user; then
# setpriv drops to the user and execs CMD (same pid: signals reach CMD).
set -eu
root=$1 user=$2
shift 2
. "$(dirname "$0")/open_root.sh"
open_root "$root/root-orig"
bind_etc "$root"
exec setpriv --reuid="$user" --regid="$user" --init-groups -- "$@"
