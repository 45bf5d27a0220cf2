"""`kinetic serve`: its flags, with llama-server's names (those kinetic honours, then those it
accepts and ignores, each with why), and serve_options, which checks them into the server's
and the engine's configuration, so that a flag kinetic refuses fails at start in one line.
Also resolve_model, the MODEL of serve and run: a GGUF file, or a pulled model's, never
downloaded. The command's parser and its other subcommands are in kinetic/cli.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from kinetic.engine.engine_config import CACHE_TYPES   # -ctk / -ctv: llama-server's names


def resolve_model(name: str) -> str:
    """The GGUF file `name` means: a path, or the cached file of a pulled model name.
    Never downloads: SystemExit with one line naming the `kinetic pull` to run."""
    from kinetic.store import ModelNotFound, resolve
    try:
        return resolve(name)
    except ModelNotFound as e:
        raise SystemExit(f"kinetic: {e}") from None


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (comma-separated, as llama-server takes it) and --api-key-file (one a line)."""
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip()]
        if not keys:
            raise SystemExit(f"kinetic serve: {args.api_key_file}: no API key in the file")
    return tuple(keys)


def serve_options(args: argparse.Namespace):
    """The `serve` flags as (ServerConfig, ModelOptions); SystemExit with a message for
    flags kinetic refuses."""
    from kinetic.api.server import ModelOptions
    from kinetic.engine.engine_config import EngineConfig, auto_step_tokens
    if args.sign_key:
        from kinetic.api.receipt import use_signing_key
        from kinetic.receipts import ReceiptError
        try:
            use_signing_key(args.sign_key)
        except ReceiptError as e:
            raise SystemExit(f"kinetic serve: --sign-key {args.sign_key}: {e}") from None
        mode = os.stat(args.sign_key).st_mode & 0o777
        if mode & 0o077:   # as OpenSSH says of a private key others can read (it refuses it)
            print(f"kinetic serve: warning: --sign-key {args.sign_key} can be read by others "
                  f"(mode {mode:04o}): anyone who reads it can sign receipts as this server; "
                  f"chmod 600 it", file=sys.stderr)
    if args.ubatch_size is not None and args.ubatch_size < 1:
        raise SystemExit("kinetic serve: -ub must be at least 1")
    if args.batch_size < 1:
        raise SystemExit("kinetic serve: -b must be at least 1")
    # -ub: rows per compiled step; without it engine_config.auto_step_tokens(-np)
    ubatch = args.ubatch_size or auto_step_tokens(max(args.parallel, 1))
    if args.draft_max is not None and not 0 <= args.draft_max < ubatch:
        raise SystemExit(f"kinetic serve: --draft-max must be between 0 and -ub - 1 "
                         f"({ubatch - 1}), got {args.draft_max}")
    if args.cache_ram is not None and args.cache_ram < 0:
        raise SystemExit(f"kinetic serve: --cache-ram must be 0 (none) or more MiB, "
                         f"got {args.cache_ram}")
    if args.context_shift:
        raise SystemExit("kinetic serve: --context-shift: kinetic never shifts the context "
                         "(an answer ends with finish_reason length at the context's end); "
                         "leave the flag out")
    if args.model and args.model_flag:
        raise SystemExit("kinetic serve: give the model once (MODEL or -m FILE)")
    if args.cpu_moe or args.n_cpu_moe is not None:
        _experts_in_host_memory(args)
    if not (args.model or args.model_flag):
        raise SystemExit("kinetic serve: which model? give a GGUF file (MODEL or -m FILE)")
    config = server_config(args)
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        raise SystemExit(f"kinetic serve: --slot-save-path {args.slot_save_path}: not a "
                         f"directory")
    # -b: prompt rows one request may take in a step. EngineConfig refuses -np past 64 or
    # above -ub (a ValueError: main prints it as one line)
    # --draft-max 0: no drafting at all; --cache-ram: evicted prefix pages kept in host memory
    given = ({"max_draft": min(EngineConfig.max_draft, ubatch - 1)}
             if args.draft_max is None else
             {"max_draft": args.draft_max, "speculative": args.draft_max > 0})
    if args.decode_steps is not None:
        if args.decode_steps < 1:
            raise SystemExit(f"kinetic serve: --decode-steps must be at least 1, got "
                             f"{args.decode_steps}")
        given["decode_steps"] = args.decode_steps
    if args.cache_ram is not None:
        given["host_cache_mb"] = args.cache_ram
    types = {t for t in (args.cache_type_k, args.cache_type_v) if t is not None}
    if len(types) > 1:
        raise SystemExit(f"kinetic serve: -ctk {args.cache_type_k} and -ctv "
                         f"{args.cache_type_v}: kinetic keeps keys and values in one type; "
                         f"give both the same one")
    if types:
        given["kv_dtype"] = CACHE_TYPES[types.pop()]
    if args.swa_full:
        given["swa_full"] = True
    if args.kv_unified and args.ctx_size:   # one pool of -c tokens, any slot may fill it
        given["num_pages"] = -(-args.ctx_size // EngineConfig.page_size) + 1
    engine = EngineConfig(parallel=args.parallel, n_ctx=_slot_context(args),
                          step_tokens=args.ubatch_size or 0, chunk_tokens=args.batch_size,
                          split=split_from(args, "serve"), **given)
    model = resolve_model(args.model or args.model_flag)
    draft = resolve_model(args.model_draft) if args.model_draft else None
    if args.mmproj and not os.path.isfile(args.mmproj):
        raise SystemExit(f"kinetic serve: --mmproj {args.mmproj}: no such file")
    return config, ModelOptions(model, engine, args.dtype, draft, _sampling(args),
                                _chat_template(args), args.pooling, args.mmproj,
                                args.kernel or "auto")


def _experts_in_host_memory(args: argparse.Namespace) -> None:
    """--cpu-moe / --n-cpu-moe N: on JAX's cpu backend every weight is in host memory
    already (nothing to do); elsewhere experts kept in host memory while the rest runs on
    the device are not built yet: one line."""
    if args.n_cpu_moe is not None and args.n_cpu_moe < 0:
        raise SystemExit(f"kinetic serve: --n-cpu-moe must be 0 or more, got {args.n_cpu_moe}")
    import jax
    if jax.default_backend() != "cpu":
        raise SystemExit(f"kinetic serve: --cpu-moe / --n-cpu-moe: keeping experts in host "
                         f"memory while the rest runs on the {jax.default_backend()} is not "
                         f"built yet; leave the flag out")


def server_config(args: argparse.Namespace):
    """The HTTP side of the `serve` flags (a server's or a router's)."""
    from kinetic.api.core import ServerConfig
    port = args.port if args.port is not None else (11434 if args.ollama else 8080)
    return ServerConfig(  # a ValueError for a bad value: main prints it as one line
        host=args.host, port=port, api_keys=_api_keys(args),
        max_connections=args.max_connections, request_timeout=args.timeout,
        stall_timeout=args.stall_timeout, sign_key=args.sign_key, ollama=args.ollama,
        aliases=_names(args.alias), tags=_names(args.tags), n_predict=args.n_predict,
        slots_endpoint=not args.no_slots, slot_save_path=args.slot_save_path,
        allowed_hosts=tuple(n.lower().rstrip(".") for n in _names(args.allowed_hosts)),
        verbose=args.verbose, webui=not args.no_webui)


# the flags a router keeps for itself; every other flag given goes to each model's worker
ROUTER_DESTS = {"model", "model_flag", "host", "port", "api_key", "api_key_file",
                "allowed_hosts", "timeout", "max_connections", "ollama", "verbose", "alias",
                "tags", "no_webui", "models_dir", "models_max", "models_preset",
                "models_autoload", "func", "command"}


PRESET_REFUSED = {"model", "model_flag", "host", "port", "api_key", "api_key_file", "alias",
                  "models_dir", "models_max", "models_preset", "models_autoload"}


def worker_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The `kinetic serve` flags of each worker of a router: those given to the router that
    are not its own (ROUTER_DESTS), as they were given."""
    out = []
    for action in parser._actions:
        dest = action.dest
        if dest in ROUTER_DESTS or not action.option_strings or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value == action.default or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def read_presets(path: str | None) -> dict[str, list[str]]:
    """--models-preset FILE: an INI file of sections named by model ([*]: every model), each
    `flag = value` line a `kinetic serve` flag of that model's worker (`ctx-size = 8192`,
    `swa-full = true`); SystemExit in one line for a file that cannot be read."""
    import configparser
    if path is None:
        return {}
    ini = configparser.ConfigParser(default_section="__none__")
    ini.optionxform = str
    try:
        with open(path, encoding="utf-8") as f:
            ini.read_file(f)
    except (OSError, ValueError, configparser.Error) as e:   # ValueError: not UTF-8
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"kinetic serve: --models-preset {path}: {first}") from None
    out = {}
    for section in ini.sections():
        flags = []
        for key, value in ini.items(section):
            flag = ("-" if len(key) <= 3 and not key.startswith("-") else "--") + key.lstrip("-")
            if value.strip().lower() in ("true", "on", "yes", ""):
                flags.append(flag)
            elif value.strip().lower() not in ("false", "off", "no"):
                flags += [flag, value.strip()]
        out[section] = flags
    return out


def cmd_router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`kinetic serve` with no model, or with --models-dir: router mode (kinetic/router/)."""
    from kinetic.router.app import run_router
    from kinetic.router.catalog import models_dir_error
    if args.model or args.model_flag:
        raise SystemExit("kinetic serve: --models-dir serves the models of a folder: give no "
                         "model with it")
    why = models_dir_error(args.models_dir)
    if why:
        raise SystemExit(f"kinetic serve: {why}")
    if args.models_max < 0:
        raise SystemExit("kinetic serve: --models-max must be 0 (from free memory) or more")
    presets = read_presets(args.models_preset)
    check_presets(presets, parser, args.models_preset)
    return run_router(server_config(args), {
        "models_dir": args.models_dir, "models_max": args.models_max,
        "presets": presets, "autoload": args.models_autoload,
        "flags": worker_flags(args, parser)})


