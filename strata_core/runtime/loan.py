"""PromptLoan: per request, lend the prompt path the slots its own chunk needs, from the coldest end of the cache.

The loan is sized by `plan.loan_for(c)` for the request's chunk c, not by the auto chunk's loan: loan(c) is not
monotonic in c (a smaller chunk can get a deeper ring), which is the bug of seed #2090. When a request's loan is
larger than the auto chunk's, it is lent from further down the cache and that is said in one line. When it cannot
be lent at all, the chunk is halved for this request (and logged); the engine never exits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_core.planner.chunks import halve
from strata_core.runtime.cache import ExpertCache
from strata_core.runtime.runlog import RunLog


@dataclass(frozen=True)
class Loan:
    """Slots lent to one request's prompt path: the ring first, then the buffer slots."""

    prompt_tokens: int
    chunk_tokens: int
    ring: np.ndarray
    buffers: np.ndarray
    halvings: int
    larger_than_auto: bool

    @property
    def loan_slots(self) -> int:
        """Slots lent in all."""
        return len(self.ring) + len(self.buffers)

    @property
    def slots(self) -> np.ndarray:
        """Every lent slot."""
        return np.concatenate([self.ring, self.buffers])


@dataclass(frozen=True)
class NoLoan:
    """A request whose prompt is read without a loan (shorter than the stream minimum, or owned buffers)."""

    prompt_tokens: int
    chunk_tokens: int
    why: str
    halvings: int = 0
    larger_than_auto: bool = False
    loan_slots: int = 0


class PromptLoan:
    """Lends and takes back the prompt path's slots, as the plan sized them, from one ExpertCache."""

    def __init__(self, plan: Any, cache: ExpertCache, log: RunLog):
        self.plan = plan
        self.cache = cache
        self.log = log
        self.loans = 0
        self.halvings = 0
        self.outstanding: Loan | None = None
        #: (chunk tokens, planned buffer slots) -> the buffer slots the chunk's buffers really take (the runtime
        #: carves them from the loan): lending only those keeps the rest of the loan caching experts. None: all.
        self.buffer_need: Any = None

    @property
    def auto_loan_slots(self) -> int:
        """The loan of the plan's own chunk."""
        return self.plan.loan_for(self.plan.prompt.chunk).loan_slots if self.plan.prompt.chunk else 0

    def _lendable(self, need_slots: int) -> bool:
        """Can need_slots be lent now and still leave the slots decode keeps?"""
        keep = self.plan.prompt.min_keep_slots
        return need_slots <= self.cache.available_slots and self.cache.slots - need_slots >= keep

    def lend(self, prompt_tokens: int, max_chunk: int | None = None) -> Loan | NoLoan:
        """The loan for a request of prompt_tokens: its chunk's slots, halving the chunk until they can be lent.

        `max_chunk` caps the chunk (a retry after the device refused a chunk's buffers).
        """
        assert self.outstanding is None, "a loan is still outstanding"
        chunk = self.plan.request_chunk(prompt_tokens)
        if max_chunk is not None and chunk > max_chunk:
            chunk = max(1, max_chunk)
        if not self.plan.streams(prompt_tokens):
            why = ("the plan gives the prompt path its own buffers" if self.plan.prompt.owned_buffers else
                   f"prompts shorter than {self.plan.prompt.stream_min_tokens} tokens are read without a loan")
            return NoLoan(prompt_tokens=prompt_tokens, chunk_tokens=chunk, why=why)
        grid = self.plan.prompt.grid_tokens
        halvings = 0
        first_chunk = chunk
        first = row = self.plan.loan_for(chunk)
        while not self._lendable(row.loan_slots):
            if chunk <= grid:
                # the workspace holds the buffers of chunks up to the stream minimum: read with those, unlent
                own = max(1, min(first_chunk, self.plan.prompt.stream_min_tokens or first_chunk))
                self.halvings += halvings
                self.log.say(f"no chunk down to {chunk} tokens can be lent ({self.cache.available_slots} slots "
                             f"available, {self.plan.prompt.min_keep_slots} kept for decode): requests of "
                             f"{first_chunk}-token chunks read {own}-token chunks in the workspace, without a loan",
                             once=("unlent", first_chunk))
                return NoLoan(prompt_tokens=prompt_tokens, chunk_tokens=own, halvings=halvings,
                              why="no chunk could be lent")
            chunk = halve(chunk, grid)
            halvings += 1
            row = self.plan.loan_for(chunk)
        if halvings:
            # said once per pair of chunks, so a cache that stays small does not grow the log a line a request
            self.log.say(f"the loan for a chunk of {first_chunk} tokens ({first.loan_slots} slots) cannot be lent "
                         f"({self.cache.available_slots} slots available, {self.plan.prompt.min_keep_slots} kept for "
                         f"decode): such requests read with chunks of {chunk} tokens ({halvings} halvings)",
                         once=("halved", first_chunk, chunk))
        if self.buffer_need is None:  # nothing is carved from the buffers (accounting): the plan's loan as it is
            need = row.buffer_slots
            slots = self.cache.lend(row.loan_slots)
        else:
            need = min(row.buffer_slots, int(self.buffer_need(chunk, row.buffer_slots)))
            run = self.cache.lend_run(need)  # first: one run of adjacent slots is harder to find than any slots
            if run is None:
                run = self.cache.lend(need)  # no free run: the buffers are then views of each run of slots
            ring = self.cache.lend(row.ring_slots)
            slots = None if run is None or ring is None else np.concatenate([ring, run])
        assert slots is not None, "lendable slots could not be lent"
        auto = self.auto_loan_slots
        larger = row.loan_slots > auto
        if larger:
            self.log.say(f"the loan for a chunk of {chunk} tokens ({row.loan_slots} slots) is larger than the auto "
                         f"chunk's ({auto} slots): lent from further down the cache", once=("loan-larger", chunk))
        self.log.trace(f"lent {row.ring_slots + need} slots for {chunk} tokens ({row.ring_slots} ring, "
                       f"{need} of the plan's {row.buffer_slots} buffer slots)")
        loan = Loan(prompt_tokens=prompt_tokens, chunk_tokens=chunk, ring=slots[:row.ring_slots],
                    buffers=slots[row.ring_slots:], halvings=halvings, larger_than_auto=larger)
        self.loans += 1
        self.halvings += halvings
        self.outstanding = loan
        return loan

    def give_back(self, loan: Loan | NoLoan) -> None:
        """Return a request's slots to the cache (a NoLoan has none)."""
        if isinstance(loan, Loan):
            assert self.outstanding is loan, "giving back a loan that is not the outstanding one"
            self.cache.give_back(loan.slots)
            self.outstanding = None
            self.log.trace(f"returned {loan.loan_slots} slots")
