"""Holding Ctrl-C and SIGTERM while a result is written, so that an interrupt never loses it."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

from rooflib.core.printing import progress

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what a supervisor or `kill` sends


class SignalHold:
    """Ctrl-C and SIGTERM held off while a result is completed and written: from start() until
    release() or the end of the `with` block, each is noted (in `noted`), not obeyed, so it cannot
    lose the result; what is left is bounded (one request of --timeout at most). Before start()
    they act as usual. Only the main thread sets signal handlers: elsewhere this holds nothing."""

    def __init__(self, what: str):
        self.what = what
        self.noted: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalHold":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._restore()

    def start(self) -> None:
        """Hold from now on. The handlers are swapped with the signals blocked: one that comes
        meanwhile is noted once they are in place, never lost between the two."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            with signals_blocked(*STOP_SIGNALS):
                self._previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}

    def release(self) -> None:
        """Obey them again; one noted meanwhile is obeyed now (KeyboardInterrupt)."""
        self._restore()
        if self.noted:
            self.noted.clear()
            raise KeyboardInterrupt

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append(signum)
        progress(f"{self.what}: finishing: the results are being written")

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@contextlib.contextmanager
def signals_blocked(*signums: int):
    """Around starting a child process that ignores these signals itself and then unblocks them:
    it inherits the mask, so a Ctrl-C to the process group while it starts up waits until it
    ignores it (else it dies or prints a traceback). This process gets what came meanwhile after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
