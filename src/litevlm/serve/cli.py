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
        "--max-batch",
        type=int,
        default=d.max_batch,
        help="answers decoded together: each admitted request joins the running batch at its next step and leaves "
        "it when done (the modules and native backends; 1: one at a time) (default: %(default)s)",
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
    g.add_argument(
        "--view-cache-mb",
        type=int,
        default=256,
        help="MiB of encoded camera views kept across requests, keyed by content: a frame sent again skips "
        "decoding and the vision encoder; 0 turns it off (default: %(default)s)",
    )
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    r = p.add_argument_group("replicas (Ray Serve; pip install 'litevlm[ray]')")
    r.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="copies of the pipeline behind Ray Serve's HTTP proxy; 1 is the one-process server (default: %(default)s)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="an existing Ray cluster (auto: the one `ray start` began on this node; or HOST:6379); "
        "default: a new Ray instance on this machine",
    )
    r.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each replica; its torch threads (default: %(default)s)",
    )
    r.add_argument(
        "--gpus-per-replica", type=float, default=0.0, help="GPUs Ray reserves for each replica (default: %(default)s)"
    )


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
        max_batch=args.max_batch,
    )
    try:
        Limits(**options)
    except ValueError as e:
        raise LiteVLMError(f"serve: {e}") from None
    if args.view_cache_mb < 0:
        raise LiteVLMError(f"serve: --view-cache-mb must be >= 0 (0 turns the cache off), got {args.view_cache_mb}")
    return dict(model_name=args.model_name, view_cache_bytes=args.view_cache_mb << 20, **options)


def _server():
    """`build_app` and `serve_forever`, imported only when a server is built: FastAPI, pydantic, uvicorn and
    prometheus_client are the `serve` extra's; LiteVLMError naming the missing one when it is absent."""
    try:
        import uvicorn  # noqa: F401  (serve_forever imports it only when it runs)

        from litevlm.serve.app import build_app
        from litevlm.serve.server import serve_forever
    except ImportError as e:
        raise LiteVLMError(
            f"litevlm serve needs FastAPI, uvicorn, pydantic and prometheus_client ({e}): pip install 'litevlm[serve]'"
        ) from None
    return build_app, serve_forever


def run_server(pipe, args) -> None:
    """Serve `pipe` with the flags of `add_serve_arguments` until interrupted."""
    build_app, serve_forever = _server()
    app = build_app(pipe, **app_options(args))
    limits = app.state.limits
    print(
        f"litevlm serve: model {app.state.model_name!r} at http://{args.host}:{args.port}/v1 "
        f"(queue {limits.max_queue}, timeout {limits.timeout_s:g} s)",
        flush=True,
    )
    serve_forever(app, args.host, args.port, args.log_level)


def replica_options(args) -> dict | None:
    """`serve_replicas` keyword arguments from the parsed flags, or None for the one-process server;
    LiteVLMError for a bad combination."""
    if args.replicas < 1:
        raise LiteVLMError(f"serve: --replicas must be >= 1, got {args.replicas}")
    if args.replicas == 1:
        ray_only = {
            "--ray-address": args.ray_address is not None,
            "--cpus-per-replica": args.cpus_per_replica != 1.0,
            "--gpus-per-replica": args.gpus_per_replica != 0.0,
        }
        if any(ray_only.values()):
            flags = ", ".join(f for f, given in ray_only.items() if given)
            raise LiteVLMError(f"serve: {flags} only with --replicas N > 1 (Ray Serve replicas)")
        return None
    if not args.cpus_per_replica > 0 or args.gpus_per_replica < 0:
        raise LiteVLMError("serve: --cpus-per-replica must be > 0 and --gpus-per-replica >= 0")
    return dict(
        replicas=args.replicas,
        address=args.ray_address,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        host=args.host,
        port=args.port,
    )


def serve_main(args) -> None:
    """The `serve` command (`litevlm.cli` registers it): the flags checked, then the pipeline built by
    `args.make_pipeline` and served; with --replicas N > 1, the options handed to Ray Serve, where each
    replica builds its own pipeline."""
    options = app_options(args)
    scale = replica_options(args)
    if scale is None:
        _server()  # the server's packages are checked before the pipeline is built
        run_server(args.make_pipeline(args), args)
        return
    try:
        from litevlm.serve.replicas import serve_replicas
    except ImportError as e:
        raise LiteVLMError(
            f"serve --replicas needs Ray Serve and the server packages ({e}): pip install 'litevlm[ray]'"
        ) from None
    from litevlm.options import pipeline_options

    serve_replicas(args.model, pipeline_options(args), options, **scale)
