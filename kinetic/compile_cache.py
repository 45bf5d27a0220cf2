"""Compiled executables kept on disk, so that a later start loads them instead of compiling.

A start compiles every step, decode-loop and sampler shape before /health says ok (tens of
seconds on 2 cores, Engine.compile). JAX's own persistent cache keys an executable by its
lowered program, so a warm start still traces and lowers every shape first (most of a
warm start's time); `jit` here keys it by what the program is made from instead, and a
warm start only loads it:

- the **build**: a hash of kinetic's own Python sources and kernel library, jax's and
  jaxlib's versions, the backend and device kind, the CPU (/proc/cpuinfo's model and feature
  flags: XLA compiles for the CPU it runs on), the CPU count, the jax settings that change
  a program, and every XLA_*, JAX_* and KINETIC_* environment variable. Any change gives
  a new directory (`build_dir`): nothing compiled by another build is ever read;
- the **call**: the function's name, what it was bound to (`context`: the model's Config,
  say), its static arguments, and the structure, shapes and dtypes of its other arguments
  (the weights' offsets and formats are in that structure: weights.split_buffer's skeleton).

What is made from anything else (a global read while tracing) must be in `context` or in
the build. Shapes not wrapped here go through JAX's own persistent cache, which `configure`
points at the build's directory too (keyed by their lowered program: always right, slower
to find).

On by default, under `$KINETIC_COMPILE_CACHE_DIR`, else ~/.cache/kinetic/compiled;
`KINETIC_COMPILE_CACHE=0` (or `kinetic serve --no-compile-cache`, `kinetic.load(...,
compile_cache=False)`) turns it off. The whole directory is bounded
(`KINETIC_COMPILE_CACHE_MAX_MB`, default 1024): `trim` removes the least recently used
files past it. An entry that cannot be read or loaded is removed and compiled again; files
are written whole (a temporary name, then renamed), so two processes may share the cache."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import sys
import threading
import weakref
from pathlib import Path

import jax

from kinetic.files import write_whole
from kinetic.kernels import target

log = logging.getLogger("kinetic.compile_cache")

DEFAULT_MAX_MB = 1024
# the jax settings that change what a traced function lowers to
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                 "jax_numpy_dtype_promotion", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_platforms", "jax_use_shardy_partitioner")
_ENV_PREFIXES = ("XLA_", "JAX_", "KINETIC_")
# ... but not these, which only say where and whether this cache runs
_ENV_IGNORED = ("KINETIC_COMPILE_CACHE", "KINETIC_COMPILE_CACHE_DIR",
                "KINETIC_COMPILE_CACHE_MAX_MB", "JAX_COMPILATION_CACHE_DIR",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "KINETIC_CACHE")

_lock = threading.Lock()
_instances: weakref.WeakSet = weakref.WeakSet()   # every jit, for clear()
_state = {"enabled": None, "build": None, "loaded": 0, "compiled": 0, "ahead": 0}


def enabled() -> bool:
    """Whether executables are read from and written to disk: `set_enabled`'s choice, else
    on unless KINETIC_COMPILE_CACHE is 0, off, false or no."""
    if _state["enabled"] is None:
        flag = os.environ.get("KINETIC_COMPILE_CACHE", "1").strip().lower()
        _state["enabled"] = flag not in ("0", "off", "false", "no")
    return _state["enabled"]


def set_enabled(on: bool) -> None:
    _state["enabled"] = bool(on)


def root() -> Path:
    env = os.environ.get("KINETIC_COMPILE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kinetic" / "compiled"


def max_bytes() -> int:
    try:
        mb = float(os.environ.get("KINETIC_COMPILE_CACHE_MAX_MB", DEFAULT_MAX_MB))
    except ValueError:
        mb = DEFAULT_MAX_MB
    return int(max(mb, 0) * 2**20)


def counts() -> dict[str, int]:
    """Executables loaded from disk and compiled by `jit` in this process so far."""
    return {"loaded": _state["loaded"], "compiled": _state["compiled"]}


def aside(name: str) -> Path | None:
    """A folder under root() for what else a start can keep rather than make again (the
    grammar trie: "vocab"), within the same bound (trim); None with the cache off."""
    return root() / name if enabled() else None


def loaded_ahead() -> int:
    """Of counts()["loaded"], how many `preloading` had loaded before they were asked for."""
    return _state["ahead"]


def build_dir() -> Path:
    """This build's directory under root() (the module docstring's build hash)."""
    with _lock:
        if _state["build"] is None:
            _state["build"] = _build_hash()
        return root() / _state["build"]


def configure() -> None:
    """Point JAX's own persistent cache at build_dir()/xla for the shapes `jit` does not
    wrap (unless the process set JAX_COMPILATION_CACHE_DIR itself, as the tests do), when
    the cache is on. Call before the first compile."""
    if not enabled() or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    xla = build_dir() / "xla"
    try:
        xla.mkdir(parents=True, exist_ok=True)   # JAX writes into it, but does not make it
    except OSError:
        return
    jax.config.update("jax_compilation_cache_dir", str(xla))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _build_hash() -> str:
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".so", ".lark", ".jinja") and path.is_file():
            h.update(str(path.relative_to(package)).encode())
            h.update(path.read_bytes())
    import jaxlib
    h.update(f"{jax.__version__} {jaxlib.__version__} {sys.version}".encode())
    device = jax.local_devices()[0]
    h.update(f"{device.platform} {device.device_kind} {jax.default_backend()}".encode())
    h.update(_cpu().encode())
    h.update(str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count()).encode())
    for name in _JAX_SETTINGS:
        h.update(f"{name}={jax.config.values.get(name)!r}".encode())
    for key in sorted(os.environ):
        if key.startswith(_ENV_PREFIXES) and key not in _ENV_IGNORED:
            h.update(f"{key}={os.environ[key]}".encode())
    return h.hexdigest()[:20]


def _cpu() -> str:
    """The first processor's identity and feature flags from /proc/cpuinfo ('' elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() + platform.machine()
    first = text.split("\n\n", 1)[0]
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
            "CPU implementer", "CPU part")
    return "\n".join(line for line in first.splitlines()
                     if line.split(":", 1)[0].strip() in keep)


