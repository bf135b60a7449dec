"""The offline batch command's progress line on stderr (both paths: Serve handles and Ray Data)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A progress line on stderr: lines done of all, output tokens/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool = True):
        self.total, self.done, self.tokens = total, done, 0
        self.start = time.monotonic()
        self._ran = 0
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="line", dynamic_ncols=True, file=sys.stderr)

    def update(self, tokens: int) -> None:
        self.done += 1
        self._ran += 1
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self.tok_per_s:.0f} tok/s", refresh=False)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.start)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
