"""The suite's pytest-xdist scheduler (tests/conftest.py): files stay whole, and every file that uses the
session's SmolLM2 server or conversion shares one worker with the others."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import SMOLLM2_FILES, worker_group

TESTS = Path(__file__).parent
# what starts, converts or fetches SmolLM2 once a session
SESSION_SMOLLM2 = re.compile(r"\bsmollm2_server\b|\bconversion_cache\b|\bfetch_gguf_model\(")


def test_every_file_that_uses_smollm2_shares_its_worker():
    users = {path.name for path in TESTS.glob("test_*.py") if SESSION_SMOLLM2.search(path.read_text())}
    assert users == SMOLLM2_FILES, "keep SMOLLM2_FILES in tests/conftest.py to the files that use SmolLM2"


def test_the_scheduler_groups_by_file_and_smollm2():
    assert worker_group("tests/test_mla.py::test_a[v3-moe-tp4]") == worker_group("tests/test_mla.py::test_b") \
        == "tests/test_mla.py"
    assert worker_group("tests/test_server.py::test_x") == "tests/test_server.py"
    assert {worker_group(f"tests/{name}::test_x[a::b]") for name in SMOLLM2_FILES} == {"smollm2"}
