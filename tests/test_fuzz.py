"""Bad input never gets a traceback: random and mutated policy YAML (wrong types, unknown
keys, huge numbers, negative durations, wrong nesting, invalid UTF-8, truncation, anchors
that expand a billion-fold) through ``load_policy`` and ``orchestrator validate``, and
malformed command lines through every subcommand. Seeded, so a failure reproduces."""

from __future__ import annotations

import contextlib
import io
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, run
from launch.cli import EXIT_INVALID, main
from orchestrator.errors import PolicyError
from orchestrator.policy import Policy, load_policy

pytestmark = pytest.mark.timeout(300)

DEFAULT = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
VALUES: list[Any] = [
    None, True, -1, 0, 2**64, -(2**63), 10**400, 1e308, -1e308, float("inf"), float("-inf"),
    float("nan"), -0.5, "", "x" * 5000, "1e3", "∞", [], [1, 2], {}, {"a": 1}, [[[[]]]],
    {"kind": "crash"}, {"kind": "nope", "step": 1}, "s3://", "../../etc", "\x00",
]  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _set(doc[path[0]], path[1:], value)
    return doc


def mutate(rng: random.Random) -> Any:
    """The default policy with 1-3 random mutations: a value of another type or size, a
    key deleted, added or renamed, a section nested in a list or a mapping."""
    import copy

    doc = copy.deepcopy(DEFAULT) or {}
    doc.setdefault("faults", [{"kind": "crash", "step": 5}, {"kind": "slow_storage", "seconds": 1}])
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(doc)[1:])
        op = rng.randrange(5)
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        if op == 0:
            _set(doc, path, rng.choice(VALUES))
        elif op == 1 and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == 2 and isinstance(parent, dict):
            parent[f"{path[-1]}_typo"] = parent.pop(path[-1])
        elif op == 3:
            _set(doc, path, [parent[path[-1]]] if rng.random() < 0.5 else {"x": parent[path[-1]]})
        else:
            _set(doc, path, -abs(rng.choice([1, 0.5, 10**9])))  # negative numbers, durations
    return doc


def texts(rng: random.Random, n: int) -> list[bytes]:
    """``n`` policy files: mutated documents, some then damaged as text."""
    out = []
    for i in range(n):
        body = yaml.safe_dump(mutate(rng), allow_unicode=True).encode()
        kind = i % 6
        if kind == 1:
            body = body[: rng.randrange(len(body))]  # truncated mid-way
        elif kind == 2:
            at = rng.randrange(len(body))
            body = body[:at] + b"\xff\xfe\xc3(" + body[at:]  # invalid UTF-8
        elif kind == 3:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        out.append(body)
    return out


SPECIAL = [
    b"",
    b"null",
    b"- a\n- b\n",
    b"42",
    b"snapshot: [every_steps: 5]",
    b"snapshot:\n  every_steps: 10\nsnapshot:\n  keep: 2\n",
    b"supervisor: {hang_timeout_s: -5}",
    b"supervisor: {hang_timeout_s: .inf}",
    b"supervisor: {hang_timeout_s: .nan}",
    b"snapshot: {keep: 100000000000}",
    b"faults: [{kind: kill_persist, phase: manifest, step: 1, rank: 3}]",
    b"\xef\xbb\xbfsnapshot: {every_steps: 5}",  # a byte-order mark: still a policy
    b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
    + b"".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n".encode()
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + b"faults: [*i]\n",  # 9^9 nodes once expanded: the billion laughs
    b"[" * 5000 + b"]" * 5000,
    b"!!python/object/apply:os.system ['echo pwned']",
]


def _check(path: Path) -> None:
    try:
        policy = load_policy(path)
    except PolicyError as err:
        said = str(err)
        assert str(path) in said, said  # names the file
        assert "Traceback" not in said
        return
    assert isinstance(policy, Policy)


def test_mutated_policies_load_or_fail_naming_the_path(tmp_path: Path) -> None:
    rng = random.Random(19)
    for i, body in enumerate([*SPECIAL, *texts(rng, 1500)]):
        path = tmp_path / f"p{i}.yaml"
        path.write_bytes(body)
        try:
            _check(path)
        except Exception as err:
            pytest.fail(f"{path} ({body[:200]!r}): {type(err).__name__}: {err}")


def test_every_misspelt_key_is_refused_by_name(tmp_path: Path) -> None:
    """Loads-or-fails would also pass a policy whose misspelt key is silently ignored (its
    setting then never applies): every key of the default policy, renamed, is refused with
    the new name in the message."""
    import copy

    doc = {**DEFAULT, "faults": [{"kind": "crash", "step": 5}]}
    keys = [p for p in _paths(doc)[1:] if not isinstance(p[-1], int)]
    assert len(keys) > 50
    for i, key in enumerate(keys):
        bad = copy.deepcopy(doc)
        parent = bad
        for part in key[:-1]:
            parent = parent[part]
        parent[f"{key[-1]}_typo"] = parent.pop(key[-1])
        path = tmp_path / f"typo{i}.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(PolicyError, match=f"{key[-1]}_typo"):
            load_policy(path)


