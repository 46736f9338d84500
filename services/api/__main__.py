"""``python -m services.api -c cfg.yaml [key=value ...]``: serve the REST API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from core.config import load_config_or_exit
from services.api.app import check_api_config, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.api", description=__doc__)
    parser.add_argument("-c", "--config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides, check=check_api_config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(cfg), host=cfg.api.host, port=cfg.api.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
