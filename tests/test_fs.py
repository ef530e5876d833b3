"""The GGUF file layer: Config accessors, the tensor index, and clear errors for damaged files."""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import assets
import gguf
import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.fs import Config, GGUFError, GGUFFile

# ---------------------------------------------------------------- Config


def make_config() -> Config:
    return Config(
        {
            "general.architecture": "llama",
            "general.name": "test",
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b"],
            "llama.block_count": 5,
            "llama.rope.freq_base": 10000.0,
            "llama.attention.causal": True,
            "llama.negative": -3,
            "llama.head_counts": [4, 4, 8],
            "llama.floats": [0.5, 1.5],
            "llama.swa_pattern": [True, False],
            "llama.mixed": [1, "x"],
            "qwen2.block_count": 7,
        }
    )


def test_config_prefixes_architecture_except_general_and_tokenizer() -> None:
    config = make_config()
    assert config.architecture() == "llama"
    assert config.full_key("block_count") == "llama.block_count"
    assert config.full_key("general.name") == "general.name"
    assert config.full_key("tokenizer.ggml.model") == "tokenizer.ggml.model"
    assert config.get_uint("block_count") == 5
    assert config.get_string("general.name") == "test"
    assert config.get_string("tokenizer.ggml.model") == "gpt2"
    assert config.get_strings("tokenizer.ggml.tokens") == ["a", "b"]
    assert config.get_float("rope.freq_base") == 10000.0
    assert config.get_bool("attention.causal") is True
    assert config.get_ints("head_counts") == [4, 4, 8]
    assert config.get_floats("floats") == [0.5, 1.5]
    assert config.get_bools("swa_pattern") == [True, False]
    assert "block_count" in config and "missing" not in config
    assert config.value("block_count") == 5
    assert len(config) == 13
    assert "qwen2.block_count" in config.keys()


def test_config_missing_keys_give_defaults() -> None:
    config = make_config()
    assert config.get_uint("missing") == 0
    assert config.get_uint("missing", 42) == 42
    assert config.get_string("missing", "x") == "x"
    assert config.get_float("missing", 1e-5) == 1e-5
    assert config.get_bool("missing", True) is True
    assert config.get_strings("missing") == []
    assert config.get_ints("missing", [1, 2]) == [1, 2]
    assert config.get_floats("missing", [0.25]) == [0.25]
    assert config.get_bools("missing", [False]) == [False]
    assert config.value("missing", "d") == "d"
    # The prefix comes from general.architecture: qwen2's keys are not llama's.
    assert config.get_uint("general.block_count", 9) == 9


def test_config_mistyped_keys_give_defaults() -> None:
    config = make_config()
    assert config.get_uint("general.name", 3) == 3  # a string
    assert config.get_uint("attention.causal", 3) == 3  # a bool is not an integer
    assert config.get_uint("negative", 3) == 3  # not unsigned
    assert config.get_uint("rope.freq_base", 3) == 3  # a float
    assert config.get_float("block_count", 2.5) == 2.5  # an integer
    assert config.get_string("block_count", "s") == "s"
    assert config.get_bool("block_count", False) is False
    assert config.get_strings("head_counts", ["d"]) == ["d"]
    assert config.get_ints("mixed", [7]) == [7]
    assert config.get_ints("swa_pattern") == []  # bools are not integers
    assert config.get_floats("head_counts") == []
    assert config.get_bools("block_count") == []


def test_config_lists_are_copies() -> None:
    config = make_config()
    config.get_ints("head_counts").append(99)
    assert config.get_ints("head_counts") == [4, 4, 8]


def test_config_without_architecture() -> None:
    config = Config({"block_count": 1})
    assert config.architecture() == ""
    assert config.get_uint("block_count", 5) == 5  # looked up as ".block_count"


# ---------------------------------------------------------------- reading real files


def reader_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_same_metadata(ours: dict[str, object], theirs: dict[str, object]) -> None:
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, list) and value and isinstance(value[0], float):
            np.testing.assert_array_equal(np.array(ours[key], np.float32), np.array(value, np.float32))
        else:
            assert ours[key] == value, key


def test_stories_file_is_the_one_described_in_its_readme(stories_path: Path) -> None:
    readme = (stories_path.parent / "README.md").read_text()
    recorded = re.search(r"sha256 of `stories260K.gguf`: `([0-9a-f]{64})`", readme)
    assert recorded is not None
    assert hashlib.sha256(stories_path.read_bytes()).hexdigest() == recorded[1]