@pytest.mark.parametrize("body", [b for b in SPECIAL if b"hang_timeout_s" in b or b"keep: 1000" in b
                                  or b"python/object" in b or b"[" * 100 in b])  # fmt: skip
def test_the_known_bad_specials_are_refused(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(body)
    with pytest.raises(PolicyError, match=str(path)):
        load_policy(path)


def test_a_bad_field_is_named_by_its_yaml_path(tmp_path: Path) -> None:
    cases = {
        b"supervisor: {hang_timeout_s: -5}": "supervisor.hang_timeout_s",
        b"supervisor: {hang_timeout_s: .nan}": "supervisor.hang_timeout_s",
        b"persist: {every_steps: [1]}": "persist.every_steps",
        b"snapshot: {keep: 100000000000}": "snapshot.keep",
        b"faults: [{kind: crash, step: 1}, {kind: crash, stp: 2}]": "faults[1].stp",
        b"snapshot: [every_steps: 5]": "snapshot",
        b"detect: {spike: {zscore: yes please}}": "detect.spike.zscore",
    }
    for body, where in cases.items():
        path = tmp_path / "p.yaml"
        path.write_bytes(body)
        with pytest.raises(PolicyError) as err:
            load_policy(path)
        assert f"  {where}:" in str(err.value), (body, str(err.value))


def _cli(argv: list[str]) -> tuple[int, str]:
    """``orchestrator`` in this process: its exit code and everything it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's usage errors
            code = stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue()


def test_validate_exits_2_on_every_bad_policy(tmp_path: Path) -> None:
    rng = random.Random(5)
    for i, body in enumerate([*SPECIAL, *texts(rng, 200)]):
        path = tmp_path / f"p{i}.yaml"
        path.write_bytes(body)
        code, said = _cli(["validate", str(path)])
        assert code in (0, EXIT_INVALID), (body[:200], said)
        assert "Traceback" not in said and (code == 0 or str(path) in said), said
    for path in (tmp_path / "missing.yaml", tmp_path):  # absent; a directory
        code, said = _cli(["validate", str(path)])
        assert code == EXIT_INVALID and str(path) in said, said
    # The real command line, as a user runs it: exit 2, one message, no traceback.
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"supervisor: {hang_timeout_s: -5}\x80")
    r = run([sys.executable, "-m", "launch.cli", "validate", str(bad)], timeout=60)
    assert r.returncode == EXIT_INVALID and "Traceback" not in r.stdout, r.stdout


def test_malformed_command_lines_never_trace_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every subcommand with missing, unknown or malformed arguments, and arguments that
    name nothing usable (missing paths, files for directories, unknown URL schemes)."""
    monkeypatch.chdir(tmp_path)  # whatever a command creates lands here
    a_file = tmp_path / "a-file"
    a_file.write_text("not a run directory")
    bad_policy = tmp_path / "bad.yaml"
    bad_policy.write_text("snapshot: {every_steps: -1}")
    argvs: list[list[str]] = [
        [], ["nope"], ["--help-me"], ["validate"], ["validate", "a", "b"],
        ["snapshots"], ["snapshots", str(tmp_path / "none")], ["snapshots", str(a_file)],
        ["snapshots", "nosuchscheme://x/y"], ["snapshots", "memory://nothing"],
        ["snapshots", "--quick"],
        ["status"], ["status", str(tmp_path / "none")], ["status", str(a_file)],
        ["status", str(tmp_path), "--interval", "abc"], ["status", str(tmp_path), "--follow",
                                                          "--interval", "-1"],
        ["report"], ["report", str(tmp_path / "none")], ["report", str(a_file)],
        ["launch"], ["launch", "--"], ["launch", "--nproc", "abc", "x.py"],
        ["launch", "--nproc", "2"], ["launch", "--policy", str(bad_policy), "--", "true"],
        ["launch", "--policy", str(tmp_path / "none.yaml"), "--", "true"],
        ["launch", "--run-dir", str(a_file), "--", "true"],
        ["health"], ["health", "--policy", str(bad_policy), "--", "torchrun"],
        ["demo", "--steps", "many"], ["demo", "--steps", "-5"],
    ]  # fmt: skip
    rng = random.Random(7)
    words = ["validate", "snapshots", "status", "report", "launch", "health", "demo",
             "--policy", "--run-dir", "--nproc", "--steps", "--out", "--quick", "--fresh",
             "--interval", "--follow", "-5", "1e9", "\x00", "é", "", "nosuch://",
             str(a_file)]  # fmt: skip
    for _ in range(150):
        argv = [rng.choice(words) for _ in range(rng.randint(1, 5))]
        if argv[0] in ("launch", "health", "demo") or "launch" in argv[:1]:
            argv.insert(1, "--nproc=x")  # never starts anything: a usage error first
        argvs.append(argv)
    for argv in argvs:
        try:
            code, said = _cli(argv)
        except Exception as err:
            pytest.fail(f"orchestrator {argv}: {type(err).__name__}: {err}")
        assert "Traceback" not in said, (argv, said)
        assert code in (0, 1, EXIT_INVALID), (argv, code, said)
