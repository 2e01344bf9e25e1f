"""kvshard's walk over a GGUF file's header (kvshard/models/gguf.py `read_gguf_header`) against the gguf library's
own reader, `gguf.GGUFReader`, on files the library writes: every metadata value, every tensor's name, type, shape
and data, in every tensor type the converter reads and with a non-default alignment."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvshard.config import ConfigError
from kvshard.models.gguf import _header_from_reader, read_gguf_header

TENSOR_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def write_gguf(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name("header test")
    writer.add_block_count(3)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bool("test.flag", True)
    writer.add_int64("test.signed", -7)
    writer.add_float64("test.double", 0.125)
    writer.add_array("test.numbers", [3, 1, 4, 1, 5])
    writer.add_token_list([f"tok{i}" for i in range(300)] + ["é", "日本"])
    writer.add_token_merges(["t o", "to k"])
    writer.add_chat_template("{{ messages }}")
    for i, tensor_type in enumerate(TENSOR_TYPES):
        weights = rng.standard_normal((4 + i, 64), dtype=np.float32)
        if tensor_type == Q.F32:
            writer.add_tensor(f"blk.{i}.w", weights)
        elif tensor_type == Q.F16:
            writer.add_tensor(f"blk.{i}.w", weights.astype(np.float16))
        else:
            writer.add_tensor(f"blk.{i}.w", gguf.quants.quantize(weights, tensor_type), raw_dtype=tensor_type)
    writer.add_tensor("norm.weight", rng.standard_normal(7, dtype=np.float32))  # 1-D, an odd length
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_walk_reads_what_gguf_reader_reads(tmp_path, alignment):
    path = write_gguf(tmp_path / "test.gguf", alignment)
    walked, reference = read_gguf_header(path), _header_from_reader(path)
    assert walked.fields == reference.fields
    assert walked.fields["tokenizer.ggml.tokens"] == 302  # a string array: its length
    assert walked.fields["test.numbers"] == [3, 1, 4, 1, 5]
    assert walked.fields["general.alignment" if alignment else "general.name"] == (alignment or "header test")
    assert [t.name for t in walked.tensors] == [t.name for t in reference.tensors]
    assert {t.tensor_type for t in walked.tensors} == set(TENSOR_TYPES)
    for got, want in zip(walked.tensors, reference.tensors):
        assert (got.tensor_type, got.shape) == (want.tensor_type, want.shape), got.name
        assert (got.data.dtype, got.data.shape) == (want.data.dtype, want.data.shape), got.name
        assert np.array_equal(got.data, want.data, equal_nan=True), got.name
        assert not got.data.flags.writeable  # a view of the mapped file, copied by the conversion
        assert np.array_equal(gguf.quants.dequantize(got.data, got.tensor_type),
                              gguf.quants.dequantize(want.data, want.tensor_type), equal_nan=True), got.name


def test_a_file_that_is_not_gguf_or_is_truncated_is_a_clear_error(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ConfigError, match="model.gguf is not a GGUF file"):
        read_gguf_header(not_gguf)
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(whole[:-100])
    with pytest.raises(ConfigError, match="cut.gguf ends inside tensor '[^']+': the file is truncated"):
        read_gguf_header(truncated)
