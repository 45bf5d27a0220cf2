"""Several greedy decode steps in one device call (Runner.decode_steps), when nothing could
happen between them.

`plan` decides, before the scheduler plans a turn, how many steps the next call runs, and
hands the scheduler placeholder drafts that make it reserve those steps' rows and pages;
`planned` checks the scheduler gave every sequence all of them (it may not: pages ran short;
the step then runs as an ordinary one that verifies the placeholders as drafts, which is
correct, only slower); `run` runs them and returns the turn's samples.
"""

from __future__ import annotations

import numpy as np

from kinetic.engine.sample_batch import SampleShape, initial_mu, plain_greedy


def plan(scheduler, runner, jobs: dict, quiet: bool) -> int:
    """How many decode steps the next device call runs (0: one ordinary step), the
    scheduler's sequences given their placeholder drafts when more than one. Only where
    nothing could happen between them: `quiet` (no request or cancel waiting in the inbox),
    no request waiting for a slot, no prefill wanting the rows they leave, every running
    sequence caught up without a draft, and every request plain greedy (no penalties, DRY or
    Mirostat), without a grammar, logprobs or scored logits, with room in the context for
    every step's token. Stop strings, end-of-generation tokens and max_tokens may still come
    within the steps: the tokens after them are dropped (Job.take; Turn._finish cuts at
    max_tokens), never sent, as a rejected draft's are. (Waiting for every sequence to have
    n tokens left before its max_tokens sent a batch whose streams end at different steps
    through single steps for their last n - 1 tokens each.)"""
    running = scheduler.running
    if not running or not quiet or scheduler.waiting or scheduler.prefilling:
        return 0
    n = runner.decode_steps_at(len(running))
    if n < 2:
        return 0
    for seq in running:
        job = jobs.get(seq.seq_id)
        if (job is None or seq.draft or seq.num_computed != len(seq.tokens) - 1
                or job.matcher is not None or job.request.logprobs is not None
                or job.all_logits or not plain_greedy(job.request.params)):
            return 0
        if runner.config.max_context - len(seq.tokens) < n - 1:
            return 0
    # The turn's n x len(running) rows may pass step_tokens, so they must all be given (an
    # ordinary step could not hold them): each sequence's n - 1 more tokens take at most
    # this many new pages, and the pages must be there without preempting anyone.
    per = (n - 1) // runner.config.page_size + 2
    if scheduler.pages.available < per * len(running):
        return 0
    for seq in running:
        scheduler.set_draft(seq.seq_id, [seq.tokens[-1]] * (n - 1), past_max=True)
    return n


def planned(step_plan, n: int) -> bool:
    """Whether the scheduler gave every sequence of `step_plan` its decode row and the n - 1
    placeholder rows."""
    return all(c.sampled and c.num_rows == n and c.num_draft == n - 1
               for c in step_plan.chunks)


def run(runner, step_plan, rows: dict[int, list[int]], jobs: dict,
        shape: SampleShape) -> dict:
    """Run `step_plan` (every sequence: its newest token's row and n - 1 placeholder rows)
    as n decode steps in one device call, each step's token fed to the next. The plan's
    placeholder tokens become the tokens the steps drew, so that Scheduler.complete sees
    them as accepted drafts. Returns seq id -> (its tokens, None), as the turn's samples."""
    order = list(rows.items())
    grid = np.array([r for _, r in order], np.int64).T   # [n, B]: step i's row per seq
    first = grid[0]
    bias = tuple(jobs[sid].bias_pairs(shape.vocab_size) for sid, _ in order)
    drawn = runner.decode_steps(step_plan.tokens[first], step_plan.positions[grid],
                                step_plan.slots[first], step_plan.write_index[grid],
                                step_plan.page_table, bias, shape)[:, :len(order)]
    out = {}
    for j, (sid, row_ids) in enumerate(order):
        tokens = drawn[:, j].tolist()
        step_plan.tokens[row_ids[1:]] = tokens[:-1]
        job = jobs[sid]
        job.pending_mu = initial_mu(job.request.params) if job.mu is None else job.mu
        out[sid] = (tokens, None)
    return out
