"""What every command-line entry point shares (`specter generate|serve`, `python -m
specter.routing_stats`, make_figures.py): the refusal rule of docs/input_safety.md.

    bad input           one line `<prog>: error: ...` on stderr, exit status 2, never a traceback
    Ctrl-C / SIGTERM    one line, exit status 130 / 143
    stdout closed       (`... | head`) one line, exit status 141, no BrokenPipeError at exit

Torch-free, so make_figures.py can use it without the engine's dependencies.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator


class UsageError(Exception):
    """Input a user can fix: reported as one line, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is so that it unwinds as Ctrl-C does."""


PACKAGE = os.path.dirname(os.path.abspath(__file__))
OWN_CODE = [PACKAGE, os.path.join(os.path.dirname(PACKAGE), "baselines")]  # + the running script (_own)


class SafePoint:
    """A signal handler that raises `exception` in the main thread at a safe point: in Specter's own code
    (specter/, baselines/, the script that runs), never inside an import or a library's bookkeeping.

    A handler's exception lands between any two bytecodes. Inside an import it left a half initialised
    module (numpy's `dtypes` recursed until a RecursionError, torch aborted with SIGABRT, transformers
    lost a model class, and torch's import-time registration made the interpreter die by SIGINT after
    the command had printed its line); inside OmegaConf's flag handling it turned into an AttributeError
    reported as bad input. So a signal that finds the main thread elsewhere is held, and a profile hook
    (this thread's only, cleared once it fires) raises it at the next call or return in own code. A second
    signal while one is held raises at once: a command stuck in a library still stops on the second
    Ctrl-C. Under a profiler (sys.getprofile() set) it raises at once, as Python's own handler does."""

    def __init__(self, exception: type[BaseException]):
        self.exception = exception
        self.held = False

    def __call__(self, signum, frame):  # noqa: ARG002 - the signal module's handler signature
        if self.held or _safe(frame) or sys.getprofile() not in (None, self._watch):
            self._raise()
        self.held = True
        sys.setprofile(self._watch)

    def _watch(self, frame, event, arg):  # noqa: ARG002 - sys.setprofile's signature
        if _safe(frame):
            self._raise()

    def _raise(self):
        if self.held:
            sys.setprofile(None)
        self.held = False
        raise self.exception()

    def raise_held(self) -> None:
        """Raise a signal still held when the block it arrived in ends (it would be lost otherwise)."""
        if self.held:
            self._raise()


def _safe(frame) -> bool:
    if frame is None or not _own(frame.f_code.co_filename):
        return False
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return False
        frame = frame.f_back
    return True


def _own(filename: str) -> bool:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    roots = [*OWN_CODE, *([os.path.abspath(main)] if main else [])]
    return any(filename == r or filename.startswith(r + os.sep) for r in roots)


interrupt = SafePoint(KeyboardInterrupt)  # SIGINT's handler for every command (Python's raises anywhere)
_terminate = SafePoint(Terminated)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated for the enclosed block (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
        _terminate.raise_held()
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line(err: BaseException | str) -> str:
    return " ".join(str(err).split())


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a UsageError (one line) instead of usage text and exit."""

    def error(self, message: str):
        raise UsageError(message)


def bounded(kind: Callable[[str], float], lo: float, hi: float, what: str) -> Callable[[str], float]:
    """An argparse type: a finite `kind` in [lo, hi], else "'<text>' is not <what>"."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def guarded(prog: str, body: Callable[[], int], user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run `body` under the refusal rule; `user_errors` are reported like a UsageError."""
    try:
        with terminate_as_interrupt():
            return body()
    except BrokenPipeError:
        # the reader of stdout left: no more output, and no second BrokenPipeError at interpreter exit
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        print(f"{prog}: output closed by its reader; stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGPIPE
    except (UsageError, *user_errors) as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2
    except Terminated:
        print(f"{prog}: terminated (SIGTERM)", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
