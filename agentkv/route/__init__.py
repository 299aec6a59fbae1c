"""Routing agentic traffic to real engines: the block index, the proxy, tenants, worker health."""