# --- the wrapped functions ----------------------------------------------------------------


class jit:
    """jax.jit(fun, ...) whose executables are kept on disk (the module docstring).
    `name` names the function in the key; `context` is what the function closes over that
    its arguments do not carry (a tuple of values whose repr says all of them, and of
    functions, keyed by name). Calls as the jitted function does; its other attributes
    (`lower`, `trace`...) are the jitted function's. persist: True where the caller vouches
    that name and context say what the function computes (None: the rule above).
    """

    def __init__(self, fun, *, name: str, context=(), static_argnums=(), static_argnames=(),
                 donate_argnums=(), compiler_options: dict | None = None,
                 persist: bool | None = None):
        self._args = dict(fun=fun, name=name, context=context, static_argnums=static_argnums,
                          static_argnames=static_argnames, donate_argnums=donate_argnums,
                          persist=persist)
        self._static_nums, self._static_names = _statics(fun, static_argnums, static_argnames)
        self._jit = jax.jit(fun, static_argnums=self._static_nums,
                            static_argnames=self._static_names, donate_argnums=donate_argnums)
        self._name = name
        # functions are keyed by name: only kinetic's own module-level ones, whose code the
        # build hash covers; with any other (a test's mock, a closure) the executables stay
        # in memory only
        functions = [f for f in (*_parts(fun), *context) if callable(f)]
        self._disk = all(_named(f) for f in functions) if persist is None else persist
        self._context = tuple(_describe(c) for c in context)
        self._options = dict(compiler_options or {})
        self._executables: dict = {}
        self._variants: dict = {}
        self._lock = threading.Lock()
        _instances.add(self)

    def with_options(self, compiler_options: dict) -> "jit":
        """This function compiled with XLA's `compiler_options` (kept apart on disk)."""
        key = tuple(sorted(compiler_options.items()))
        with self._lock:
            if key not in self._variants:
                self._variants[key] = jit(**self._args, compiler_options=compiler_options)
            return self._variants[key]

    def __getattr__(self, name: str):
        """lower, trace, eval_shape...: the jitted function's."""
        if name.startswith("__") or name in ("_jit", "_args"):
            raise AttributeError(name)
        return getattr(self._jit, name)

    def __call__(self, *args, **kwargs):
        if not enabled() and not self._options:
            return self._jit(*args, **kwargs)
        dyn_args, dyn_kwargs = self._dynamic(args, kwargs)
        exe = self._executable(args, kwargs, (dyn_args, dyn_kwargs))
        if exe is None:   # called inside another function's trace: as jax.jit is
            return self._jit(*args, **kwargs)
        return exe(*dyn_args, **dyn_kwargs)

    def executable(self, *args, **kwargs):
        """The executable a call with these arguments runs (loaded or compiled now); it is
        called with the arguments that are not static. None for tracers."""
        return self._executable(args, kwargs, self._dynamic(args, kwargs))

    def prepare(self, *args, **kwargs) -> bool:
        """Have the executable a call with these arguments runs ready (loaded or compiled
        now) without running it. False where calls go through jax.jit (the cache off),
        which compiles only when called: the caller runs it then."""
        if not enabled() and not self._options:
            return False
        return self.executable(*args, **kwargs) is not None

    def _cache_size(self) -> int:
        """Executables held in memory (jax.jit's own count while the cache is off)."""
        return (len(self._executables) + self._jit._cache_size()
                + sum(v._cache_size() for v in self._variants.values()))

    def _dynamic(self, args, kwargs) -> tuple[tuple, dict]:
        return (tuple(a for i, a in enumerate(args) if i not in self._static_nums),
                {k: v for k, v in kwargs.items() if k not in self._static_names})

    def _executable(self, args, kwargs, dyn):
        static = (target.backend(),   # a trace for the GPU differs (kernels/target.py)
                  tuple(args[i] for i in self._static_nums if i < len(args)),
                  tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names)))
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return None
        # and the devices the call runs on (a split model's arrays: engine/split.py): JAX
        # runs every committed argument of one call on the same devices, so the first
        # array's placement names them (a tuple of every leaf's cost 26 us a step call)
        placed = next((x.sharding for x in leaves if hasattr(x, "sharding")), None)
        signature = (static, tree, tuple(_aval(x) for x in leaves), placed)
        exe = self._executables.get(signature)
        if exe is None:
            with self._lock:
                exe = self._executables.get(signature)
                if exe is None:
                    exe = self._executables[signature] = self._load_or_compile(
                        signature, args, kwargs, tree)
        return exe

    def _load_or_compile(self, signature, args, kwargs, tree):
        static, _, avals, placed = signature
        if not enabled() or not self._disk or _elsewhere(placed):
            return self._compile(args, kwargs)
        key = hashlib.sha256(repr((self._name, self._context, static, tree, avals,
                                   sorted(self._options.items()))).encode()).hexdigest()
        path = build_dir() / f"{self._name}-{key[:32]}.exe"
        exe = _load(path, tree)
        if exe is not None:
            _state["loaded"] += 1
            return exe
        exe, fresh = self._compile_fresh(args, kwargs)
        _state["compiled"] += 1
        if fresh:
            _store(path, exe)
        return exe

    def _compile(self, args, kwargs):
        lowered = self._jit.lower(*args, **kwargs)
        return lowered.compile(self._options) if self._options else lowered.compile()

    def _compile_fresh(self, args, kwargs):
        """(the executable, whether it may be written to disk): not when JAX's own
        persistent cache gave it (_jax_hits), since an executable JAX loaded from its
        cache serializes without all of its compiled functions (loading that blob fails
        with "Function ... not found"). So that JAX's cache never holds these functions
        (and never answers for them), it writes none while they compile."""
        _watch_jax_cache()
        _jax_hits.n = 0
        with _not_in_jax_cache():
            exe = self._compile(args, kwargs)
        return exe, _jax_hits.n == 0


