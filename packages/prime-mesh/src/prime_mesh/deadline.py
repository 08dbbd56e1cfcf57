"""Collective deadlines that follow observed durations, so timeouts need no hand-tuning."""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger("prime_mesh.deadline")


class CollectiveDeadline:
    """Deadline = `factor` x the mean of the last `window` successful collective durations, plus
    `margin`, clamped to [`floor`, `ceiling`]; `initial` until the first observation.

    The margin (the mesh uses heartbeat_timeout + one interval) lets the coordinator judge a
    stalled peer first, through `should_abort`; the deadline is the backstop for what it cannot
    see, such as a link cut between two nodes that both still reach the coordinator. The window
    bounds the average's memory, and the ceiling bounds a run of slow steps.
    """

    def __init__(
        self,
        initial: float = 300.0,
        factor: float = 4.0,
        margin: float = 6.0,
        floor: float = 5.0,
        ceiling: float = 1800.0,
        window: int = 16,
    ) -> None:
        if not 0 < floor <= ceiling:
            raise ValueError(f"need 0 < floor <= ceiling, got floor={floor}, ceiling={ceiling}")
        self.initial, self.factor, self.margin = initial, factor, margin
        self.floor, self.ceiling = floor, ceiling
        self._samples: deque[float] = deque(maxlen=max(1, window))
        self._logged: float | None = None

    def record(self, seconds: float) -> None:
        if seconds >= 0:
            self._samples.append(float(seconds))
        value = self.timeout()
        if self._logged is None or abs(value - self._logged) > 0.1 * self._logged:
            log.info(
                "collective deadline %.2fs (mean of last %d collectives %.2fs x %g + %.1fs margin)",
                value,
                len(self._samples),
                self.mean or 0.0,
                self.factor,
                self.margin,
            )
            self._logged = value

    @property
    def mean(self) -> float | None:
        return sum(self._samples) / len(self._samples) if self._samples else None

    def timeout(self) -> float:
        mean = self.mean
        raw = self.initial if mean is None else self.factor * mean + self.margin
        return min(self.ceiling, max(self.floor, raw))
