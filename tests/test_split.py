"""A model split over devices (kinetic/engine/split.py, model/device_split.py): `--split-mode
row` and `--split-mode layer` over 1, 2 and 4 devices give the one device's bits. The devices are CPU devices that
XLA makes on request (XLA_FLAGS=--xla_force_host_platform_device_count=4), which must be set
before JAX starts: each check runs in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kinetic.cli import build_parser
from kinetic.engine.engine_config import Split
from kinetic.engine.split import owners, row_counts
from kinetic.kernels import pallas_matmul as pm
from kinetic.serve_cli import split_from
from tests.conftest import real_model_file
from tests.serve_process import ServeProcess
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
FOUR = "--xla_force_host_platform_device_count=4"


def run_devices(script: str, tmp_path: Path, *argv: str) -> dict:
    """The JSON the script prints last, run with four CPU devices (argv: its sys.argv[1:])."""
    env = {**os.environ, "XLA_FLAGS": FOUR,
           "KINETIC_COMPILE_CACHE_DIR": str(tmp_path / "compiled")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *argv], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


COMPARE = """
    import json, sys
    import numpy as np
    import kinetic
    from kinetic.engine.engine_config import EngineConfig, Split
    from kinetic.llm import open_model
    path, splits, check, kernel = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    out = {}
    for name, (mode, n, *shares) in splits.items():
        split = Split(mode, n, tensor_split=tuple(float(t) for t in shares))
        model = open_model(path, EngineConfig(parallel=2, n_ctx=128, split=split),
                           kernel=kernel, compile=False)
        try:
            logits = np.asarray(model.logits([1, 5, 9, 30, 2, 7, 11]))
            runner = model.engine.runner
            got = {"logits": logits.tobytes().hex(), "split": runner.split,
                   "held": [s.data.nbytes for s in runner._buffer.addressable_shards]
                           if runner._buffer is not None else None,
                   "heads": [s.data.shape[2] for s in runner.cache[0][0].addressable_shards],
                   "output": list(getattr(runner._skeleton.get("output"), "rows", ()))}
            if check in ("stream", "receipt"):
                got["stream"] = [(d.token_ids, [[e.token, e.logprob, e.top] for e in d.logprobs])
                                 for d in model.stream([1, 5, 9, 30, 2], max_tokens=6,
                                                       temperature=0.9, seed=3, logprobs=2)]
            if check == "receipt":   # a split answer's receipt, re-run on one device
                receipt = model.receipt("hello there", max_tokens=6, temperature=0.9, seed=3)
                checked = kinetic.verify_receipt(receipt, model=path)
                got["receipt"] = [receipt["engine"]["split"], checked.status,
                                  list(checked.notes)]
            out[name] = got
        finally:
            model.close()
    print(json.dumps(out))
"""


def compare(path, splits: dict, tmp_path: Path, check: str = "logits",
            kernel: str = "ffi") -> dict:
    """Per split name (splits: name -> [mode, devices] or [mode, devices, tensor shares,
    one per device]): its logits (hex), its runner's split, what each device holds; with
    check "stream" a sampled stream's tokens and log-probabilities too, with "receipt" also
    its receipt verified on one device. All in one process of four CPU devices."""
    return run_devices(COMPARE, tmp_path, str(path), json.dumps(splits), check, kernel)


@pytest.mark.parametrize("mode", ["row", "layer"])
def test_a_split_gives_one_devices_bits_at_1_2_and_4(mode, tmp_path):
    """Logits, tokens and log-probabilities of a sampled stream through the engine."""
    path = write_tiny_model(tmp_path / "llama.gguf", "llama", qtype="Q8_0", d_model=128,
                            d_ffn=256, n_kv_head=4)
    splits = {"none": ["none", 0], "1": [mode, 1], "2": [mode, 2], "4": [mode, 4]}
    out = compare(path, splits, tmp_path, check="receipt")
    assert [out[n]["split"] for n in splits] == [
        {"mode": "none", "devices": 1}, {"mode": mode, "devices": 1},
        {"mode": mode, "devices": 2}, {"mode": mode, "devices": 4}]
    for name in ("1", "2", "4"):
        # the cache's 4 KV heads: each device holds its share's pages
        assert out[name]["heads"] == [4 // int(name)] * int(name), out[name]["heads"]
        assert out[name]["logits"] == out["none"]["logits"], name
        assert out[name]["stream"] == out["none"]["stream"], name
        split, status, notes = out[name]["receipt"]
        assert split == out[name]["split"] and status == "verified", (name, status, notes)
        assert any(f"split by {mode} over {name} devices" in n for n in notes), notes


@pytest.mark.parametrize("arch,qtype", [("qwen2", "Q4_0"), ("gemma3", "Q8_0"),
                                        ("qwen3", "Q8_0"), ("mistral3", "Q8_0"),
                                        ("qwen35", "Q8_0"), ("lfm2", "Q8_0"),
                                        ("qwen3moe", "Q8_0"), ("lfm2moe", "Q8_0"),
                                        ("qwen35moe", "Q8_0")])
def test_every_family_splits_to_the_same_logits(arch, qtype, tmp_path):
    """Dense, recurrent (Qwen3.5's delta rule, LFM2's convolutions) and mixture-of-experts
    families (by layer a mixture's experts run on their layer's device, by row each device
    multiplies its rows of the chosen experts)."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype=qtype, d_model=128,
                            d_ffn=256, n_kv_head=4)
    splits = {"none": ["none", 0], "layer4": ["layer", 4], "row4": ["row", 4]}
    out = compare(path, splits, tmp_path,
                  check="stream" if arch in ("qwen35", "qwen3moe") else "logits")
    assert len({out[name]["logits"] for name in splits}) == 1
    if "stream" in out["none"]:
        assert out["layer4"]["stream"] == out["row4"]["stream"] == out["none"]["stream"]


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("gemma3", "Q8_0"),
                                        ("qwen3moe", "Q8_0")])
