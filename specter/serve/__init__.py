"""Serving: `specter generate` (one prompt, streamed to the terminal) and `specter serve` (an
OpenAI-compatible HTTP server) over one Method built from the run configuration.

    loop.py     the engine thread: requests join and leave the batched decoder between windows
    metrics.py  Prometheus counters and histograms the loop updates
    app.py      the HTTP layer (FastAPI): the app, its wiring and the body-size limit
    routes.py   its handlers around one loaded engine: checks, errors, server-sent events
    schema.py   the request bodies and the error a refusal raises

`specter serve` loads its engine through the Python API (specter.api.load_overrides), which holds the
loading code (compose_checked, build_served, MAX_BATCH), the request loops (batch_loop) and the streamed
text (TextStream); the API imports nothing from this package (build.py keeps two old names for callers).

The decoders (specter/speculative) never import this package.
"""
