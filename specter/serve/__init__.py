"""Serving: `specter generate` (one prompt, streamed to the terminal) and `specter serve` (an
OpenAI-compatible HTTP server) over one Method built from the run configuration.

    build.py    the Method, tokenizer and warm-up, composed exactly as `python run.py` composes them
    loop.py     the engine thread: requests join and leave the batched decoder between windows
    metrics.py  Prometheus counters and histograms the loop updates
    app.py      the HTTP layer (FastAPI): request schemas, errors, server-sent events

The decoders (specter/speculative) never import this package.
"""
