"""known_hosts checking with OpenSSH ``StrictHostKeyChecking`` semantics.

* known key matches            → proceed
* host known, key differs      → refused (``hostkey-changed``), always, even with accept-new
* host unknown                 → refused (``hostkey-unknown``) unless accept-new, which
                                 appends the key to known_hosts atomically and proceeds.

paramiko's :class:`HostKeys` reads hashed (``|1|...``) and ``[host]:port`` entries.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Sequence

import paramiko

from clusterkit.errors import TransportError

# One writer at a time per process; the file itself is replaced atomically, so
# readers (ssh, other processes) never see a half-written known_hosts.
_WRITE_LOCK = threading.Lock()

# How a known key type maps onto what kex negotiates for the same key.
_RSA_ALGS = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")


def _load(path: str) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    if os.path.exists(path):
        try:
            keys.load(path)
        except OSError as exc:
            raise TransportError(f"cannot read known_hosts: {exc}", kind="config", path=path) from exc
    return keys


def known_key_types(path: str, name: str) -> list[str]:
    """Host key algorithms to prefer so kex offers the key we already know."""
    entry = _load(path).lookup(name)
    if entry is None:
        return []
    types: list[str] = []
    for key_type in entry:
        types.extend(_RSA_ALGS if key_type == "ssh-rsa" else (key_type,))
    return types


def fingerprint(key: paramiko.PKey) -> str:
    return str(key.fingerprint)  # "SHA256:..." like OpenSSH prints it


def verify(path: str, name: str, key: paramiko.PKey, *, accept_new: bool, host: str,
           also: Sequence[str] = ()) -> None:
    """Raise unless ``key`` is the known key for ``name`` (or accepted as new).

    ``also``: more files to trust, read-only (the other UserKnownHostsFile entries and
    GlobalKnownHostsFile, e.g. /etc/ssh/ssh_known_hosts), as OpenSSH does; a new key
    is only ever written to ``path``.
    """
    changed_in = None
    for source in (path, *also):
        entry = _load(source).lookup(name)
        if entry is None:
            continue
        known = entry.get(key.get_name())
        if known is not None and known == key:
            return
        changed_in = changed_in or source
    if changed_in is not None:
        path = changed_in
        raise TransportError(
            f"HOST KEY CHANGED for {name}: server offers {key.get_name()} "
            f"{fingerprint(key)}, which does not match {path}",
            kind="hostkey-changed",
            host=host,
            path=path,
            hint=(
                "possible man-in-the-middle, or the host was reinstalled; if you verified "
                f"the new key, remove the old one: ssh-keygen -R '{name}' -f {path}"
            ),
        )
    if not accept_new:
        raise TransportError(
            f"unknown host key for {name} ({key.get_name()} {fingerprint(key)}); not in {path}",
            kind="hostkey-unknown",
            host=host,
            path=path,
            hint=(
                "verify the fingerprint, then add it (ssh once by hand) or opt in with "
                "--accept-new-host-keys (accept_new_host_keys: true in the inventory)"
            ),
        )
    _append(path, name, key, host)


def _append(path: str, name: str, key: paramiko.PKey, host: str) -> None:
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    with _WRITE_LOCK:
        # Re-check under the lock: another thread may have added it meanwhile.
        entry = _load(path).lookup(name)
        if entry is not None:
            if entry.get(key.get_name()) == key:
                return
            verify(path, name, key, accept_new=False, host=host)
        try:
            _atomic_append(path, line)
        except OSError as exc:
            raise TransportError(
                f"cannot add host key to known_hosts: {exc}",
                kind="config",
                host=host,
                path=path,
            ) from exc


def _atomic_append(path: str, line: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        old, mode = "", 0o644
    if old and not old.endswith("\n"):
        old += "\n"
    fd, tmp = tempfile.mkstemp(prefix=".known_hosts.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(old + line)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
