"""The HTTP doors shared by `agentkv serve` and `agentkv route`: request bodies read under caps, JSON
checked before it is trusted, OpenAI-shaped errors, heavy parsing off the event loop, and
connection hygiene (idle and body timeouts, a connection cap, file-descriptor recovery)."""