_jax_hits = threading.local()   # this thread's hits of JAX's own persistent cache
_watching = []


def _not_in_jax_cache():
    """A context in which JAX's own persistent cache writes nothing of what compiles (its
    minimum compile time, a thread-local setting, set past any compile)."""
    try:
        from jax._src import config as jax_config
        return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):
        return contextlib.nullcontext()


def _watch_jax_cache() -> None:
    """Count, per thread, the executables JAX's own persistent cache gives (once)."""
    with _lock:
        if _watching:
            return
        _watching.append(True)

    def listen(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _jax_hits.n = getattr(_jax_hits, "n", 0) + 1
    jax.monitoring.register_event_listener(listen)


def _parts(fun) -> list:
    """fun, or a functools.partial's function and the values it binds."""
    if isinstance(fun, functools.partial):
        return [*_parts(fun.func), *fun.args, *fun.keywords.values()]
    return [fun]


def _named(fn) -> bool:
    """Whether fn is a module-level function of kinetic (its name says what it does)."""
    module, name = getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", "<")
    return (module == "kinetic" or module.startswith("kinetic.")) and "<" not in name


def _describe(value):
    return f"{value.__module__}.{value.__qualname__}" if callable(value) and _named(value) \
        else value


def _statics(fun, nums, names) -> tuple[tuple, tuple]:
    """The static arguments' positions and names both ways, as jax.jit infers them from the
    signature (an argument may be given either way)."""
    nums, names = set(nums), set(names)
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return tuple(sorted(nums)), tuple(sorted(names))
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            continue
        if p.name in names:
            nums.add(i)
        if i in nums and p.kind == p.POSITIONAL_OR_KEYWORD:
            names.add(p.name)
    return tuple(sorted(nums)), tuple(sorted(names))


def clear() -> None:
    """Drop every executable the jit functions hold in memory (as jax.clear_caches drops
    jax.jit's): each is loaded or compiled again on its next call."""
    for fn in list(_instances):
        with fn._lock:
            fn._executables.clear()


def _elsewhere(placed) -> bool:
    """Whether a call runs on devices other than the first alone (a split model's arrays,
    engine/split.py): such executables stay in memory (the key on disk has no place for the
    devices)."""
    return placed is not None and placed.device_set != {jax.local_devices()[0]}


def _aval(x):
    """A leaf's shape, dtype and weak type: a jax.Array's own aval (cheap; a per-leaf str
    of the dtype cost 3 us, a third of a millisecond per step call), else from numpy."""
    aval = getattr(x, "aval", None)
    if aval is not None:
        return aval
    return jax.typeof(x) if hasattr(x, "dtype") or isinstance(x, (int, float, bool)) \
        else (type(x).__name__, repr(x))


# --- loading a set ahead ------------------------------------------------------------------

_preload = {"futures": {}, "used": None}   # path -> Future of _read(path); paths used


@contextlib.contextmanager
def preloading(key: str):
    """A context in which the executables that the last compile under the same `key` used
    (its list in build_dir()/preload) are loaded ahead in one thread per CPU, while the
    caller goes on (the loads release the interpreter's lock: a warm start's loads take half
    the time on 2 cores), and `jit` takes them from there. key: what the set depends on (a
    model's Config and engine settings). On exit the list is written with the executables
    used inside, and anything loaded but not used is dropped. Nothing happens with the
    cache off, or inside another preloading()."""
    if not enabled() or _preload["used"] is not None:
        yield
        return
    from concurrent.futures import ThreadPoolExecutor
    base = build_dir()
    listing = base / "preload" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        names = listing.read_text().split()
    except OSError:
        names = []
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1)),
                              thread_name_prefix="kinetic-preload")
    with _lock:
        _preload["used"] = []
        _preload["futures"] = {base / name: pool.submit(_read, base / name)
                               for name in names if "/" not in name}
    try:
        yield
    finally:
        with _lock:
            used, futures = _preload["used"], _preload["futures"]
            _preload["used"], _preload["futures"] = None, {}
        for future in futures.values():
            future.cancel()
        pool.shutdown(wait=True)
        if used and sorted(used) != sorted(names):
            _write(listing, "\n".join(used).encode())


