"""The engine: config, hashing, requests, KV manager, scheduler, model runner, LLM API, server, metrics."""
