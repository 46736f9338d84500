"""rollwave services."""
