"""The one size rule and the one duration rule (clusterkit/units.py, docs/units.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from clusterkit.errors import ClusterkitError
from clusterkit.units import duration_type, parse_duration, parse_size, size_type

GiB, GB = 2**30, 10**9


@pytest.mark.parametrize(("text", "expected"), [
    ("40G", 40 * GiB), ("40GiB", 40 * GiB), ("40gib", 40 * GiB), ("40 G", 40 * GiB),
    ("40GB", 40 * GB), ("40gb", 40 * GB), ("5GB", 5 * GB), ("1.5T", int(1.5 * 2**40)),
    ("4M", 4 * 2**20), ("4MB", 4 * 10**6), ("1kB", 1000), ("1K", 1024), ("512", 512),
    ("512B", 512), (".5G", GiB // 2),
])
def test_one_size_rule(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "-1G", "40Gi", "1e5", "4 M B", "G"])
def test_bad_sizes_name_the_flag(text: str) -> None:
    with pytest.raises(ClusterkitError) as e:
        parse_size(text, "--ckpt-size")
    assert e.value.key == "--ckpt-size" and "docs/units.md" in e.value.one_line()


@pytest.mark.parametrize(("text", "expected"), [
    ("90", 90.0), ("2.5", 2.5), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("2d", 172800.0), ("01:30:00", 5400.0), ("05:30", 330.0), ("1-00:00:00", 86400.0),
    ("1-05:30", 86400.0 + 5 * 3600 + 30 * 60), ("0", 0.0),
])
def test_one_duration_rule(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "m5", "30m1h", "1:61", "5 minutes", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ClusterkitError):
        parse_duration(text, "--grace")


def test_argparse_types_fail_at_parse_time() -> None:
    p = argparse.ArgumentParser(prog="x", exit_on_error=False)
    p.add_argument("--size", type=size_type("--size", minimum=1))
    p.add_argument("--wait", type=duration_type("--wait"))
    ns = p.parse_args(["--size", "40G", "--wait", "1m"])
    assert ns.size == 40 * GiB and ns.wait == 60.0
    for argv in (["--size", "lots"], ["--size", "0"], ["--wait", "-1"]):
        with pytest.raises(argparse.ArgumentError):
            p.parse_args(argv)


def test_duration_type_refuses_zero_and_fractions_where_asked() -> None:
    poll = duration_type("--poll", zero=False)
    assert poll("2s") == 2.0
    with pytest.raises(argparse.ArgumentTypeError, match="more than 0"):
        poll("0")
    lead = duration_type("--signal-lead", zero=False, whole=True)
    assert lead("2m") == 120 and isinstance(lead("2m"), int)
    with pytest.raises(argparse.ArgumentTypeError, match="whole seconds"):
        lead("1.5")
    # one object per flag and rule: the same type in every verb (tests/unit/test_jobflags.py)
    assert duration_type("--grace") is duration_type("--grace")


# Every duration flag of every verb, with the value its verb's parser gets for "1h30m".
DURATION_FLAGS = [
    (["launch", "--grace"], "grace_s"), (["launch", "--keepalive-timeout"], "keepalive_s"),
    (["launch", "--hang-timeout"], "hang_timeout_s"), (["render", "--hang-timeout"], "hang_timeout_s"),
    (["sbatch", "--hang-timeout"], "hang_timeout_s"), (["stop", "j", "--grace"], "grace"),
    (["doctor", "--connect-timeout"], "connect_timeout"), (["sbatch", "--poll"], "poll"),
    (["sbatch", "--slurm-timeout"], "slurm_timeout"), (["sbatch", "--signal-lead"], "signal_lead"),
    (["collect-ckpt", "--slurm-wait"], "slurm_wait"),
]


@pytest.mark.parametrize(("argv", "dest"), DURATION_FLAGS)
def test_every_duration_flag_takes_the_documented_forms(argv: list[str], dest: str) -> None:
    from clusterkit.cli.main import build_parser
    from clusterkit.errors import UsageError

    for text, seconds in (("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0),
                          ("01:30:00", 5400.0)):
        assert getattr(build_parser(argv).parse_args([*argv, text]), dest) == seconds
    for bad in ("nan", "inf", "-1", "5 minutes"):
        with pytest.raises(UsageError) as e:
            build_parser(argv).parse_args([*argv, bad])
        assert e.value.key == argv[-1]


@pytest.mark.parametrize(("argv", "flag"), [
    (["doctor", "--ckpt-size", "lots"], "--ckpt-size"),
    (["doctor", "--bandwidth-size", "0"], "--bandwidth-size"),
    (["collect-ckpt", "JOB", "--max-shard-size", "5 gigs"], "--max-shard-size"),
])
def test_verbs_refuse_bad_sizes_before_anything_starts(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from clusterkit.cli.main import main

    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, no usage text
    assert line.startswith(f"clusterkit: error: {flag}: ")


def test_doctor_and_collect_read_sizes_by_the_same_rule() -> None:
    from clusterkit.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["doctor", "--ckpt-size", "40G"]).ckpt_size == 40 * GiB
    assert p.parse_args(["doctor", "--ckpt-size", "40GB"]).ckpt_size == 40 * GB
    collect = p.parse_args(["collect-ckpt", "JOB", "--max-shard-size", "40G"])
    assert collect.max_shard_size == 40 * GiB  # was refused: only KB/MB/GB/TB were read
    assert p.parse_args(["collect-ckpt", "JOB"]).max_shard_size == 5 * GB


def test_consolidate_hands_deepspeed_the_byte_count(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from clusterkit.checkpoints.convert import consolidate as mod
    from clusterkit.errors import CheckpointError

    seen: list[int] = []

    def fake_convert(dest: str, tag: str, out: str, safe: bool, max_shard_size: int,
                     universal: bool = False) -> None:
        seen.append(max_shard_size)
        raise CheckpointError("stop here")

    monkeypatch.setattr(mod, "_convert", fake_convert)
    for text, expected in (("5G", 5 * GiB), ("5GB", 5 * GB), (1234, 1234)):
        with pytest.raises(CheckpointError):
            mod.consolidate(str(tmp_path), "global_step1", max_shard_size=text)
        assert seen.pop() == expected
    with pytest.raises(ClusterkitError) as e:
        mod.consolidate(str(tmp_path), "global_step1", max_shard_size="5 gigs")
    assert e.value.key == "--max-shard-size" and not seen


def test_every_seconds_flag_uses_the_duration_type() -> None:
    """A flag whose value is seconds (metavar S) reads it by the one rule: no float()."""
    import argparse as ap

    from clusterkit.cli.main import build_parser

    def walk(p: ap.ArgumentParser) -> list[tuple[str, ap.Action]]:
        out = [(p.prog, a) for a in p._actions]
        for a in p._actions:
            if isinstance(a, ap._SubParsersAction):
                for sub in dict.fromkeys(a.choices.values()):
                    out += walk(sub)
        return out

    seconds = [(prog, a) for prog, a in walk(build_parser()) if a.metavar == "S"]
    assert len(seconds) >= 10
    for prog, action in seconds:
        assert getattr(action.type, "__qualname__", "") == "duration_type.<locals>.convert", \
            (prog, action.option_strings)
