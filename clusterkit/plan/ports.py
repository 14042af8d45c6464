"""Moved: the port rule lives in :mod:`clusterkit.spec.ports` (the batch script uses it too)."""

from __future__ import annotations

from clusterkit.spec.ports import PORT_BASE, PORT_SPAN, master_port

__all__ = ["PORT_BASE", "PORT_SPAN", "master_port"]
