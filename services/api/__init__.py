"""The REST API: rollout jobs, cluster status, metrics, and the built-in dashboard."""

from services.api.app import create_app

__all__ = ["create_app"]
