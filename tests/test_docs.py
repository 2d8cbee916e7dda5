"""The docs stay true: the README is a landing page, links resolve, every command shown parses
with the real CLI, and no tracked file names an absolute path of a developer's machine. Also the
shared-data and optional-oracle helpers (tests.graphs.shared_data, tests.graphs.oracle): a skip
outside CI, a failure under CI=true."""

from __future__ import annotations

import argparse
import contextlib
import io
import runpy
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import tests.graphs as graphs

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
BENCH_README = REPO / "benchmarks" / "README.md"
README_LIMIT = 10_000
OPENING = ("make demo", "make test")

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def block_commands(block: str) -> list[str]:
    """The command lines of a code block, continuation lines (``\\``) joined."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    if current:
        lines.append(current)
    return lines


def dorylus_argv(command: str) -> list[str] | None:
    """The arguments after the ``dorylus`` program in a shell line, or None if it runs no dorylus."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for k, word in enumerate(words):
        if (word == "dorylus" or word.endswith("/dorylus")) and (k == 0 or words[k - 1] not in ("-u", "--user")):
            return words[k + 1:]
    return None


@lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    from dorylus.cli import build_parser

    return build_parser()


def subparsers() -> dict[str, argparse.ArgumentParser]:
    for action in parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("dorylus.cli.build_parser() has no subcommands")


