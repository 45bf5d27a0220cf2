"""Tests for kinetic.model.gguf_file: files written by gguf-py's GGUFWriter read back exactly,
every kind of broken file fails with a GGUFError saying why, and the real model and vocab
files read the same as with gguf-py's GGUFReader."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from kinetic.fetch import cache_dir
from kinetic.model.gguf_file import GGUFError, GGUFFile
from kinetic.model.quants import dequantize
from tests.conftest import real_model_file
from tests.tiny_models import vocab_file

DATA = Path(__file__).parent / "data"


# --- files written by GGUFWriter -----------------------------------------------------------

SCALARS = [  # (key, value type, value as written, value expected back)
    ("t.u8", V.UINT8, 200, 200), ("t.i8", V.INT8, -100, -100),
    ("t.u16", V.UINT16, 60000, 60000), ("t.i16", V.INT16, -30000, -30000),
    ("t.u32", V.UINT32, 4_000_000_000, 4_000_000_000), ("t.i32", V.INT32, -2_000_000_000,
                                                        -2_000_000_000),
    ("t.u64", V.UINT64, 2**63 + 5, 2**63 + 5), ("t.i64", V.INT64, -(2**62), -(2**62)),
    ("t.f32", V.FLOAT32, 0.1, float(np.float32(0.1))), ("t.f64", V.FLOAT64, 0.1, 0.1),
    ("t.true", V.BOOL, True, True), ("t.false", V.BOOL, False, False),
    ("t.str", V.STRING, "héllo ✓ 你好", "héllo ✓ 你好"), ("t.empty", V.STRING, "", ""),
    # Bytes that are not UTF-8 (a byte-level token) survive as surrogate escapes.
    ("t.bytes", V.STRING, b"a\xff\xfe", "a\udcff\udcfe"),
]
NUMERIC_ARRAYS = [  # (key, item type, numpy dtype expected back)
    ("a.u8", V.UINT8, np.uint8), ("a.i8", V.INT8, np.int8), ("a.u16", V.UINT16, np.uint16),
    ("a.i16", V.INT16, np.int16), ("a.u32", V.UINT32, np.uint32), ("a.i32", V.INT32, np.int32),
    ("a.u64", V.UINT64, np.uint64), ("a.i64", V.INT64, np.int64),
    ("a.f32", V.FLOAT32, np.float32), ("a.f64", V.FLOAT64, np.float64),
]


def _tensors() -> dict[str, tuple[T, np.ndarray, np.ndarray]]:
    """name -> (type, the array given to the writer, the float values it stands for)."""
    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((2, 4, 8)).astype(np.float16)
    i32 = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    values = rng.standard_normal((4, 512)).astype(np.float32)
    # gguf-py cannot quantize to K-quants: random Q6_K blocks with a finite scale d instead.
    q6_k = rng.integers(0, 256, (2, 210), dtype=np.uint8)
    q6_k[:, 208:210] = np.array([0.01, -0.02], np.float16).view(np.uint8).reshape(2, 2)
    return {
        "a.f32": (T.F32, f32, f32),
        "b.f16": (T.F16, f16, f16.astype(np.float32)),
        "c.i32": (T.I32, i32, i32),
        "d.bf16": (T.BF16, gguf.quants.quantize(values[:, :64], T.BF16), values[:, :64]),
        "e.q8_0": (T.Q8_0, gguf.quants.quantize(values, T.Q8_0), values),
        "f.q4_1": (T.Q4_1, gguf.quants.quantize(values, T.Q4_1), values),
        "f.q6_k": (T.Q6_K, q6_k, gguf.quants.dequantize(q6_k, T.Q6_K)),
        "g.vec": (T.F32, np.array([1.5], np.float32), np.array([1.5], np.float32)),
    }


QUANTIZED = (T.BF16, T.Q8_0, T.Q4_1, T.Q6_K)  # written as bytes


def write_sample(path: Path, alignment: int | None = None) -> Path:
    """A file with a value of every type, arrays of every kind and tensors of seven types."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, value, _ in SCALARS:
        w.add_key_value(key, value, vtype)
    for i, (key, vtype, _) in enumerate(NUMERIC_ARRAYS):
        w.add_key_value(key, [1, 2, 3 + i], V.ARRAY, vtype)
    w.add_key_value("a.bool", [True, False, True], V.ARRAY, V.BOOL)
    w.add_array("a.str", ["", "a", "héllo", "▁the", "<|im_end|>"])
    w.add_array("a.nested", [[1, 2, 3], [4]])
    w.add_array("a.nested_str", [["a", "b"], ["c"]])
    for name, (qtype, array, _) in _tensors().items():
        w.add_tensor(name, array, raw_dtype=qtype if qtype in QUANTIZED else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample(tmp_path_factory.mktemp("gguf") / "sample.gguf")


def test_scalar_values_read_back_exactly(sample):
    f = GGUFFile(sample)
    assert f.path == str(sample)
    assert f.architecture == "llama" and f.get("general.architecture") == "llama"
    for key, _, _, expected in SCALARS:
        value = f.metadata[key]
        assert value == expected and type(value) is type(expected), key
    assert f.get("no.such.key") is None and f.get("no.such.key", 5) == 5


def test_arrays_read_back_exactly(sample):
    m = GGUFFile(sample).metadata
    for i, (key, _, dtype) in enumerate(NUMERIC_ARRAYS):
        assert isinstance(m[key], np.ndarray) and m[key].dtype == dtype, key
        assert m[key].tolist() == [1, 2, 3 + i], key
    assert m["a.bool"].dtype == np.bool_ and m["a.bool"].tolist() == [True, False, True]
    assert m["a.str"] == ["", "a", "héllo", "▁the", "<|im_end|>"]
    assert [a.tolist() for a in m["a.nested"]] == [[1, 2, 3], [4]]
    assert m["a.nested"][0].dtype == np.int32
    assert m["a.nested_str"] == [["a", "b"], ["c"]]


def test_dropped_values_are_read_again_from_the_file(sample):
    whole = GGUFFile(sample).metadata
    f = GGUFFile(sample)
    dropped = ("a.str", "a.nested", "a.f32", "no.such.key")
    f.drop(dropped)
    assert list(f.metadata) == [k for k in whole if k not in dropped]
    assert f.keys() == list(whole)   # in the file's order, the dropped ones too
    assert f.read("a.str") == whole["a.str"] and f.read("t.str") == whole["t.str"]
    assert [a.tolist() for a in f.read("a.nested")] == [[1, 2, 3], [4]]
    assert f.read("a.f32").dtype == np.float32
    assert f.read("a.f32").tolist() == whole["a.f32"].tolist()
    assert "a.str" not in f.metadata   # read for the caller, not kept
    with pytest.raises(KeyError):
        f.read("no.such.key")


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_read_back_exactly(tmp_path, alignment):
    f = GGUFFile(write_sample(tmp_path / "s.gguf", alignment))
    expected = _tensors()
    assert list(f.tensors) == list(expected)
    for name, (qtype, array, values) in expected.items():
        t = f.tensors[name]
        assert t.name == name and t.qtype == qtype, name
        assert t.data.dtype == np.uint8 and t.data.ndim == 1 and not t.data.flags.writeable
        assert t.data.tobytes() == array.tobytes(), name
        assert t.shape == values.shape, name  # in elements, also where the writer got bytes
        if qtype in QUANTIZED:
            reference = gguf.quants.dequantize(array, qtype)
            np.testing.assert_array_equal(dequantize(t), reference, err_msg=name)
            np.testing.assert_allclose(dequantize(t), values, atol=0.3)
        elif qtype != T.I32:  # I32 is not a weight type: quants does not decode it
            np.testing.assert_array_equal(dequantize(t), values, err_msg=name)


def test_no_tensors_and_no_keys(tmp_path):
    path = tmp_path / "bare.gguf"
    path.write_bytes(header(n_tensors=0, kvs=[]))
    f = GGUFFile(path)
    assert f.metadata == {} and f.tensors == {}
    with pytest.raises(GGUFError, match="no general.architecture"):
        f.architecture


def test_empty_arrays(tmp_path):
    # GGUFWriter refuses empty arrays; other writers do not.
    path = tmp_path / "e.gguf"
    path.write_bytes(header(0, [kv("x.f", V.ARRAY, struct.pack("<IQ", V.FLOAT32, 0)),
                                kv("x.s", V.ARRAY, struct.pack("<IQ", V.STRING, 0))]))
    m = GGUFFile(path).metadata
    assert m["x.f"].dtype == np.float32 and m["x.f"].size == 0
    assert m["x.s"] == []


# --- raw files, for what GGUFWriter will not write ---------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def tensor_info(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return (gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", qtype, offset))


def header(n_tensors: int, kvs: list[bytes], infos: list[bytes] = (), version: int = 3,
           data: bytes = b"", alignment: int = 32) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs)) + b"".join(kvs)
    out += b"".join(infos)
    if infos:
        out += b"\0" * (-len(out) % alignment) + data
    return out


