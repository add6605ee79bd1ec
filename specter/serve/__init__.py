"""Serving: `specter generate` (one prompt, streamed to the terminal) and `specter serve` (an
OpenAI-compatible HTTP server) over one Method built from the run configuration.

    loop.py     the engine thread around the one request scheduler (specter/scheduler.py)
    metrics.py  Prometheus counters and histograms the loop updates
    app.py      the HTTP layer (FastAPI): the app, its wiring and the body-size limit
    routes.py   its handlers around one loaded engine: checks, errors, server-sent events
    schema.py   the request bodies and the error a refusal raises

`specter serve` loads its engine through the Python API (specter.api.load_overrides), which holds the
loading code (compose_checked, build_served, MAX_BATCH) and the streamed text (TextStream), and steps
the scheduler `specter.load`'s generate steps too; the API imports nothing from this package.

The decoders (specter/speculative) never import this package.
"""
