# Sourced by node_init.sh and as_user.sh (tests/testbed/users.py): make /root traversable
# for the test bed's unprivileged user without touching the host. /root is mode 700 here
# and the interpreter lives under /root/.pyenv. In the caller's own mount namespace, a
# mode-755 tmpfs goes over /root and each of root's entries is bind-mounted back at its
# own path, with its own mode: only /root's mode differs. $1: an empty directory to
# hold the original /root (a mount there is seen by this namespace only).
open_root() {
    local keep=$1 entry name
    mkdir -p "$keep"
    mount --bind /root "$keep"
    mount -t tmpfs -o mode=0755,size=1m tmpfs /root
    for entry in "$keep"/.[!.]* "$keep"/..?* "$keep"/*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        name=${entry##*/}
        if [ -L "$entry" ]; then cp -P "$entry" "/root/$name"; continue; fi
        if [ -d "$entry" ]; then mkdir "/root/$name"; else : >"/root/$name"; fi
        mount --bind "$entry" "/root/$name"
    done
}

# The bed's passwd, group and shadow (the host's lines plus the user's) over /etc's.
bind_etc() {
    local root=$1 f
    for f in passwd group shadow; do mount --bind "$root/etc/$f" "/etc/$f"; done
}
