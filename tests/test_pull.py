"""`kinetic pull`, `list` and `rm`, and that no other command touches the network.

The Hugging Face pulls run against FakeHub, a hub of the test's own on 127.0.0.1 (HF_ENDPOINT
points at it), which answers the two routes huggingface_hub's calls in kinetic.hub use: the
repository's file list with sizes and LFS SHA-256 (`GET /api/models/OWNER/REPO?blobs=True`)
and the file itself (`GET /OWNER/REPO/resolve/COMMIT/PATH`, with Range requests). It
records every request, so a test can say which ones were made. The cache is tmp_path
(KINETIC_CACHE).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pytest

from kinetic import fetch, store
from kinetic.cli import build_parser, main
from kinetic.fetch import FetchError, ModelSpec
from kinetic.hub import HfName, choose, quant_of
from kinetic.serve_cli import resolve_model, serve_options
from tests.tiny_models import write_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parent.parent


class FakeHub:
    """A Hugging Face hub in a thread: `add` a repository, point HF_ENDPOINT at `url`."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lfs_sha256: dict[tuple[str, str], str] = {}   # a digest that lies, by (repo, path)
        self.cut: dict[str, int] = {}     # path -> how many GETs of it end half-way through
        self.requests: list[SimpleNamespace] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,),
                                       daemon=True)

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = files

    def downloads(self) -> list[SimpleNamespace]:
        return [r for r in self.requests if "/resolve/" in r.path]

    def info(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        files = self.repos[repo]
        siblings = []
        for path, data in files.items():
            s = {"rfilename": path, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
            if path.endswith(".gguf"):   # stored with LFS, as the hub stores GGUF files
                sha = self.lfs_sha256.get((repo, path), hashlib.sha256(data).hexdigest())
                s["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
            siblings.append(s)
        _json(h, 200, {"_id": "0" * 24, "id": repo, "modelId": repo, "sha": COMMIT,
                       "private": False, "siblings": siblings})

    def file(self, h: BaseHTTPRequestHandler, repo: str, path: str) -> None:
        data = self.repos[repo].get(path)
        if data is None:
            return _json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        start, status = 0, 200
        if (asked := h.headers.get("Range")) is not None:
            start, status = int(re.fullmatch(r"bytes=(\d+)-", asked)[1]), 206
        body = data[start:]
        h.send_response(status)
        sha = hashlib.sha256(data).hexdigest()
        for k, v in {"Content-Length": len(body), "Accept-Ranges": "bytes", "ETag": f'"{sha}"',
                     "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(data),
                     "X-Repo-Commit": COMMIT}.items():
            h.send_header(k, str(v))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if h.command == "HEAD":
            return
        if self.cut.get(path, 0) > 0:   # the connection drops part-way through the body
            self.cut[path] -= 1
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(body)

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(SimpleNamespace(method=h.command, path=path, query=urlsplit(
            h.path).query, headers={k.lower(): v for k, v in h.headers.items()}))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)", path):
            repo, route = m[1], "info"
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
            repo, route = m[1], "file"
        else:
            return _json(h, 404, {"error": f"FakeHub does not serve {path}"})
        if repo not in self.repos:
            return _json(h, 404, {"error": "Repository not found"},
                         {"X-Error-Code": "RepoNotFound"})
        if route == "info":
            return self.info(h, repo)
        return self.file(h, repo, m[2])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive, as the hub

    def do_GET(self):
        self.server.hub.answer(self)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def _json(h: BaseHTTPRequestHandler, status: int, body: dict, headers: dict | None = None):
    data = json.dumps(body).encode()
    h.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": len(data),
                 **(headers or {})}.items():
        h.send_header(k, str(v))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("KINETIC_CACHE", str(d))
    return d


@pytest.fixture
def fake_hub(cache, monkeypatch):
    h = FakeHub()
    h.thread.start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    yield h
    h.server.shutdown()
    h.server.server_close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A real GGUF file (a random-weight gemma3 of 5 MB) that kinetic loads and runs."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_model(path, "gemma3", n_layer=1, d_model=32, n_head=2, n_kv_head=1,
                            head_dim=16, d_ffn=64).read_bytes()


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def pull(name: str, capsys) -> tuple[int, str, str]:
    code = main(["pull", name])
    out = capsys.readouterr()
    return code, out.out, out.err


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# --- names and choosing a file (no network) -----------------------------------------------