def check_presets(presets: dict[str, list[str]], parser: argparse.ArgumentParser,
                  path: str | None) -> None:
    """SystemExit in one line for a preset flag that the router sets for its workers
    (PRESET_REFUSED: where a worker listens, its key, its model and name): a worker on
    another port or address than the router gave it would never be reached, or would be
    reached by anyone."""
    options = parser._option_string_actions
    for section, flags in presets.items():
        for flag in flags:
            action = options.get(flag)
            if action is not None and action.dest in PRESET_REFUSED:
                raise SystemExit(f"kinetic serve: --models-preset {path}: [{section}] sets "
                                 f"{flag}, which the router sets for its workers")


def add_weight_flags(command: argparse.ArgumentParser) -> None:
    """--kernel and --dtype: what multiplies the weights, and --no-compile-cache (kinetic run
    and serve)."""
    command.add_argument("--kernel", choices=["auto", "ffi", "xla", "pallas"], default=None,
                         help="what multiplies the weights: ffi (kinetic's C++ kernel, the "
                         "default on CPU), pallas (Pallas kernels, the default on a GPU; "
                         "interpreted on a CPU: exact but slow), xla (dequantized weights); "
                         "default: KINETIC_KERNEL, else auto")
    command.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                         help="compute type of the weights when they are dequantized "
                         "(--kernel xla; default bfloat16); the other kernels read the GGUF "
                         "blocks themselves")
    command.add_argument("--no-compile-cache", action="store_true",
                         help="compile every shape again instead of loading what an earlier "
                         "start compiled (kept in KINETIC_COMPILE_CACHE_DIR, else "
                         "~/.cache/kinetic/compiled; KINETIC_COMPILE_CACHE=0 does the same)")


