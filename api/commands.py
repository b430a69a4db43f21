"""The server's commands, `draftline serve` and `draftline bench-serve`: their flags and what
they run. They live beside the server (core never imports the API); ``draftline.cli`` adds them
to core's commands."""

from __future__ import annotations

import argparse
import contextlib

from draftline.core import flags
from draftline.core.arguments import DEFAULT_SPEC
from draftline.core.flags import NON_NEGATIVE, PORT, POSITIVE

UTILIZATION = flags.share()  # 0 (the spec's) or a share of the GPU's memory in (0, 1]


def cmd_serve(args: argparse.Namespace) -> int:
    from draftline.core.spec import load_spec

    from .server import serve

    spec = load_spec(args.spec)
    return serve(spec, args.host or spec.server.host, args.port or spec.server.port)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from draftline.core.spec import load_spec

    from .bench import Options, run_bench

    opts = Options(args.concurrency, args.requests, args.max_new_tokens, args.prompt_len, args.shared_prefix,
                   args.long_prompt, args.acceptance or "", tuple(args.modes), args.max_model_len,
                   not args.no_prefix_caching, args.max_num_batched_tokens, args.num_kv_blocks,
                   args.gpu_memory_utilization, args.admission_wait, args.max_prefill_stall, args.trace_rounds)
    with _quiet(not args.verbose):  # the table, not every request's log line
        table = run_bench(load_spec(args.spec), opts, args.json)
    print(table)
    return 0


@contextlib.contextmanager
def _quiet(on: bool):
    """Info log lines off while the block runs (warnings still show); the old config after."""
    import logging

    import structlog

    old = structlog.get_config()
    if on:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**old)


def add_commands(sub) -> None:
    """The server's subcommands, added to the `draftline` parser (core.arguments.build_parser)."""
    sv = sub.add_parser("serve", help="start the HTTP server (/generate, /v1/completions, /v1/chat/completions, /metrics, ...)")
    sv.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    sv.add_argument("--host", help="address to bind (default: the spec's server.host, 127.0.0.1)")
    sv.add_argument("--port", type=PORT, help="port to bind (default: the spec's server.port, 8000)")
    sv.set_defaults(func=cmd_serve)
    bs = sub.add_parser("bench-serve", help="requests/s, tokens/s, TTFT, TPOT at several concurrencies, drafting on and off")
    bs.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    bs.add_argument("--concurrency", type=flags.listed(POSITIVE), default="1,4,16", help="comma-separated concurrency levels")
    bs.add_argument("--requests", type=NON_NEGATIVE, default=0, help="requests per level (0: max(8, 8 x concurrency))")
    bs.add_argument("--max-new-tokens", type=POSITIVE, default=64, help="tokens generated per request")
    bs.add_argument("--prompt-len", type=NON_NEGATIVE, default=0,
                    help="random input-id prompts of this many tokens (0: the shipped eval prompts' text)")
    bs.add_argument("--shared-prefix", type=NON_NEGATIVE, default=0,
                    help="tokens of one random prefix shared by every prompt (with --prompt-len)")
    bs.add_argument("--long-prompt", type=NON_NEGATIVE, default=0,
                    help="send one prompt of this many tokens halfway through each level (0: none)")
    bs.add_argument("--acceptance", metavar="PROFILE",
                    help="SIMULATED acceptance on the cuda backend, as `draftline bench --acceptance` (with --prompt-len)")
    bs.add_argument("--modes", type=flags.listed(flags.choice("always", "auto", "off")), default="always,auto,off",
                    help="drafting modes to run: always, auto (the spec's policy), off")
    bs.add_argument("--max-model-len", type=NON_NEGATIVE, default=0,
                    help="override the spec's model.max_model_len (0: the spec's): static slots are sized by it")
    bs.add_argument("--no-prefix-caching", action="store_true", help="serve with server.enable_prefix_caching off")
    bs.add_argument("--num-kv-blocks", type=NON_NEGATIVE, default=0,
                    help="override server.num_kv_blocks, the KV blocks the running requests share (0: the spec's)")
    bs.add_argument("--gpu-memory-utilization", type=UTILIZATION, default=0.0,
                    help="override server.gpu_memory_utilization: page the KV in a pool of what fits in this share "
                         "of the GPU's memory (0: the spec's)")
    bs.add_argument("--max-num-batched-tokens", type=NON_NEGATIVE, default=0,
                    help="override server.max_num_batched_tokens, the prompt tokens a step prefills (0: the spec's)")
    bs.add_argument("--admission-wait", type=NON_NEGATIVE, default=0,
                    help="override server.admission_wait, the steps arrivals may wait to be prefilled together "
                         "(0: the spec's)")
    bs.add_argument("--max-prefill-stall", type=flags.real(0.0), default=None,
                    help="override server.max_prefill_stall, the rounds' time a step's prefill may take while "
                         "others decode (0: no bound; default: the spec's, off unless it sets one)")
    bs.add_argument("--trace-rounds", default="",
                    help="write every collected round (rows, verify width, wall, device and host time) and prefill "
                         "to PATH.MODE.jsonl, with a record where each concurrency level starts")
    bs.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bs.add_argument("--verbose", action="store_true", help="also log every request")
    bs.set_defaults(func=cmd_bench_serve)
