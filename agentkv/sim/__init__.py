"""Offline simulation: N engines behind a routing policy on a virtual clock, and parameter sweeps."""