def test_the_pallas_kernel_splits_by_row_to_the_same_bits(arch, qtype, tmp_path):
    """The GPU's kernel (interpreted here): each device multiplies whole tiles of the
    unsplit weight's tile over N (pallas_matmul.tiling's bn; a device may get none and
    compute zero rows), at the unsplit weight's tiling, and the cache is split by heads; a
    mixture's
    experts split as any weight; with --tensor-split 3,1 (llama) each weight's tiles in
    that proportion."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype=qtype, d_model=128,
                            d_ffn=256, n_kv_head=4)
    splits = {"none": ["none", 0], "2": ["row", 2], "4": ["row", 4]}
    if arch == "llama":
        splits["ts"] = ["row", 0, 3, 1]
    out = compare(path, splits, tmp_path, check="stream" if arch == "llama" else "logits",
                  kernel="pallas")
    assert len({out[name]["logits"] for name in out}) == 1
    assert out["4"]["heads"] == [1] * 4
    if arch == "llama":
        assert len({str(out[name]["stream"]) for name in out}) == 1
        # the output projection's rows, in whole tiles of the unsplit weight's bn
        (a, b), (c, d) = out["2"]["output"], out["ts"]["output"]
        bn = pm.tiling(a + b, 128).bn
        assert a + b == c + d and (a + b) % 16 == 0
        assert abs(a - b) <= bn and abs(c - 3 * d) <= 4 * bn and a % bn == c % bn == 0


def test_uneven_shares_and_heads_that_do_not_divide(tmp_path):
    """2 KV heads over 4 devices: every device holds the whole cache, and by row the keys'
    32 rows (two 16-row groups) go to two devices, the other two holding zero rows; and
    --tensor-split 3,1 by row: each weight's rows in proportion. The same bits."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype="Q8_0", d_model=128,
                            d_ffn=256, n_kv_head=2)
    splits = {"none": ["none", 0], "layer4": ["layer", 4], "row4": ["row", 4],
              "ts": ["row", 0, 3, 1]}
    out = compare(path, splits, tmp_path, check="stream")
    assert out["layer4"]["heads"] == out["row4"]["heads"] == [2] * 4
    assert out["ts"]["split"]["devices"] == 2
    for got in (out["layer4"], out["row4"], out["ts"]):
        assert got["logits"] == out["none"]["logits"]
        assert got["stream"] == out["none"]["stream"]


def test_smollm2_splits_to_the_same_logits(tmp_path):
    """By row and by layer, each device holding its part of the weights, not all of them."""
    splits = {"none": ["none", 0], "row2": ["row", 2], "row4": ["row", 4],
              "layer2": ["layer", 2], "layer4": ["layer", 4]}
    out = compare(real_model_file("smollm2"), splits, tmp_path)
    assert len({out[name]["logits"] for name in splits}) == 1
    whole = out["none"]["held"][0]
    for name in ("row2", "row4", "layer2", "layer4"):
        held = out[name]["held"]
        assert len(held) == int(name[-1]) and max(held) < 0.7 * whole, (name, held, whole)


