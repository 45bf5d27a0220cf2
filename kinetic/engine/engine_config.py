"""The engine's shape: slots, context, step size, pages, speculative drafting."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MAX_AUTO_PARALLEL = 4
MAX_PARALLEL = 64        # the server's 64 connections (docs/server.md); a step holds every stream
MIN_STEP_TOKENS = 16     # the automatic step size: 16 rows, more past 8 streams (auto_step_tokens)
MOE_STEP_TOKENS = 128    # a mixture of experts': a prompt step's rows share each expert


SPLIT_MODES = ("none", "layer", "row")


@dataclass(frozen=True)
class Split:
    """How the model is split (kinetic/engine/split.py): mode (none, layer, row), devices
    (0: every visible device), tensor_split (each device's proportion, 0 leaving it out;
    only equal ones yet), main_device (where the sampler runs). What the runner made of it
    is Runner.split."""

    mode: str = "none"
    devices: int = 0
    tensor_split: tuple[float, ...] = ()
    main_device: int = 0

    def __post_init__(self) -> None:
        if self.mode not in SPLIT_MODES:
            raise ValueError(f"split mode {self.mode!r}: one of {', '.join(SPLIT_MODES)}")
        if self.devices < 0:
            raise ValueError(f"devices must be 0 (all) or more, not {self.devices}")
        if any(not math.isfinite(t) or t < 0 for t in self.tensor_split) or (
                self.tensor_split and sum(self.tensor_split) <= 0):
            raise ValueError(f"--tensor-split {','.join(map(str, self.tensor_split))}: "
                             f"proportions are numbers >= 0, not all 0")

    @property
    def active(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class EngineConfig:
    parallel: int = 0          # sequences at once (-np), 1..MAX_PARALLEL; 0: as many full
                               # contexts as half the free memory holds, up to 4
    n_ctx: int = 4096          # context per sequence (-c), capped by the model's own
    step_tokens: int = 0       # most rows per step (-ub; steps run at row buckets up to it);
                               # 0: auto_step_tokens(parallel). At least parallel: each
                               # running stream takes one row in every step
    page_size: int = 16
    chunk_tokens: int = 512    # most prompt rows one sequence gets per step
    num_pages: int = 0         # 0: every slot can hold a full context, plus the reserved page
    kv_dtype: str = "float16"   # the KV cache's storage type, llama.cpp's default (float32
                                # doubles it; CACHE_TYPES has llama-server's names)
    speculative: bool = True   # n-gram prompt-lookup drafts in the step's spare rows
    max_draft: int = 4
    host_cache_mb: int = 1024  # evicted prefix pages kept in host memory (0: none)
    decode_steps: int = 4      # greedy decode steps per device call when nothing can come
                               # between them (1: one step per call; see docs/performance.md)
    swa_full: bool = False     # keep sliding-window layers' rows past their window (llama-
                               # server's --swa-full); False: handed back (sliding_window.py)
    split: Split = field(default_factory=Split)   # the devices the model is split over

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_VALUE_BYTES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: one of {', '.join(KV_VALUE_BYTES)}")
        if not 0 <= self.parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel (-np) must be 0 (automatic) or 1 to {MAX_PARALLEL} "
                             f"sequences at once, not {self.parallel}")
        if self.n_ctx < self.page_size:
            raise ValueError(f"the context ({self.n_ctx}) must hold at least one page "
                             f"({self.page_size} tokens)")
        if self.step_tokens < 0:
            raise ValueError("step_tokens must be 0 (automatic) or at least 1")
        if self.step_tokens and self.step_tokens < self.parallel:
            raise ValueError(f"step_tokens (-ub {self.step_tokens}) must be at least parallel "
                             f"(-np {self.parallel}): every running sequence takes a row in "
                             f"each step")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be at least 1")
        if self.max_draft < 0 or (self.step_tokens and self.max_draft >= self.step_tokens):
            raise ValueError("max_draft must be between 0 and step_tokens - 1")

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(self.n_ctx / self.page_size)

    def resolved(self, model_config) -> "EngineConfig":
        """Fill the automatic fields for a model: context capped by the model's, parallel
        from free memory (at most step_tokens when that is given), step_tokens from parallel,
        pages for every slot's full context. Raises ValueError, naming the sizes, if the KV
        cache would not fit the memory available (kv_memory_needed)."""
        if self.kv_dtype == "q8_0" and (model_config.head_dim % 32 or
                                        model_config.v_head_dim % 32):
            raise ValueError(f"a q8_0 KV cache stores blocks of 32 values: this model's heads "
                             f"are {model_config.head_dim} wide (keys) and "
                             f"{model_config.v_head_dim} (values); use f16 (-ctk f16)")
        if self.kv_dtype == "q8_0" and getattr(model_config, "kernel", "ffi") == "pallas":
            raise ValueError("a q8_0 KV cache runs with the ffi and xla kernels; the pallas "
                             "kernel reads float caches: use f16 (-ctk f16)")
        n_ctx = min(self.n_ctx, model_config.context_length)
        cfg = dataclasses.replace(self, n_ctx=max(n_ctx, self.page_size))
        parallel = cfg.parallel or auto_parallel(model_config, cfg.n_ctx, cfg.kv_dtype)
        if cfg.step_tokens:
            parallel = min(parallel, cfg.step_tokens)
        steps = cfg.step_tokens or auto_step_tokens(parallel, model_config)
        pages = cfg.num_pages or parallel * cfg.pages_per_slot + 1
        out = dataclasses.replace(cfg, parallel=parallel, step_tokens=steps, num_pages=pages)
        check_kv_fits(model_config, out)
        return out


def auto_step_tokens(parallel: int, model_config=None) -> int:
    """The step size for `parallel` streams: 16 rows up to 8 streams; past them 4 x
    parallel up to 64 rows, 2 x parallel beyond (-np 16: 64, -np 32: 64, -np 64: 128). With
    every stream decoding (one row each), the rest are left for new requests' prompt chunks
    or for drafts (at 16 slots a 16-row step would leave a new request's prompt one row a
    step beside 15 decoding streams). Four rows a stream where that is at most 64, not
    two: when many requests arrive together every prompt step that ends a prompt reads the
    output projection for its sampled rows, the largest matrix of a small model, so
    larger steps end more prompts per read (Gemma 3 270M, 16 streams of a 16-token prompt
    and 64 tokens, in process: the prompts took 178 ms at 32-row steps, 138-143 at 64, the
    same at 128; docs/performance.md). It grows only past 8 streams: each row bucket (1, 2,
    4 ... step_tokens) costs compiled step shapes and a sampler size, tens of MB and
    seconds of start-up (docs/server.md, "Sharing a step", has figures).

    A mixture of experts (model_config.n_expert, on a kernel whose steps cost their rows:
    not "xla") steps at least 128 rows: at 16 a prompt step's rows choose most experts a
    row or two each, so every expert's blocks are read again every 16 prompt tokens (a
    Qwen3-MoE of 32 experts: 846 prompt tok/s at 16 rows, 1324 at 64, 1786 at 128 and 256;
    docs/performance.md). Its buckets compile in seconds (the experts are one call)."""
    base = MIN_STEP_TOKENS
    if (model_config is not None and getattr(model_config, "n_expert", 0)
            and getattr(model_config, "kernel", "ffi") != "xla"):
        base = MOE_STEP_TOKENS
    return max(base, 2 * parallel, min(4 * parallel, 64)) if parallel > 8 else base


def kv_bytes_per_token(model_config, kv_dtype: str) -> int:
    """Cache bytes a token takes: keys and values of each attention layer (in kv_dtype), a
    convolution layer's float32 input (runner.py's cache); a delta-rule layer's state is per
    sequence, not per token (recurrent_bytes_per_sequence)."""
    c = model_config
    n_conv, n_recurrent = sum(c.conv_layers), sum(c.recurrent_layers)
    per_head = (c.head_dim + c.v_head_dim) * KV_VALUE_BYTES[kv_dtype]
    return (math.ceil((c.n_layer - n_conv - n_recurrent) * c.n_kv_head * per_head)
            + n_conv * c.d_model * 4)


def recurrent_bytes_per_sequence(model_config) -> int:
    """A sequence's recurrent state (float32): each delta-rule layer's convolution window and
    its matrices (kinetic/model/delta_net.py). A state snapshot takes as much."""
    c = model_config
    if not c.recurrent:
        return 0
    from kinetic.model.delta_net import conv_channels
    per_layer = ((c.ssm_conv - 1) * conv_channels(c)
                 + c.ssm_v_heads * c.ssm_state * c.ssm_state) * 4
    return sum(c.recurrent_layers) * per_layer


# llama-server's names for the cache types (-ctk / -ctv, /props) -> EngineConfig.kv_dtype.
# q8_0: blocks of 32 values, an f16 scale and 32 int8 (34 bytes), as GGUF's Q8_0 weights and
# llama.cpp's q8_0 cache (kinetic/model/layers.py kv_storage)
CACHE_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0"}
KV_VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "q8_0": 34 / 32}


def cache_type_name(kv_dtype: str) -> str:
    """llama-server's name of a kv_dtype (f32, f16, bf16, q8_0)."""
    return next(name for name, dtype in CACHE_TYPES.items() if dtype == kv_dtype)