def add_split_flags(command: argparse.ArgumentParser) -> None:
    """llama.cpp's flags for a model split over several devices, and vLLM's count (kinetic
    run and serve; kinetic/engine/split.py)."""
    command.add_argument("-sm", "--split-mode", choices=["none", "layer", "row"],
                         default=None,
                         help="split the model over several devices: layer (consecutive "
                         "layers on consecutive devices), row (every projection's rows "
                         "divided among them, the pieces gathered), or none (the default); "
                         "either split gives the same bits as one device")
    command.add_argument("-ts", "--tensor-split", metavar="N0,N1,...", default=None,
                         help="each device's share of the split, as llama.cpp's flag "
                         "(0 leaves a device out; alone it means --split-mode layer, as "
                         "in llama.cpp); either split follows it in proportion")
    command.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="I",
                         help="the device the sampler runs on under a split (default 0)")
    command.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                         help="vLLM's name for --split-mode row over N devices")


def split_from(args: argparse.Namespace, command: str):
    """The engine's Split of the split flags; SystemExit in one line for a wrong one."""
    from kinetic.engine.engine_config import Split
    mode = args.split_mode
    if args.tensor_parallel_size is not None:
        if args.tensor_parallel_size < 1:
            raise SystemExit(f"kinetic {command}: --tensor-parallel-size must be at least 1")
        if mode not in (None, "row"):
            raise SystemExit(f"kinetic {command}: --tensor-parallel-size is --split-mode "
                             f"row; it cannot go with --split-mode {mode}")
        mode = "row"
    shares: tuple[float, ...] = ()
    if args.tensor_split is not None:
        try:
            shares = tuple(float(t) for t in args.tensor_split.replace("/", ",").split(","))
        except ValueError:
            raise SystemExit(f"kinetic {command}: --tensor-split {args.tensor_split}: give "
                             f"numbers separated by commas (3,1 or 1,1,1,1)") from None
        mode = mode or "layer"
    try:
        return Split(mode or "none", devices=args.tensor_parallel_size or 0,
                     tensor_split=shares, main_device=args.main_gpu)
    except ValueError as e:
        raise SystemExit(f"kinetic {command}: {e}") from None


