"""The live progress bar of a run (stderr, tqdm): workflows done, and the run's state now."""

from __future__ import annotations

import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(total=total, desc=desc, unit="wf", dynamic_ncols=True, leave=True, mininterval=0.5)
        self._last = 0.0

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def status(self, active: int, queued: int, kv: float | None, t: float) -> None:
        if self.bar is not None:
            now = time.monotonic()  # display throttling only: never reaches the run's records
            refresh = now - self._last >= 0.5
            if refresh:
                self._last = now
            self.bar.set_postfix_str(f"t={t:.0f}s active={active} queued={queued} "
                                     f"kv={'-' if kv is None else f'{kv:.0%}'}", refresh=refresh)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
