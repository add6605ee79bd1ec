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


def _terminate(signum, frame):  # noqa: ARG001 - the signal module's handler signature
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated for the enclosed block (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
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