def _names(value: str | None) -> tuple[str, ...]:
    """A comma-separated flag value as its names, spaces around them dropped."""
    return () if value is None else tuple(n.strip() for n in value.split(","))


def _slot_context(args: argparse.Namespace) -> int:
    """Each slot's context from -c, as llama-server counts it: with -np N given, -c is the
    total of the N slots; with the automatic -np, each slot's (a large number: the model's
    own, capped at load)."""
    if args.ctx_size is None:
        return 4096
    if args.ctx_size == 0:
        return 1 << 30
    if args.ctx_size < 0:
        raise SystemExit(f"kinetic serve: -c must be 0 (the model's own) or more tokens, "
                         f"got {args.ctx_size}")
    if args.parallel > 0 and not args.kv_unified:
        return args.ctx_size // args.parallel
    return args.ctx_size


def _sampling(args: argparse.Namespace) -> dict:
    """The SamplingParams fields that --temp, --seed... set for requests that give none
    (checked now: a bad value fails at start)."""
    from kinetic.engine.sampling_params import SamplingParams
    given = {field: getattr(args, f"sampling_{field}") for _, field, _ in SAMPLING_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if args.seed is not None and args.seed != -1:
        if not 0 <= args.seed < 1 << 32:
            raise SystemExit(f"kinetic serve: --seed must be -1 (a fresh one per request) or "
                             f"0 to {(1 << 32) - 1}, got {args.seed}")
        given["seed"] = args.seed
    try:
        SamplingParams(**given)
    except ValueError as e:
        raise SystemExit(f"kinetic serve: {e}") from None
    return given


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template or --chat-template-file: the Jinja source, checked now."""
    from kinetic.text.chat_template import ChatTemplate
    if args.chat_template is not None and args.chat_template_file is not None:
        raise SystemExit("kinetic serve: give --chat-template or --chat-template-file, not both")
    source = args.chat_template
    if args.chat_template_file is not None:
        try:
            with open(args.chat_template_file, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"kinetic serve: --chat-template-file "
                             f"{args.chat_template_file}: {e}") from None
    if source is None:
        return None
    from kinetic.text.builtin_templates import BUILTIN
    if args.chat_template_file is None and source in BUILTIN:
        source = BUILTIN[source]
    elif "{" not in source and source != "chatml":
        names = ", ".join(sorted([*BUILTIN, "chatml"]))
        raise SystemExit(f"kinetic serve: --chat-template {source!r}: not a Jinja template "
                         f"nor a format kinetic knows by name ({names}); give the template "
                         f"with --chat-template-file")
    try:
        ChatTemplate(source)
    except Exception as e:  # noqa: BLE001 - any template error is the flag's fault
        raise SystemExit(f"kinetic serve: the chat template cannot be used: {e}") from None
    return source


def die_with_router() -> None:
    """In a router's worker (KINETIC_ROUTER_PID, set by kinetic/router/workers.py): Linux
    sends this process SIGTERM when the router ends, by SIGKILL too, which no handler of the
    router's sees (PR_SET_PDEATHSIG); a router already gone ends it now. Elsewhere nothing."""
    pid = os.environ.pop("KINETIC_ROUTER_PID", None)
    if pid is None:
        return
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the router's stop still ends it
        pass
    if str(os.getppid()) != pid:
        raise SystemExit("kinetic serve: the router that started this worker has ended")


def cmd_serve(args: argparse.Namespace) -> int:
    apply_compile_cache_flag(args)
    die_with_router()
    if args.models_dir is not None or not (args.model or args.model_flag):
        if args.coordinator:
            raise SystemExit("kinetic serve: --coordinator serves one model (give MODEL), "
                             "not a router's")
        return cmd_router(args, args.serve_parser)
    if args.coordinator:
        follower = join_processes(args)
        if follower:
            return follow(args)
    from kinetic.api.server import run
    return run(*serve_options(args))


def join_processes(args: argparse.Namespace) -> bool:
    """--coordinator, --num-processes, --process-id: checked, and this process joined to the
    others (engine/hosts.py). Without a split, the model is split by layer (llama.cpp's
    default across devices). Returns whether this process follows (not process 0)."""
    if args.num_processes is None or args.process_id is None:
        raise SystemExit("kinetic serve: --coordinator needs --num-processes P and "
                         "--process-id I (0 for the one that serves HTTP)")
    if args.num_processes < 2 or not 0 <= args.process_id < args.num_processes:
        raise SystemExit(f"kinetic serve: --num-processes {args.num_processes} "
                         f"--process-id {args.process_id}: at least 2 processes, and an id "
                         f"from 0 to P - 1")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"kinetic serve: --coordinator {args.coordinator}: give HOST:PORT")
    if args.split_mode in (None, "none") and args.tensor_parallel_size is None:
        if args.split_mode == "none":
            raise SystemExit("kinetic serve: --coordinator splits the model over the "
                             "processes' devices; -sm none leaves nothing to them")
        args.split_mode = "layer"
    from kinetic.engine import hosts
    hosts.initialize(args.coordinator, args.num_processes, args.process_id)
    return args.process_id > 0


