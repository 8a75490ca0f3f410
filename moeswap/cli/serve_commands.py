"""`moeswap serve` (OpenAI-compatible HTTP server) and `moeswap chat` (terminal chat)."""

from __future__ import annotations

from moeswap.cli.common_args import (add_force_argument, add_model_argument,
                                     add_threads_argument, default_ctx, warn_beyond_training)
from moeswap.cli.load_report import load_progress, memory_summary
from moeswap.cli.offload_args import (add_exact_tiers_argument, add_mmap_argument,
                                      add_kv_type_argument,
                                      add_offload_arguments,
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
    add_exact_tiers_argument(p)
    add_mmap_argument(p)
    add_offload_arguments(p)
    add_force_argument(p)
    p.add_argument("--plan", choices=["auto", "off"], default=None,
                   help="auto: budgets from the planner for this machine's free RAM and GPU and "
                        "for the KV caches and steps asked for, printed first (--host-mem / "
                        "--device-mem given win); off: only the flags' budgets (default: auto "
                        "unless --host-mem is given, or the model is a folder; docs/PLANNER.md)")


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
    p.add_argument("--log-level", choices=["warning", "info", "debug"], default="info",
                   help="uvicorn's log: info lists each request but the polling of /health, "
                        "/metrics and the page's /v1/moeswap/experts, which debug adds (info)")
    p.set_defaults(handler=run_serve)

    c = subparsers.add_parser("chat", help="chat with a model in the terminal, streamed")
    _add_model_arguments(c, "positions of the whole conversation (default: 4096, or the "
                            "model's trained context when shorter)", required=False)
    c.add_argument("--system", default=None, help="a system prompt")
    c.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (512)")
    add_sampling_arguments(c)
    c.set_defaults(handler=run_chat)


def _load(args, charge, progress, recorder=None):
    """The runtime; its expert store's host budget pays ``charge`` (a moeswap.memory.HostCharge)
    under the budgets --plan chose (printed), and it chats with ``--chat-template`` or the
    model's own (said when it falls back). ``progress``: load_progress's (progress,
    verbose_log), which the plan's lines print above."""
    import sys

    import moeswap
    from moeswap.template_library import FALLBACK, template_source

    template = template_source(args.chat_template) if args.chat_template else None
    budgets = planned_budgets(args, charge, progress[0].console)
    settings = offload_settings(args, budgets, model_path=args.model,
                                say=lambda line: progress[0].console.print(line, markup=False))
    # force: cli.main validated the file (or was told --force) before the plan read it
    runtime = moeswap.load(args.model, threads=args.threads, replay_routing=args.replay_routing,
                           repack=not args.exact_tiers, force=True, recorder=recorder,
                           chat_template=template, verbose_log=progress[1],
                           **offload_load_options(settings, charge, args.threads, args.model,
                                                  args.mmap))
    if runtime.chat_template_fallback:
        print(f"moeswap: warning: {args.model} has no chat template: chat uses the {FALLBACK} "
              "one (role: text lines); give --chat-template FILE or chatml, llama3, gemma",
              file=sys.stderr)
    return runtime


def planned_budgets(args, charge, console) -> tuple[int | None, int] | None:
    """--plan auto's (host, device) budgets for ``charge``'s contexts, sequences and steps, its
    lines printed; None: the flags' own (--plan off, the default with --host-mem or a folder,
    which the planner cannot read)."""
    from pathlib import Path

    from moeswap.cli.run_commands import auto_budgets

    plan = args.plan or ("off" if args.host_mem is not None or Path(args.model).is_dir()
                         else "auto")
    if plan == "off":
        return None
    return auto_budgets(args, args.model, charge.context_tokens, console, charge.step_tokens,
                        charge.sequences)


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


def run_serve(args) -> int:
    """Binds the port, answers /health 503 while the model loads on a thread, then serves."""
    import sys
    from pathlib import Path

    import uvicorn

    import moeswap
    from moeswap.memory import parse_size
    from moeswap.server.access_log import quiet_polling
    from moeswap.server.activity import ExpertActivity
    from moeswap.server.app import ServerOptions, create_app
    from moeswap.server.batching import BatchOptions
    from moeswap.server.budget import batch_charge
    from moeswap.server.loading import LoadingGate

    args.model = args.model or str(moeswap.DEFAULT_MODEL)
    args.ctx = args.ctx or default_ctx(args.model)
    listening = listen(args.host, args.port)  # a busy port is said now, not after loading
    page = f"http://{args.host}:{listening.getsockname()[1]}/"
    batch = BatchOptions(max_batch=args.max_batch, queue_size=args.queue, ctx=args.ctx,
                         step_tokens=args.step_tokens)
    options = ServerOptions(model_name=Path(args.model).stem or Path(args.model).name, batch=batch,
                            aliases=tuple(args.alias), strict_model=args.strict_model,
                            ctx_policy=args.ctx_policy,
                            api_key=args.api_key, max_body=parse_size(args.max_body),
                            bind_host=args.host, allow_hosts=tuple(args.allow_host))

    def load():
        charge = batch_charge(batch, args.kv_type)
        activity = ExpertActivity()  # the web page's expert grid: which experts each step used
        with load_progress(args.model, _stderr()) as progress:
            runtime = _load(args, charge, progress, activity)
        warn_beyond_training(runtime, args.ctx)
        for line in memory_summary(runtime, args.model, charge) + [f"page at {page}"]:
            print(f"moeswap serve: {line}", file=sys.stderr)
        return create_app(runtime, options, activity)

    print(f"moeswap serve: loading {args.model}; GET /health answers 503 until it is ready, "
          f"at {page}health", file=sys.stderr)
    gate = LoadingGate(load, on_failure=lambda: setattr(server, "should_exit", True))
    server = uvicorn.Server(uvicorn.Config(gate, log_level=args.log_level))
    quiet_polling()  # after uvicorn.Config, which (re)configures its loggers
    server.run(sockets=[listening])
    if gate.error is not None:  # the load failed: said as any command's error
        raise gate.error
    return 0


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def run_chat(args) -> int:
    import sys

    import moeswap
    from moeswap.chat import ChatOptions, ChatSession
    from moeswap.memory import HostCharge

    sampling = sampling_params(args)
    args.model = args.model or str(moeswap.DEFAULT_MODEL)
    args.ctx = args.ctx or default_ctx(args.model)
    options = ChatOptions(ctx=args.ctx, ctx_policy=args.ctx_policy, max_tokens=args.n_predict,
                          system=args.system, step_tokens=args.step_tokens)
    # a turn's new tokens may fill the context; they are fed a chunk at a time
    charge = HostCharge.for_sequence(args.ctx, min(args.step_tokens, args.ctx), args.kv_type)
    with load_progress(args.model, _stderr()) as progress:
        runtime = _load(args, charge, progress)
    warn_beyond_training(runtime, args.ctx)
    for line in memory_summary(runtime, args.model, charge):
        print(f"moeswap chat: {line}", file=sys.stderr)
    session = ChatSession(runtime, options, sampling)
    session.run(sys.stdin, sys.stdout)
    return 0
