"""The CPU share: for small prompt chunks, some missed experts run on the CPU on host weights while the device
streams and computes the rest.

It is optional in every way (seed #1756): armed only when the plan enables it and for chunks below the plan's
`cpu_share.max_chunk`; its page-locked buffer comes from the pinned floor, sized once for the largest
share-eligible chunk before the first request; when that buffer cannot be had, the share turns itself off for the
run with one line and every request goes on on the device path.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from strata_core.reference import kernels as ref
from strata_core.runtime.pinned import PinnedPool
from strata_core.runtime.runlog import RunLog

BUFFER = "cpu-share activations"


class CpuShare:
    """Arms per chunk, runs its experts in a thread, and stands down for the run when its buffer is refused."""

    def __init__(self, plan: Any, pool: PinnedPool, log: RunLog, hidden: int):
        self.plan = plan
        self.pool = pool
        self.log = log
        self.hidden = int(hidden)
        self.enabled = bool(plan.cpu_share.enabled)
        self.max_chunk = int(plan.cpu_share.max_chunk)
        self.off_reason = "" if self.enabled else plan.cpu_share.reason
        self.buffer_bytes = 0
        self.runs = 0
        self.rows_computed = 0

    def prepare(self, budget_exhausted: bool) -> None:
        """Size the buffer once for the largest share-eligible chunk, from the floor; off for the run if refused."""
        if not self.enabled:
            self.log.say(f"CPU share: off ({self.off_reason})"
                         + ("; the pinned budget is exhausted (the arena could not be pinned whole)"
                            if budget_exhausted else ""), once="cpu-share-plan")
            return
        # one hidden f32 row per token of the largest share-eligible chunk: the share takes at most that many rows
        want = max(self.plan.pinned.cpu_share_bytes, self.max_chunk * self.hidden * 4)
        if self.pool.reserve(BUFFER, want, say=False) is None:
            self.turn_off(f"its {want / (1 << 20):.1f} MiB page-locked buffer could not be had from the floor "
                          f"({self.pool.last_failure}); the share is off for this run and prompts run on the "
                          "device path")
            return
        self.buffer_bytes = want
        if budget_exhausted:
            self.log.say(f"CPU share: the expert arena could not be pinned whole (pinned budget exhausted); the "
                         f"share's {want / (1 << 20):.1f} MiB buffer was taken from the kept floor",
                         once="cpu-share-floor")

    def turn_off(self, why: str) -> None:
        """Off for the rest of the run, said once."""
        if self.enabled:
            self.enabled = False
            self.off_reason = why
            self.log.fallback("CPU share", why)

    def armed_for(self, chunk_tokens: int) -> bool:
        """Does the share run on a chunk of this many tokens?"""
        return self.enabled and 0 < chunk_tokens <= self.max_chunk

    @property
    def rows_capacity(self) -> int:
        """Routed rows (hidden f32 each) the buffer sized once holds: the most rows one chunk-layer gives the share."""
        return self.buffer_bytes // (self.hidden * 4) if self.enabled else 0

    def output(self, rows: int) -> np.ndarray | None:
        """The page-locked [rows, hidden] f32 buffer the share writes its experts' outputs into (None when off)."""
        out = self.pool.view(BUFFER, (rows, self.hidden), np.float32)
        if out is None:
            self.turn_off(f"{rows} routed rows do not fit its buffer sized once ({self.buffer_bytes} bytes); "
                          "off for this run")
        return out

    def start(self, x: np.ndarray, groups: list[tuple[dict, np.ndarray]], out: np.ndarray,
              pool_dtype: "str | ref.ExpertPool") -> "ShareJob":
        """Run SwiGLU experts on the host in a thread: each group's rows of x through its expert, into out in turn."""
        job = ShareJob(self._work, x, groups, out, pool_dtype)
        self.runs += 1
        self.rows_computed += sum(len(r) for _, r in groups)
        job.start()
        return job

    @staticmethod
    def _work(x: np.ndarray, groups: list, out: np.ndarray, pool_dtype: str) -> None:
        at = 0
        for arrays, rows in groups:
            # the host pool of the layer (its formats: a 'gguf' pool's slots are raw file rows), or its dtype name
            one = {k: v[None] for k, v in arrays.items()}
            pool = pool_dtype.with_arrays(one) if hasattr(pool_dtype, "with_arrays") else ref.ExpertPool(pool_dtype, one)
            n = len(rows)
            out[at:at + n] = ref.moe_grouped_ffn(x[rows], np.array([0, n]), np.array([0]), pool)
            at += n


class ShareJob:
    """One chunk-layer's CPU work in a thread; `join` returns when it is done and re-raises its error, if any."""

    def __init__(self, fn: Callable, *args: Any):
        self._fn = fn
        self._args = args
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._fn(*self._args)
        except BaseException as e:  # handed to the joiner, which falls back
            self._error = e

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def join(self) -> BaseException | None:
        """Wait for the work; the error it raised, or None."""
        self._thread.join()
        return self._error