def follow(args: argparse.Namespace) -> int:
    """A process other than 0: the model read, then the leader's calls (hosts.follow)."""
    import sys
    from kinetic import compile_cache
    from kinetic.engine import hosts
    from kinetic.model.loader import load_model
    path = resolve_model(args.model or args.model_flag)
    compile_cache.configure()
    print(f"kinetic: process {args.process_id} loading {path}", file=sys.stderr, flush=True)
    loaded = load_model(path, dtype=args.dtype, kernel=args.kernel or "auto",
                        defer_repack=True)
    if loaded.config.task != "text":
        raise SystemExit(f"kinetic serve: {path} is an {loaded.config.task} model; only text "
                         f"models are served across processes yet")
    try:
        draft = None if not args.model_draft else load_model(
            resolve_model(args.model_draft), dtype=args.dtype, kernel=args.kernel or "auto",
            defer_repack=True)
        return hosts.follow(loaded, draft)
    except BaseException as e:   # noqa: BLE001 - a follower that fails leaves at once:
        # Python's own exit would wait for every process (jax.distributed's shutdown) while
        # the leader waits for this one in a broadcast
        print(f"kinetic: process {args.process_id}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        os._exit(1)


def apply_compile_cache_flag(args: argparse.Namespace) -> None:
    """--no-compile-cache: compile everything again (kinetic/compile_cache.py); set in the
    environment too, for the processes this one starts."""
    if args.no_compile_cache:
        from kinetic import compile_cache
        compile_cache.set_enabled(False)
        os.environ["KINETIC_COMPILE_CACHE"] = "0"


def add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP (OpenAI API)",
        description="Serve MODEL over HTTP with the OpenAI API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/health). The server listens at once and answers "
        "503 while the model loads and compiles, then prints its address. Flags take "
        "llama-server's names. See docs/server.md.")
    serve.add_argument("model", nargs="?",
                       help="a GGUF file, or a pulled model name (kinetic pull NAME first; "
                       "serve never downloads)")
    serve.add_argument("-m", "--model", dest="model_flag", metavar="FILE",
                       help="the model, as llama-server takes it (instead of MODEL)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; another address lets "
                       "anyone who reaches it use the model: set --api-key)")
    serve.add_argument("--port", type=int, default=None,
                       help="port to listen on (default 8080; with --ollama and no --port, only "
                       "11434; 0 picks a free one)")
    serve.add_argument("-c", "--ctx-size", type=int, default=None,
                       help="context in tokens, as llama-server counts it: with -np N, the "
                       "total of the N slots, each getting a 1/N share; with the automatic "
                       "-np, the context of each slot (default: 4096 per slot; 0: the model's "
                       "own; capped by the model's)")
    serve.add_argument("-np", "--parallel", type=int, default=0,
                       help="requests run at once, one slot each, 1 to 64 (default 0: as many "
                       "full contexts as half the free memory holds, up to 4). The KV cache "
                       "of every slot's full context is allocated at start; one that does not "
                       "fit the memory available is an error naming the sizes")
    serve.add_argument("-ub", "--ubatch-size", type=int, default=None,
                       help="most token rows of a step, shared by every running request, at "
                       "least -np (default 16, or 2 x -np when that is more; 128 for a "
                       "mixture of experts; llama.cpp's "
                       "physical batch). With the C++ kernel a step runs at the smallest "
                       "compiled bucket 1, 2, 4 ... N that holds its rows; with "
                       "KINETIC_KERNEL=xla every step costs N rows")
    serve.add_argument("-b", "--batch-size", type=int, default=512,
                       help="most prompt tokens of one request run per step (default 512; "
                       "capped by -ub)")
    serve.add_argument("--api-key", metavar="KEY",
                       help="require this key (Authorization: Bearer KEY or X-Api-Key: KEY) on "
                       "every route but /health; several keys: comma-separated")
    serve.add_argument("--api-key-file", metavar="FILE",
                       help="read API keys from FILE, one per line")
    serve.add_argument("--allowed-hosts", metavar="NAMES",
                       help="on a loopback --host without --api-key, Host names served beside "
                       "this computer's own (localhost, *.localhost, 127.0.0.0/8, [::1]), "
                       "comma-separated; '*' serves any (default: none; other Host names get "
                       "403, which stops DNS rebinding)")
    serve.add_argument("-to", "--timeout", type=float, default=30.0, metavar="SECONDS",
                       help="seconds a client has to send its request (default 30); slower "
                       "clients are disconnected")
    serve.add_argument("--max-connections", type=int, default=64,
                       help="open connections served at once (default 64); one more is "
                       "answered 503 at once and closed")
    serve.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="/health answers 503 while one engine step has run longer than "
                       "this (default 60), so that a supervisor can restart a stuck server")
    serve.add_argument("-md", "--model-draft", metavar="MODEL",
                       help="a smaller model of the same vocabulary that drafts tokens for "
                       "speculative decoding (never changes an answer; without it, drafts "
                       "come from n-gram lookup)")
    serve.add_argument("--draft-max", "--spec-draft-n-max", type=int, default=None, metavar="N",
                       help="most tokens drafted per step for each request (default 4; less "
                       "than -ub); 0 turns speculative decoding off, n-gram lookup and -md alike")
    serve.add_argument("--decode-steps", type=int, default=None, metavar="N",
                       help="greedy decode steps per device call when nothing can come between "
                       "them (no request waiting, no grammar, penalties or logprobs; default 4; "
                       "1: one step per call). Never changes an answer")
    serve.add_argument("-cram", "--cache-ram", type=int, default=None, metavar="MiB",
                       help="host memory for prompt-cache pages evicted from the KV cache, "
                       "reused by a later prompt that starts the same (default 1024; 0: none)")
    serve.add_argument("-ctk", "--cache-type-k", metavar="TYPE", choices=sorted(CACHE_TYPES),
                       default=None,
                       help="KV cache type: f16 (the default, as llama-server's), f32 (twice "
                       "the memory), bf16, or q8_0 (blocks of 32 int8 values with an f16 scale: "
                       "0.53 of f16's memory; heads a multiple of 32 wide; keys and values "
                       "rotated as llama.cpp rotates a quantized cache). kinetic keeps keys and "
                       "values in one type: -ctk and -ctv must agree, and either one alone "
                       "sets both")
    serve.add_argument("-ctv", "--cache-type-v", metavar="TYPE", choices=sorted(CACHE_TYPES),
                       default=None, help="KV cache type for values: as -ctk")
    serve.add_argument("--swa-full", action="store_true",
                       help="keep every row of the sliding-window layers' cache (Gemma 3's), as "
                       "llama-server's flag does. By default their rows that every query has "
                       "passed by the window take no memory (C++ kernel); a prompt then reuses "
                       "a cached prefix only as far back as those layers still hold its last "
                       "window. Never changes an answer")
    serve.add_argument("--sign-key", metavar="FILE",
                       help="sign the receipts of answers that ask for one (\"receipt\": "
                       "true) with this Ed25519 private key, PEM PKCS#8 (kinetic keygen FILE "
                       "writes one); a key that cannot be used fails at start")
    serve.add_argument("--mmproj", metavar="FILE",
                       help="vision projector (llama.cpp's mmproj GGUF) for the text model: "
                       "chat messages may then carry images (image_url parts with base64 data "
                       "URLs of PNG or JPEG). Projectors: Gemma 3, SmolVLM / Idefics3")
    serve.add_argument("--ollama", action="store_true",
                       help="also listen on Ollama's port 11434, for apps written for Ollama "
                       "(its /api routes are always served; without --port, only 11434)")
    serve.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", type=int, metavar="N",
                       help="accepted for llama-server compatibility: kinetic places the whole "
                       "model on JAX's default device (ignored on a CPU)")
    serve.add_argument("-cmoe", "--cpu-moe", action="store_true",
                       help="keep every mixture-of-experts layer's experts in host memory, "
                       "as llama-server's flag: on a CPU (JAX's cpu backend) they are there "
                       "already, so it changes nothing; on a GPU it is refused (not built "
                       "yet)")
    serve.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=None, metavar="N",
                       help="the same for the first N layers' experts (llama-server's flag)")
    add_weight_flags(serve)
    add_split_flags(serve)
    serve.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="serve one model from several processes, one per host, joined "
                       "by jax.distributed at this address (process 0 listens there): the "
                       "model split over all their devices (-sm layer unless told), process "
                       "0 serving HTTP. Every process runs the same command with its own "
                       "--process-id")
    serve.add_argument("--num-processes", type=int, default=None, metavar="P",
                       help="how many processes serve the model (with --coordinator)")
    serve.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process's number, 0 to P - 1 (with --coordinator); 0 "
                       "serves HTTP, the others follow it")
    _add_llama_server_flags(serve)
    _add_router_flags(serve)
    serve.set_defaults(func=cmd_serve, serve_parser=serve)


