"""`kinetic serve`'s flags, mapped to the server's and the engine's configs (no model is
loaded: these check the mapping and the refusals)."""

from __future__ import annotations

import pytest

from kinetic.cli import build_parser
from kinetic.serve_cli import serve_options


@pytest.fixture(autouse=True)
def model_files(tmp_path, monkeypatch):
    """m.gguf and d.gguf in the working directory: serve resolves its model and draft at
    start, and refuses a file that does not exist."""
    monkeypatch.chdir(tmp_path)
    for name in ("m.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"")


def options(*argv: str):
    return serve_options(build_parser().parse_args(["serve", "m.gguf", *argv]))


def test_defaults_are_llama_servers():
    config, model = options()
    assert (config.host, config.port) == ("127.0.0.1", 8080)
    assert config.api_keys == () and config.max_connections == 64
    assert config.request_timeout == 30.0 and config.stall_timeout == 60.0
    assert model.path == "m.gguf" and model.model_id == "m" and model.draft is None
    assert model.engine.parallel == 0 and model.engine.n_ctx == 4096


def test_the_kernel_is_a_flag_of_serve_and_run():
    """--kernel picks what multiplies the weights (default: KINETIC_KERNEL, else auto)."""
    assert options()[1].kernel == "auto"
    assert options("--kernel", "pallas")[1].kernel == "pallas"
    assert build_parser().parse_args(["run", "m.gguf", "hi", "--kernel", "xla"]).kernel == "xla"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m.gguf", "--kernel", "cuda"])


def test_flags_map_to_fields(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("k2\n\n k3 \n")
    sign = tmp_path / "sign.pem"
    from kinetic.receipts import write_signing_key
    write_signing_key(sign)
    config, model = options(
        "--host", "0.0.0.0", "--port", "9000", "-c", "6144", "-np", "3", "-ub", "32",
        "-b", "64", "--api-key", "k1,k0", "--api-key-file", str(keys), "--timeout", "2.5",
        "--max-connections", "8", "--stall-timeout", "120", "--sign-key", str(sign),
        "--metrics", "--slots", "-ngl", "99")
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert config.api_keys == ("k1", "k0", "k2", "k3")
    assert config.request_timeout == 2.5 and config.max_connections == 8
    assert config.stall_timeout == 120.0
    assert config.sign_key == str(sign)
    e = model.engine
    assert (e.n_ctx, e.parallel, e.step_tokens, e.chunk_tokens) == (2048, 3, 32, 64)


def test_ollama_takes_its_port_unless_one_is_given():
    assert options("--ollama")[0].port == 11434
    assert options("--ollama", "--port", "8081")[0].port == 8081


def test_context_zero_means_the_models_own():
    assert options("-c", "0")[1].engine.n_ctx >= 1 << 20  # capped by the model at load


@pytest.mark.parametrize("argv,words", [
    (["--mmproj", "/no/such/p.gguf"], "no such file"),
    (["-ub", "0"], "-ub"),
    (["-b", "0"], "-b"),
    (["--sign-key", "/no/such/key.pem"], "no such file"),
    (["--draft-max", "16"], "--draft-max"),
    (["-ub", "4", "--draft-max", "4"], "--draft-max"),
    (["--cache-ram", "-1"], "--cache-ram"),
    (["-ctk", "f16", "-ctv", "f32"], "one type"),
])
def test_refused_flags_say_why(argv, words):
    with pytest.raises(SystemExit) as e:
        options(*argv)
    assert words in str(e.value)


@pytest.mark.parametrize("argv", [["--max-connections", "0"], ["--timeout", "0"],
                                  ["--stall-timeout", "0"], ["--port", "70000"], ["-np", "-1"],
                                  ["-np", "65"], ["-np", "16", "-ub", "8"]])
def test_invalid_values_are_errors(argv):
    with pytest.raises(ValueError):
        options(*argv)


def test_parallel_is_bounded_in_one_line_naming_the_flags():
    with pytest.raises(ValueError, match=r"^parallel \(-np\) must be 0 \(automatic\) or 1 to 64 "
                       r"sequences at once, not 100$"):
        options("-np", "100")
    with pytest.raises(ValueError, match=r"^step_tokens \(-ub 8\) must be at least parallel "
                       r"\(-np 16\)"):
        options("-np", "16", "-ub", "8")


def test_the_step_size_is_automatic_unless_ub_is_given():
    # 0: resolved at load to 16 rows, or 2 x the slots when that is more (EngineConfig)
    assert options("-np", "16")[1].engine.step_tokens == 0
    assert options("-np", "16", "-ub", "16")[1].engine.step_tokens == 16
    assert options("-np", "16", "--draft-max", "20")[1].engine.max_draft == 20   # -ub 32


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--host", "--port", "--ctx-size", "--parallel", "--batch-size",
                 "--ubatch-size", "--api-key", "--api-key-file", "--model-draft", "--sign-key",
                 "--mmproj", "--ollama", "--metrics", "--slots", "--gpu-layers", "--timeout",
                 "--max-connections", "--stall-timeout", "--draft-max", "--cache-ram",
                 "--cache-type-k", "--cache-type-v", "--swa-full", "--no-compile-cache",
                 "--models-dir", "--models-max", "--models-preset", "--models-autoload"):
        assert flag in text


def test_mmproj_is_taken(tmp_path):
    (tmp_path / "p.gguf").write_bytes(b"")
    assert options("--mmproj", str(tmp_path / "p.gguf"))[1].mmproj == str(tmp_path / "p.gguf")


def test_model_draft_is_taken():
    assert options("-md", "d.gguf")[1].draft == "d.gguf"


def test_drafting_and_the_host_cache_can_be_turned_off():
    e = options()[1].engine
    assert e.speculative and e.max_draft == 4 and e.host_cache_mb == 1024
    e = options("--draft-max", "0", "--cache-ram", "0")[1].engine
    assert not e.speculative and e.max_draft == 0 and e.host_cache_mb == 0
    e = options("--spec-draft-n-max", "2", "-cram", "64")[1].engine
    assert e.speculative and e.max_draft == 2 and e.host_cache_mb == 64


def test_cache_type_flags_set_the_kv_cache_type():
    assert options()[1].engine.kv_dtype == "float16"                  # llama.cpp's default
    assert options("-ctk", "f32")[1].engine.kv_dtype == "float32"     # one alone sets both
    assert options("-ctv", "bf16")[1].engine.kv_dtype == "bfloat16"
    assert options("-ctk", "q8_0", "-ctv", "q8_0")[1].engine.kv_dtype == "q8_0"
    assert options("--cache-type-k", "f16", "--cache-type-v", "f16")[1].engine.kv_dtype == "float16"
    with pytest.raises(SystemExit):          # a type kinetic has not: argparse names the choices
        options("-ctk", "q4_0")


def test_swa_full_keeps_the_sliding_window_rows():
    assert not options()[1].engine.swa_full
    assert options("--swa-full")[1].engine.swa_full


@pytest.mark.parametrize("argv", [["serve", "m.gguf", "-ctk", "q4_1"], ["serve", "--bogus"],
                                  ["run"], ["nothing-such"]])
def test_a_bad_command_line_is_one_line(argv, capsys):
    """argparse's errors without its usage block: one line naming the problem and where
    the flags are listed, exit status 2."""
    from kinetic.cli import main
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "usage" not in err
    assert err.startswith("kinetic") and "--help lists the flags" in err


def test_a_router_passes_its_engine_flags_to_each_worker(tmp_path):
    """The flags that are not the router's own go to every worker as they were given; the
    preset file adds a model's own."""
    from kinetic.serve_cli import read_presets, worker_flags
    args = build_parser().parse_args(["serve", "--models-dir", str(tmp_path), "-c", "4096",
                                      "-np", "2", "--swa-full", "--api-key", "k", "--port",
                                      "9000", "-ctk", "q8_0", "--no-compile-cache"])
    flags = worker_flags(args, args.serve_parser)
    assert flags == ["--ctx-size", "4096", "--parallel", "2", "--cache-type-k", "q8_0",
                     "--swa-full", "--no-compile-cache"]
    preset = tmp_path / "preset.ini"
    preset.write_text("[*]\nctx-size = 1024\n\n[smollm2]\nswa-full = true\nnp = 3\n"
                      "kv-unified = false\n")
    assert read_presets(str(preset)) == {"*": ["--ctx-size", "1024"],
                                         "smollm2": ["--swa-full", "-np", "3"]}
    with pytest.raises(SystemExit, match="models-preset"):
        read_presets(str(tmp_path / "missing.ini"))


def test_expert_offload_flags_change_nothing_on_a_cpu_and_are_refused_elsewhere(monkeypatch):
    """--cpu-moe / --n-cpu-moe: every weight is in host memory on JAX's cpu backend."""
    import jax
    assert options("--cpu-moe")[1].path == "m.gguf"
    assert options("--n-cpu-moe", "4")[1].path == "m.gguf"
    with pytest.raises(SystemExit, match="--n-cpu-moe must be 0 or more"):
        options("--n-cpu-moe", "-1")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(SystemExit, match="while the rest runs on the gpu is not built yet"):
        options("--cpu-moe")


@pytest.mark.parametrize("argv,message", [
    (["--coordinator", "127.0.0.1:1234"], "needs --num-processes P and --process-id I"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "1", "--process-id", "0"],
     "at least 2 processes"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "an id from 0 to P - 1"),
    (["--coordinator", "nowhere", "--num-processes", "2", "--process-id", "0"],
     "give HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "-sm", "none"],
     "-sm none leaves nothing to them"),
])
def test_the_process_flags_are_checked_before_anything_starts(argv, message):
    """(kinetic/engine/hosts.py: nothing joins, no JAX backend starts, for a wrong set.)"""
    from kinetic.serve_cli import join_processes
    with pytest.raises(SystemExit, match=message) as e:
        join_processes(build_parser().parse_args(["serve", "m.gguf", *argv]))
    assert str(e.value).startswith("kinetic serve: ")