def memory_summary(model_config, config: EngineConfig, weights_bytes: int,
                   resident: int | None) -> str:
    """One line of what a served model holds, as llama-server prints its buffer sizes: the
    GGUF file (mapped: its pages come from the file, not from allocations), the KV cache of
    the resolved config (its type; taken page by page as steps write it, up to this size),
    and the process's resident memory now (what the weights read so far, the runtime and the
    compiled steps hold), when the system tells it."""
    c = config
    kv = kv_memory_needed(model_config, c)
    line = (f"memory: weights {_size(weights_bytes, math.ceil)} mapped from the file; KV cache "
            f"up to {_size(kv, math.ceil)} ({cache_type_name(c.kv_dtype)} keys and values, "
            f"{c.num_pages - 1} pages of {c.page_size} tokens)")
    sliding = sum(getattr(model_config, "sliding_layers", ()) or ())
    if sliding and getattr(model_config, "sliding_window", 0) > 0:
        kernel = getattr(model_config, "kernel", "ffi")
        line += (f", of which {sliding} sliding-window layers of {model_config.n_layer} " + (
            f"hand back each sequence's rows past their {model_config.sliding_window}-token "
            f"window" if window_released(model_config, c) else
            "keep every row (--swa-full)" if c.swa_full else
            f"keep every row (the {kernel} kernel's cache is device memory)"))
    return line if resident is None else f"{line}; resident now {_size(resident, math.ceil)}"