def _add_router_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("router mode (no MODEL: every pulled model, and with "
                                 "--models-dir every GGUF of a folder, each loaded in a "
                                 "process of its own when a request names it)")
    g.add_argument("--models-dir", metavar="DIR", default=None,
                   help="serve every GGUF file under DIR too (by its file name), beside the "
                   "pulled models")
    g.add_argument("--models-max", type=int, default=0, metavar="N",
                   help="models loaded at once; past it the least recently used idle one is "
                   "unloaded (default 0: as many as half the free memory holds)")
    g.add_argument("--models-preset", metavar="FILE", default=None,
                   help="an INI file: a section per model name ([*] for all), each line a "
                   "`kinetic serve` flag of its worker (ctx-size = 8192)")
    g.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                   help="load a model when a request names it (default); with "
                   "--no-models-autoload only POST /models/load does")


# llama-server's sampling flags -> the SamplingParams field whose server default each sets
SAMPLING_FLAGS = [("--temp", "temperature", float), ("--top-k", "top_k", int),
                  ("--top-p", "top_p", float), ("--min-p", "min_p", float),
                  ("--repeat-penalty", "repeat_penalty", float),
                  ("--repeat-last-n", "repeat_last_n", int),
                  ("--presence-penalty", "presence_penalty", float),
                  ("--frequency-penalty", "frequency_penalty", float)]
