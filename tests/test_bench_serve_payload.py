"""`kvshard bench serve --extra-body`: its fields reach every request sent."""

import argparse

import pytest

from kvshard.bench.cli import _json_object
from kvshard.bench.serve import completion_payload
from kvshard.bench.workloads import BenchRequest


def test_extra_body_fields_are_added_to_each_request():
    request = BenchRequest([1, 2, 3], 8)
    plain = completion_payload("m", request)
    assert plain["prompt"] == [1, 2, 3] and plain["max_tokens"] == 8 and "response_format" not in plain
    extra = {"response_format": {"type": "json_object"}, "max_tokens": 4}
    sent = completion_payload("m", request, extra)
    assert sent["response_format"] == {"type": "json_object"} and sent["max_tokens"] == 4
    assert completion_payload("m", request) == plain  # nothing carried over between requests


def test_extra_body_must_be_a_json_object():
    assert _json_object('{"a": 1}') == {"a": 1}
    for bad in ("[1]", "{nope", "3"):
        with pytest.raises(argparse.ArgumentTypeError):
            _json_object(bad)
