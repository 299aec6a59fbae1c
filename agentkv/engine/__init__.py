"""A serving engine without weights: hardware catalogue, cost model, scheduler, clock."""
