"""On / off settings read from the environment (1 on, 0 off, unset: on) that a block of code can force either way
(A/B legs of the benchmark, tests): LATTICE_COMPILE (models/compiled.py), LATTICE_TRACE_ROUNDS (speculative/pipelined.py),
LATTICE_TRACE_STEPS (decode.py)."""

import os
from contextlib import contextmanager


class Switch:
    def __init__(self, name: str, on: str, off: str):
        self.name, self.on, self.off = name, on, off
        self._forced: bool | None = None

    def enabled(self) -> bool:
        """On unless the variable is 0 or `forced(False)` is in effect; any value but 0, 1 or empty is an error."""
        if self._forced is not None:
            return self._forced
        value = os.environ.get(self.name, "1")
        if value not in ("0", "1", ""):
            raise ValueError(f"{self.name}={value!r}: use 1 ({self.on}, the default) or 0 ({self.off})")
        return value != "0"

    @contextmanager
    def forced(self, on: bool | None):
        """On / off inside the block whatever the variable says (None: as it says)."""
        before, self._forced = self._forced, on
        try:
            yield
        finally:
            self._forced = before