def test_a_layer_split_follows_the_tensor_split():
    assert owners(30, Split("layer", 4), 4) == [0] * 8 + [1] * 7 + [2] * 7 + [3] * 8
    assert owners(4, Split("layer", tensor_split=(3, 1)), 2) == [0, 0, 0, 1]
    assert owners(6, Split("layer", tensor_split=(1, 0, 2)), 2) == [0, 0, 1, 1, 1, 1]
    assert owners(3, Split("layer", 1), 1) == [0, 0, 0]


def test_a_row_split_follows_the_tensor_split_in_whole_groups():
    assert row_counts(576, 1, Split("row", 4), 4) == (144,) * 4
    assert row_counts(32, 16, Split("row", 4), 4) == (0, 16, 16, 0)
    assert row_counts(64, 16, Split("row", tensor_split=(3, 1)), 2) == (48, 16)
    assert row_counts(10, 1, Split("row", tensor_split=(1, 0, 1)), 2) == (5, 5)


def test_a_split_that_cannot_be_made_is_one_clear_error(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype="Q8_0", d_model=128,
                            d_ffn=256, n_kv_head=2)
    out = run_devices(f"""
        import json
        from kinetic.engine.engine_config import EngineConfig, Split
        from kinetic.llm import open_model
        errors = []
        for split, kernel in ((Split("row", 8), "ffi"),
                              (Split("layer", tensor_split=(1, 1, 1, 1, 1)), "ffi"),
                              (Split("layer", 2), "pallas")):
            try:
                open_model({str(path)!r}, EngineConfig(parallel=1, n_ctx=64, split=split),
                           kernel=kernel).close()
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        print(json.dumps(errors))
    """, tmp_path)
    assert "8 devices: 4 are visible" in out[0]
    assert "--tensor-split names 5 devices; 4 are visible" in out[1]
    assert "--split-mode layer runs on --kernel ffi, not 'pallas'" in out[2]


def test_the_flags():
    parse = build_parser().parse_args
    assert split_from(parse(["serve", "m.gguf", "-sm", "row"]), "serve") == Split("row")
    assert split_from(parse(["run", "m", "x", "-tp", "2"]), "run") == Split("row", 2)
    assert split_from(parse(["serve", "m.gguf", "-ts", "3,1", "-mg", "1"]), "serve") == \
        Split("layer", tensor_split=(3.0, 1.0), main_device=1)
    assert split_from(parse(["serve", "m.gguf", "-sm", "row", "-ts", "1,1"]), "serve") == \
        Split("row", tensor_split=(1.0, 1.0))
    assert split_from(parse(["serve", "m.gguf"]), "serve") == Split()
    for argv, message in ((["-ts", "a,b"], "give numbers separated by commas"),
                          (["-ts", "0,0"], "not all 0"),
                          (["-tp", "0"], "at least 1"),
                          (["-tp", "2", "-sm", "layer"], "cannot go with --split-mode layer")):
        with pytest.raises(SystemExit) as e:
            split_from(parse(["serve", "m.gguf", *argv]), "serve")
        assert str(e.value).startswith("kinetic serve: ") and message in str(e.value)


def test_a_served_split_model_says_so_and_answers_the_same(tmp_path, monkeypatch):
    """`kinetic serve -tp 2` and `-ts 1,1` (a layer split) on two CPU devices: /props and the
    start line say how the model is split, and a greedy completion is the unsplit
    server's."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype="Q8_0", d_model=128,
                            d_ffn=256, n_kv_head=4)
    monkeypatch.setenv("XLA_FLAGS", FOUR)
    body = {"prompt": "hello there", "n_predict": 8, "temperature": 0, "n_probs": 2}
    answers = []
    for flags, mode in (((), "none"), (("-tp", "2"), "row"), (("-ts", "1,1"), "layer")):
        serve = ServeProcess(str(path), "-c", "256", "-np", "1", "--draft-max", "0", *flags)
        try:
            serve.wait_ready()
            status, _, props = serve.request("GET", "/props")
            assert status == 200
            assert props["split"] == {"mode": mode, "devices": 2 if flags else 1}
            status, _, answer = serve.request("POST", "/completion", body)
            assert status == 200, answer
            answers.append((answer["content"], answer["completion_probabilities"]))
            if flags:
                assert f"split by {mode} over 2 devices" in serve.output()
        finally:
            serve.close()
    assert answers[0] == answers[1] == answers[2]
