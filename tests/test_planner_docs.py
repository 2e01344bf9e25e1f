"""docs/planner.md's `$ kvshard plan ...` examples are what the command prints today: each example is run and every
line it shows (an example may leave lines out with `...`; a table's title is compared without the padding that
centres it) must be a line of the output, so that a change to the planner's model cannot leave its docs behind."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kvshard.entrypoints.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner.md"


def _examples() -> list[tuple[int, str, list[str]]]:
    lines = DOC.read_text().split("\n")
    examples = []
    for i, line in enumerate(lines):
        if line.startswith("$ kvshard plan"):
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            examples.append((i + 1, line[2:], lines[i + 1:j]))
    return examples


EXAMPLES = _examples()


def test_the_doc_has_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("line, command, shown", EXAMPLES, ids=[f"line{e[0]}" for e in EXAMPLES])
def test_an_example_shows_what_the_command_prints(capsys, monkeypatch, line, command, shown):
    # the tables' width: the docs' examples are printed off a terminal, at the planner's 160 columns (a test
    # worker may see another width through the environment)
    monkeypatch.setenv("COLUMNS", "160")
    try:
        status = main(shlex.split(command)[1:])
    except SystemExit as ended:  # argparse's own errors
        status = ended.code
    captured = capsys.readouterr()
    printed = [text.rstrip() for text in (captured.out + captured.err).split("\n")]
    stripped = {text.strip() for text in printed}
    for text in shown:
        if text.strip() == "...":
            continue
        if text == "(exit code 2)":
            assert status == 2, command
            continue
        assert text in printed or text.strip() in stripped, f"docs/planner.md line {line}: {command}\n  shows {text!r}"
