"""agentkv bench: replay agentic sessions against OpenAI-compatible servers and report."""
