"""rollwave trainer."""
