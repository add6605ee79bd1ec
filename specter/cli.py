"""`specter generate` and `specter serve`: the engine for use, not only for measurement.

    specter generate model=tiny_dsv2 memory=low method=specter prompt="def fib(n):" max_new_tokens=64
    specter generate model=dsv2 model.local_dir=/models/dsv2 prompt="..." temperature=0.7 seed=3
    specter serve model=tiny_dsv2 model.trained=true memory=low --port 8000
    specter serve model=dsv2 model.local_dir=/models/dsv2 --host 127.0.0.1 --max-queue 128

Both take the config groups of `python run.py` (model, memory, method, hardware and every key=value
override) and build one Method as a run does. `generate` streams the text to stdout as tokens
commit and prints one line of statistics on stderr; `serve` answers OpenAI-compatible HTTP
requests (docs/serving.md). Errors a user can fix are one line with exit status 2; Ctrl-C exits
130 and SIGTERM 143, each with a line; a closed output pipe (`| head`) exits 141 with a line.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

GENERATE_KEYS = ("prompt", "ignore_eos")  # generate's own keys; every other key=value is a config override


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"generate": generate_main, "serve": serve_main}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"specter: error: unknown command {argv[0]!r}; choose generate or serve", file=sys.stderr)
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    return _guarded(commands[argv[0]], argv[1:])


def _guarded(command, argv: list[str]) -> int:
    """Run a command under the refusal rule (specter/entry.py); a full disk is a user error too.

    The SIGTERM handler is in place before the engine's imports (seconds), so a signal while they
    load is the same line and status as one while the model decodes."""
    from specter.entry import UsageError, guarded

    def body() -> int:
        from specter.assembly.errors import USER_ERRORS, disk_error

        try:
            return command(argv)
        except USER_ERRORS as err:
            raise UsageError(str(err)) from None
        except OSError as err:
            user = disk_error(err)  # None for a broken pipe too: guarded() handles that one
            if user is None:
                raise
            raise UsageError(str(user)) from None

    with interruptible():
        return guarded("specter", body)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt for the enclosed block, however the command was started.

    A command a script starts in the background inherits SIGINT ignored (a shell without job control
    does that), and Python then installs no handler of its own: Ctrl-C or `kill -INT` while the model
    loaded was lost (generate went on and decoded; serve came up and never stopped, since uvicorn only
    takes the signal once it runs). The command takes SIGINT back for its lifetime, as uvicorn does, with
    a handler that raises at a safe point: never inside an import (specter/entry.py SafePoint)."""
    from specter.entry import interrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
        interrupt.raise_held()
    finally:
        signal.signal(signal.SIGINT, previous)