# llama-server flags that kinetic takes and that change nothing: (names, takes a value, why)
IGNORED_FLAGS = [
    (("-t", "--threads"), True, "the C++ kernel's pool has one thread per core"),
    (("-tb", "--threads-batch"), True, "the C++ kernel's pool has one thread per core"),
    (("-cb", "--cont-batching"), False, "batching is always continuous"),
    (("--no-mmap", "--mlock", "--mmap"), False, "the weights are read once at load"),
    (("-fa", "--flash-attn"), True, "attention is kinetic's own (docs/parity.md)"),
    (("--no-jinja", "--jinja"), False, "chat templates always run in kinetic's sandboxed "
     "Jinja"),
    (("--no-context-shift",), False, "kinetic never shifts the context: an answer ends at "
     "the context's end"),
    (("--embedding", "--embeddings", "--reranking", "--rerank"), False,
     "the model file says whether it embeds or ranks"),
    (("-no-kvu", "--no-kv-unified"), False, "each slot holding its own share is the default"),
    (("--metrics",), False, "/metrics is always on"),
    (("--slots",), False, "/slots is on unless --no-slots"),
    (("--webui", "--ui"), False, "the page at / is on unless --no-webui"),
    (("--offline",), False, "kinetic never downloads"),
    (("--no-repack",), False, "kinetic has no weight repacking"),
    (("--draft-min", "--spec-draft-n-min"), True, "drafts are checked whatever their length"),
    (("--reasoning-format",), True, "reasoning always comes back as reasoning_content"),
]