@pytest.mark.parametrize("name, quant", [
    ("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
    ("ggml-model-f16.gguf", "F16"),
    ("model_bf16.gguf", "BF16"),
    ("sub/Llama-3.2-1B-IQ4_XS.gguf", "IQ4_XS"),
    ("gemma-3-1b-it-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("big-Q8_0-00002-of-00003.gguf", "Q8_0"),
    ("mistral-7b-instruct-v0.2.gguf", None),
    ("model.gguf", None),
])
def test_quant_of_reads_the_end_of_the_name(name, quant):
    assert quant_of(name) == quant


@pytest.mark.parametrize("text, parsed", [
    ("hf:bartowski/SmolLM2-135M-Instruct-GGUF", HfName("bartowski/SmolLM2-135M-Instruct-GGUF")),
    ("hf:o/r:q8_0", HfName("o/r", quant="Q8_0")),
    ("hf:o/r/x-Q4_0.gguf", HfName("o/r", file="x-Q4_0.gguf")),
    ("hf:o/r/sub/dir/x.GGUF", HfName("o/r", file="sub/dir/x.GGUF")),
])
def test_hf_names_parse_and_print_back(text, parsed):
    assert HfName.parse(text) == parsed
    assert str(parsed) == text.replace("q8_0", "Q8_0")


@pytest.mark.parametrize("text", ["hf:o", "hf:o/r/x", "hf:o/r:Q4 K", "hf:o/r:", "hf:../r",
                                  "hf:o/r/../../x.gguf", "hf:o/r//x.gguf", "hf:o--x/r",
                                  "hf:o/r.", "hf:/r"])
def test_malformed_hf_names_say_the_forms(text):
    with pytest.raises(FetchError, match="not a Hugging Face name; give hf:OWNER/REPO, "
                       "hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf"):
        HfName.parse(text)


REPO = ["README.md", "x-F16.gguf", "x-Q8_0.gguf", "x-Q4_K_M.gguf", "x-Q5_K_M.gguf",
        "mmproj-x-Q4_K_M.gguf", "x-Q4_0.gguf"]


@pytest.mark.parametrize("name, files, chosen", [
    ("hf:o/r", REPO, "x-Q4_K_M.gguf"),                        # llama-server's default
    ("hf:o/r", [f for f in REPO if "Q4_K_M" not in f], "x-Q4_0.gguf"),   # the closest
    ("hf:o/r", ["x-Q8_0.gguf", "x-Q6_K.gguf", "x-F16.gguf"], "x-Q6_K.gguf"),
    ("hf:o/r", ["x-F16.gguf", "x-BF16.gguf", "x-F32.gguf"], "x-BF16.gguf"),
    ("hf:o/r", ["b-q4_k_m.gguf", "a-Q8_0.gguf"], "b-q4_k_m.gguf"),     # any case
    ("hf:o/r", ["mmproj-x-Q4_K_M.gguf", "x-Q8_0.gguf"], "x-Q8_0.gguf"),  # never a projector
    ("hf:o/r", ["x-Q4_K_M-00001-of-00002.gguf", "x-Q4_K_M-00002-of-00002.gguf",
                "x-Q5_K_M.gguf"], "x-Q5_K_M.gguf"),           # a split model is skipped
    ("hf:o/r:q8_0", REPO, "x-Q8_0.gguf"),
    ("hf:o/r:Q4_K_M", REPO, "x-Q4_K_M.gguf"),
    ("hf:o/r/x-F16.gguf", REPO, "x-F16.gguf"),
    ("hf:o/r/X-f16.GGUF", REPO, "x-F16.gguf"),
    ("hf:o/r/mmproj-x-Q4_K_M.gguf", REPO, "mmproj-x-Q4_K_M.gguf"),   # named: taken
    ("hf:o/r:Q8_0", ["b/x-Q8_0.gguf", "a/x-Q8_0.gguf"], "a/x-Q8_0.gguf"),   # first by name
])
def test_choosing_a_file(name, files, chosen):
    assert choose(HfName.parse(name), files) == chosen


@pytest.mark.parametrize("name, files, words", [
    ("hf:o/r:Q2_K", REPO, "hf:o/r:Q2_K: o/r has no Q2_K file; it has Q4_K_M, Q4_0, Q5_K_M, "
                          "Q8_0, F16"),
    ("hf:o/r", ["README.md", "model.safetensors", "mmproj-f16.gguf"],
     "hf:o/r: the repository has no GGUF model file"),
    ("hf:o/r/y.gguf", REPO, "hf:o/r/y.gguf: no such file in o/r; its GGUF models: "),
    ("hf:o/r", ["x-IQ2_XS.gguf", "x-IQ3_M.gguf"], "none of o/r's files has a quantization "
     "kinetic chooses by default (IQ2_XS, IQ3_M); name one: kinetic pull hf:o/r:QUANT"),
    ("hf:o/r:Q4_K_M", ["x-Q4_K_M-00001-of-00002.gguf", "x-Q4_K_M-00002-of-00002.gguf",
                       "x-Q8_0.gguf"],
     "x-Q4_K_M-00001-of-00002.gguf is one of 2 parts of a split model, and kinetic loads a "
     "single GGUF file; merge the parts (llama.cpp's llama-gguf-split --merge) or choose a "
     "quantization in one file (Q8_0)"),
    ("hf:o/r", ["x-00001-of-00002.gguf", "x-00002-of-00002.gguf"], "one of 2 parts"),
])
def test_choosing_fails_in_one_line_naming_what_there_is(name, files, words):
    with pytest.raises(FetchError) as e:
        choose(HfName.parse(name), files)
    assert words in str(e.value) and "\n" not in str(e.value)


# --- pulling from the hub -----------------------------------------------------------------

def test_pull_downloads_verifies_caches_and_serve_finds_it(fake_hub, cache, tiny_gguf, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    fake_hub.add("test/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny_gguf, "README.md": b"# tiny\n"})
    code, out, err = pull("hf:test/tiny-GGUF", capsys)
    assert code == 0, err
    path = cache / "hf" / "test" / "tiny-GGUF" / "tiny-Q4_K_M.gguf"
    assert out == f"{path}\n"
    assert path.read_bytes() == tiny_gguf
    digest = hashlib.sha256(tiny_gguf).hexdigest()
    assert json.loads(fetch.marker_path(path).read_text())["sha256"] == digest
    assert files_under(cache) == ["hf/test/tiny-GGUF/tiny-Q4_K_M.gguf",
                                  "hf/test/tiny-GGUF/tiny-Q4_K_M.gguf.sha256-ok"]
    # one listing, one download, both with the token; the file from the listed commit
    assert [(r.method, r.path) for r in fake_hub.requests] == [
        ("GET", "/api/models/test/tiny-GGUF"),
        ("GET", f"/test/tiny-GGUF/resolve/{COMMIT}/tiny-Q4_K_M.gguf")]
    assert fake_hub.requests[0].query.lower() == "blobs=true"
    assert all(r.headers["authorization"] == "Bearer hf_secret" for r in fake_hub.requests)
    assert "sha256 verified" in err
    # serve and run find it by any name that means it, without the hub
    for name in ("hf:test/tiny-GGUF", "hf:test/tiny-GGUF:q4_k_m",
                 "hf:test/tiny-GGUF/tiny-Q4_K_M.gguf"):
        assert resolve_model(name) == str(path)
    _, model = serve_options(build_parser().parse_args(["serve", "hf:test/tiny-GGUF"]))
    assert model.path == str(path)
    capsys.readouterr()
    assert main(["run", "hf:test/tiny-GGUF", "Hello", "-n", "2"]) == 0
    assert capsys.readouterr().out.strip()   # the model loaded and generated
    # pulling again asks the hub which file is current and downloads nothing
    assert pull("hf:test/tiny-GGUF", capsys)[:2] == (0, f"{path}\n")
    assert len(fake_hub.downloads()) == 1


def test_each_name_form_pulls_its_file(fake_hub, cache, capsys):
    files = {f"sub/x-{q}.gguf": q.encode() * 100 for q in ("Q8_0", "Q4_0", "F16")}
    fake_hub.add("o/r", files)
    root = cache / "hf" / "o" / "r"
    assert pull("hf:o/r", capsys)[1] == f"{root / 'sub/x-Q4_0.gguf'}\n"        # the closest
    assert pull("hf:o/r:q8_0", capsys)[1] == f"{root / 'sub/x-Q8_0.gguf'}\n"
    assert pull("hf:o/r/sub/x-F16.gguf", capsys)[1] == f"{root / 'sub/x-F16.gguf'}\n"
    for path, data in files.items():
        assert (root / path).read_bytes() == data
    assert [r.path.rsplit("/", 1)[1] for r in fake_hub.downloads()] == \
        ["x-Q4_0.gguf", "x-Q8_0.gguf", "x-F16.gguf"]


def test_a_dropped_connection_resumes_with_a_range_request(fake_hub, cache, capsys,
                                                           monkeypatch):
    """The connection drops half-way: huggingface_hub 1.x and later resume at once, in the
    same pull; 0.x gives up, keeping the partial file, and the next pull resumes it."""
    import huggingface_hub.constants
    import huggingface_hub.file_download as fd
    # it waits 1 s before it resumes: recorded instead of waited
    monkeypatch.setattr(fd, "time", SimpleNamespace(sleep=lambda s: None))
    # it writes what it receives in chunks of 10 MB, and resumes after the last one written:
    # smaller chunks let a 1 MB file show it
    for module in (huggingface_hub.constants, fd):   # 0.x copied it into file_download
        monkeypatch.setattr(module, "DOWNLOAD_CHUNK_SIZE", 64 * 1024, raising=False)
    data = bytes(range(256)) * 4000
    fake_hub.add("o/r", {"m-Q4_K_M.gguf": data})
    fake_hub.cut["m-Q4_K_M.gguf"] = 1
    code, out, err = pull("hf:o/r", capsys)
    if code == 1:
        assert last_line(err).endswith("`kinetic pull hf:o/r` again resumes the download")
        code, out, err = pull("hf:o/r", capsys)
    assert code == 0, err
    assert Path(out.strip()).read_bytes() == data
    first, second = fake_hub.downloads()
    assert "range" not in first.headers
    # from the last chunk written before the drop, at half the file
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second.headers["range"])[1])
    assert 0 < resumed_at <= len(data) // 2 and resumed_at % (64 * 1024) == 0


def test_an_interrupted_pull_keeps_its_partial_file_and_the_next_one_resumes(
        fake_hub, cache, capsys, monkeypatch):
    """Ctrl-C part-way: the bytes so far stay in the partial file, the final path does not
    appear, and the next pull asks only for the rest."""
    import huggingface_hub.file_download as fd
    data = os.urandom(300_000)
    fake_hub.add("o/r", {"m-Q8_0.gguf": data})
    real_get, kept = fd.http_get, 100_000

    class CtrlC:   # the file http_get writes to, interrupted after `kept` bytes
        def __init__(self, f):
            self.f = f

        def write(self, chunk):
            self.f.write(chunk[:kept])
            raise KeyboardInterrupt

        def __getattr__(self, attr):
            return getattr(self.f, attr)
    monkeypatch.setattr(fd, "http_get", lambda url, f, **kw: real_get(url, CtrlC(f), **kw))
    code, _, err = pull("hf:o/r:Q8_0", capsys)
    assert code == 130
    assert "`kinetic pull hf:o/r:Q8_0` again resumes the download" in err
    digest = hashlib.sha256(data).hexdigest()
    assert files_under(cache) == [f"hf/o/r/.m-Q8_0.gguf.{digest[:16]}.incomplete"]
    assert (cache / files_under(cache)[0]).read_bytes() == data[:kept]

    monkeypatch.setattr(fd, "http_get", real_get)
    code, out, err = pull("hf:o/r:Q8_0", capsys)
    assert code == 0, err
    assert f"resuming m-Q8_0.gguf at {kept} of {len(data)} bytes" in err
    assert fake_hub.downloads()[-1].headers["range"] == f"bytes={kept}-"
    assert Path(out.strip()).read_bytes() == data
    assert files_under(cache) == ["hf/o/r/m-Q8_0.gguf", "hf/o/r/m-Q8_0.gguf.sha256-ok"]


def test_a_cached_file_that_changed_is_not_served_and_pull_restores_it(fake_hub, cache,
                                                                       capsys):
    data = os.urandom(10_000)
    fake_hub.add("o/r", {"m-Q4_K_M.gguf": data})
    path = Path(pull("hf:o/r", capsys)[1].strip())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # touched, same bytes
    assert resolve_model("hf:o/r") == str(path)                    # hashed again: still it
    path.write_bytes(data[::-1])                                   # changed
    with pytest.raises(SystemExit, match="hf:o/r is not pulled; run: kinetic pull hf:o/r"):
        resolve_model("hf:o/r")
    code, out, err = pull("hf:o/r", capsys)
    assert (code, out) == (0, f"{path}\n") and "downloading" in err
    assert path.read_bytes() == data and resolve_model("hf:o/r") == str(path)
    assert len(fake_hub.downloads()) == 2


def test_a_wrong_checksum_is_refused_and_nothing_is_cached(fake_hub, cache, capsys):
    data = b"GGUF" + b"\0" * 5000
    fake_hub.add("o/r", {"m-Q4_K_M.gguf": data})
    fake_hub.lfs_sha256["o/r", "m-Q4_K_M.gguf"] = "ab" * 32
    code, out, err = pull("hf:o/r", capsys)
    assert code == 1 and out == ""
    assert last_line(err) == (
        f"kinetic pull: hf:o/r: sha256 mismatch for m-Q4_K_M.gguf: the hub says {'ab' * 32}, "
        f"the download has {hashlib.sha256(data).hexdigest()}; deleted it, nothing was cached")
    assert files_under(cache) == []
    with pytest.raises(SystemExit, match="hf:o/r is not pulled; run: kinetic pull hf:o/r"):
        resolve_model("hf:o/r")


@pytest.mark.parametrize("name, words", [
    ("hf:test/nope", "kinetic pull: hf:test/nope: no repository test/nope on {url} (a private "
                     "one needs HF_TOKEN)"),
    ("hf:o/r:Q2_K", "kinetic pull: hf:o/r:Q2_K: o/r has no Q2_K file; it has Q4_0, Q8_0"),
    ("hf:o/empty", "kinetic pull: hf:o/empty: the repository has no GGUF model file"),
])
def test_a_missing_repository_or_quantization_is_one_line(fake_hub, cache, capsys, name, words):
    fake_hub.add("o/r", {"x-Q8_0.gguf": b"8", "x-Q4_0.gguf": b"4"})
    fake_hub.add("o/empty", {"README.md": b"", "model.safetensors": b"weights"})
    code, out, err = pull(name, capsys)
    assert (code, out) == (1, "")
    assert last_line(err) == words.format(url=fake_hub.url)
    assert fake_hub.downloads() == []
    assert not cache.exists() or files_under(cache) == []


def test_a_second_pull_of_the_same_file_at_once_is_refused(fake_hub, cache, capsys):
    import fcntl
    data = b"GGUF" * 1000
    fake_hub.add("o/r", {"m-Q4_K_M.gguf": data})
    digest = hashlib.sha256(data).hexdigest()
    partial = cache / "hf/o/r" / f".m-Q4_K_M.gguf.{digest[:16]}.incomplete"
    partial.parent.mkdir(parents=True)
    with open(partial, "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)   # as a pull in another process holds it
        code, _, err = pull("hf:o/r", capsys)
    assert code == 1
    assert last_line(err) == (f"kinetic pull: hf:o/r: another kinetic pull is downloading "
                              f"m-Q4_K_M.gguf into {partial.parent}")
    assert fake_hub.downloads() == []


def test_registry_keys_pull_through_fetch_and_models_fetch_is_pull(cache, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(store, "fetch_model",
                        lambda key, progress=None: asked.append(key) or cache / f"{key}.gguf")
    assert main(["pull", "smollm2"]) == 0
    assert main(["models", "fetch", "qwen25coder"]) == 0
    assert asked == ["smollm2", "qwen25coder"]
    assert capsys.readouterr().out == f"{cache / 'smollm2.gguf'}\n{cache / 'qwen25coder.gguf'}\n"
    assert main(["pull", "llama99"]) == 1
    assert "kinetic pull: llama99: not a model name" in capsys.readouterr().err


# --- list and rm --------------------------------------------------------------------------

def test_list_shows_the_registry_and_the_pulls_and_rm_removes_them(fake_hub, cache, capsys,
                                                                   monkeypatch):
    whole = b"registry model"
    monkeypatch.setitem(fetch.MODELS, "fake", ModelSpec(
        "fake", "a fake registry model", "fake.gguf", hashlib.sha256(whole).hexdigest(),
        ("fake==1.0",), ("fake/fake.gguf",), ""))
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(whole)   # as fetch_model leaves it
    fake_hub.add("o/r", {"x-Q8_0.gguf": b"8" * 3 * 2**20, "x-Q4_0.gguf": b"4" * 2**20})
    fake_hub.add("p/q", {"sub/a.gguf": b"a" * 100})
    for name in ("hf:o/r:Q8_0", "hf:o/r:Q4_0", "hf:p/q/sub/a.gguf"):
        assert pull(name, capsys)[0] == 0

    assert main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert main(["models", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == listed
    rows = {line.split()[0]: line for line in listed}
    assert set(rows) == {*fetch.MODELS, "hf:o/r:Q4_0", "hf:o/r:Q8_0", "hf:p/q/sub/a.gguf"}
    assert re.fullmatch(r"smollm2 +- +not pulled +SmolLM2-135M-Instruct.*", rows["smollm2"])
    assert rows["fake"].split()[1:] == ["0.0", "MiB", str(cache / "fake.gguf"), "a", "fake",
                                        "registry", "model"]
    assert rows["hf:o/r:Q8_0"].split()[1:] == ["3.0", "MiB", str(cache / "hf/o/r/x-Q8_0.gguf")]
    assert rows["hf:o/r:Q4_0"].split()[1:] == ["1.0", "MiB", str(cache / "hf/o/r/x-Q4_0.gguf")]

    assert main(["rm", "hf:o/r:q8_0"]) == 0
    assert files_under(cache / "hf") == ["o/r/x-Q4_0.gguf", "o/r/x-Q4_0.gguf.sha256-ok",
                                         "p/q/sub/a.gguf", "p/q/sub/a.gguf.sha256-ok"]
    assert main(["rm", "hf:o/r:Q8_0"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"kinetic rm: hf:o/r:Q8_0 is not in kinetic's model cache ({cache})"
    assert main(["rm", "hf:p/q/sub/a.gguf"]) == 0 and main(["rm", "hf:o/r"]) == 0
    assert list((cache / "hf").iterdir()) == []   # the emptied folders go too
    assert main(["rm", "fake"]) == 0
    assert files_under(cache) == []
    for name in ("fake", "smollm2"):
        assert main(["rm", name]) == 1
    assert main(["rm", "llama99"]) == 1
    assert "kinetic rm: llama99: not a model name" in capsys.readouterr().err


def test_a_copy_is_a_model_of_its_own(cache, capsys, tmp_path):
    """store.copy (a router's /api/copy): a link to the source's file under a name of its
    own, which list shows and serve's resolve finds, and rm takes away alone; a malformed
    or taken name is refused. A file elsewhere (a --models-dir file) can be copied too."""
    source = tmp_path / "models" / "mine.gguf"
    source.parent.mkdir()
    source.write_bytes(b"GGUF weights")
    made = store.copy(source, "mine-copy:latest")
    assert made == cache / "copies" / "mine-copy.gguf"
    assert made.read_bytes() == source.read_bytes()
    assert os.path.samefile(made, source)   # no second copy of the weights
    assert store.resolve("mine-copy") == store.resolve("mine-copy:latest") == str(made)
    store.copy(made, "mine-copy:v2")
    assert main(["list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert rows["mine-copy"].endswith("a copy") and "mine-copy:v2" in rows
    for bad in ("mine-copy", "smollm2", "a/b", "../x", "", ":tag", None, "x" * 200):
        with pytest.raises(ValueError):
            store.copy(source, bad)
    assert main(["rm", "mine-copy"]) == 0
    assert source.read_bytes() == b"GGUF weights" and (cache / "copies/mine-copy:v2.gguf").exists()
    with pytest.raises(store.ModelNotFound):
        store.resolve("mine-copy")
    assert main(["rm", "mine-copy"]) == 1


def test_rm_deletes_nothing_outside_the_cache(cache, capsys, tmp_path):
    """A name that is a path (absolute, or up out of copies/ with ..) is no copy's: rm
    deletes nothing (it once deleted such a .gguf file), and says so in one line."""
    (cache / "copies").mkdir(parents=True, exist_ok=True)   # as after any /api/copy
    decoy = tmp_path / "decoys" / "victim.gguf"
    decoy.parent.mkdir()
    decoy.write_bytes(b"GGUF not yours")
    up = os.path.relpath(decoy.with_suffix(""), cache / "copies")
    for name in (str(decoy.with_suffix("")), up, "z" * 100_000, "hf:x"):
        assert main(["rm", name]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        with pytest.raises(store.ModelNotFound):
            store.remove(name)
    assert decoy.read_bytes() == b"GGUF not yours"
    with pytest.raises(ValueError):
        store.copy(decoy, "hf:x")   # an hf: name is Hugging Face's, and rm could not take it


# --- no other command touches the network -------------------------------------------------

@pytest.fixture
def no_network(cache, monkeypatch):
    """Opening a connection or running pip fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a command other than kinetic pull used the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(fetch, "_pip_download", refuse)
    monkeypatch.setattr(fetch, "_pip_command", ["/nonexistent/pip-must-not-run"])
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


@pytest.mark.parametrize("name", ["smollm2", "hf:o/r", "hf:o/r:Q8_0", "hf:o/r/x.gguf"])
def test_an_unpulled_model_names_the_pull_to_run_without_downloading(no_network, name, capsys,
                                                                     tmp_path):
    line = f"kinetic: {name} is not pulled; run: kinetic pull {name}"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")   # a file that exists: then the draft model is what fails
    for argv in (["run", name, "hi"], ["serve", name], ["serve", "-m", name],
                 ["run", str(model), "hi", "-md", name], ["serve", str(model), "-md", name]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == line
    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    assert main(["verify-receipt", str(receipt), "--model", name]) == 2
    assert capsys.readouterr().err == \
        f"kinetic verify-receipt: cannot check the receipt: --model {line[9:]}\n"


def test_a_missing_file_is_one_line(no_network, tmp_path):
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(SystemExit) as e:
        main(["run", missing, "hi"])
    assert e.value.code == (f"kinetic: {missing}: no such file, and not a model name "
                            f"(`kinetic list` shows them; hf:OWNER/REPO[:QUANT] names a Hugging "
                            f"Face repository)")


def test_a_registry_file_that_fails_its_check_is_pulled_again_not_served(no_network, cache):
    cache.mkdir()
    (cache / fetch.MODELS["smollm2"].filename).write_bytes(b"not the model")
    with pytest.raises(SystemExit, match="smollm2: its cached file failed its SHA-256 check; "
                       "run: kinetic pull smollm2"):
        resolve_model("smollm2")


def test_kinetic_serve_exits_1_in_one_line_and_asks_no_hub_or_index(fake_hub, cache):
    """The real command, in a process of its own: the hub and pip's index both point at
    FakeHub, which must see no request."""
    env = {**os.environ, "PIP_INDEX_URL": f"{fake_hub.url}/simple", "HF_ENDPOINT": fake_hub.url}
    for name in ("smollm2", "hf:o/r:Q8_0"):
        proc = subprocess.run([sys.executable, "-m", "kinetic.cli", "serve", name],
                              capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert (proc.returncode, proc.stdout) == (1, "")
        assert proc.stderr == f"kinetic: {name} is not pulled; run: kinetic pull {name}\n"
    assert fake_hub.requests == []


def test_only_pull_imports_huggingface_hub(cache):
    script = ("import sys\nfrom kinetic import cli\n"
              "cli.main(['list'])\n"
              "for argv in (['run', 'hf:o/r', 'x'], ['rm', 'hf:o/r']):\n"
              "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
              "assert 'huggingface_hub' not in sys.modules, 'imported'\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