def split_overrides(argv: list[str], own: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(config overrides, the command's own key=value settings)."""
    from specter.assembly.config import ConfigError

    overrides, settings = [], {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {arg!r}")
        if key in own:
            settings[key] = value
        else:
            overrides.append(arg)
    return overrides, settings


def _flag(settings: dict[str, str], key: str) -> bool:
    from specter.assembly.config import ConfigError

    value = settings.get(key, "false").strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"{key} must be true or false, got {settings[key]!r}")
    return value in ("true", "1", "yes")


# ---------------------------------------------------------------------------------- generate
def generate_main(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from specter.api import compose_checked, load_overrides
    from specter.assembly.config import ConfigError
    from specter.assembly.runtime import model_checkpoint

    overrides, settings = split_overrides(argv, GENERATE_KEYS)
    if not settings.get("prompt"):
        raise ConfigError('generate needs a prompt: prompt="def fib(n):"')
    try:
        settings["prompt"].encode("utf-8")  # bytes that are not UTF-8 arrive as lone surrogates
    except UnicodeEncodeError:
        raise ConfigError("the prompt is not valid UTF-8 text") from None
    ignore_eos = _flag(settings, "ignore_eos")
    cfg = compose_checked(overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_checkpoint(cfg))
    ids = tokenizer(settings["prompt"], add_special_tokens=False).input_ids
    if not ids:
        raise ConfigError("the prompt has no tokens")
    # the whole prompt is decoded (run.py truncates to prefix_tokens): the decoders size their caches from it
    engine = load_overrides([*overrides, f"prefix_tokens={max(len(ids), int(cfg.prefix_tokens))}"], max_batch=1)
    try:  # the Python API's stream (specter/api.py): text as each window commits, then the statistics
        stream = engine.stream(settings["prompt"], ignore_eos=ignore_eos)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        done = stream.result
    finally:
        engine.close()
    print(done.stats.line(engine.method.name, done.finish_reason), file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------------- serve
def serve_main(argv: list[str]) -> int:
    from specter.api import MAX_BATCH, compose_checked, load_overrides
    from specter.entry import OneLineParser, bounded
    from specter.assembly.config import ConfigError
    from specter.serve.limits import BODY_TIMEOUT_S
    from specter.serve.server import (HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS, bind_socket, is_loopback,
                                      make_server)

    parser = OneLineParser(prog="specter serve", description="OpenAI-compatible HTTP server "
                     "(config overrides as key=value, e.g. model=tiny_dsv2 memory=low)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=bounded(int, 0, 65535, "a port number (0-65535)"), default=8000)
    parser.add_argument("--max-batch", type=bounded(int, 1, 2**31, "an integer >= 1"), default=MAX_BATCH,
                        help="requests decoded together, at most the tier's largest fitting batch")
    parser.add_argument("--max-queue", type=bounded(int, 0, 2**31, "an integer >= 0"), default=64,
                        help="requests waiting beyond the batch (then 503)")
    parser.add_argument("--drain-timeout", type=bounded(float, 0, 86400, "a number of seconds in [0, 86400]"),
                        default=600.0, help="seconds SIGTERM waits for in-flight requests and the engine's queue, "
                        "in all")
    parser.add_argument("--header-timeout", type=bounded(float, 0.1, 3600, "a number of seconds in [0.1, 3600]"),
                        default=HEADER_TIMEOUT_S, help="seconds a client has to send a request's headers (then 408)")
    parser.add_argument("--body-timeout", type=bounded(float, 0.1, 3600, "a number of seconds in [0.1, 3600]"),
                        default=BODY_TIMEOUT_S, help="seconds a client has to send a request's body (then 408)")
    parser.add_argument("--keep-alive", type=bounded(int, 1, 3600, "an integer number of seconds in [1, 3600]"),
                        default=KEEP_ALIVE_S, help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--max-connections", type=bounded(int, 1, 65536, "an integer in [1, 65536]"),
                        default=MAX_CONNECTIONS, help="open connections at most (one more is answered 503)")
    args, rest = parser.parse_known_args(argv)
    overrides, _ = split_overrides(rest, ())
    compose_checked(overrides)  # a bad override is refused before the port is taken
    try:  # bound before the model loads: a port in use or a foreign address is refused at once
        sock = bind_socket(args.host, args.port)
    except OSError as err:
        raise ConfigError(str(err)) from None
    port = sock.getsockname()[1]
    if not is_loopback(args.host):
        print(f"specter serve: warning: --host {args.host} exposes the server to the network; it has no "
              "authentication (docs/serving.md)", file=sys.stderr, flush=True)
    try:  # built as the Python API builds it (specter/api.py)
        engine = load_overrides(overrides, max_batch=args.max_batch)
    except BaseException:
        sock.close()
        raise
    try:
        parts = make_server(engine, args.host, port, args.max_queue, args.drain_timeout, log_level="info",
                            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                            keep_alive_s=args.keep_alive, max_connections=args.max_connections)
        print(f"specter serve: {engine.name} ({engine.method.name}, {engine.cfg.memory.name} tier, batch up to "
              f"{engine.max_batch}, queue {args.max_queue}) on http://{args.host}:{port}/v1", flush=True)
        stopped: list[int] = []
        # uvicorn handles SIGTERM/SIGINT while it runs (stop accepting, finish in-flight requests, drain the
        # engine), then raises the signal again under the handler it found: this one, so the runtime is
        # closed below and the exit status is 0 instead of death by the signal. A signal that arrives
        # before uvicorn takes the signals over stops the server too (it would run on otherwise).
        def stop(signum, frame):  # noqa: ARG001 - the signal module's handler signature
            stopped.append(signum)
            parts.server.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            parts.server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
        engine.close()
    if parts.loop.failure is not None:  # the engine stopped: the server exited instead of answering 503s
        print(f"specter serve: error: the engine stopped ({parts.loop.failure})", file=sys.stderr, flush=True)
        return 1
    print(f"specter serve: stopped{' on ' + signal.Signals(stopped[0]).name if stopped else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
