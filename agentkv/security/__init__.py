"""Attacks and checks that prove agentkv's isolation promises (timing side channels, prompt privacy)."""