def _raises(path: Path, *phrases: str) -> str:
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    message = str(e.value)
    assert message.startswith(str(path) + ": "), message
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_odd_but_valid_values(tmp_path):
    path = tmp_path / "o.gguf"
    nested = struct.pack("<IQ", V.ARRAY, 1) * 5 + struct.pack("<IQ", V.UINT8, 1) + b"\x07"
    path.write_bytes(header(0, [
        kv("b", V.ARRAY, struct.pack("<IQ", V.BOOL, 3) + b"\x00\x01\x02"),
        kv("b1", V.BOOL, b"\x02"),
        kv("n", V.ARRAY, nested)]))
    m = GGUFFile(path).metadata
    assert m["b"].dtype == np.bool_ and m["b"].tolist() == [False, True, True]
    assert m["b1"] is True
    assert m["n"][0][0][0][0][0].tolist() == [7]  # five lists around a uint8 array


def test_absurd_nesting_and_counts(tmp_path):
    path = tmp_path / "n.gguf"
    path.write_bytes(header(0, [kv("deep", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) * 5000)]))
    _raises(path, "'deep'", "nested more than 32 deep")
    path.write_bytes(header(0, [kv("many", V.ARRAY, struct.pack("<IQ", V.STRING, 2**40))]))
    _raises(path, "truncated", "'many'", f"array of {2**40} items")
    path.write_bytes(header(0, [kv("s", V.ARRAY, struct.pack("<IQ", V.STRING, 3)
                                   + gstr("ab") + struct.pack("<Q", 99) + b"x" * 20)]))
    _raises(path, "truncated", "'s', string #1 of 3")