def _add_llama_server_flags(serve: argparse.ArgumentParser) -> None:
    """llama-server's flags that scripts pass: those kinetic honours, then the accepted and
    ignored ones (each listed in --help with why it changes nothing)."""
    g = serve.add_argument_group("llama-server flags")
    g.add_argument("-s", "--seed", type=int, default=None,
                   help="the seed of requests that give none (default: a fresh one per "
                   "request; -1 too); /props reports it")
    for flag, field, kind in SAMPLING_FLAGS:
        g.add_argument(flag, dest=f"sampling_{field}", type=kind, default=None,
                       metavar="N", help=f"the default {field} of requests (the model "
                       f"file's, else llama-server's, without it)")
    g.add_argument("-n", "--n-predict", "--predict", type=int, default=-1, metavar="N",
                   help="most tokens of an answer whose request gives no limit (default -1: "
                   "none); a request's own max_tokens or n_predict wins, as in llama-server")
    g.add_argument("-a", "--alias", metavar="NAMES",
                   help="the model's names, comma-separated: the first is the id /v1/models "
                   "shows and answers carry (default: the file name without extension)")
    g.add_argument("--tags", metavar="TAGS",
                   help="comma-separated tags shown in /v1/models (informational)")
    g.add_argument("--no-slots", action="store_true",
                   help="GET /slots answers 501 (default: on)")
    g.add_argument("--slot-save-path", metavar="DIR",
                   help="directory where POST /slots/N?action=save writes a slot's prompt "
                   "cache and action=restore reads it (default: those actions answer 501)")
    g.add_argument("--chat-template", metavar="JINJA",
                   help="a Jinja chat template instead of the model file's, or one of "
                   "llama-server's named formats: chatml, command-r, deepseek3, gemma, "
                   "llama2, llama3, mistral-v7, phi3, phi4, vicuna, zephyr")
    g.add_argument("--chat-template-file", metavar="FILE",
                   help="read the Jinja chat template from FILE")
    g.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                   help="log each request's method, path, status and time on stderr")
    g.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="one KV cache of -c tokens shared by all slots, each of which may "
                   "use all of it (default: each slot has its own -c / -np); a request that "
                   "finds no room waits for the pages others free")
    g.add_argument("--pooling", choices=["none", "mean", "cls", "last"],
                   help="an embedding model's pooling instead of its file's (none: a vector "
                   "per token, on /embedding); refused for text and ranking models")
    g.add_argument("--no-webui", "--no-ui", action="store_true",
                   help="no web page at / (default: a chat page, for a browser on this "
                   "computer)")
    g.add_argument("--context-shift", action="store_true",
                   help="refused: kinetic never shifts the context (an answer ends with "
                   "finish_reason length at the context's end)")
    for names, value, why in IGNORED_FLAGS:
        dest = f"ignored_{names[-1].lstrip('-').replace('-', '_')}"
        if value:
            g.add_argument(*names, dest=dest, metavar="X", help=f"accepted and ignored: {why}")
        else:
            g.add_argument(*names, dest=dest, action="store_true",
                           help=f"accepted and ignored: {why}")