def test_stories_metadata_matches_gguf_reader(stories_path: Path) -> None:
    model = GGUFFile.open(stories_path)
    reader = gguf.GGUFReader(stories_path)
    assert_same_metadata(model.metadata, reader_metadata(reader))
    assert model.architecture == "llama"
    assert model.config.get_uint("block_count") == reader.fields["llama.block_count"].contents()
    assert model.version == reader.fields["GGUF.version"].contents()


def test_stories_tensor_index_matches_gguf_reader(stories_path: Path) -> None:
    model = GGUFFile.open(stories_path)
    reader = gguf.GGUFReader(stories_path)
    assert model.tensor_data_offset == reader.data_offset
    assert model.file_size == stories_path.stat().st_size
    assert list(model.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = model.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(d) for d in t.shape)  # ggml order, ne0 first
        assert info.n_elements == t.n_elements
        assert info.n_bytes == t.n_bytes
        assert info.offset == t.data_offset
        assert model.tensor_data(t.name).tobytes() == t.data.tobytes()
    embd = model.tensors["token_embd.weight"]
    assert embd.shape == (
        model.config.get_uint("embedding_length"),
        len(model.metadata["tokenizer.ggml.tokens"]),
    )


def test_vocab_metadata_matches_gguf_reader() -> None:
    path = assets.vocab("llama-spm")
    model = GGUFFile.open(path)
    reader = gguf.GGUFReader(path)
    assert_same_metadata(model.metadata, reader_metadata(reader))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            vtype, etype = model.value_types[key]
            assert vtype == field.types[0]
            assert etype == (field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    assert model.tensors == {}


def test_tensor_data_of_unknown_tensor(tmp_path: Path) -> None:
    model = GGUFFile.open(small_file(tmp_path / "m.gguf"))
    with pytest.raises(KeyError, match="nope"):
        model.tensor_data("nope")


# ---------------------------------------------------------------- damaged files


def small_file(path: Path) -> Path:
    """A small GGUF with every kind of metadata value and two tensors, F32 then Q8_0."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("llama.flag", True)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_tensor("first.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("second.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def synthetic_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assets.vocab("llama-spm")  # write_synthetic copies its tokenizer
    path = tmp_path_factory.mktemp("fs") / "tiny.gguf"
    return write_synthetic(path, "llama", weight_type="Q8_0", n_layer=1)


def damaged_copy(source: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(source.read_bytes())
    data = edit(data) or data
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path


def tensor_info_fields(data: bytes, name: str) -> tuple[int, int]:
    """Positions of a tensor info's type id and relative offset fields."""
    encoded = name.encode()
    pos = data.rfind(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    type_pos = pos + 4 + 8 * n_dims
    return type_pos, type_pos + 4


def expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as caught:
        GGUFFile.open(path)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_synthetic_file_is_valid(synthetic_file: Path) -> None:
    model = GGUFFile.open(synthetic_file)
    assert model.architecture == "llama"
    last = max(model.tensors.values(), key=lambda t: t.offset)
    assert last.offset + last.n_bytes <= model.file_size


def test_bad_magic(synthetic_file: Path, tmp_path: Path) -> None:
    path = damaged_copy(synthetic_file, tmp_path, lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    expect_error(path, "not a GGUF file")


def test_truncated_header(synthetic_file: Path, tmp_path: Path) -> None:
    expect_error(damaged_copy(synthetic_file, tmp_path, lambda d: d[:10]), "truncated", "header")


def test_truncated_metadata(synthetic_file: Path, tmp_path: Path) -> None:
    expect_error(damaged_copy(synthetic_file, tmp_path, lambda d: d[:5000]), "truncated", "metadata")


def test_truncated_tensor_infos(synthetic_file: Path, tmp_path: Path) -> None:
    def cut(data: bytearray) -> bytearray:
        type_pos, _ = tensor_info_fields(data, "blk.0.ffn_up.weight")
        return data[:type_pos]

    expect_error(damaged_copy(synthetic_file, tmp_path, cut), "truncated", "tensor infos")


def test_truncated_tensor_data(synthetic_file: Path, tmp_path: Path) -> None:
    model = GGUFFile.open(synthetic_file)
    last = max(model.tensors.values(), key=lambda t: t.offset)
    path = damaged_copy(synthetic_file, tmp_path, lambda d: d[: last.offset + last.n_bytes // 2])
    expect_error(path, repr(last.name), "extends past the end of the file")


def test_tensor_offset_past_end_of_file(synthetic_file: Path, tmp_path: Path) -> None:
    def move(data: bytearray) -> None:
        _, offset_pos = tensor_info_fields(data, "blk.0.attn_q.weight")
        data[offset_pos : offset_pos + 8] = struct.pack("<Q", 1 << 40)

    path = damaged_copy(synthetic_file, tmp_path, move)
    expect_error(path, "'blk.0.attn_q.weight'", "extends past the end of the file")


def test_unknown_tensor_type(synthetic_file: Path, tmp_path: Path) -> None:
    def retype(data: bytearray) -> None:
        type_pos, _ = tensor_info_fields(data, "blk.0.attn_k.weight")
        data[type_pos : type_pos + 4] = struct.pack("<I", 99)

    path = damaged_copy(synthetic_file, tmp_path, retype)
    expect_error(path, "'blk.0.attn_k.weight'", "unknown ggml type id 99")


def test_unsupported_tensor_type(synthetic_file: Path, tmp_path: Path) -> None:
    def retype(data: bytearray) -> None:
        type_pos, _ = tensor_info_fields(data, "blk.0.attn_k.weight")
        data[type_pos : type_pos + 4] = struct.pack("<I", gguf.GGMLQuantizationType.Q8_K)  # activations only

    path = damaged_copy(synthetic_file, tmp_path, retype)
    expect_error(path, "'blk.0.attn_k.weight'", "Q8_K", "does not support")


def test_unknown_metadata_value_type(synthetic_file: Path, tmp_path: Path) -> None:
    def retype(data: bytearray) -> None:
        (key_len,) = struct.unpack_from("<Q", data, 24)  # the first key follows the 24-byte header
        type_pos = 24 + 8 + key_len
        data[type_pos : type_pos + 4] = struct.pack("<I", 77)

    expect_error(damaged_copy(synthetic_file, tmp_path, retype), "corrupt metadata", "unknown value type 77")


def test_metadata_string_not_utf8(synthetic_file: Path, tmp_path: Path) -> None:
    path = damaged_copy(synthetic_file, tmp_path, lambda d: d.__setitem__(slice(32, 33), b"\xff"))
    expect_error(path, "corrupt metadata", "not valid UTF-8")


def test_unsupported_version(synthetic_file: Path, tmp_path: Path) -> None:
    path = damaged_copy(synthetic_file, tmp_path, lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 1)))
    expect_error(path, "unsupported GGUF version 1")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(path, "empty file")


def test_directory(tmp_path: Path) -> None:
    expect_error(tmp_path, "is a directory")


def test_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "absent.gguf", "no such file")


def test_every_truncation_is_reported(tmp_path: Path) -> None:
    source = small_file(tmp_path / "small.gguf")
    data = source.read_bytes()
    model = GGUFFile.open(source)
    data_end = max(t.offset + t.n_bytes for t in model.tensors.values())
    path = tmp_path / "cut.gguf"
    for length in range(data_end):
        path.write_bytes(data[:length])
        with pytest.raises(GGUFError, match=str(path)):
            GGUFFile.open(path)


def test_random_byte_damage_never_escapes_as_another_error(tmp_path: Path) -> None:
    source = small_file(tmp_path / "small.gguf")
    data = source.read_bytes()
    header_end = GGUFFile.open(source).tensor_data_offset
    rng = np.random.default_rng(0)
    path = tmp_path / "flipped.gguf"
    for _ in range(500):
        damaged = bytearray(data)
        for pos in rng.integers(0, header_end, size=int(rng.integers(1, 4))):
            damaged[pos] = int(rng.integers(0, 256))
        path.write_bytes(bytes(damaged))
        try:
            GGUFFile.open(path)
        except GGUFError as e:
            assert str(path) in str(e)


def test_type_tables_are_the_gguf_packages():
    """fs/gguf_file.py copies gguf's type ids and block sizes (importing gguf slowed every runner's start)."""
    from ollama_engine.fs import gguf_file

    assert {t.name: int(t) for t in gguf_file.GGMLQuantizationType} == {
        t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {t.name: int(t) for t in gguf_file.GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
    assert {int(k): v for k, v in gguf_file.GGML_QUANT_SIZES.items()} == {
        int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    assert gguf_file.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
