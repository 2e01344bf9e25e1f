"""Per test file: the `assert` statements and `pytest.raises` / `pytest.warns` checks it holds (read from
its source), so that a change to the suite can show that no check went away.

    python scripts/count_assertions.py [tests] > counts.tsv
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def checks(path: Path) -> int:
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assert):
            count += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "raises", "warns") and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest":
            count += 1
    return count


def main(root: str = "tests") -> None:
    total = 0
    for path in sorted(Path(root).glob("*.py")):
        n = checks(path)
        total += n
        print(f"{path.name}\t{n}")
    print(f"total\t{total}")


if __name__ == "__main__":
    main(*sys.argv[1:])
