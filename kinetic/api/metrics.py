"""What the server has run: a record of each generation, for /metrics, /slots and the timings
of llama-server's answers.

`core.generation` opens a `Task` for every request it runs in the engine, whatever the dialect,
and `Activity` keeps them: the totals since the server became ready (the warm-up request is
not one of them), the tasks running now and, per slot, the last task it ran. The engine calls
a task's `engine_delta` from its own thread, in the step where the task's first token came:
that is the one moment the task is known to sit in its slot, so the slots are read then
(`Engine.stats()` is safe to call there) and matched with the task's id on the event loop.
Everything else happens on the event loop.

Embedding and rerank requests (kinetic/api/embeddings.py) count as requests whose texts are
prompt tokens (`Activity.encoded`), as llama-server counts them.

Prefills (/v1/prefill) are not generations: `Activity.prefilled` counts them apart, under
kinetic's own names (kinetic:prefill_requests_total, kinetic:prefill_tokens_total), and the
tokens they run are not prompt tokens of any request.

The token counts reported by /metrics are those the answers report (prompt tokens run, prompt
tokens reused, tokens generated), so they add up exactly; the seconds are, as in llama-server,
each request's own prompt and generation time, summed over requests that may overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kinetic.engine.request import Delta, GenerationRequest, Usage


@dataclass(eq=False)
class Task:
    """One generation as /slots, /metrics and llama-server's timings see it."""

    request: GenerationRequest
    stream: bool = False
    id: int = -1                  # the engine's id for it (llama-server's id_task)
    slot: int = -1                # -1 until known
    n_cached: int = 0             # prompt tokens reused from the cache
    n_decoded: int = 0            # tokens of the answer so far
    has_new_line: bool = False
    usage: Usage | None = None    # once finished
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # first output of the engine (a token, or the end)
    t_end: float | None = None
    slots_seen: list | None = None  # the engine's slots at t_first (set on the engine thread)
    output: list[int] = field(default_factory=list)   # the answer's token ids so far

    @property
    def n_prompt(self) -> int:
        return len(self.request.prompt)

    def engine_delta(self, delta: Delta, engine) -> None:
        """Called on the engine thread with each delta, before it goes to the event loop."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            if delta.finish_reason is None:  # a token: the task is in its slot now
                self.slots_seen = engine.stats().slots
        if delta.finish_reason is not None:
            self.t_end = now

    def saw(self, delta: Delta) -> None:
        """Take a delta on the event loop. The first one also finds the task's slot among
        those the engine thread saw (the task's id is known by then)."""
        if self.slots_seen is not None:
            for s in self.slots_seen:
                if s.seq_id == self.id:
                    self.slot, self.n_cached = s.slot, s.n_cached
            self.slots_seen = None
        self.n_decoded += len(delta.token_ids)
        self.output.extend(delta.token_ids)
        self.has_new_line = self.has_new_line or "\n" in delta.text
        if delta.usage is not None:
            self.usage, self.n_cached = delta.usage, delta.usage.cached_tokens
            self.n_decoded = delta.usage.completion_tokens

    @property
    def n_processed(self) -> int:
        """Prompt tokens run (not reused); 0 while the prompt has not started."""
        return self.n_prompt - self.n_cached if self.t_first is not None else 0

    def timings(self) -> dict[str, float]:
        """llama-server's timings: the prompt's (until the first token) and the generation's
        (from the first token to the end), in milliseconds."""
        end = self.t_end if self.t_end is not None else time.perf_counter()
        first = self.t_first if self.t_first is not None else end
        prompt_ms, predicted_ms = 1e3 * (first - self.t_submit), 1e3 * (end - first)
        return {"cache_n": self.n_cached, "prompt_n": self.n_processed,
                **_rate("prompt", self.n_processed, prompt_ms),
                "predicted_n": self.n_decoded,
                **_rate("predicted", self.n_decoded, predicted_ms)}


def _rate(name: str, n: int, ms: float) -> dict[str, float]:
    return {f"{name}_ms": ms, f"{name}_per_token_ms": ms / n if n else 0.0,
            f"{name}_per_second": 1e3 * n / ms if n and ms > 0 else 0.0}


@dataclass
class Totals:
    """Since the server became ready (llama-server's metric names, without llamacpp:)."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_tokens_max: int = 0
    prefill_requests_total: int = 0    # /v1/prefill answers (kinetic: names)
    prefill_tokens_total: int = 0      # prompt tokens the prefills ran


class Activity:
    """The server's tasks: totals, the running ones by id, the last one of each slot."""

    def __init__(self) -> None:
        self.totals = Totals()
        self.running: dict[int, Task] = {}
        self.last: dict[int, Task] = {}
        self.encoding = 0   # embedding and rerank requests running now

    def encoded(self, n_tokens: int, longest: int, seconds: float) -> None:
        """Count one embedding or rerank request: its texts' tokens are prompt tokens."""
        t = self.totals
        t.requests_total += 1
        t.prompt_tokens_total += n_tokens
        t.prompt_seconds_total += seconds
        t.n_tokens_max = max(t.n_tokens_max, longest)

    def started(self, task: Task) -> None:
        self.totals.requests_total += 1
        self.running[task.id] = task

    def saw(self, task: Task, delta: Delta) -> None:
        task.saw(delta)
        last = self.last.get(task.slot)
        if task.slot >= 0 and (last is None or last.id < task.id):  # ids grow with time
            self.last[task.slot] = task

    def prefilled(self, result) -> None:
        """Count one answered prefill (an engine Prefilled)."""
        self.totals.prefill_requests_total += 1
        self.totals.prefill_tokens_total += result.computed_tokens

    def ended(self, task: Task) -> None:
        """Count the task (finished, or cancelled: then what it had run until then)."""
        self.running.pop(task.id, None)
        if task.t_end is None:
            task.t_end = time.perf_counter()
        if task.t_first is None:
            return  # cancelled before the engine ran any of it
        t, timings = self.totals, task.timings()
        t.prompt_tokens_total += task.n_processed
        t.prompt_tokens_cached_total += task.n_cached
        t.prompt_seconds_total += timings["prompt_ms"] / 1e3
        t.tokens_predicted_total += task.n_decoded
        t.tokens_predicted_seconds_total += timings["predicted_ms"] / 1e3
        t.n_tokens_max = max(t.n_tokens_max, task.n_prompt + task.n_decoded)


# --- Prometheus text ------------------------------------------------------------------------

# (name, type, help): docs/server.md's list, under llama-server's names and types.
METRICS = [
    ("requests_total", "counter", "Generation requests started"),
    ("prompt_tokens_total", "counter", "Prompt tokens run, not counting those reused from "
     "the cache"),
    ("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Seconds spent on prompts, summed over requests"),
    ("tokens_predicted_total", "counter", "Tokens generated"),
    ("tokens_predicted_seconds_total", "counter", "Seconds spent generating, summed over "
     "requests"),
    ("n_tokens_max", "counter", "Longest sequence seen (prompt and generated tokens)"),
    ("prompt_tokens_seconds", "gauge", "Average prompt speed in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation speed in tokens/s"),
    ("requests_processing", "gauge", "Requests running in a slot"),
    ("requests_deferred", "gauge", "Requests waiting for a free slot"),
]
# kinetic's own, after llama-server's, under kinetic: (names llama-server does not have)
KINETIC_METRICS = [
    ("prefill_requests_total", "counter", "Prefills answered (/v1/prefill; not requests)"),
    ("prefill_tokens_total", "counter", "Prompt tokens run by prefills into the prompt cache"),
]


def metric_values(totals: Totals, processing: int, deferred: int) -> dict[str, float]:
    t = totals
    values: dict[str, float] = dict(vars(t))
    values["prompt_tokens_seconds"] = (t.prompt_tokens_total / t.prompt_seconds_total
                                       if t.prompt_seconds_total > 0 else 0.0)
    values["predicted_tokens_seconds"] = (t.tokens_predicted_total /
                                          t.tokens_predicted_seconds_total
                                          if t.tokens_predicted_seconds_total > 0 else 0.0)
    values["requests_processing"] = processing
    values["requests_deferred"] = deferred
    return values


def prometheus_text(values: dict[str, float]) -> str:
    """Prometheus' text format (version 0.0.4): llama-server's metrics under llamacpp:, then
    kinetic's own under kinetic:."""
    lines = []
    named = [("llamacpp", m) for m in METRICS] + [("kinetic", m) for m in KINETIC_METRICS]
    for prefix, (name, kind, help_) in named:
        full = f"{prefix}:{name}"
        value = values[name]
        shown = str(value) if isinstance(value, int) else repr(round(float(value), 6))
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}", f"{full} {shown}"]
    return "\n".join(lines) + "\n"
