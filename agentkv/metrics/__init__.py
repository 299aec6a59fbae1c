"""Per-request records (one schema for bench and simulate), the summaries built from them, and SVG charts."""
