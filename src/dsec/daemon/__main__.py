"""``python -m dsec.daemon serve``: the daemon's own entry point (what :func:`dsec.daemon.server.up` spawns).

Kept apart from the ``dsec`` CLI so the background daemon does not depend on the CLI's imports.
It only parses options and calls :func:`dsec.daemon.server.serve`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from dsec.config import Settings
from dsec.daemon import logs, memory
from dsec.daemon.engine import Engine
from dsec.daemon.server import ServeError, serve
from dsec.e2b.options import E2BOptions
from dsec.errors import InvalidRequest
from dsec.fusion.options import FusionOptions, RunnerSettings


def main(argv: list[str] | None = None, engine: Callable[[Settings], Engine] | None = None) -> int:
    """Parse options and serve; returns the process exit status. ``engine`` makes the engine served instead of
    the node's (the tests' fake daemon)."""
    parser = argparse.ArgumentParser(prog="python -m dsec.daemon", description="DSec node daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the node daemon in the foreground")
    p.add_argument("--home", type=Path, default=None, help="state directory (default: $DSEC_HOME)")
    p.add_argument("--tcp", default=None, metavar="HOST:PORT", help="also serve on TCP (needs a token)")
    p.add_argument("--token", default=None, help="TCP bearer token (default: $DSEC_TOKEN; prefer the env)")
    p.add_argument("--log-level", default="INFO", help="Python log level (default INFO)")
    p.add_argument("--e2b", default=None, metavar="HOST:PORT", help="also serve E2B's API (needs a token)")
    p.add_argument("--e2b-domain", default=None, help="E2B_DOMAIN of the clients (api.DOMAIN, PORT-ID.DOMAIN)")
    p.add_argument("--e2b-tls-cert", type=Path, default=None, help="PEM certificate for HTTPS")
    p.add_argument("--e2b-tls-key", type=Path, default=None, help="PEM key (default: in the certificate)")
    p.add_argument("--e2b-default-image", default="debian-python", help="image of the 'base' template")
    p.add_argument("--e2b-backend", default="container", help="backend of a template that names none")
    p.add_argument("--e2b-network", default="none", help="network of a sandbox that asks for none")
    p.add_argument("--sandbox-fusion", default=None, metavar="HOST:PORT",
                   help="also serve SandboxFusion's /run_code (needs a token)")
    p.add_argument("--sandbox-fusion-image", default="debian-python", help="the image /run_code runs on")
    args = parser.parse_args(argv)
    settings = Settings(home=args.home) if args.home else Settings()
    logs.setup(settings.log_file, args.log_level)
    try:
        e2b = _e2b_options(args)
        fusion = None
        if args.sandbox_fusion is not None:
            fusion = FusionOptions(args.sandbox_fusion, RunnerSettings(image=args.sandbox_fusion_image))
        trace = memory.start_from_env(settings.run_dir)
        serve(settings, tcp=args.tcp, token=args.token or os.environ.get("DSEC_TOKEN") or None,
              engine=engine(settings) if engine is not None else None, e2b=e2b, fusion=fusion)
    except (ServeError, InvalidRequest, ValueError) as exc:
        print(f"dsec daemon: {exc}", file=sys.stderr)
        return 1
    if trace is not None:
        trace.stop()
    return 0


def _e2b_options(args: argparse.Namespace) -> E2BOptions | None:
    if args.e2b is None:
        return None
    return E2BOptions(listen=args.e2b, domain=args.e2b_domain, tls_cert=args.e2b_tls_cert, tls_key=args.e2b_tls_key,
                      default_image=args.e2b_default_image, backend=args.e2b_backend, network=args.e2b_network)


if __name__ == "__main__":
    sys.exit(main())
