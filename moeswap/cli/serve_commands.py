"""`moeswap serve` (OpenAI-compatible HTTP server) and `moeswap chat` (terminal chat)."""

from __future__ import annotations

from moeswap.cli.common_args import (add_model_argument, add_threads_argument, default_ctx,
                                     warn_beyond_training)
from moeswap.cli.offload_args import (add_kv_type_argument, add_offload_arguments,
                                      add_step_tokens_argument,
                                      offload_load_options, offload_settings)
from moeswap.cli.sampling_args import add_sampling_arguments, sampling_params


def _add_model_arguments(p, ctx_help: str, step_scope: str = "", required: bool = True) -> None:
    from moeswap.context_window import POLICIES

    add_model_argument(p, "a .gguf file or a Hugging Face folder"
                          + ("" if required else " (default: the built-in model, docs/MODEL.md)"),
                       required)
    p.add_argument("-c", "--ctx", type=int, default=None, help=ctx_help)
    p.add_argument("--ctx-policy", choices=POLICIES, default="error",
                   help="when a prompt outgrows --ctx: refuse it (error), or keep the system "
                        "prompt and the most recent tokens (keep-recent) (error)")
    p.add_argument("--chat-template", metavar="FILE|NAME",
                   help="the chat template to render with, instead of the model's: a Jinja "
                        "file, or chatml, llama3, gemma or plain (default: the model's; plain "
                        "for a model without one)")
    add_threads_argument(p)
    add_step_tokens_argument(p, step_scope)
    add_kv_type_argument(p)
    add_offload_arguments(p)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model_arguments(p, "positions per request: prompt and reply (default: 4096, or the "
                            "model's trained context when shorter)",
                         ", all requests together", required=False)
    p.add_argument("-a", "--alias", action="append", default=[], metavar="NAME",
                   help="another name requests may give as `model` (repeatable), as a client "
                        "with a hard-coded model name needs; listed by GET /v1/models")
    p.add_argument("--strict-model", action="store_true",
                   help="refuse requests naming a model other than the file's name or an "
                        "--alias (default: any name is served, as llama-server does)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (8)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a batch slot; more get 429 (64)")
    # what a request may be, and who may send one (docs/SERVER.md, "Security")
    p.add_argument("--max-body", default="4MiB", metavar="SIZE",
                   help="largest request body; more gets 413 (4MiB)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable); "
                        "localhost names, IP addresses and --host are always answered")
    p.set_defaults(handler=run_serve)

    c = subparsers.add_parser("chat", help="chat with a model in the terminal, streamed")
    _add_model_arguments(c, "positions of the whole conversation (default: 4096, or the "
                            "model's trained context when shorter)")
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (512)")
    add_sampling_arguments(c)
    c.set_defaults(handler=run_chat)


def _load(args, charge, recorder=None):
    """The runtime; its expert store's host budget pays ``charge`` (a moeswap.memory.HostCharge),
    and it chats with ``--chat-template`` or the model's own (said when it falls back)."""
    import sys

    import moeswap
    from moeswap.template_library import FALLBACK, template_source

    template = template_source(args.chat_template) if args.chat_template else None
    runtime = moeswap.load(args.model, threads=args.threads, replay_routing=args.replay_routing,
                           recorder=recorder, chat_template=template,
                           **offload_load_options(offload_settings(args), charge, args.threads))
    if runtime.chat_template_fallback:
        print(f"moeswap: warning: {args.model} has no chat template: chat uses the {FALLBACK} "
              "one (role: text lines); give --chat-template FILE or chatml, llama3, gemma",
              file=sys.stderr)
    return runtime


def listen(host: str, port: int):
    """A socket bound to (host, port), before the model loads: a port in use is one line now."""
    import socket

    from moeswap.errors import MoeswapError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise MoeswapError(f"--host {host} --port {port}: cannot listen there "
                           f"({e.strerror or e}); give another --port, or stop what uses it")
    return sock


def start_summary(runtime, args, port: int) -> str:
    """One line at start: what the host budget holds and where the page is."""
    from moeswap.memory import format_size

    where = f"http://{args.host}:{port}/"
    stats = runtime.stats()
    if "tiers" not in stats:
        return f"moeswap serve: {args.model}: every weight in RAM (no --host-mem); page at {where}"
    host = stats["tiers"]["host"]
    experts = host["held_bytes"] - sum(stats[k] for k in ("shared_bytes", "kv_bytes",
                                                          "working_bytes"))
    device = stats["tiers"]["device"]
    return (f"moeswap serve: --host-mem {format_size(host['budget_bytes'])}: shared weights "
            f"{format_size(stats['shared_bytes'])}, KV cache {format_size(stats['kv_bytes'])}, "
            f"working memory {format_size(stats['working_bytes'])}, experts and staging "
            f"{format_size(experts)} ({host['slots']} host slots"
            + (f", {device['slots']} device slots" if device["slots"] else "")
            + f"); page at {where}")


def run_serve(args) -> int:
    import sys
    from pathlib import Path

    import uvicorn

    from moeswap.server.activity import ExpertActivity
    from moeswap.server.app import ServerOptions, create_app
    from moeswap.server.batching import BatchOptions
    from rich.console import Console

    import moeswap
    from moeswap.memory import parse_size
    from moeswap.server.budget import batch_charge

    args.model = args.model or str(moeswap.DEFAULT_MODEL)
    args.ctx = args.ctx or default_ctx(args.model)
    listening = listen(args.host, args.port)  # a busy port is said now, not after loading
    batch = BatchOptions(max_batch=args.max_batch, queue_size=args.queue, ctx=args.ctx,
                         step_tokens=args.step_tokens)
    options = ServerOptions(model_name=Path(args.model).stem or Path(args.model).name, batch=batch,
                            aliases=tuple(args.alias), strict_model=args.strict_model,
                            ctx_policy=args.ctx_policy,
                            api_key=args.api_key, max_body=parse_size(args.max_body),
                            bind_host=args.host, allow_hosts=tuple(args.allow_host))
    activity = ExpertActivity()  # the web page's expert grid: which experts each step used
    with Console(stderr=True).status(f"loading {args.model}"):  # big models take a while
        runtime = _load(args, batch_charge(batch, args.kv_type), activity)
    warn_beyond_training(runtime, args.ctx)
    print(start_summary(runtime, args, listening.getsockname()[1]), file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(create_app(runtime, options, activity),
                                           log_level="info"))
    server.run(sockets=[listening])
    return 0


def run_chat(args) -> int:
    import sys

    from rich.console import Console

    from moeswap.chat import ChatOptions, ChatSession
    from moeswap.memory import HostCharge

    sampling = sampling_params(args)
    args.ctx = args.ctx or default_ctx(args.model)
    options = ChatOptions(ctx=args.ctx, ctx_policy=args.ctx_policy, max_tokens=args.n_predict,
                          system=args.system, step_tokens=args.step_tokens)
    # a turn's new tokens may fill the context; they are fed a chunk at a time
    charge = HostCharge.for_sequence(args.ctx, min(args.step_tokens, args.ctx), args.kv_type)
    with Console(stderr=True).status(f"loading {args.model}"):  # big models take a while
        runtime = _load(args, charge)
    warn_beyond_training(runtime, args.ctx)
    session = ChatSession(runtime, options, sampling)
    session.run(sys.stdin, sys.stdout)
    return 0
