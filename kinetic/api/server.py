"""`kinetic serve`: the app on Hypercorn, with the model loaded in the background.

The server listens at once, so that /v1/health can answer 503 while the model loads; a
loader thread reads the GGUF file, builds the engine, compiles every step shape the engine
will use and runs one short warm-up request (progress on stderr: a bar on a terminal, a few
plain lines in a log), then the server prints one line with its address and serves.

Stopping always stops. SIGINT or SIGTERM: no new connections, idle ones close, requests
still running get GRACEFUL_SECONDS to finish; then each answer still running ends with an
error in its dialect's shape (a stream's error event or line, then its end; a 503 for one
not streamed), resumable streams included, and what is left after CANCELLED_SECONDS is
cancelled; the engine thread stops between two steps. A watchdog thread, started with the
stop, ends the process (status 1, with a message) if all that has not finished within
STOP_SECONDS: an engine thread stuck in a long device call can never be joined. A second
signal ends the process at once.

The listener itself (the connection limit, the stop's steps, requests h11 cannot parse) is
kinetic/api/listener.py, which the router shares.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kinetic import kernels
from kinetic.progress import progress_printer
from kinetic.api.app import create_app
from kinetic.api.core import ServerConfig, ServerState
from kinetic.api.listener import (OLLAMA_PORT, STOP_SECONDS, _serve, exit_now, listen,
                                  setup_logging, start_watchdog)
from kinetic.api.offload import SWITCH_INTERVAL
from kinetic.engine.engine_config import EngineConfig, memory_summary
from kinetic.memory import resident_bytes


@dataclass(frozen=True)
class ModelOptions:
    """What the server loads: the GGUF file, the engine's shape, an optional draft model."""

    path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "bfloat16"
    draft: str | None = None
    sampling: dict = field(default_factory=dict)   # --temp, --seed...: SamplingParams fields
                                                   # that replace the model's defaults
    chat_template: str | None = None               # --chat-template(-file): Jinja source
    pooling: str | None = None                     # --pooling: an embedding model's pooling
    mmproj: str | None = None                      # --mmproj: a vision projector
    kernel: str = "auto"                           # --kernel: weights.kernel_choice

    @property
    def model_id(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def build_model(opts: ModelOptions, progress: Callable[[str], Callable[[int, int], None]]):
    """A kinetic.llm.Model (or EmbeddingModel) ready to serve: loaded and compiled
    (llm.open_model), then one short request, so that no client request waits for XLA (the
    engine thread is idle until then). The request has a grammar, so the token trie for
    grammar masks is built now too. progress(label) gives the callback of one stage."""
    from kinetic.engine.request import GenerationRequest
    from kinetic.grammar import compile_json_schema
    from kinetic.llm import open_model

    model = open_model(opts.path, opts.engine, dtype=opts.dtype, draft=opts.draft,
                       stage=progress, compile=True, pooling=opts.pooling, mmproj=opts.mmproj,
                       kernel=opts.kernel)
    tokenizer = model.tokenizer
    first = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    if model.loaded.config.task != "text":
        model.encoder.pooled([[first]])   # the host side (pooling, head) once
        return model
    model.default_params = dataclasses.replace(model.default_params, **opts.sampling)
    if opts.chat_template is not None:
        model.use_chat_template(opts.chat_template)
    warm_up = GenerationRequest([first], max_tokens=2, logprobs=1,
                                grammar=compile_json_schema(True))
    for delta in model.engine.generate(warm_up):
        if delta.error:
            raise RuntimeError(delta.error)
    return model


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run(config: ServerConfig, opts: ModelOptions) -> int:
    """Serve until SIGINT or SIGTERM. Returns the exit status (1 if the model failed to
    load or the address cannot be bound). The interpreter switches threads every
    offload.SWITCH_INTERVAL, so that the event loop waits little for the lock while workers
    parse requests."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
    setup_logging()
    return asyncio.run(_main(config, opts))


async def _main(config: ServerConfig, opts: ModelOptions) -> int:

    loop = asyncio.get_running_loop()
    state = ServerState(config, opts.model_id)
    app = create_app(state)
    listening = listen(config)
    if listening is None:
        return 1
    hconfig, host, sockets, port = listening
    also = (f" and Ollama's API at http://{host}:{OLLAMA_PORT}/api"
            if len(sockets.insecure_sockets) > 1 else "")
    stop = asyncio.Event()
    status = [0]
    stop_began: list[float] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop_began:
            exit_now(f"{sig.name} again: stopped at once", 1)
        stop_began.append(time.monotonic())
        start_watchdog(STOP_SECONDS)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    def progress(label: str) -> Callable[[int, int], None]:
        show = progress_printer(label)

        def update(done: int, total: int) -> None:
            state.loading = f"Loading model: {label} {100 * done // max(total, 1)}%"
            show(done, total)
        return update

    def ready(model) -> None:  # on the event loop: no request runs between these two lines
        task = model.loaded.config.task
        slots = (_count(model.engine.config.parallel, "slot") if task == "text" else
                 f"{'an embedding' if task == 'embedding' else 'a ranking'} model, pooling "
                 f"{model.pooling}")
        kernel = model.loaded.config.kernel
        on = kernels.describe(kernel)["backend"]
        how = {"ffi": f"kinetic's C++ kernel, {kernels.isa()} path",
               "pallas": f"the pallas kernel on {on} (weights quantized on the device"
                         f"{'; interpreted: slow, for tests' if on != 'gpu' else ''})",
               }.get(kernel, f"XLA on {on} (dequantized weights)")
        split = model.engine.runner.split if task == "text" else {"mode": "none"}
        if split["mode"] != "none":
            how += f", split by {split['mode']} over {split['devices']} devices"
        print(f"kinetic: weights multiplied by {how}", file=sys.stderr, flush=True)
        if task == "text":
            line = memory_summary(model.loaded.config, model.engine.config,
                                  os.path.getsize(model.loaded.file.path), resident_bytes())
            print(f"kinetic: {line}", file=sys.stderr, flush=True)
        print(f"kinetic: serving {state.model_id} at http://{host}:{port}/v1{also} (context "
              f"{model.n_ctx}, {slots}); Ctrl+C stops it", file=sys.stderr, flush=True)
        # what loading made lives as long as the server: out of the collector's sight, so
        # that a full collection (tens of ms with a model loaded, on the event loop's
        # thread or a worker's, holding the lock) does not walk it again and again
        gc.freeze()
        state.set_ready(model)

    def load() -> None:
        try:
            model = build_model(opts, progress)
        except Exception as e:  # noqa: BLE001 - any failure ends the server with its message
            print(f"kinetic: {e}", file=sys.stderr, flush=True)
            status[0] = 1
            loop.call_soon_threadsafe(stop.set)
            return
        loop.call_soon_threadsafe(ready, model)

    print(f"kinetic: loading {opts.path}", file=sys.stderr, flush=True)
    loader = threading.Thread(target=load, name="kinetic-loader", daemon=True)
    loader.start()
    await _serve(app, hconfig, sockets, config.max_connections, stop, state.end_generations)
    if loader.is_alive():  # stopped while loading: XLA may be compiling; leave at once
        print("kinetic: stopped while loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status[0])
    if state.model is not None:
        began = stop_began[0] if stop_began else time.monotonic()
        left = STOP_SECONDS - 1.0 - (time.monotonic() - began)
        # (an embedding model has no engine thread: its requests ran out with the server)
        if state.kind == "text" and not state.model.engine.close(timeout=max(left, 0.0)):
            exit_now("stopped, but the engine thread is stuck in a step; exiting without it", 1)
        print("kinetic: stopped", file=sys.stderr, flush=True)
    return status[0]