def test_duplicates(tmp_path):
    path = tmp_path / "d.gguf"
    path.write_bytes(header(0, [kv("a.b", V.UINT32, struct.pack("<I", 1)),
                                kv("a.b", V.UINT32, struct.pack("<I", 2))]))
    _raises(path, "duplicate metadata key 'a.b'")
    infos = [tensor_info("w", [4], T.F32, 0), tensor_info("w", [4], T.F32, 32)]
    path.write_bytes(header(2, [], infos, data=b"\0" * 64))
    _raises(path, "duplicate tensor 'w'")


def test_unknown_value_types(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(header(0, [kv("a.b", 77, b"\0" * 8)]))
    _raises(path, "'a.b'", "unknown value type id 77")
    path.write_bytes(header(0, [kv("a.c", V.ARRAY, struct.pack("<IQ", 66, 1))]))
    _raises(path, "'a.c'", "array of unknown value type id 66")


def test_bad_tensor_infos(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(header(1, [], [tensor_info("blk.0.x", [4], 99, 0)], data=b"\0" * 64))
    _raises(path, "tensor 'blk.0.x'", "unknown GGML type id 99")
    path.write_bytes(header(1, [], [tensor_info("q", [48], T.Q8_0, 0)], data=b"\0" * 64))
    _raises(path, "tensor 'q'", "Q8_0", "block size 32")
    path.write_bytes(header(1, [], [tensor_info("m", [4], T.F32, 8)], data=b"\0" * 64))
    _raises(path, "tensor 'm'", "offset 8", "alignment 32")
    path.write_bytes(header(1, [], [tensor_info("d", [1] * 5, T.F32, 0)], data=b"\0" * 64))
    _raises(path, "tensor 'd'", "5 dimensions")
    path.write_bytes(header(1, [], [tensor_info("h", [2**40, 2**20], T.F32, 0)]))
    _raises(path, "truncated", "tensor 'h'", f"{2**62} bytes")


@pytest.mark.parametrize("alignment", [0, 3, True])
def test_bad_alignment(tmp_path, alignment):
    path = tmp_path / "a.gguf"
    vtype = V.BOOL if alignment is True else V.UINT32
    payload = struct.pack("<B" if alignment is True else "<I", alignment)
    path.write_bytes(header(0, [kv("general.alignment", vtype, payload)]))
    _raises(path, "general.alignment", "power of two")


# --- not GGUF, other versions, truncated, damaged ------------------------------------------

def test_missing_file(tmp_path):
    _raises(tmp_path / "nothing.gguf", "no such file")
    _raises(tmp_path, "directory")


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"")
    _raises(path, "not a GGUF file", "empty")
    path.write_bytes(b"GG")
    _raises(path, "not a GGUF file", "b'GG'")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    _raises(path, "not a GGUF file", "starts with b'\\x89PNG'")
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes())
    _raises(path, "not a GGUF file", "starts with")


