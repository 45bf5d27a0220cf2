"""The engine: one thread that owns the device and runs the step loop.

    start(request, sink) -> id; sink(Delta) on the engine thread   (the server: api/core.py)
    generate(request) -> iterator of Delta                          (notebooks, tests)

The Engine is the bridge between the threads that ask (the server's event loop, a notebook)
and the engine thread: requests, prefills, cancels and forgets go into its inbox; the engine
thread drains it into the Stepper (engine/turn.py), which runs one turn after another while
there is work, and sleeps when there is none. A request's tokens come back through its sink,
on the engine thread. The Engine imports no JAX: the runner (engine/runner.py) is the one
place that calls the device, for the steps and for sampling.

Requests with a grammar: the server readies a grammar first (`prepare_grammar`, in a worker
thread: engine/grammar_step.py); the turn then masks its rows within a per-request budget.

Prefills (`start_prefill`, /v1/prefill): token ids run into the prefix cache and nothing else,
at the lowest priority (the scheduler's "Prefills"): no sampling and no output, a slot only
while no request waits for one, the rows real requests leave. A request arriving ends every
prefill before the next step is planned, so it waits for no more than the step in flight;
each prefill's sink then gets a `Prefilled` saying how much of it is cached. While a prefill
wants rows, steps run one at a time (no several decode steps per call), so it advances.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from kinetic import compile_cache
from kinetic.engine.draft_model import DraftModel
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.host_cache import HostPageStore
from kinetic.engine.job import Job
from kinetic.engine.recurrent_state import StateSnapshots
from kinetic.engine.request import Delta, GenerationRequest
from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.engine.scheduler import ContextOverflow, Prefilled, Scheduler, SchedulerConfig
from kinetic.engine.turn import Stepper, answer
from kinetic.grammar import Grammar, TokenVocab
from kinetic.memory import compiling, drop_code_pages, drop_staging_caches, release_memory
from kinetic.model.loader import LoadedModel
from kinetic.text.tokenizer import Tokenizer

STATE_SNAPSHOTS_PER_SLOT = 4   # recurrent models: prefix states kept (StateSnapshots)


# Engines not yet closed: closed at the interpreter's exit (_close_open), before Python
# finalizes. A daemon engine thread still in a turn then would come back from the device
# call to a finalizing interpreter, which ends the thread by unwinding it through the C++
# frames below it, and the process aborts ("FATAL: exception not rethrown"): a script or
# notebook that never calls close() must still exit cleanly.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for engine in list(_OPEN):
        engine.close(timeout=10.0)


@dataclass(frozen=True)
class EngineStats:
    slots: list            # scheduler.SlotStats per slot
    queue_length: int
    requests_processing: int


class Engine:
    """Batched generation over one model. Thread-safe: start/generate/cancel from anywhere."""

    def __init__(self, model: LoadedModel, tokenizer: Tokenizer, config: EngineConfig,
                 draft: LoadedModel | None = None, images: bool = False):
        """draft: a smaller model of the same vocabulary that proposes speculative drafts
        (otherwise n-gram lookup does, when config.speculative). images: requests may give
        prompt rows as embeddings (GenerationRequest.images: a vision projector's)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config.resolved(model.config)
        runner_config = RunnerConfig(
            step_tokens=config.step_tokens, num_slots=config.parallel,
            page_size=config.page_size, num_pages=config.num_pages,
            pages_per_slot=config.pages_per_slot, kv_dtype=config.kv_dtype,
            decode_steps=config.decode_steps if draft is None else 1,
            # a recurrent model keeps each draft row's inputs until it is verified; the
            # placeholders of decode steps are verified as drafts when pages run short
            max_draft=max(config.max_draft if config.speculative else 0,
                          config.decode_steps - 1), image_rows=images, split=config.split)
        self.runner = Runner(model, runner_config)
        self.drafter = DraftModel(draft, model, runner_config) if draft is not None else None
        self.host_pages = HostPageStore(config.host_cache_mb << 20)
        # sliding-window layers keep only their window unless --swa-full (sliding_window.py)
        windows = [r.release_window for r in (self.runner, self.drafter and self.drafter.runner)
                   if r is not None]
        self.scheduler = Scheduler(SchedulerConfig.from_runner(
            self.runner.config, chunk_tokens=config.chunk_tokens,
            window=0 if config.swa_full else max(windows)))
        if config.host_cache_mb > 0:
            self.scheduler.host = self.host_pages
        self.scheduler.keep_partial = self.drafter is None
        self.vocab_size = model.config.vocab_size
        # the shape of every sampler call (sample_batch.py): fixed per engine, so that the
        # sampler compiles once per bucket whatever a request asks
        self.sample_shape = self.runner.sample_shape(tokenizer.eog_ids)
        self._stepper = Stepper(self)
        if self._stepper.stateful:
            self.scheduler.snapshots = StateSnapshots(STATE_SNAPSHOTS_PER_SLOT * config.parallel)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._stop = False
        self._dead: str | None = None  # set if the engine thread failed
        self._turn_started: float | None = None  # time.monotonic() of the running turn
        self._thread = threading.Thread(target=self._loop, name="kinetic-engine", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # --- the outside ----------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.runner.config.max_context

    def grammar_vocab(self) -> TokenVocab:
        """The tokenizer's trie for grammar masks (control tokens as their text), built once
        (about a second for a 150k vocabulary: the server builds it while it starts)."""
        return self._stepper.grammar.vocab()

    def prepare_grammar(self, grammar: Grammar) -> None:
        """Build `grammar`'s start state and first token mask on the calling thread (never
        the engine's: the server calls it from a worker thread), within the grammar budget
        (grammar_step.MASK_BUDGET_SECONDS). Raises GrammarTooCostly (a ValueError) past it.
        The engine then finds both cached."""
        self._stepper.grammar.prepare(grammar)

    def start(self, request: GenerationRequest, sink: Callable[[Delta], None],
              all_logits: bool = False) -> int:
        """Queue a request; `sink` gets its deltas from the engine thread. Returns its id.
        Raises ContextOverflow (a ValueError) at once if the prompt cannot fit."""
        self._check_tokens(request.prompt, "prompt")
        if request.images and not self.runner.config.image_rows:
            raise ValueError("this engine takes no images (no vision projector)")
        for image in request.images:
            if image.embeddings.shape[1:] != (self.model.config.d_model,):
                raise ValueError(f"image rows of width {image.embeddings.shape[1:]}, not the "
                                 f"model's {self.model.config.d_model}")
            rows = min(self.config.chunk_tokens, self.config.step_tokens)
            if image.non_causal and len(image.embeddings) > rows:
                raise ValueError(f"an image of {len(image.embeddings)} rows that attend to each "
                                 f"other must be computed in one step, and a prompt chunk here "
                                 f"is at most {rows} rows (-ub, -b)")
        if self._dead:
            raise RuntimeError(self._dead)
        seq_id = next(self._ids)
        seed = request.params.seed
        if seed is None or seed == -1:
            seed = int.from_bytes(os.urandom(4), "little")
        vocab = self.grammar_vocab() if request.grammar is not None else None
        job = Job(seq_id, request, sink, self.tokenizer, seed, all_logits, vocab)
        self._inbox.put(("add", job))
        self._wake.set()
        if self._dead:  # the engine failed after the check above: nobody will answer it
            job.fail(self._dead)
        return seq_id

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        """ContextOverflow when `tokens` leave no room in a slot, ValueError for an id outside
        the vocabulary: a request's or a prefill's, checked before it is queued."""
        if len(tokens) >= self.max_context:
            raise ContextOverflow(f"the {what} has {len(tokens)} tokens; the context "
                                  f"holds {self.max_context}")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")

    def cancel(self, seq_id: int) -> None:
        """Stop a request or a prefill; its pages are freed on the engine's next turn."""
        self._inbox.put(("cancel", seq_id))
        self._wake.set()

    def start_prefill(self, tokens: list[int], sink: Callable[[Prefilled], None]) -> int:
        """Queue a prefill of `tokens`: their whole pages are computed into the prefix cache
        (module docstring). `sink` gets one Prefilled, on the engine thread, once they are
        cached, or as soon as the prefill is cut short (a request arrived, a newer prefill of
        the same conversation, pages a request needs, a cancel). Returns its id. Raises
        ContextOverflow (a ValueError) at once if the tokens cannot fit a slot."""
        self._check_tokens(tokens, "prefill")
        if self._dead:
            raise RuntimeError(self._dead)
        seq_id = next(self._ids)
        self._inbox.put(("prefill", (seq_id, list(tokens), sink)))
        self._wake.set()
        if self._dead:
            sink(Prefilled(seq_id, 0, 0, self._dead))
        return seq_id

    def prefill(self, tokens: list[int]) -> Prefilled:
        """A prefill of `tokens`, synchronously (for notebooks and tests)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        self.start_prefill(tokens, out.put)
        return out.get()

    async def submit_prefill(self, tokens: list[int]) -> Prefilled:
        """A prefill of `tokens`, awaited; cancelling the await cancels the prefill."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def answer(result: Prefilled) -> None:
            if not done.done():
                done.set_result(result)
        seq_id = self.start_prefill(tokens, lambda r: loop.call_soon_threadsafe(answer, r))
        answered = False
        try:
            result = await done
            answered = True
            return result
        finally:
            if not answered:
                self.cancel(seq_id)

    async def forget(self, tokens: list[int]) -> int:
        """Drop the prefix cache's pages of `tokens` that no request is using (llama-server's
        slot erase), on the engine thread. Returns the tokens whose pages were dropped."""
        if self._dead:
            raise RuntimeError(self._dead)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._inbox.put(("forget", (list(tokens),
                                    lambda n: loop.call_soon_threadsafe(done.set_result, n))))
        self._wake.set()
        return await done

    def generate(self, request: GenerationRequest) -> Iterator[Delta]:
        """The request's deltas, synchronously (for notebooks and tests)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        seq_id = self.start(request, out.put)
        done = False
        try:
            while not done:
                delta = out.get()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.cancel(seq_id)

    def score(self, tokens: list[int], images: tuple = ()) -> np.ndarray:
        """Logits at every position of `tokens` ([len, V] float32), computed by the same
        steps as generation (teacher forcing: receipts and parity use this); images: rows of
        `tokens` that are image embeddings (ImageRows)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        request = GenerationRequest(list(tokens), max_tokens=1, speculative=False,
                                    images=tuple(images))
        seq_id = self.start(request, out.put, all_logits=True)
        while True:
            delta = out.get()
            if delta.finish_reason is not None:
                break
        if delta.error:
            raise RuntimeError(delta.error)
        return self._stepper.scored.pop(seq_id)

    def counters(self) -> dict[str, float]:
        """Totals since start: requests, prompt tokens run and reused, predicted tokens, the
        seconds spent on each (a step's time split by its rows), drafts proposed/accepted,
        prefills answered and the rows they ran (not counted as requests or prompt tokens)."""
        return dict(self._stepper.counters)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.slot_stats(), s.queue_length, len(s.running))

    def compile(self, progress=None) -> None:
        """Compile the sampler and log-probabilities at every row bucket, then the step at
        every row and key bucket, now: the first request of each shape would otherwise stall
        every stream while XLA compiles. progress(done, total) as Runner.compile.

        Compiling takes hundreds of MB that the C library keeps after XLA frees them; they are
        handed back after each compile (release_memory), and the sampler compiles before the
        first step maps the weights in, so that the peak is one compile's, not their sum; the
        steps warm up on zero weights (Runner.compile), and the weights are rearranged into
        the kernel's layout only at the end (LoadedModel.finish_repack).
        JAX's tracing caches are dropped after (drop_staging_caches). glibc's mmap threshold
        is held low meanwhile (kinetic.memory.compiling), and jaxlib's code pages are unmapped
        before, between and after (kinetic.memory.drop_code_pages: faulted back in where they
        run)."""
        with compiling():
            meanwhile = None
            if compile_cache.loading_ahead():
                # a warm start: the executables load in threads, and the weights'
                # rearrangement (C++) and the grammar trie (read from the cache's vocab/)
                # are done meanwhile rather than after (on a cold start their peaks would
                # add to the compiler's)
                meanwhile = threading.Thread(target=self._ready_meanwhile, daemon=True,
                                             name="kinetic-meanwhile")
                meanwhile.start()
            self._compile(progress)
            if meanwhile is not None:
                meanwhile.join()

    def _ready_meanwhile(self) -> None:
        self.runner.model.finish_repack()
        self.grammar_vocab()

    def _compile(self, progress) -> None:
        drop_code_pages()   # what importing JAX touched (kinetic.memory)
        self.runner.sampler.compile(self.sample_shape, self.runner.row_buckets)
        _releasing(None)(0, 0)
        self.runner.compile(progress=_releasing(progress), shape=self.sample_shape)
        drop_staging_caches()
        release_memory()
        # the weights' 16-column rearrangement, left by the loader until the compiler's memory
        # is handed back (Runner.compile warms up on zero weights)
        self.runner.model.finish_repack()
        drop_code_pages()   # XLA's and LLVM's passes: serving never runs them again
        compile_cache.trim()   # the disk cache within its bound

    def prepare_post_sampling(self) -> None:
        """Compile sampler.distribution_rows (post-sampling probabilities) at the chain's
        bucket, once. Seconds, so not at start-up: call it in a worker thread
        before starting the first request with post_sampling, which would otherwise compile
        it on the engine thread and stall every stream meanwhile."""
        self.runner.sampler.prepare_post_sampling(self.sample_shape)

    def stalled_for(self) -> float:
        """Seconds the engine thread has spent in its current turn (one step: plan, run,
        sample, hand out tokens); 0 while it waits for work. /health reads it: a turn that
        never ends (a stuck device call) is what no other signal shows."""
        started = self._turn_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (every request since fails with it), or None."""
        return self._dead

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the engine thread between two turns; requests still running end
        "cancelled". Returns whether the thread ended within `timeout` seconds (not if it
        is stuck inside a turn: a device call cannot be interrupted)."""
        _OPEN.discard(self)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            return False
        if self._dead is None:
            self.runner.close()
        return True

    # --- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        work = self._stepper
        try:
            while not self._stop:
                self._drain_inbox()
                work.answer_prefills()
                if not self.scheduler.has_work:
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._turn_started = time.monotonic()
                work.turn(quiet=self._inbox.empty())
                work.answer_prefills()
                self._turn_started = None
            self._drain_inbox()
            for seq_id in list(work.jobs):  # closed: end what is still running
                work.cancel(seq_id)
            for seq_id in list(work.prefills):
                work.cancel(seq_id)
            work.answer_prefills()
        except Exception as e:  # never lose a request silently: fail them all, loudly
            self._dead = self.runner.failed(e)
            try:
                self._drain_inbox()
            except Exception:  # the jobs already known still get their error below
                pass
            for job in list(work.jobs.values()):
                job.fail(self._dead)
            for seq_id, sink in list(work.prefills.items()):
                answer(sink, Prefilled(seq_id, 0, 0, self._dead))
            raise

    def _drain_inbox(self) -> None:
        work = self._stepper
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                work.add(item)
            elif kind == "prefill":
                work.add_prefill(*item)
            elif kind == "forget":
                tokens, reply = item
                answer(reply, self.scheduler.forget(tokens))
            elif kind == "cancel":
                work.cancel(item)


def _releasing(progress):
    """progress, after handing back what each compile left: JAX's staging caches, the
    compiler's code pages and the heap's free memory. Each compile's peak sits on what the
    ones before it left: SmolLM2 at -np 8, VmHWM after Engine.compile 594 MiB with all three
    handed back only at the end, 541 dropping the code pages after each, 472 with the
    staging caches too (docs/performance.md, Memory III). An executable loaded from the disk
    cache (kinetic/compile_cache.py) runs no compiler: what linking it touches is handed
    back once, at Engine._compile's end (after each, it cost a warm start 20-30 ms a shape
    for pages faulted straight back in), and nothing after a shape that needed neither."""
    seen = [None]

    def step(done: int, total: int) -> None:
        compiled = compile_cache.counts()["compiled"]
        if compiled != seen[0]:
            seen[0] = compiled
            drop_staging_caches()
            drop_code_pages()
            release_memory()
        if progress:
            progress(done, total)
    return step
