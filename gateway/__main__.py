"""`python -m gateway --scheduler 127.0.0.1:50052 --port 8000 --grpc-port 50051 ...`"""

from __future__ import annotations

import argparse
import os

from gateway.config import GatewayConfig
from gateway.multimodal import MediaConfig, parse_limit_mm_per_prompt
from gateway.openai.reasoning_parsers import ReasoningParserManager
from gateway.openai.tool_parsers import AUTO, ToolParserManager
from gateway.server import serve
from gateway.tenancy.tenants import TenantFileError, load_tenant_file
from gateway.upstream.dns_discovery import DEFAULT_REFRESH_S
from gateway.upstream.lora_adapters import parse_lora_module
from gateway.upstream.routing import POLICIES, RoutingConfig
from pagoda.contract.image_inputs import ImageLimits
from pagoda.runtime import event_loop
from pagoda.runtime.logging import configure_logging
from pagoda.runtime.service_flags import add_service_flags


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="Pagoda gateway")
    parser.add_argument("--scheduler", action="append", default=None,
                        help="scheduler host:port (default 127.0.0.1:50052); repeat it, or separate them "
                             "with commas, for data-parallel replicas behind this gateway; MODEL=HOST:PORT "
                             "puts that scheduler in the pool serving MODEL (docs/gateway.md#model-pools); "
                             "dns:///NAME:PORT (or dns://DNSSERVER:PORT/NAME:PORT): the replicas are NAME's "
                             "A records, kept up to date (docs/fleet.md)")
    parser.add_argument("--fallback-model", action="append", default=[], metavar="A=B",
                        help="serve model B when model A's pool is unavailable or shedding (repeatable)")
    _add_routing_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port")
    parser.add_argument("--tokenizer", "--model-dir", dest="tokenizer", default=None,
                        help="the default pool's tokenizer directory (default: the model path its scheduler "
                             "reports; named pools always use theirs)")
    parser.add_argument("--served-model-name", default=None,
                        help="the default pool's model id (default: the model path its scheduler reports)")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $PAGODA_API_KEY)")
    parser.add_argument("--api-keys", metavar="FILE", default=None,
                        help="API keys -> tenants with optional limits, one JSON object per line "
                             "(docs/reliability.md#tenancy)")
    parser.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--limit-mm-per-prompt", default=None,
                        help='vision-language models: images per prompt, as vLLM\'s JSON (\'{"image": 2}\'; '
                             "default 4)")
    parser.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose http(s) image URLs the gateway fetches (default: none; data URLs "
                             "always work)")
    parser.add_argument("--media-fetch-timeout", type=float, default=5.0, help="seconds per image URL fetch")
    parser.add_argument("--max-image-bytes", type=int, default=20 << 20, help="largest encoded image")
    parser.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        help="largest decoded image (width x height)")
    parser.add_argument("--tool-call-parser", choices=(*ToolParserManager.names(), AUTO), default="hermes",
                        help="the model's tool-call format (vLLM's names); auto: the one the model's chat "
                             "template names (docs/gateway.md#tool-calling)")
    parser.add_argument("--reasoning-parser", choices=ReasoningParserManager.names(), default=None,
                        help="split the model's <think> reasoning into reasoning_content (vLLM's names)")
    parser.add_argument("--enable-request-timings", action="store_true",
                        help="add per-request timings (queue, prefill, decode, first token, cached tokens) "
                             "to responses")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) served by the default model under NAME "
                             "(the worker needs --enable-lora; docs/lora.md)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto")')
    add_service_flags(parser, serves="public gRPC", verifies="scheduler")
    args = parser.parse_args(argv)
    try:
        api_keys = load_tenant_file(args.api_keys) if args.api_keys else None
        return _config(args, api_keys)
    except TenantFileError as error:  # exits 2 with "python -m gateway: error: FILE line N: ..."
        parser.error(str(error))