def loading_ahead() -> bool:
    """Whether executables are being loaded ahead (inside preloading(), whose key had a
    list): a warm start, whose compile is mostly waiting on them."""
    with _lock:
        return bool(_preload["futures"])


def _read(path: Path):
    """(its arguments' structure, the loaded executable) stored at path; raises
    FileNotFoundError where there is none, OSError where it cannot be read, and anything
    else where it is torn or foreign."""
    blob = path.read_bytes()
    _register_handlers()
    from jax.experimental import serialize_executable
    payload, in_tree, out_tree = pickle.loads(blob)
    # on the first device alone, as every executable kept here ran (_elsewhere): left to
    # itself, the loader assigns one to every device of the backend (2 GPUs, or forced
    # CPU devices: "expected 2 shards")
    return in_tree, serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=jax.local_devices()[:1])


def _load(path: Path, tree):
    """The executable stored at path, or None (missing, or unreadable: then removed)."""
    with _lock:
        future = _preload["futures"].pop(path, None)
        if _preload["used"] is not None:
            _preload["used"].append(path.name)
    try:
        in_tree, exe = future.result() if future is not None else _read(path)
        _state["ahead"] += future is not None
        if in_tree != tree:
            raise ValueError("its arguments' structure differs")
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("compile cache: cannot read %s (%s); compiling", path, e)
        return None
    except Exception as e:   # a torn or foreign file: compile again, and replace it
        log.warning("compile cache: dropping %s (%s)", path.name, e)
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)   # recently used (trim keeps it)
    except OSError:
        pass
    return exe