@pytest.mark.parametrize("version", [1, 99])
def test_unsupported_version(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(header(0, [], version=version))
    _raises(path, f"unsupported GGUF version {version}", "supported: 2, 3")


def test_version_2(tmp_path):
    path = tmp_path / "v2.gguf"
    path.write_bytes(header(0, [kv("a", V.STRING, gstr("b"))], version=2))
    assert GGUFFile(path).metadata == {"a": "b"}


def test_big_endian(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    _raises(path, "big-endian")


def _offset_of(data: bytes, name: str) -> int:  # where a key or tensor name starts
    return data.index(gstr(name))


def _data_of(data: bytes, tensor: str) -> int:  # where a tensor's bytes start
    return data.index(_tensors()[tensor][1].tobytes())


@pytest.mark.parametrize("where, phrases", [
    (lambda d: 12, ["truncated", "the header"]),
    (lambda d: _offset_of(d, "a.str") + 30, ["truncated", "metadata key 'a.str'"]),
    (lambda d: _offset_of(d, "t.f32") + 3, ["truncated", "metadata key #"]),
    (lambda d: _offset_of(d, "c.i32") + 20, ["truncated", "tensor info of 'c.i32'"]),
    (lambda d: _offset_of(d, "c.i32") + 3, ["truncated", "tensor info #2 of 8"]),
    (lambda d: _data_of(d, "f.q4_1") + 100, ["truncated", "tensor 'f.q4_1'", "Q4_1",
                                              "shape (4, 512)", "1280 bytes"]),
], ids=["counts", "kv-value", "kv-key", "tensor-info", "tensor-name", "tensor-data"])
def test_truncated(sample, tmp_path, where, phrases):
    data = sample.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:where(data)])
    message = _raises(path, *phrases)
    if "tensor 'f.q4_1'" in phrases:
        assert f"the file has {_data_of(data, 'f.q4_1') + 100} bytes" in message


def test_every_truncation_of_the_header_is_a_gguf_error(sample, tmp_path):
    data = sample.read_bytes()
    end = GGUFFile(sample)._data_offset
    path = tmp_path / "cut.gguf"
    # The writer pads the last tensor: its last byte is 4 bytes into it.
    for n in list(range(4, end)) + [end + 1, _data_of(data, "g.vec") + 3]:
        path.write_bytes(data[:n])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(path)


