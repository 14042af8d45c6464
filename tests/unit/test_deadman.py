"""The launcher's summary after a partition names the nodes it could not confirm (issue 14)."""

from __future__ import annotations

from types import SimpleNamespace

from clusterkit.cli.cmd_launch import _stopped_where


def test_summary_names_unconfirmed_nodes() -> None:
    assert _stopped_where(SimpleNamespace(unconfirmed=[])) == "every rank on every node was stopped"
    text = _stopped_where(SimpleNamespace(unconfirmed=["node6", "node7"]))
    assert text.startswith("every rank on the other nodes was stopped; node[6-7] could not be "
                           "confirmed")