def _add_routing_args(parser: argparse.ArgumentParser) -> None:
    defaults = RoutingConfig()
    group = parser.add_argument_group("data-parallel replicas (several --scheduler)")
    group.add_argument("--routing-policy", choices=POLICIES, default=None,
                       help="how a request picks its replica (default: prefix with several replicas)")
    group.add_argument("--routing-prefix-blocks", type=int, default=defaults.prefix_blocks,
                       help="full KV blocks of the prompt hashed into the prefix routing key")
    group.add_argument("--routing-overload-threshold", type=int, default=defaults.overload_threshold,
                       help="leave the prefix owner when its queue exceeds the least-loaded replica's by more")
    group.add_argument("--replica-stats-interval", type=float, default=defaults.stats_interval_s,
                       help="seconds between each replica's health + GetStats refresh")
    group.add_argument("--breaker-failures", type=int, default=defaults.breaker_failures,
                       help="consecutive failures that take a replica out of rotation")
    group.add_argument("--breaker-cooldown", type=float, default=defaults.breaker_cooldown_s,
                       help="seconds before a replica out of rotation is probed again")
    group.add_argument("--scheduler-dns-refresh-s", type=float, default=DEFAULT_REFRESH_S,
                       help="seconds between re-resolutions of a dns:// --scheduler (sooner when the "
                            "answer's TTL is shorter)")
    group.add_argument("--max-stream-failovers", type=int, default=defaults.max_stream_failovers,
                       help="times a stream under way may move to another replica when its replica "
                            "fails (0: never)")


def _routing(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(policy=args.routing_policy, prefix_blocks=args.routing_prefix_blocks,
                         overload_threshold=args.routing_overload_threshold,
                         stats_interval_s=args.replica_stats_interval, breaker_failures=args.breaker_failures,
                         breaker_cooldown_s=args.breaker_cooldown, max_stream_failovers=args.max_stream_failovers)


def _media(args: argparse.Namespace) -> MediaConfig:
    return MediaConfig(parse_limit_mm_per_prompt(args.limit_mm_per_prompt), tuple(args.allowed_media_domains),
                       args.media_fetch_timeout, ImageLimits(args.max_image_bytes, args.max_image_pixels))


def _config(args: argparse.Namespace, api_keys) -> GatewayConfig:
    scheduler = ",".join(args.scheduler or ["127.0.0.1:50052"])
    fallbacks = tuple(_pair(text) for text in args.fallback_model)
    return GatewayConfig(scheduler=scheduler, fallback_models=fallbacks, routing=_routing(args),
                         scheduler_dns_refresh_s=args.scheduler_dns_refresh_s,
                         host=args.host, port=args.port,
                         grpc_port=args.grpc_port,
                         tokenizer=args.tokenizer, served_model_name=args.served_model_name,
                         api_key=args.api_key, api_keys=api_keys, max_request_bytes=args.max_request_bytes,
                         media=_media(args),
                         log_json=args.log_json, log_level=args.log_level, otlp_traces_endpoint=args.otlp_traces_endpoint,
                         shutdown_timeout_s=args.shutdown_timeout, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, tls_ca=args.tls_ca, tool_call_parser=args.tool_call_parser,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         reasoning_parser=args.reasoning_parser,
                         enable_request_timings=args.enable_request_timings,
                         lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules))


def _pair(text: str) -> tuple[str, str]:
    requested, _, fallback = text.partition("=")
    if not fallback:
        raise ValueError(f"--fallback-model takes A=B (serve B when A cannot), got {text!r}")
    return requested.strip(), fallback.strip()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(json=config.log_json, level=config.log_level, service="gateway")
    from pagoda.runtime.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("pagoda-gateway", config.otlp_traces_endpoint)
    try:
        event_loop.run(serve(config))
    finally:
        shutdown_tracing()  # flush the drained requests' spans


if __name__ == "__main__":
    main()
