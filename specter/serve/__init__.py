"""Serving: `specter generate` (one prompt, streamed to the terminal) and `specter serve` (an
OpenAI-compatible HTTP server) over one Method built from the run configuration.

    build.py    the Method, tokenizer and warm-up, composed exactly as `python run.py` composes them
    loop.py     the engine thread: requests join and leave the batched decoder between windows
    metrics.py  Prometheus counters and histograms the loop updates
    app.py      the HTTP layer (FastAPI): the app, its wiring and the body-size limit
    routes.py   its handlers around one loaded engine: checks, errors, server-sent events
    schema.py   the request bodies and the error a refusal raises

`specter serve` loads its engine through the Python API (specter.api.load_overrides).

The decoders (specter/speculative) never import this package.
"""
