"""`python -m scheduler_svc --workers 127.0.0.1:50061 --port 50052`: the scheduler process."""

from __future__ import annotations

import argparse

from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime import event_loop
from pagoda.runtime.service_flags import add_service_flags, configure_service_logging
from scheduler_svc.core.brownout import BrownoutConfig
from scheduler_svc.core.config import SpeculativeConfig
from scheduler_svc.pinned_prompts import PinnedPromptsError, load_pinned_prompts
from scheduler_svc.server import EngineServiceConfig, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--workers", default="127.0.0.1:50061",
                   help="comma-separated worker addresses (the rank-0 driver of each group)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--max-num-encoder-input-tokens", type=int, default=0,
                   help="vision-language models: image embedding rows the worker may encode per step "
                        "(0: --max-num-batched-tokens), docs/vision.md")
    p.add_argument("--max-waiting-requests", type=int, default=4096)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--admission-order", choices=["auto", "fcfs", "cached-first"], default="auto",
                   help="which waiting request is admitted next: the queue's head, or the earliest with fewer "
                        "tokens to compute after its prefix-cache hit than the head (multi-turn sessions; "
                        "docs/kv_tiers.md); auto: cached-first with a host KV tier, else fcfs")
    p.add_argument("--no-pipelining", action="store_true", help="one plan in flight at a time")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="how a preempted sequence resumes: recompute its KV, or swap it to the worker's "
                        "host pool and back (needs the worker's --swap-space). Default: by cost, swap "
                        "a sequence longer than one prefill chunk when the host pool has room"),
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                        'or \'{"method": "suffix", "num_speculative_tokens": 8}\' (suffix decoding; '
                        'suffix_decoding_* keys: docs/speculative_decoding.md), or a draft model '
                        '\'{"model": PATH or "self:q4", "num_speculative_tokens": 4}\' (give the '
                        'worker the same flag: it loads the draft)')
    p.add_argument("--pinned-prompts", metavar="FILE", default=None,
                   help="JSON list of prompts (token-id lists, strings, or {\"messages\": [...]}) prefilled "
                        "at start and kept in the prefix cache for the engine's lifetime")
    p.add_argument("--tenant-kv-share", type=float, default=1.0, metavar="F",
                   help="the fraction (0..1] of the device KV pool each tenant may hold, in use + cached + "
                        "session leases (a tenant's kv_share in the gateway's --api-keys file overrides it); "
                        "default 1.0: no cap")
    p.add_argument("--tenant-fairness", choices=["off", "vtc"], default="off",
                   help="admission across tenants: 'vtc' admits the waiting request of the tenant with the "
                        "least service (virtual token counter: prompt tokens + 2 x output tokens); 'off' "
                        "keeps --scheduling-policy's order across tenants (default)")
    _add_brownout_flags(p)
    p.add_argument("--worker-timeout", type=float, default=30.0,
                   help="seconds a lost worker may take to come back before requests fail")
    add_service_flags(p, serves="Engine API", verifies="worker")
    return p.parse_args(argv)


def _add_brownout_flags(p: argparse.ArgumentParser) -> None:
    d = BrownoutConfig()
    g = p.add_argument_group("brownout", "under sustained memory pressure, smaller steps and capped "
                             "max_tokens for newly admitted requests (off unless --enable-brownout)")
    g.add_argument("--enable-brownout", action="store_true")
    g.add_argument("--brownout-max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="max_tokens cap for requests admitted for the first time during brownout "
                        "(default: %(default)s)")
    g.add_argument("--brownout-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="step token budget during brownout (default: half of --max-num-batched-tokens, "
                        "at least --max-num-seqs)")
    g.add_argument("--brownout-kv-watermark", type=float, default=d.kv_watermark, metavar="F",
                   help="enter when KV usage (0..1) stays at or above this for --brownout-window-steps "
                        "steps (default: %(default)s; above 1: off)")
    g.add_argument("--brownout-kv-recover-watermark", type=float, default=d.kv_recover_watermark,
                   metavar="F", help="leave after --brownout-window-steps steps below this with no "
                                     "preemption (default: %(default)s)")
    g.add_argument("--brownout-preemptions", type=int, default=d.preemption_threshold, metavar="N",
                   help="enter when this many preemptions happen within the window (default: "
                        "%(default)s; 0: off)")
    g.add_argument("--brownout-window-steps", type=int, default=d.window_steps, metavar="N",
                   help="the window, in scheduler steps (default: %(default)s)")


def brownout_config(args: argparse.Namespace) -> BrownoutConfig | None:
    if not args.enable_brownout:
        return None
    try:
        return BrownoutConfig(
            max_tokens=args.brownout_max_tokens, max_num_batched_tokens=args.brownout_max_num_batched_tokens,
            kv_watermark=args.brownout_kv_watermark, kv_recover_watermark=args.brownout_kv_recover_watermark,
            preemption_threshold=args.brownout_preemptions, window_steps=args.brownout_window_steps)
    except ValueError as error:
        raise SystemExit(f"scheduler: bad brownout flags: {error}") from None


def _speculative_config(value: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(f"bad --speculative-config: {error}") from error


def build_config(args: argparse.Namespace) -> EngineServiceConfig:
    return EngineServiceConfig(
        workers=tuple(w.strip() for w in args.workers.split(",") if w.strip()),
        host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        max_waiting_requests=args.max_waiting_requests, scheduling_policy=args.scheduling_policy,
        admission_order=args.admission_order,
        pipelining=not args.no_pipelining, worker_timeout_s=args.worker_timeout,
        shutdown_timeout_s=args.shutdown_timeout, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_ca=args.tls_ca, speculative=args.speculative_config, brownout=brownout_config(args),
        preemption_mode=args.preemption_mode, tenant_kv_share=args.tenant_kv_share,
        tenant_fairness=args.tenant_fairness,
        pinned_prompts=tuple(load_pinned_prompts(args.pinned_prompts)) if args.pinned_prompts else ())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_service_logging(args, "scheduler")
    from pagoda.runtime.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("pagoda-scheduler", args.otlp_traces_endpoint)
    try:
        event_loop.run(serve(build_config(args)))
    except (PinnedPromptsError, InvalidRequestError, ValueError) as error:  # bad --pinned-prompts, no swap space
        raise SystemExit(f"scheduler: {error}") from None
    finally:
        shutdown_tracing()  # flush the drained requests' spans


if __name__ == "__main__":
    main()
