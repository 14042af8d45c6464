"""paramiko public-key authentication: ssh-agent keys, then the identity files; never a
password. Each failure is one :class:`TransportError` of kind ``auth`` that says which
keys were offered and which were skipped and why."""

from __future__ import annotations

import os

import paramiko

from clusterkit.errors import TransportError
from clusterkit.remote.sshconfig import Endpoint


def open_agent(notes: list[str]) -> paramiko.Agent | None:
    try:
        return paramiko.Agent()
    except (paramiko.SSHException, OSError) as exc:  # stale SSH_AUTH_SOCK
        notes.append(f"ssh-agent: {exc}")
        return None


def load_key(path: str) -> paramiko.PKey | str:
    if not os.path.exists(path):
        return "missing"
    try:
        return paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        # We never prompt: encrypted keys are usable only through ssh-agent.
        return "encrypted (load it into ssh-agent)"
    except (paramiko.SSHException, OSError, ValueError) as exc:
        return f"unusable ({exc})"


def try_key(ep: Endpoint, transport: paramiko.Transport, key: paramiko.PKey, timeout: float) -> bool:
    try:
        remaining = transport.auth_publickey(ep.user, key)
    except paramiko.BadAuthenticationType as exc:
        raise TransportError(
            f"user {ep.user} cannot log in with a public key "
            f"(allows: {', '.join(exc.allowed_types) or 'nothing'})",
            kind="auth",
            host=ep.label,
            hint="clusterkit uses key authentication only; enable PubkeyAuthentication",
        ) from exc
    except paramiko.AuthenticationException as exc:
        if "timeout" in str(exc).lower():
            raise TransportError(
                f"authentication as {ep.user} did not finish within {timeout:g}s",
                kind="auth",
                host=ep.label,
            ) from exc
        return False
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise TransportError(
            f"the host closed the connection during authentication ({exc})",
            kind="auth",
            host=ep.label,
            hint="too many keys offered (sshd MaxAuthTries)? set identity_file / IdentitiesOnly",
        ) from exc
    if transport.is_authenticated():
        return True
    raise TransportError(
        f"the host wants further authentication ({', '.join(remaining)}) after the key",
        kind="auth",
        host=ep.label,
        hint="clusterkit supports key-only logins",
    )


def auth_failed(ep: Endpoint, offered: list[str], notes: list[str]) -> TransportError:
    detail = f"rejected {len(offered)} key(s): {', '.join(offered)}" if offered else "no key to offer"
    if notes:
        detail += f"; skipped {'; '.join(notes)}"
    return TransportError(
        f"authentication failed for user {ep.user} ({detail})",
        kind="auth",
        host=ep.label,
        hint=f"add your public key to ~{ep.user}/.ssh/authorized_keys there, or set "
        "identity_file (IdentityFile) to the right key; passwords are never tried",
    )
