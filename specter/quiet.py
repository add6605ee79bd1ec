"""Keep third-party banners and log noise out of Specter's output; `verbose=true` shows them.

Some libraries print while they load: gptqmodel its ASCII-art banner, a version table and
`WARN`/`INFO` lines about the GIL and environment variables it sets; torchao (which it imports) a
line per optional kernel library it cannot load; torch a `_pytree` registration warning. None of
it says anything about a Specter run, and it lands in the middle of the comparison table.

`quiet_import()` wraps such an import: everything written to the process's stdout and stderr
(file descriptors 1 and 2, so C extensions too) goes to a temporary file, which is replayed on
stderr if the import fails, so an error is never hidden. `quiet_loggers()` then raises the
libraries' own loggers to ERROR. `verbose()` is true when the run says `verbose=true` (or
SPECTER_VERBOSE=1 is set): nothing is hidden then.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

ENV = "SPECTER_VERBOSE"
# Loggers of libraries Specter uses whose INFO/WARNING lines are noise in a run's output.
NOISY_LOGGERS = ("logbar", "gptqmodel", "torchao", "torch.utils._pytree", "transformers.modeling_utils",
                 "accelerate.utils.modeling",
                 # "The following TP rules were not applied ..." / "... layers were not sharded": tensor
                 # parallelism Specter never uses, checked on every load once modeling_utils is at
                 # ERROR (transformers runs that check only when its logger's level is WARNING or above)
                 "transformers.distributed.tensor_parallel")


def verbose() -> bool:
    """Whether third-party output is shown (SPECTER_VERBOSE=1, set by `verbose=true`)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_verbose(on: bool) -> None:
    """Show (True) or hide (False) third-party banners and log lines for this process and its children."""
    os.environ[ENV] = "1" if on else "0"
    quiet_loggers()


def quiet_loggers() -> None:
    """Raise the noisy libraries' loggers to ERROR (back to NOTSET when verbose)."""
    level = logging.NOTSET if verbose() else logging.ERROR
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    quiet_progress_bars()


def quiet_progress_bars() -> None:
    """transformers' own bars ("Loading weights", "Writing model shards") off unless verbose.

    transformers' switch also flips huggingface_hub's bars (downloads, which a user waits on):
    those are put back as they were."""
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
        from transformers.utils import logging as hf_logging
    except ImportError:  # neither installed: nothing of theirs to hide
        return
    hub_was_off = are_progress_bars_disabled()
    if verbose():
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    if hub_was_off != are_progress_bars_disabled():
        (disable_progress_bars if hub_was_off else enable_progress_bars)()


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Hide what the enclosed import prints (fd 1 and 2, and Python's sys.stdout/sys.stderr), unless
    verbose; replay it on stderr if the block raises."""
    if verbose():
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    text = io.StringIO()
    failed = True
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
            failed = False
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            quiet_loggers()
            if failed:  # the library's own words, for the error that follows
                sink.seek(0)
                sys.stderr.write(sink.read().decode("utf-8", errors="replace") + text.getvalue())
                sys.stderr.flush()
