"""OpenAI-compatible HTTP server on the agentkv engine: vLLM's API, metrics and KV events."""