def option_strings(sub: argparse.ArgumentParser) -> set[str]:
    return {s for action in sub._actions for s in action.option_strings}


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every dorylus command line in a code block of README.md or docs/."""
    found = []
    for page in PAGES:
        for block in code_blocks(page.read_text()):
            for line in block_commands(block):
                if dorylus_argv(line) is not None:
                    found.append((_rel(page), line.strip()))
    return found


def mentioned_flags() -> list[tuple[str, str, str]]:
    """(page, subcommand, flag) for every ``dorylus <sub> ... --flag`` in inline code and code blocks."""
    found = []
    for page in PAGES + [BENCH_README]:
        text = page.read_text()
        spans = INLINE.findall(FENCE.sub("", text))
        spans += [line for block in code_blocks(text) for line in block_commands(block)]
        for span in spans:
            argv = dorylus_argv(span)
            if not argv or not re.fullmatch(r"[a-z][a-z-]*", argv[0]):
                continue  # `dorylus --help`, or a placeholder such as `dorylus <subcommand>`
            for flag in FLAG.findall(" ".join(argv[1:])):
                found.append((_rel(page), argv[0], flag))
    return found


# ----------------------------------------------------------------------------- the README


def test_readme_is_a_landing_page():
    text = README.read_text()
    assert len(text) <= README_LIMIT, f"README.md has {len(text):,} characters; at most {README_LIMIT:,}"


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first = FENCE.search(text)
    assert first is not None, "README.md has no code block"
    before = text[: first.start()].strip()
    assert before.startswith("#") and "\n" not in before, f"README.md must open with its title, then the commands: {before!r}"
    lines = [line.split("#")[0].strip() for line in first.group(1).strip().splitlines()]
    assert tuple(lines) == OPENING, f"README.md's first code block must be exactly {OPENING}, got {lines}"


def test_readme_commands_are_make_targets():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    for target in [c.split()[1] for c in OPENING]:
        assert target in targets, f"README.md runs `make {target}`, which the Makefile does not define"
    for page in PAGES + [BENCH_README]:
        for target in re.findall(r"`make ([a-z][\w-]*)`", page.read_text()):
            assert target in targets, f"{_rel(page)} mentions `make {target}`, which the Makefile does not define"


# ----------------------------------------------------------------------------- links


def test_docs_exist():
    names = {p.name for p in DOCS}
    for name in ("architecture.md", "runs.md", "models.md", "modes.md", "backends.md", "planning.md",
                 "security.md", "aws.md"):
        assert name in names, f"docs/{name} is missing"


@pytest.mark.parametrize("page", PAGES + [BENCH_README], ids=lambda p: _rel(p))
def test_relative_links_point_at_files(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # http(s)://, mailto:, or an anchor in the same page
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_rel(page)} links to missing files: {broken}"


# ----------------------------------------------------------------------------- commands


def test_docs_show_commands():
    assert len(documented_commands()) >= 20  # the parsing below found them


@pytest.mark.parametrize("page,command", documented_commands())
def test_documented_command_parses(page, command):
    argv = dorylus_argv(command)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{page}: `{command}` does not parse (exit {exc.code}): {stderr.getvalue().strip()}")


def test_mentioned_flags_exist():
    subs = subparsers()
    wrong = []
    for page, sub, flag in mentioned_flags():
        if sub not in subs:
            wrong.append(f"{page}: `dorylus {sub}` is no subcommand")
        elif flag not in option_strings(subs[sub]):
            wrong.append(f"{page}: `dorylus {sub}` has no {flag}")
    assert not wrong, "\n".join(wrong)


def test_mentioned_flags_were_found():
    assert len(mentioned_flags()) >= 50


def benchmark_commands() -> dict[str, set[str]]:
    """benchmarks/<script>.py -> the flags the docs pass to it."""
    found: dict[str, set[str]] = {}
    for page in PAGES + [BENCH_README]:
        text = page.read_text()
        spans = INLINE.findall(FENCE.sub("", text)) + [l for b in code_blocks(text) for l in block_commands(b)]
        for span in spans:
            match = re.search(r"(benchmarks/bench_\w+\.py|\bbench_\w+\.py)(.*)", span)
            if match:
                script = match.group(1) if "/" in match.group(1) else f"benchmarks/{match.group(1)}"
                found.setdefault(script, set()).update(FLAG.findall(match.group(2).split("#")[0]))
    return found


def test_benchmark_commands_use_real_flags(monkeypatch):
    commands = benchmark_commands()
    assert commands, "the docs mention no benchmark script"
    for script in commands:
        assert (REPO / script).is_file(), f"{script} is mentioned in the docs but does not exist"
    checked = sorted(script for script, flags in commands.items() if flags)
    # In this process, as ``python SCRIPT --help`` runs it: torch and the project import once, not
    # once per script (a process each took 12.8 s of the suite).
    wrong = []
    for script in checked:
        out = io.StringIO()
        with monkeypatch.context() as patch:
            patch.setattr(sys, "argv", [script, "--help"])
            patch.syspath_prepend(str((REPO / script).parent))
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
                runpy.run_path(str(REPO / script), run_name="__main__")
        assert exit_.value.code in (0, None), f"{script} --help exited {exit_.value.code}"
        wrong += [f"{script} has no {flag}" for flag in sorted(commands[script] - set(FLAG.findall(out.getvalue())))]
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- absolute paths

# Built from pieces so that this file does not match itself.
MACHINE_PATHS = re.compile("(?<![\\w.~-])/(" + "|".join(("wo" + "rk", "ro" + "ot", "ho" + "me")) + ")/")
# In code (not in prose, which may say where the system puts a temp file), a string literal naming a
# path under /tmp: a fixed name there ignores TMPDIR and is predictable in a directory every user
# can write; tempfile.gettempdir() or mkdtemp() is the portable spelling. "/tmp" alone stays
# allowed (a short fallback for a Unix socket's directory, dorylus/coordinator/local.py), as do
# URLs like ipc:///tmp/x in examples.
TMP_LITERALS = re.compile("[\"'`]/" + "tmp" + "/[\\w.$-]")


def test_no_absolute_machine_paths():
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listing.returncode != 0:
        pytest.skip(f"not a git checkout: {listing.stderr.decode().strip()}")
    files = listing.stdout
    hits = []
    for name in filter(None, files.decode().split("\0")):
        path = REPO / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        code = not name.endswith(".md")
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATHS.search(line) or (code and TMP_LITERALS.search(line)):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, ("absolute machine paths (use paths relative to the checkout, or tempfile's temp "
                      "directory):\n" + "\n".join(hits))


def test_machine_path_pattern():
    assert MACHINE_PATHS.search("x = '/" + "work/shared/data/cora.npz'")
    assert MACHINE_PATHS.search("cd /" + "home/me/dorylus")
    assert not MACHINE_PATHS.search("../shared/data/cora.npz")
    assert not MACHINE_PATHS.search("/etc/dorylus/cluster.json and /opt/dorylus/bin/dorylus")


def test_tmp_literal_pattern():
    tmp = "/" + "tmp"
    for line in (f'default="{tmp}/dorylus-scale"', f"Path('{tmp}/x.npz')", f'dir="{tmp}/$USER"'):
        assert TMP_LITERALS.search(line), line
    for line in (f'for parent in (None, "{tmp}"):', f'advertised_endpoint("ipc://{tmp}/x", "host")',
                 f"under ``$TMPDIR`` or ``{tmp}``", "tempfile.gettempdir()", '"/var/tmp-cache/x"'):
        assert not TMP_LITERALS.search(line), line


# ----------------------------------------------------------------------------- shared test data


def test_shared_data_is_relative_to_the_checkout():
    assert graphs.SHARED_DATA == REPO.parent / "shared" / "data"


def test_shared_data_returns_an_existing_file(tmp_path, monkeypatch):
    (tmp_path / "cora.npz").write_bytes(b"x")
    monkeypatch.setattr(graphs, "SHARED_DATA", tmp_path)
    monkeypatch.setenv("CI", "true")
    assert graphs.shared_data("cora.npz") == tmp_path / "cora.npz"


def test_missing_shared_data_skips_outside_ci(tmp_path, monkeypatch):
    monkeypatch.setattr(graphs, "SHARED_DATA", tmp_path)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="cora.npz is missing"):
        graphs.shared_data("cora.npz")


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_missing_shared_data_fails_in_ci(tmp_path, monkeypatch, value):
    monkeypatch.setattr(graphs, "SHARED_DATA", tmp_path)
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="cora.npz is missing.*CI=true"):
        graphs.shared_data("cora.npz")


def test_ci_false_is_not_ci(tmp_path, monkeypatch):
    monkeypatch.setattr(graphs, "SHARED_DATA", tmp_path)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        graphs.shared_data("cora.npz")


# ----------------------------------------------------------------------------- optional oracles


def test_an_oracle_that_imports_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert graphs.oracle("json", reason="x") is __import__("json")


def test_a_missing_oracle_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_oracle_module cannot be imported.*the oracle"):
        graphs.oracle("no_such_oracle_module", reason="the oracle")


def test_a_missing_oracle_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_oracle_module.*CI=true"):
        graphs.oracle("no_such_oracle_module", reason="the oracle")
