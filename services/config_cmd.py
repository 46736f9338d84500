"""``rollwave config check``: the resolved config on stdout; an invalid one is a ConfigError (exit 2)."""

from __future__ import annotations

import argparse
import sys

from buffer.redis_server import configured_url
from core.config import dump_config, load_config, refuse_secret_overrides


def check(args: argparse.Namespace) -> int:
    """The config as every component resolves it: ``redis.url`` is the one they connect to, ``REDIS_URL`` when it is
    set (it wins over ``redis.url``: the launchers and the deploy files hand Redis over in it), said on stderr when it
    replaces another."""
    refuse_secret_overrides(args.overrides)
    cfg = load_config(args.config, args.overrides)
    url = configured_url(cfg.redis)
    if cfg.redis.url is not None and url != cfg.redis.url:
        print(f"note: redis.url: REDIS_URL in the environment ({url}) wins over {cfg.redis.url}", file=sys.stderr)
    cfg.redis.url = url
    sys.stdout.write(dump_config(cfg))
    return 0
