"""Routing agentic traffic: policies (shared with the simulator), the block index, the proxy, tenants."""
