"""The serving layer: kvstrata's face to the network, driving the engine, which knows nothing of it.

    schemas.py          OpenAI's request and response shapes
    errors.py           every error in OpenAI's shape
    middleware.py       API key, drain (503 while shutting down), request body limit
    tokenizer_pool.py   tokenizing off the event loop, a tokenizer per thread
    responses.py        engine outputs as responses and server-sent event streams
    app.py              the FastAPI app and its routes
    metrics.py          Prometheus exposition of the engine's snapshots
    server.py           `kvstrata serve`: bind, load, serve, drain, write the cache down
"""
