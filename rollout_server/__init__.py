"""rollwave rollout_server."""