def window_released(model_config, config: EngineConfig) -> bool:
    """Whether the sliding-window layers' rows that every query has passed are handed back
    (kinetic/engine/sliding_window.py): the C++ kernel's cache (host memory), unless
    --swa-full. The cache is still allocated whole: a page's rows come back when it is
    written again, and short sequences pass nothing, so kv_memory_needed is unchanged."""
    return (not config.swa_full and getattr(model_config, "sliding_window", 0) > 0
            and any(getattr(model_config, "sliding_layers", ()) or ())
            and getattr(model_config, "kernel", "ffi") == "ffi")


def kv_memory_needed(model_config, config: EngineConfig) -> int:
    """Bytes of the KV cache of a resolved config: every page, the reserved one included."""
    return (kv_bytes_per_token(model_config, config.kv_dtype) * config.page_size * config.num_pages
            + recurrent_bytes_per_sequence(model_config) * (config.parallel + 3))


def check_kv_fits(model_config, config: EngineConfig) -> None:
    """The whole KV cache is allocated at start, as llama-server allocates its whole -c: a
    cache larger than the memory available (available_memory) is refused here with the
    sizes, rather than failing or swapping later."""
    need, have = kv_memory_needed(model_config, config), available_memory()
    if need > have:
        c = config
        full = c.num_pages == c.parallel * c.pages_per_slot + 1   # the default pool
        what = (f"{c.parallel} sequence{'s' if c.parallel != 1 else ''} of {c.n_ctx} tokens"
                if full else f"{c.num_pages} pages of {c.page_size} tokens")
        raise ValueError(
            f"the KV cache for {what} ({c.kv_dtype}) needs {_size(need, math.ceil)}, more than "
            f"the {_size(have, math.floor)} of memory available; lower --parallel (-np) or "
            f"--ctx-size (-c)")


def _size(n: int, rounding) -> str:
    """n bytes in MiB or GiB, two decimals, rounded by `rounding` (math.ceil for what is
    needed, math.floor for what is available: a refusal never reads "X, more than X")."""
    unit, name = (1 << 20, "MiB") if n < (1 << 30) else (1 << 30, "GiB")
    return f"{rounding(100 * n / unit) / 100:.2f} {name}"


def auto_parallel(model_config, n_ctx: int, kv_dtype: str) -> int:
    """As many full-context sequences as half the available memory holds, 1..4."""
    per_seq = (kv_bytes_per_token(model_config, kv_dtype) * n_ctx
               + recurrent_bytes_per_sequence(model_config))
    return max(1, min(MAX_AUTO_PARALLEL, (available_memory() // 2) // max(per_seq, 1)))


def available_memory() -> int:
    """Bytes free where the KV cache is allocated: on an accelerator, its memory that JAX
    has not handed out (memory_stats; only if JAX is already in use); else the system's
    MemAvailable."""
    device = _device_memory()
    if device is not None:
        return device
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _device_memory() -> int | None:
    import sys
    jax = sys.modules.get("jax")   # never imported here: the scheduler side stays JAX-free
    if jax is None:
        return None
    try:
        device = jax.local_devices()[0]
        if device.platform == "cpu":
            return None
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    except Exception:  # noqa: BLE001 - no figure: fall back to the host's
        return None
