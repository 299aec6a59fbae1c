"""The KV event transport: a ZMQ publisher (PUB + replay ROUTER, vLLM's wire format) and subscriber."""
