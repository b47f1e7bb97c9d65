"""The docs cannot drift from the code: every `marge ...` command line in the README, docs/ and deploy/README.md
names subcommands and flags the CLI has, and every repository path they name exists.

Command lines are read from fenced code blocks (each line starting with `marge `, after `$ ` or environment
assignments) and from inline code spans that start with `marge `. Flags are checked against the argparse parser
of the subcommand they follow (`services.cli.build_parser`); paths are tokens under one of the repository's own
top-level folders (outputs a command writes, such as `runs/` or `data/prepared/`, are not checked).
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_FOLDERS = ("deploy/", "docs/", "services/", "shared/", "tests/", "benchmarks/", "experiments/", "scripts/",
                "tools/")
"""Paths under these are the repository's own and must exist; data/ and runs/ hold what commands write."""
OTHER_PROGRAMS = {"--build-arg", "--dashboard-host", "--metrics-export-port", "--node-ip-address", "--tls-cert-file",
                  "--tls-key-file", "--tls-port"}
"""Flags the docs quote of other programs (`ray start`, `redis-server`, `docker build`)."""


def script_flags() -> set[str]:
    """Flags the repository's scripts define (benchmarks, experiments, tools): `add_argument("--name"`."""
    flags = set()
    for folder in ("benchmarks", "experiments", "tools", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            flags |= set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text(encoding="utf-8")))
    return flags


def command_lines(text: str) -> list[str]:
    """`marge ...` command lines of a Markdown text: in fenced blocks (continuation lines joined) and inline code."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"^\s*(\$ )?((\w+=\S+) )*", "", line)
            if line.startswith("marge "):
                lines.append(line.split(" #", 1)[0].split(" | ", 1)[0].split(" && ", 1)[0].strip())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += [span.strip() for span in re.findall(r"`(marge [^`]+)`", prose)]
    return lines


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def check(line: str, root: argparse.ArgumentParser) -> list[str]:
    """What in `line` the CLI does not have (empty: all of it exists)."""
    try:
        words = shlex.split(line)[1:]
    except ValueError:
        words = line.split()[1:]
    problems, parser, path = [], root, ["marge"]
    for word in words:
        if word in ("...", "…") or word.startswith(("<", "[")) or "*" in word:
            continue
        children = subparsers(parser)
        if children and not word.startswith("-"):
            if word not in children:
                if word.isupper() or not word.isidentifier() and "-" not in word:
                    continue  # a placeholder (PATH, RUN_DIR)
                problems.append(f"`{' '.join(path)}` has no subcommand {word!r}")
                break
            parser, path = children[word], [*path, word]
            continue
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            if flag not in parser._option_string_actions:
                problems.append(f"`{' '.join(path)}` has no flag {flag}")
    return problems


def repo_paths(text: str) -> list[str]:
    """Paths under the repository's own folders: a name with an extension or a folder (`docs/s`, a unit, is not)."""
    candidates = re.findall(r"(?<![\w/.-])((?:%s)[\w./-]*[\w/])" % "|".join(map(re.escape, REPO_FOLDERS)), text)
    return sorted({c.rstrip(".") for c in candidates
                   if "<" not in c and "{" not in c and ("." in c.rsplit("/", 1)[-1] or c.endswith("/") or c.count("/") > 1
                                                         or len(c.rsplit("/", 1)[-1]) > 2)})


def every_flag(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and its subcommands, at any depth."""
    flags = set(parser._option_string_actions)
    for child in subparsers(parser).values():
        flags |= every_flag(child)
    return flags


def bare_flags(text: str) -> list[str]:
    """Flags quoted on their own in prose (`--heldout-permille N`)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return sorted({m.split("=", 1)[0] for m in re.findall(r"`(--[a-z][a-z0-9-]*)[ =`]", prose)})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_marge_command_in_the_docs_names_subcommands_and_flags_the_cli_has(doc):
    from services.cli import build_parser

    root = build_parser()
    problems = [f"{line!r}: {p}" for line in command_lines(doc.read_text(encoding="utf-8")) for p in check(line, root)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_the_docs_quote_on_its_own_is_a_flag_of_a_command_or_script(doc):
    from services.cli import build_parser

    known = every_flag(build_parser()) | script_flags() | OTHER_PROGRAMS
    unknown = [f for f in bare_flags(doc.read_text(encoding="utf-8")) if f not in known]
    assert not unknown, f"{doc.relative_to(REPO)} quotes flags no marge command has: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_the_docs_name_exists(doc):
    missing = [p for p in repo_paths(doc.read_text(encoding="utf-8")) if not (REPO / p).exists()]
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def misnamed_steps(text: str) -> list[str]:
    """`step-...` names (checkpoints, snapshots) in a text that the code would never write: a number not formatted
    as `snapshot_dirname` / `save_checkpoint` format it (`step-N`, `step-0` in prose and `step-*` are placeholders)."""
    from marge.model.snapshot import snapshot_dirname

    return [name for name in re.findall(r"step-[0-9]+", text)
            if name not in ("step-0",) and snapshot_dirname(int(name[5:])) != name]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_checkpoint_and_snapshot_name_the_docs_quote_is_one_the_code_writes(doc):
    wrong = misnamed_steps(doc.read_text(encoding="utf-8"))
    assert not wrong, f"{doc.relative_to(REPO)} names checkpoints or snapshots the code never writes: {wrong}"


def test_the_checks_find_a_flag_a_subcommand_and_a_path_that_do_not_exist():
    from services.cli import build_parser

    root = build_parser()
    text = "```bash\nmarge prepare in.jsonl --out x --max-pairs-each 3\nmarge pretrain --config a.yaml\n```\n" \
           "Run `marge audit --run runs/x --json`, then `marge frobnicate --now`; see docs/nowhere.md and docs/data.md;" \
           " `--heldout-permille N` and `--no-such-flag` are quoted on their own."
    lines = command_lines(text)
    assert lines == ["marge prepare in.jsonl --out x --max-pairs-each 3", "marge pretrain --config a.yaml",
                     "marge audit --run runs/x --json", "marge frobnicate --now"]
    assert [p for line in lines for p in check(line, root)] == [
        "`marge prepare` has no flag --max-pairs-each", "`marge` has no subcommand 'frobnicate'"]
    assert repo_paths(text) == ["docs/data.md", "docs/nowhere.md"]
    assert [f for f in bare_flags(text) if f not in every_flag(root)] == ["--no-such-flag"]
    assert misnamed_steps("runs/x/checkpoints/step-00000300, step-300, step-0000300 and step-N") == ["step-300",
                                                                                                  "step-0000300"]
