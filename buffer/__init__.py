"""rollwave buffer."""