def _register_handlers() -> None:
    """Register kinetic's C++ kernels with XLA, as tracing a step does: a loaded executable
    calls them by name."""
    from kinetic.kernels import ffi
    if ffi.usable():
        ffi.register()


def _store(path: Path, exe) -> None:
    """Write exe at path whole (a temporary file renamed over it); a cache that cannot be
    written is only logged."""
    from jax.experimental import serialize_executable
    try:
        blob = pickle.dumps(serialize_executable.serialize(exe))
    except Exception as e:
        log.warning("compile cache: cannot serialize %s (%s)", path.name, e)
        return
    _write(path, blob)


def _write(path: Path, blob: bytes) -> None:
    """blob at path whole (kinetic/files.py); failing is only logged."""
    try:
        write_whole(path, blob)
    except Exception as e:
        log.warning("compile cache: cannot write %s (%s)", path, e)


def trim(limit: int | None = None) -> int:
    """Remove the least recently used files under root() until the whole is at most
    `limit` bytes (max_bytes()), empty build directories after. Returns bytes removed."""
    limit = max_bytes() if limit is None else limit
    base = root()
    if not base.is_dir():
        return 0
    files = []
    for path in base.rglob("*"):
        try:
            if path.is_file():
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        except OSError:
            continue
    total = sum(size for _, size, _ in files)
    removed = 0
    for _, size, path in sorted(files):
        if total - removed <= limit:
            break
        try:
            path.unlink()
            removed += size
        except OSError:
            continue
    # the directories of this process's build stay (JAX writes into xla/ but never makes it)
    keep = {base / _state["build"], base / _state["build"] / "xla"} if _state["build"] else set()
    for path in sorted(base.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir() and path not in keep:
            try:
                path.rmdir()   # only if empty
            except OSError:
                pass
    return removed
