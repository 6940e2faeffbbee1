"""The inference core: config, hashing, requests, KV manager, scheduler, model runner, LLM API, and
the thread that serves an engine to asyncio callers. It knows nothing of HTTP (kvstrata.serving)."""
