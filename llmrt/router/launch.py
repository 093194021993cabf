"""`llmrt route`: a router over llmrt instances (given, or launched locally), served with uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
from typing import TYPE_CHECKING

from llmrt.router.backends import HealthConfig
from llmrt.router.policies import POLICIES
from llmrt.router.prompts import PrefixConfig
from llmrt.router.versions import parse_canary

if TYPE_CHECKING:
    from llmrt.router.app import RouterConfig


def add_route_arguments(p: argparse.ArgumentParser) -> None:
    """The `llmrt route` flags."""
    p.add_argument("model", nargs="?", default=None,
                   help="with --launch: the checkpoint the launched instances serve (default: the embedded model)")
    src = p.add_argument_group("backends")
    src.add_argument("--backend", action="append", default=[], metavar="URL",
                     help="an llmrt serve instance (repeatable), e.g. http://10.0.0.1:8000")
    src.add_argument("--launch", type=int, default=0, metavar="N",
                     help="start N local `llmrt serve MODEL` instances on free ports behind the router")
    src.add_argument("--serve-args", default="", metavar="ARGS",
                     help="extra flags for the launched instances, one shell-quoted string (e.g. \"--max-num-seqs 8\")")
    src.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                     help="start N `llmrt serve MODEL` instances as Ray actors (restarted by Ray when they die); "
                          "needs pip install 'llmrt[ray]'")
    src.add_argument("--ray-address", default=None, metavar="auto|ADDR",
                     help="the Ray cluster for --ray-replicas (llmrt must be importable on its nodes); replicas "
                          "then listen on their node's IP, reachable from other nodes: set --backend-api-key. "
                          "Unset, a local Ray is started in-process and replicas listen on 127.0.0.1")
    src.add_argument("--ray-replica-host", default=None, metavar="HOST",
                     help="the address every replica listens on and is reached at, instead of the above (e.g. "
                          "127.0.0.1 on a single-node cluster)")
    src.add_argument("--ray-cpus-per-replica", type=float, default=1.0, metavar="CPUS",
                     help="Ray CPUs each replica's placement bundle reserves (default: 1)")
    g = p.add_argument_group("routing")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=9000, help="port to listen on; 0 picks a free one (default: 9000)")
    g.add_argument("--policy", choices=POLICIES, default="round-robin",
                   help="round-robin; least-load (fewest outstanding tokens); prefix-affinity (same prompt prefix, "
                        "same instance, bounded by load); session (same OpenAI `user`, same instance) "
                        "(default: round-robin)")
    g.add_argument("--canary", action="append", default=[], metavar="VERSION=SHARE",
                   help="send this share of unpinned requests to instances of VERSION (repeatable), e.g. v2=0.1")
    g.add_argument("--affinity-blocks", type=int, default=4,
                   help="prefix-affinity hashes the first this many KV blocks of the prompt (default: 4)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block for the prefix (default: 16)")
    g.add_argument("--affinity-load-factor", type=float, default=1.25,
                   help="prefix-affinity sends a prefix elsewhere when its instance has more than this times the "
                        "mean in-flight requests (default: 1.25)")
    r = p.add_argument_group("health and retries")
    r.add_argument("--health-interval", type=float, default=1.0, help="seconds between active checks (default: 1)")
    r.add_argument("--eject-after", type=int, default=3,
                   help="eject an instance after this many consecutive connect errors / retryable 5xx (default: 3)")
    r.add_argument("--cooldown", type=float, default=5.0,
                   help="an ejected instance is re-admitted after this many seconds and a passing check (default: 5)")
    r.add_argument("--max-retries", type=int, default=2, help="retries per request, each on another instance "
                                                              "(default: 2)")
    r.add_argument("--retry-budget", type=float, default=0.2,
                   help="retries may be at most this share of the last 10 s of requests, plus --retry-min "
                        "(default: 0.2)")
    r.add_argument("--retry-min", type=int, default=10, help="retries always allowed per 10 s (default: 10)")
    r.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds an instance may take to answer (default: 600)")
    s = p.add_argument_group("security and logs")
    s.add_argument("--api-key", default=os.environ.get("LLMRT_API_KEY"),
                   help="require `Authorization: Bearer KEY` from clients (default: $LLMRT_API_KEY)")
    s.add_argument("--admin-api-key", default=os.environ.get("LLMRT_ADMIN_API_KEY"),
                   help="the key of the router's /admin/backends and /admin/canary; unset, they do not exist")
    s.add_argument("--backend-api-key", default=os.environ.get("LLMRT_BACKEND_API_KEY"),
                   help="the key the router sends to instances (default: $LLMRT_BACKEND_API_KEY; launched instances "
                        "get it as their --api-key)")
    s.add_argument("--disable-access-log", action="store_true",
                   help="no JSON access-log line per request (they name the instance that served it)")


def run_route(args: argparse.Namespace) -> int:
    """Serve the router until interrupted; launched instances are stopped with it."""
    from llmrt.router.app import RouterConfig

    try:
        canary = parse_canary(args.canary)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.backend and not args.launch and not args.ray_replicas:
        print("error: give --backend URL (repeatable), --launch N or --ray-replicas N", file=sys.stderr)
        return 2
    from llmrt.server.listen import setup_access_log

    setup_access_log(args.disable_access_log)
    with contextlib.ExitStack() as stack:
        backends = list(args.backend)
        watchers = []
        extra = shlex.split(args.serve_args)
        if args.backend_api_key:
            extra += ["--api-key", args.backend_api_key]
        if args.launch:
            from llmrt.router.instances import launch_instances

            print(f"llmrt route: launching {args.launch} instances of {args.model or 'the embedded model'}...",
                  file=sys.stderr, flush=True)
            backends += stack.enter_context(launch_instances(args.launch, args.model, extra))
        if args.ray_replicas:
            from llmrt.router.ray_replicas import ray_replicas

            if args.ray_address and not args.ray_replica_host and not args.backend_api_key:
                print("llmrt route: warning: replicas will listen on their nodes' addresses without an API key; "
                      "anyone who can reach those nodes can use them (set --backend-api-key)", file=sys.stderr)
            print(f"llmrt route: starting {args.ray_replicas} Ray replicas of {args.model or 'the embedded model'}"
                  "...", file=sys.stderr, flush=True)
            try:
                replicas = stack.enter_context(ray_replicas(
                    args.ray_replicas, args.model, extra, address=args.ray_address,
                    cpus_per_replica=args.ray_cpus_per_replica, poll_s=args.health_interval,
                    host=args.ray_replica_host))
            except (RuntimeError, ConnectionError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            backends += replicas.urls
            watchers.append(replicas.watch)
        cfg = RouterConfig(
            backends=backends, policy=args.policy, canary=canary,
            health=HealthConfig(interval_s=args.health_interval, eject_after=args.eject_after,
                                cooldown_s=args.cooldown),
            prefix=PrefixConfig(blocks=args.affinity_blocks, block_size=args.block_size),
            load_factor=args.affinity_load_factor, max_retries=args.max_retries, retry_ratio=args.retry_budget,
            retry_min=args.retry_min, upstream_timeout=args.upstream_timeout, api_key=args.api_key,
            admin_api_key=args.admin_api_key, backend_api_key=args.backend_api_key,
            access_log=not args.disable_access_log, watchers=watchers)
        try:
            return asyncio.run(_serve(args, cfg))
        except KeyboardInterrupt:
            return 0


async def _serve(args: argparse.Namespace, cfg: "RouterConfig") -> int:
    from llmrt.router.app import build_router_app
    from llmrt.server.listen import bind_socket, serve_on_socket

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host

    def banner(port: int) -> None:
        print(f"llmrt route: {len(cfg.backends)} backends, policy {cfg.policy} on http://{host}:{port}\n"
              f"  OpenAI API at http://{host}:{port}/v1; backends: {', '.join(cfg.backends)}", flush=True)
    try:
        await serve_on_socket(build_router_app(cfg), sock, "on", banner)
    finally:
        sock.close()
    return 0
