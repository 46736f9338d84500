"""``python -m services.api -c cfg.yaml [key=value ...]``: serve the REST API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from core.config import load_config_or_exit
from core.net import http_url, listen_socket
from core.process import die_with_parent, prepare_component
from services.api.app import check_api_config, create_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.api", description=__doc__)
    parser.add_argument("-c", "--config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    prepare_component()
    die_with_parent()
    args = parser.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides, check=check_api_config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = listen_socket(cfg.api.host, cfg.api.port, "api")
    url = http_url(cfg.api.host, sock.getsockname()[1])
    logging.getLogger("services.api").info("serving on %s", url)
    app = create_app(cfg, url=url)
    config = uvicorn.Config(app, http=app.state.http_protocol, log_level="warning", server_header=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