def test_damaged_headers_fail_cleanly(sample, tmp_path):
    """Random byte changes in the header, and random bytes after a valid magic and version:
    the file either reads or fails with GGUFError, never with an error from inside struct,
    numpy or mmap."""
    data = sample.read_bytes()
    end = GGUFFile(sample)._data_offset
    rng = np.random.default_rng(3)
    path = tmp_path / "bad.gguf"
    failed = 0
    for i in range(600):
        if i % 10 == 0:
            damaged = bytearray(b"GGUF\3\0\0\0" + rng.bytes(int(rng.integers(1, 3000))))
        else:
            damaged = bytearray(data)
            for pos in rng.integers(4, end, rng.integers(1, 4)):
                damaged[pos] = rng.choice([0, 0xFF, int(rng.integers(0, 256))])
        path.write_bytes(bytes(damaged))
        try:
            GGUFFile(path)
        except GGUFError as e:
            assert str(e).startswith(f"{path}: ")
            failed += 1
    assert 60 <= failed < 600  # all the random tails fail; many damaged headers still read


# --- real files against gguf-py's reader --------------------------------------------------

VOCABS = ["bert-bge", "gpt-2", "llama-spm", "phi-3"]
# gguf-py's reader takes 8-30 s on each of these (100K-262K tokens): by request only.
LARGE_VOCABS = ["deepseek-llm", "gemma-4", "llama-bpe", "qwen2", "qwen35"]
FULL_CHECK = "KINETIC_FULL_GGUF_CHECK"
MODELS = ["smollm2", "qwen25coder", "gemma3"]  # kinetic.fetch keys
MINILM = "all-MiniLM-L6-v2-f16.gguf"  # PyPI has no GGUF of it: copied into cache_dir() by hand


def _reference_value(field) -> object:
    """A GGUFReader field as GGUFFile should give it."""
    types = field.types
    if types[0] == V.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="surrogateescape")
    if types[0] != V.ARRAY:
        value = field.parts[field.data[0]][0]
        return bool(value) if types[0] == V.BOOL else value.item()
    if types[-1] == V.STRING:
        return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape")
                for i in field.data]
    assert len(types) == 2, "nested arrays: none in the files checked here"
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else None


def assert_same_as_gguf_py(path: Path) -> None:
    """Every key, value, tensor name, type, shape and byte as GGUFReader reads them."""
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        want, got = _reference_value(field), ours.metadata[key]
        if isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, key
            np.testing.assert_array_equal(got, want, err_msg=key)
        elif want is None:
            assert isinstance(got, np.ndarray) and got.size == 0, key
        else:
            assert got == want and type(got) is type(want), key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type, t.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
        assert mine.data.nbytes == t.n_bytes, t.name
        assert mine.data.ctypes.data - ours.tensors[reader.tensors[0].name].data.ctypes.data \
            == t.data_offset - reader.tensors[0].data_offset, t.name
        assert np.array_equal(mine.data, t.data.reshape(-1).view(np.uint8)), t.name


@pytest.mark.parametrize("vocab", VOCABS + LARGE_VOCABS)
def test_vocab_files_match_gguf_py(vocab):
    if vocab in LARGE_VOCABS and not os.environ.get(FULL_CHECK):
        pytest.skip(f"gguf-py's reader is slow on this large vocabulary; set {FULL_CHECK}=1")
    assert_same_as_gguf_py(vocab_file(vocab))


@pytest.mark.real_model
@pytest.mark.parametrize("model", MODELS + [MINILM])
def test_real_models_match_gguf_py(model):
    if model == MINILM:
        path = cache_dir() / model
        if not path.is_file():
            pytest.skip(f"{path} is absent (PyPI has no GGUF of it: copy one there by hand)")
    else:
        path = Path(real_model_file(model))
    assert_same_as_gguf_py(path)


if __name__ == "__main__":  # by hand: python tests/test_gguf_file.py FILE.gguf ...
    import sys
    for p in sys.argv[1:]:
        assert_same_as_gguf_py(Path(p))
        print("same as GGUFReader:", os.path.basename(p))
