"""The engine's shape: slots, context, step size, pages, speculative drafting."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MAX_AUTO_PARALLEL = 4


@dataclass(frozen=True)
class EngineConfig:
    parallel: int = 0          # sequences at once (-np); 0: as many full contexts as half the
                               # free memory holds, up to 4
    n_ctx: int = 4096          # context per sequence (-c), capped by the model's own
    step_tokens: int = 16      # most rows per step (steps run at row buckets up to it)
    page_size: int = 16
    chunk_tokens: int = 512    # most prompt rows one sequence gets per step
    num_pages: int = 0         # 0: every slot can hold a full context, plus the reserved page
    kv_dtype: str = "float32"   # the KV cache's storage type (float16 halves it; see docs)
    speculative: bool = True   # n-gram prompt-lookup drafts in the step's spare rows
    max_draft: int = 4
    host_cache_mb: int = 1024  # evicted prefix pages kept in host memory (0: none)
    decode_steps: int = 4      # greedy decode steps per device call when nothing can come
                               # between them (1: one step per call; see docs/performance.md)

    def __post_init__(self) -> None:
        if self.parallel < 0:
            raise ValueError("parallel must be 0 (auto) or a positive number of slots")
        if self.n_ctx < self.page_size:
            raise ValueError(f"the context ({self.n_ctx}) must hold at least one page "
                             f"({self.page_size} tokens)")
        if self.step_tokens < 1:
            raise ValueError("step_tokens must be at least 1")
        if self.decode_steps < 1:
            raise ValueError("decode_steps must be at least 1")
        if self.max_draft < 0 or self.max_draft >= self.step_tokens:
            raise ValueError("max_draft must be between 0 and step_tokens - 1")

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(self.n_ctx / self.page_size)

    def resolved(self, model_config) -> "EngineConfig":
        """Fill the automatic fields for a model: context capped by the model's, parallel
        from free memory, pages for every slot's full context."""
        n_ctx = min(self.n_ctx, model_config.context_length)
        cfg = dataclasses.replace(self, n_ctx=max(n_ctx, self.page_size))
        parallel = cfg.parallel or auto_parallel(model_config, cfg.n_ctx, cfg.kv_dtype)
        pages = cfg.num_pages or parallel * cfg.pages_per_slot + 1
        return dataclasses.replace(cfg, parallel=parallel, num_pages=pages)


def kv_bytes_per_token(model_config, kv_dtype: str) -> int:
    size = 2 if kv_dtype in ("float16", "bfloat16") else 4
    c = model_config
    return c.n_layer * c.n_kv_head * (c.head_dim + c.v_head_dim) * size


def auto_parallel(model_config, n_ctx: int, kv_dtype: str) -> int:
    """As many full-context sequences as half the available memory holds, 1..4."""
    per_seq = kv_bytes_per_token(model_config, kv_dtype) * n_ctx
    return max(1, min(MAX_AUTO_PARALLEL, (available_memory() // 2) // max(per_seq, 1)))


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
