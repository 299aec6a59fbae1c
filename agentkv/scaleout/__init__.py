"""Running an application's independent work items elsewhere (Ray tasks), for sim and cache alike."""
