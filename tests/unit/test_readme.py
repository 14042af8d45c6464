"""The README is the front door: its two set-up commands, its docs index, its exit codes."""

from __future__ import annotations

import re

from tests.paths import REPO

README = (REPO / "README.md").read_text()


def _setup_commands() -> list[str]:
    section = README.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, flags=re.S)


def test_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each set-up command is one line"
    first_command, test_command = commands
    ci = (REPO / ".ci" / "run").read_text()
    assert test_command in ci, f"CI must run the README's test command {test_command!r}"
    # CI is a newcomer: a venv of its own, then both commands as the README gives them.
    assert "python3 -m venv" in ci and "/bin/activate" in ci, ci
    assert ci.index("/bin/activate") < ci.index(first_command) < ci.index(test_command), ci
    # One line for root without sudo (containers, CI) and for a user with sudo: the
    # script escalates itself, so the README must not prefix it with sudo.
    assert not test_command.startswith("sudo"), test_command


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README))
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), f"README does not link {sorted(pages - linked)}"
    assert linked - pages == set(), f"README links missing pages {sorted(linked - pages)}"


def test_exit_codes_listed_are_the_ones_main_uses() -> None:
    codes = set(re.findall(r"`(\d+)` ", README.split("## Exit codes", 1)[1].split("\n\n", 2)[1]))
    assert codes == {"0", "1", "2", "70", "130"}, codes
    assert not (REPO / "clusterkit" / "cli" / "cmd_planned.py").exists()
