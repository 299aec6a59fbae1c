"""agentkv: replay, simulate and route agentic LLM inference, with the KV cache at the centre."""

__version__ = "0.1.0"
