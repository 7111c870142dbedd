"""Masked ranks of the low-latency ops: which EP ranks each rank leaves out, and since which of its calls.

A rank masks a peer after a wait on it passed `Config.timeout_s` (with `Config(on_timeout="mask")`), or by hand
(`Buffer.mask_ranks`). From then on its low-latency ops neither send to that peer nor wait for it: top-k entries
naming the peer's experts are not sent (counted in `LowLatencyDispatchResult.num_masked`) and add nothing to the
combine, and nothing from the peer is received. A row travels only between two ranks that mask neither one
another, so each rank's results are those of the oracle with the masks of both ends.

`RankMasks` is the host's copy of every local rank's view, which the `xla` backend's ops read at every call; the
`cuda` backend keeps each rank's view on its GPU (jax_ep.backends.cuda.low_latency.DeviceRankMasks).
"""
from __future__ import annotations

import threading

import numpy as np

ON_TIMEOUT = ("trap", "mask")  # Config.on_timeout
NOT_MASKED = -1  # RankMasks.since of a peer that is not masked


class RankMasks:
    """since[r, p]: the call (rank r's count of its low-latency dispatches) from which rank r masks peer p, or
    NOT_MASKED. Read by the ops at run time (from a host callback) and written by the host API between calls;
    a lock keeps each read whole."""

    def __init__(self, num_ranks: int):
        self.since = np.full((num_ranks, num_ranks), NOT_MASKED, np.int64)
        self.calls = np.zeros(num_ranks, np.int64)  # dispatches each rank has started
        self._lock = threading.Lock()

    def row(self, rank: int, *, dispatch: bool) -> np.ndarray:
        """bool [R]: the peers rank masks, for its next op; a dispatch counts as one more call."""
        with self._lock:
            masked = self.since[rank] != NOT_MASKED
            if dispatch:
                self.calls[rank] += 1
            return masked

    def mask(self, peers, ranks) -> None:
        """Each of `ranks` masks each of `peers` (not itself) from its next call on, where it does not already."""
        with self._lock:
            for r in ranks:
                for p in peers:
                    if p != r and self.since[r, p] == NOT_MASKED:
                        self.since[r, p] = self.calls[r]

    def unmask(self, peers, ranks) -> None:
        with self._lock:
            for r in ranks:
                self.since[r, list(peers)] = NOT_MASKED

    def reset(self) -> None:
        """Every rank as new: no masks, no calls."""
        with self._lock:
            self.since[:] = NOT_MASKED
            self.calls[:] = 0

    def masked(self, ranks) -> dict[int, dict[int, int]]:
        """{rank: {masked peer: since call}} for each of `ranks`."""
        with self._lock:
            return {r: {int(p): int(self.since[r, p]) for p in np.flatnonzero(self.since[r] != NOT_MASKED)}
                    for r in ranks}
