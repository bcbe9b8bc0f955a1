"""Command lines shown in README.md and docs/ name only flags the CLIs accept.

Every `python -m metaseq.X ...` (and `python deprecated/reshard_mp.py ...`) in a
fenced bash block is parsed: each `--flag` must be an option of that CLI's parser,
taken from the module's `build_parser()` when it has one, else from `--help`.
Where a parser is available the whole command must also parse (choices, types).
"""
import argparse
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deprecated" / "README.md"]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
PYTHON = re.compile(r"^(?:\S*/)?python3?$")
SEPARATORS = {"|", "&&", "||", ";", "&"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    target: str  # module name, or a script path relative to the repo
    argv: tuple[str, ...]


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the first line, body) of every ```bash fenced block."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def logical_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """Join backslash continuations; drop comments and blank lines."""
    out, pending, start = [], "", first_line
    for n, line in enumerate(body.splitlines(), start=first_line):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined = (pending + line).strip()
        pending = ""
        if joined and not joined.startswith("#"):
            out.append((start, joined))
    return out


def find_commands(doc: Path) -> list[Command]:
    commands = []
    for first, body in bash_blocks(doc.read_text()):
        for n, line in logical_lines(body, first):
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                if not PYTHON.match(word) or i + 1 >= len(words):
                    continue
                rest = words[i + 1 :]
                end = next((j for j, w in enumerate(rest) if w in SEPARATORS), len(rest))
                rest = rest[:end]
                if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("metaseq."):
                    commands.append(Command(doc.name, n, rest[1], tuple(rest[2:])))
                elif rest and rest[0].startswith("deprecated/") and rest[0].endswith(".py"):
                    commands.append(Command(doc.name, n, rest[0], tuple(rest[1:])))
    return commands


@cache
def parser_for(target: str) -> argparse.ArgumentParser | None:
    """The CLI's own parser via `build_parser()`, or None when it has none."""
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"doc_check_{Path(target).stem}", REPO / target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    build = getattr(module, "build_parser", None)
    return build() if build else None


@cache
def accepted_flags(target: str) -> frozenset[str]:
    parser = parser_for(target)
    if parser is not None:
        return frozenset(s for s in parser._option_string_actions if s.startswith("--"))
    cmd = [sys.executable, str(REPO / target)] if target.endswith(".py") else [sys.executable, "-m", target]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, f"{target} --help failed: {proc.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", proc.stdout))


def flags_of(argv: tuple[str, ...]) -> list[str]:
    return [word.split("=", 1)[0] for word in argv if word.startswith("--") and word != "--"]


def unknown_flags(command: Command) -> list[str]:
    return [f for f in flags_of(command.argv) if f not in accepted_flags(command.target)]


def parse_error(command: Command) -> str | None:
    """Why the CLI's parser rejects the whole command, or None (also when it has no parser)."""
    parser = parser_for(command.target)
    if parser is None:
        return None
    parser.exit_on_error = False
    try:
        parser.parse_args(list(command.argv))
    except SystemExit as e:  # --help exits 0; argparse still exits for some errors (missing options)
        return None if e.code in (0, None) else f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 -- argparse.ArgumentError, or a CLI's own error type
        return str(e)
    return None


def module_exists(target: str) -> bool:
    if target.endswith(".py"):
        return (REPO / target).is_file()
    return importlib.util.find_spec(target) is not None


ALL_COMMANDS = [c for doc in DOC_FILES if doc.exists() for c in find_commands(doc)]


def test_docs_show_the_reshard_recipes():
    """The checks below cannot pass vacuously: the docs do show commands."""
    assert all(doc.exists() for doc in DOC_FILES), [str(d) for d in DOC_FILES if not d.exists()]
    targets = [c.target for c in ALL_COMMANDS]
    assert targets.count("metaseq.scripts.reshard_fsdp") >= 6
    assert "metaseq.cli.interactive_cli" in targets
    assert any(c.doc == "README.md" for c in ALL_COMMANDS)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_command_uses_only_accepted_flags(command):
    where = f"{command.doc} line {command.line}: {command.target}"
    assert module_exists(command.target), f"{where}: no such module or script"
    assert not unknown_flags(command), f"{where}: the CLI does not accept {unknown_flags(command)}"
    error = parse_error(command)
    assert error is None, f"{where}: the CLI rejects {shlex.join(command.argv)}: {error}"


def test_checker_catches_a_flag_the_cli_lacks(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text(
        "```bash\n"
        'python -m metaseq.scripts.reshard_fsdp --input "a-shard*.pt" \\\n'
        "    --output b.pt --num-output-shard 2  # singular: wrong\n"
        "echo hi | python3 -m metaseq.cli.interactive_cli --path x.pt --beam 4\n"
        "```\n"
        "```text\npython -m metaseq.scripts.reshard_fsdp --not-checked\n```\n"
    )
    commands = find_commands(doc)
    assert [(c.line, c.target) for c in commands] == [
        (2, "metaseq.scripts.reshard_fsdp"),
        (4, "metaseq.cli.interactive_cli"),
    ]
    assert unknown_flags(commands[0]) == ["--num-output-shard"]  # no prefix matching
    assert unknown_flags(commands[1]) == ["--beam"]


def test_help_fallback_reads_flags_of_a_module_without_build_parser():
    flags = accepted_flags("json.tool")  # stdlib CLI with no build_parser()
    assert {"--sort-keys", "--indent"} <= flags
