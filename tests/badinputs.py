"""A corpus of bad (and a few good) inputs for every verb, and the grader they share.

Each case is one command line run in a scratch directory that holds a small training
script, a directory, a plain file and several broken inventories/hostfiles. A bad input
passes when clusterkit answers it with the expected exit code and exactly one error
line on stderr (``clusterkit: error: ...``), no traceback and no usage dump. Every case
only talks to the embedded default's local nodes (no SSH, no network): ``launch`` and
``sbatch`` always carry ``--dry-run``.

Used by tests/process/test_bad_inputs.py (in-process, fast) and runnable on its own for a
report: ``python3 -m tests.badinputs [--subprocess]``.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TRAIN = "import os\nprint('rank', os.environ.get('RANK'))\n"
FILES: dict[str, str] = {
    "train.py": TRAIN,
    "ds.json": '{"train_micro_batch_size_per_gpu": 1}\n',
    "afile": "not an inventory\n",
    "notawheel.whl": "not a wheel\n",
    "hf_slots0": "node1 slots=0\nnode2 slots=2\n",
    "hf_dup": "node1 slots=2\nnode1 slots=2\n",
    "hf_abc": "node1 slots=abc\n",
    "hf_empty": "",
    "inv_num_env.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local, "
                         "slots: 2}\nhosts:\n  l[1-2]:\n    address: 127.0.0.[1-2]\n"
                         "    env: {MYLIB_VERSION: 1.10}\n"),
    "inv_oct_env.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local, "
                         "slots: 2, env: {OCT: 010}}\nhosts:\n  l[1-2]:\n    address: 127.0.0.[1-2]\n"),
    "inv_unknown.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local}\n"
                         "hosts:\n  l1: {address: 127.0.0.1, slotz: 2}\n"),
    "inv_range.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local}\n"
                       "hosts:\n  l[3-1]: {address: 127.0.0.1}\n"),
    "inv_schema.yaml": "schema_version: 7\ncluster: {name: t}\nhosts: {}\n",
    "inv_yaml.yaml": "schema_version: 1\ncluster: {name: t\nhosts:\n",
    "inv_nohosts.yaml": "schema_version: 1\ncluster: {name: t}\nhosts: {}\n",
    "inv_dup.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local}\n"
                     "hosts:\n  l[1-2]: {address: 127.0.0.[1-2]}\n  l2: {address: 127.0.0.3}\n"),
    "inv_badslots.yaml": ("schema_version: 1\ncluster: {name: t}\ndefaults: {transport: local}\n"
                          "hosts:\n  l1: {address: 127.0.0.1, slots: -2}\n"),
    "inv_list.yaml": "- a\n- b\n",
}
DIRS = ("adir",)

# Launch-like verbs always plan only.
L = ["launch", "--dry-run"]
R = ["render", "--dry-run"]
S = ["sbatch", "--dry-run"]

INT_FLAGS_MIN1 = ("--nodes", "--gpus-per-node", "--steps", "--micro-batch", "--grad-accum",
                  "--cpus-per-task")
INT_FLAGS_MIN0 = ("--save-every", "--max-restarts", "--warmup-steps")
FLOAT_FLAGS = ("--lr", "--clip")
LAUNCH_DURATIONS = ("--hang-timeout", "--grace", "--keepalive-timeout")
CHOICES = (("--zero-stage", "5"), ("--model", "huge"), ("--launcher", "pdsh"),
           ("--precision", "fp8"), ("--storage", "nfs"), ("--offload-optimizer", "gpu"),
           ("--offload-param", "disk"), ("--rdzv", "etcd"), ("--deepspeed-launcher", "ssh"))
BAD_INVENTORIES = ("missing.yaml", "adir", "afile", "inv_num_env.yaml", "inv_oct_env.yaml",
                   "inv_unknown.yaml", "inv_range.yaml", "inv_schema.yaml", "inv_yaml.yaml",
                   "inv_nohosts.yaml", "inv_dup.yaml", "inv_badslots.yaml", "inv_list.yaml")


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    code: int = 2

    @property
    def name(self) -> str:
        return " ".join(self.argv)


def _cases_numbers() -> Iterator[Case]:
    for verb in (L, R, S):
        for flag in INT_FLAGS_MIN1:
            for value in ("x", "-1", "0", "nan", "1.5", ""):
                yield Case((*verb, flag, value))
        for flag in INT_FLAGS_MIN0:
            for value in ("x", "-1", "nan"):
                yield Case((*verb, flag, value))
        for flag in FLOAT_FLAGS:
            for value in ("nan", "inf", "-1", "x"):
                yield Case((*verb, flag, value))
        for flag, value in CHOICES:
            yield Case((*verb, flag, value))
        yield Case((*verb, "--hang-timeout", "nan"))
        yield Case((*verb, "--hang-timeout", "-5"))
        yield Case((*verb, "--hang-timeout", "inf"))
        yield Case((*verb, "--local-ranks-filter", "a,b"))
        yield Case((*verb, "--set-env", "NOEQUALS"))
        yield Case((*verb, "--set-env", "=x"))
        yield Case((*verb, "--set-env", "1BAD=x"))
        yield Case((*verb, "--env", ""))
        yield Case((*verb, "--job-id", ""))
        yield Case((*verb, "--job-id", "a b"))
        yield Case((*verb, "--job-id", "../up"))
        yield Case((*verb, "--master-addr", "1.2.3.4;rm -rf /"))
        yield Case((*verb, "--master-addr", ""))
        yield Case((*verb, "--include", "nosuchnode"))
        yield Case((*verb, "--exclude", "nosuchnode"))
        yield Case((*verb, "--nodes", "9"))
        yield Case((*verb, "--gpus-per-node", "9"))
        yield Case((*verb, "--ckpt-dir", ""))
        yield Case((*verb, "--steps"))  # missing value
        yield Case((*verb, "--bogus-flag"))
        yield Case((*verb, "--stesp", "5"))  # typo
        yield Case((*verb, "--zero", "2"))  # a prefix: no abbreviations


def _cases_launch() -> Iterator[Case]:
    for value in ("nan", "inf", "-1", "abc", ""):
        for flag in LAUNCH_DURATIONS:
            yield Case((*L, flag, value))
    yield Case((*L, "missing.py"))
    yield Case((*L, "adir"))
    yield Case((*L, "--sync", "/nonexistent", "train.py"))
    yield Case((*L, "--sync", "afile", "train.py"))
    yield Case((*L, "--ckpt-dir", "/proc/nope", "train.py"))
    yield Case((*L, "train.py", "--nodes", "2"))
    yield Case((*L, "train.py", "--dry-run"))
    yield Case((*L, "train.py", "-i", "x.yaml"))
    yield Case((*L, "--time", "25:99:99", "train.py"))
    yield Case((*L, "--partition", "a b", "train.py"))
    yield Case((*L, "--submit", "train.py"))
    yield Case((*L, "--ranks", "5-2", "train.py"))
    yield Case((*L, "--launcher", "slurm", "train.py"))
    yield Case((*L, "--deepspeed-config-arg", "train.py", "--steps", "x"), 0)
    yield Case((*L, "-m"))
    yield Case((*L, "--precision", "fp16", "train.py"))
    for inv in BAD_INVENTORIES:
        yield Case((*L, "-i", inv, "train.py"))
        yield Case(("inventory", "validate", "-i", inv))


def _cases_sbatch() -> Iterator[Case]:
    for value in ("25:99:99", "99:99", "99:99:99", "x", "-1", "1-99", ""):
        yield Case((*S, "--time", value))
    yield Case(("sbatch", "--dry-run", "--submit"))
    yield Case(("sbatch", "--write-only", "--submit", "--dry-run"))
    yield Case((*S, "--poll", "0"))
    yield Case((*S, "--poll", "nan"))
    yield Case((*S, "--poll", "-1"))
    yield Case((*S, "--slurm-timeout", "nan"))
    yield Case((*S, "--slurm-timeout", "0"))
    yield Case((*S, "--signal-lead", "nan"))
    yield Case((*S, "--signal-lead", "-3"))
    yield Case((*S, "--signal", "BOGUS"))
    yield Case((*S, "--mem", "lots"))
    yield Case((*S, "--mem", "-5G"))
    yield Case((*S, "--partition", "a b"))
    yield Case((*S, "--sbatch-arg", "--foo\nbar"))
    yield Case((*S, "--template-dir", "/nonexistent"))
    yield Case((*S, "--template-dir", "afile"))
    yield Case((*S, "--launcher", "native"))
    yield Case((*S, "missing.py"))
    yield Case((*S, "adir"))
    yield Case((*S, "--ranks", "x"))


def _cases_other_verbs() -> Iterator[Case]:
    yield Case(("lanch",))
    yield Case(("--bogus",))
    yield Case(())
    yield Case(("inventory",))
    yield Case(("inventory", "frobnicate"))
    yield Case(("inventory", "validat"))
    yield Case(("nodes",))
    for hf in ("missing", "adir", "hf_slots0", "hf_dup", "hf_abc", "hf_empty"):
        yield Case(("inventory", "import-hostfile", hf))
    yield Case(("inventory", "import-hostfile", "hf_dup", "-o", "adir"))
    yield Case(("inventory", "import-hostfile", "hf_dup", "-o", "/nonexistent/dir/x.yaml"))
    yield Case(("inventory", "export-hostfile", "-i", "inv_yaml.yaml"))
    yield Case(("inventory", "export-hostfile", "-o", "adir"))
    yield Case(("inventory", "export-hostfile", "-o", "/nonexistent/dir/hf"))
    yield Case(("inventory", "show", "-i", "missing.yaml"))
    yield Case(("inventory", "show", "--bogus"))
    for value in ("nan", "0", "-1", "inf", "x"):
        yield Case(("doctor", "--connect-timeout", value))
    for value in ("abc", "-1", "nan"):
        yield Case(("doctor", "--ckpt-size", value))
        yield Case(("doctor", "--bandwidth-size", value))
    yield Case(("doctor", "--master-port", "70000"))
    yield Case(("doctor", "--master-port", "x"))
    yield Case(("doctor", "--fix-env", "adir"))
    yield Case(("doctor", "--fix-env", "/nonexistent/dir/env"))
    yield Case(("doctor", "--launcher", "pdsh"))
    yield Case(("doctor", "-i", "missing.yaml"))
    yield Case(("doctor", "--nodes", "0"))
    for value in ("abc", "-1G", "nan"):
        yield Case(("plan", "--gpu-mem", value))
        yield Case(("plan", "--cpu-mem", value))
    for value in ("2", "nan", "-0.1", "0", "x"):
        yield Case(("plan", "--gpu-fraction", value))
    yield Case(("plan", "--gpu-mem", "80G", "--model", "huge"))
    yield Case(("plan", "--gpu-mem", "80G", "--nodes", "0"))
    yield Case(("plan", "--gpu-mem", "80G", "--nodes", "99"))
    yield Case(("collect-ckpt",))
    yield Case(("collect-ckpt", "nosuchjob"))
    yield Case(("collect-ckpt", "--dir", "/nonexistent"))
    yield Case(("collect-ckpt", "--dir", "afile"))
    yield Case(("collect-ckpt", "--dir", "adir", "--to", "afile"))
    yield Case(("collect-ckpt", "--dir", "adir", "--to", "/proc/dest"))
    yield Case(("collect-ckpt", "--dir", "adir", "--jobs", "0"))
    yield Case(("collect-ckpt", "--dir", "adir", "--jobs", "x"))
    yield Case(("collect-ckpt", "--dir", "adir", "--world-size", "0"))
    yield Case(("collect-ckpt", "--dir", "adir", "--max-shard-size", "big"))
    yield Case(("collect-ckpt", "--dir", "adir", "--consolidate", "pickle"))
    yield Case(("collect-ckpt", "--dir", "adir", "--via", "ftp"))
    yield Case(("collect-ckpt", "--dir", "adir", "--tag", ""))
    yield Case(("status", "nosuchjob"))
    yield Case(("stop", "nosuchjob"))
    yield Case(("stop", "nosuchjob", "--grace", "nan"))
    yield Case(("render",))  # no --out, no --dry-run
    yield Case(("render", "--out", "afile"))
    yield Case(("render", "--out", "/proc/x"))
    yield Case(("sync", "code", "--exclude-from", "/missing"))
    yield Case(("sync", "code", "--exclude-from", "adir"))
    yield Case(("sync", "frob"))
    yield Case(("sync", "adir", "--dest", "../../etc"))  # outside the workdir
    yield Case(("sync", "adir", "--port", "x"))
    yield Case(("sync", "adir", "--port", "-1"))
    yield Case(("sync", "adir", "--port", "65530"))  # its 16 tries would pass 65535
    yield Case(("sync", ""))
    yield Case(("nodes", "build-ops", "--op", ""))
    yield Case(("nodes", "install", "--wheel", "/missing.whl"))
    yield Case(("nodes", "install", "--wheel", "notawheel.whl"))
    yield Case(("nodes", "install", "--wheel", "adir"))


# Inputs that must be accepted (guards against refusing too much).
GOOD: tuple[Case, ...] = (
    Case((*L, "train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--steps", "5",
          "--save", "2"), 0),
    Case((*L, "train.py", "--lr", "3e-4", "--zero-stage", "2"), 0),
    Case((*L, "--hang-timeout", "5m", "train.py"), 0),
    Case((*L, "--keepalive-timeout", "90s", "train.py"), 0),
    Case((*L, "--grace", "1m", "train.py"), 0),
    Case((*L, "--precision", "bf16", "train.py"), 0),
    Case((*L, "--keepalive-timeout", "0", "train.py"), 0),  # 0: off (docs/launch.md)
    Case((*L, "train.py", "--", "--nodes", "2"), 0),
    Case((*L, "--", "--steps", "5"), 0),
    Case((*R, "train.py", "--steps", "3"), 0),
    Case((*S, "--time", "1-00:00:00", "train.py"), 0),
    Case((*S, "--time", "30", "train.py"), 0),
    Case(("inventory", "validate"), 0),
    Case(("plan", "--nodes", "2", "--gpu-mem", "80GiB"), 0),
)


def bad_cases() -> list[Case]:
    out = [*_cases_numbers(), *_cases_launch(), *_cases_sbatch(), *_cases_other_verbs()]
    return list(dict.fromkeys(out))


def make_scratch(root: Path) -> None:
    for name, text in FILES.items():
        (root / name).write_text(text)
    for name in DIRS:
        (root / name).mkdir(exist_ok=True)
    (root / "home").mkdir(exist_ok=True)


@dataclass(frozen=True)
class Verdict:
    case: Case
    code: int
    stderr: str
    ok: bool
    why: str


def grade(case: Case, code: int, stderr: str) -> Verdict:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith("clusterkit: warning")]
    why = ""
    if "Traceback" in stderr:
        why = "traceback"
    elif code == 70:
        why = "internal error (70)"
    elif code != case.code:
        why = f"exit {code}, want {case.code}"
    elif case.code == 2 and "usage:" in stderr:
        why = "usage dump"
    elif case.code == 2 and len(errors) != 1:
        why = f"{len(errors)} error lines"
    elif case.code == 2 and not errors[0].startswith("clusterkit"):
        why = "line does not start with clusterkit"
    return Verdict(case, code, stderr, not why, why)


def run_in_process(case: Case) -> tuple[int, str]:
    from clusterkit.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(list(case.argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, err.getvalue()


def run_subprocess(case: Case, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "CLUSTERKIT_HOME": str(cwd / "home")}
    env.pop("CLUSTERKIT_DEBUG", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "clusterkit", *case.argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, "timeout"
    return proc.returncode, proc.stderr


def main(argv: list[str]) -> int:
    import tempfile

    use_sub = "--subprocess" in argv
    cases = bad_cases() + list(GOOD)
    with tempfile.TemporaryDirectory(prefix="ck-bad-") as tmp:
        root = Path(tmp)
        make_scratch(root)
        old = os.getcwd()
        os.chdir(root)
        os.environ["CLUSTERKIT_HOME"] = str(root / "home")
        verdicts = []
        try:
            for case in cases:
                code, err = run_subprocess(case, root) if use_sub else run_in_process(case)
                verdicts.append(grade(case, code, err))
        finally:
            os.chdir(old)
    bad = [v for v in verdicts if not v.ok]
    for v in bad:
        last = (v.stderr.strip().splitlines() or [""])[-1][:150]
        print(f"FAIL [{v.why}] {v.case.name!r}: {last}")
    print(f"{len(verdicts) - len(bad)} ok of {len(verdicts)} "
          f"({100 * (len(verdicts) - len(bad)) / len(verdicts):.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
