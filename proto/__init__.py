"""rollwave proto."""
