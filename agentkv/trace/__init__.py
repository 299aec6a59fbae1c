"""Agentic traces: the model, readers and writer, synthesis, statistics and the replay plan."""

from agentkv.trace.model import Request, Session, TimedRequest, Trace, TraceError

__all__ = ["Request", "Session", "TimedRequest", "Trace", "TraceError"]
