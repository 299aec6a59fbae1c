"""Per-request records (one schema for bench and simulate) and the summaries built from them."""
