"""Agentic traces: the model, readers and writer, synthesis, statistics, block keys and the replay plan."""
