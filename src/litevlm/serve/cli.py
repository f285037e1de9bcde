"""`litevlm serve`'s command-line flags (the server's only; the pipeline's options are the CLI's)."""

from __future__ import annotations

import argparse

from litevlm.errors import LiteVLMError
from litevlm.serve.limits import Limits


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server flags, with their defaults shown in `--help`."""
    d = Limits()
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument("--model-name", default=None, help="the model id clients send (default: the model's name)")
    g.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="requests that may wait besides the one being answered; more get 429 (default: %(default)s)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d.timeout_s,
        help="seconds from a request's arrival to its answer; later it gets 504 and its work is dropped "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        help="seconds a client has to send a request's headers before a 408 and a closed connection "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        help="seconds a client has to send a request's body before a 408 (default: %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections at most; more are closed on accept (default: %(default)s)",
    )
    g.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_bytes / 2**20,
        help="largest request body, MiB (default: %(default)s)",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help="largest image, width x height (default: %(default)s)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=int,
        default=d.max_prompt_chars,
        help="longest question in characters (default: %(default)s)",
    )
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def app_options(args) -> dict:
    """`build_app` keyword arguments from the parsed flags; LiteVLMError for a bad limit (checked before any
    model is loaded)."""
    options = dict(
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_image_pixels=args.max_image_pixels,
        max_prompt_chars=args.max_prompt_chars,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
    )
    try:
        Limits(**options)
    except ValueError as e:
        raise LiteVLMError(f"serve: {e}") from None
    return dict(model_name=args.model_name, **options)


def run_server(pipe, args) -> None:
    """Serve `pipe` with the flags of `add_serve_arguments` until interrupted."""
    from litevlm.serve.app import build_app
    from litevlm.serve.server import serve_forever

    app = build_app(pipe, **app_options(args))
    limits = app.state.limits
    print(
        f"litevlm serve: model {app.state.model_name!r} at http://{args.host}:{args.port}/v1 "
        f"(queue {limits.max_queue}, timeout {limits.timeout_s:g} s)",
        flush=True,
    )
    serve_forever(app, args.host, args.port, args.log_level)


def serve_main(args) -> None:
    """The `serve` command (`litevlm.cli` registers it): the flags checked, then the pipeline built by
    `args.make_pipeline`, then served."""
    app_options(args)
    run_server(args.make_pipeline(args), args)
