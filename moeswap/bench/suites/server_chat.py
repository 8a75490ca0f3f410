"""``--suite server --chat-turns N``: one multi-turn chat, its first message a long text, sent
to `moeswap serve` and to llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, the
``llama-cpp-python[server]`` extra) on 127.0.0.1: per turn, the seconds the reply took, the
prompt tokens and the cached tokens: what the server reports (``usage.prompt_tokens_details``),
or for llama-cpp-python's server, which reports none, its log's "Llama.generate: N
prefix-match hit" line for that request. What a multi-turn client sees of prefix reuse.

    moeswap bench -o DIR --suite server --chat-turns 3 --model M.gguf --ctx 4096 \\
        --max-tokens 32 --first-tokens 1500 --threads 2 [--engines moeswap,llama-cpp-python]
        [--serve-args "--chat-template gemma"] [--peer-args "--chat_format gemma"]

Each engine runs in its own worker (moeswap.bench.worker): it starts its server (one
sequence: `moeswap serve --max-batch 1`, llama-cpp-python's single context; --ctx positions,
--threads threads), sends one warm-up chat ("hi", one token) so turn 1 pays no first-request
set-up, then the turns — greedy, --max-tokens reply tokens each, every reply appended to the
conversation — and stops the server. The first message is functions from the bundled held-out
Python stdlib text (moeswap/bench/inputs/long_conversation.json) up to --first-tokens tokens
of the model's tokenizer, then a question; later turns ask short questions about it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from moeswap.errors import MoeswapError

ENGINES = ("moeswap", "llama-cpp-python")
QUESTIONS = ("Which of these functions read from a file?", "Which one would you test first, "
             "and how?", "Name one that could be shorter.", "Which ones return None?")
FIRST_QUESTION = "Above are Python functions. Say in one line each what they do."
SET_HERE = ("--port", "--ctx", "-c", "--max-batch", "--threads", "-t")


def add_arguments(p) -> None:
    p.add_argument("--chat-turns", type=int, default=0, metavar="N",
                   help="instead of the load test: a chat of N turns against moeswap serve and "
                        "llama-cpp-python's server, time and cached tokens per turn (0: off)")
    p.add_argument("--first-tokens", type=int, default=1500, metavar="N",
                   help="--chat-turns: the first message's length in the model's tokens (1500)")
    p.add_argument("--threads", type=int, default=None,
                   help="--chat-turns: CPU threads for both servers (default: theirs)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"--chat-turns: which servers, comma-separated ({','.join(ENGINES)})")
    p.add_argument("--peer-args", default="", metavar="FLAGS",
                   help="--chat-turns: more `python -m llama_cpp.server` flags, e.g. "
                        "\"--chat_format gemma\" beside --serve-args \"--chat-template gemma\"")


def first_message(model: str, n_tokens: int) -> str:
    """Whole functions from the bundled text until ``n_tokens`` tokens, then the question."""
    from moeswap.tokenizer import load_tokenizer

    text = resources.files("moeswap.bench") / "inputs" / "long_conversation.json"
    turns = json.loads(text.read_text("utf-8"))["turns"]
    code = [t["content"].split("\n\n", 1)[-1] for t in turns if t["role"] == "assistant"]
    tokenizer = load_tokenizer(model)
    pieces = []
    for function in code:
        pieces.append(function)
        if len(tokenizer.encode("\n".join(pieces))) >= n_tokens:
            return "\n".join(pieces) + "\n" + FIRST_QUESTION
    raise MoeswapError(f"--first-tokens {n_tokens}: the bundled text has fewer tokens; ask "
                       "for fewer")


def server_command(engine: str, model: str, port: int, ctx: int, threads: int | None,
                   flags: list[str]) -> list[str]:
    """``flags``: more of that server's own flags (--serve-args or --peer-args)."""
    if engine == "moeswap":
        return [sys.executable, "-m", "moeswap", "serve", model, "--port", str(port), "--ctx",
                str(ctx), "--max-batch", "1", *(["--threads", str(threads)] if threads else []),
                *flags]
    return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(ctx),
            *(["--n_threads", str(threads), "--n_threads_batch", str(threads)] if threads else []),
            *flags]


def wait_for_models(server: subprocess.Popen, url: str, log: Path, seconds: float = 600) -> str:
    """The served model's id, once GET /v1/models answers (both servers have it)."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        if server.poll() is not None:
            raise MoeswapError(f"the server exited {server.returncode}: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        try:
            r = httpx.get(url + "/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise MoeswapError(f"the server did not answer /v1/models within {seconds:.0f} s")
        time.sleep(0.2)


def logged_prefix_hit(log: Path, start: int) -> int | None:
    """llama-cpp-python's "Llama.generate: N prefix-match hit" for the request logged after
    byte ``start``: the prompt tokens it kept in its context (None: no such line)."""
    with open(log, "rb") as f:
        f.seek(start)
        hits = re.findall(rb"Llama\.generate: (\d+) prefix-match hit", f.read())
    return int(hits[-1]) if hits else None


def chat_turns(engine: str, model: str, ctx: int, threads: int | None, first: str, turns: int,
               max_tokens: int, flags: list[str], log_dir: str) -> dict:
    """One engine's chat, in a worker: start its server, warm it up, send the turns, stop it."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = Path(log_dir) / f"{engine}.log"
    with open(log, "w") as out:
        server = subprocess.Popen(server_command(engine, model, port, ctx, threads, flags),
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        served = wait_for_models(server, url, log)
        client = httpx.Client(base_url=url, timeout=None)

        def ask(messages: list[dict], n: int) -> tuple[dict, float]:
            logged = log.stat().st_size
            started = time.perf_counter()
            r = client.post("/v1/chat/completions", json={
                "model": served, "messages": messages, "max_tokens": n, "temperature": 0,
                "seed": 0})
            seconds = time.perf_counter() - started
            if r.status_code != 200:
                raise MoeswapError(f"{engine}: HTTP {r.status_code}: {r.text[:500]}")
            reply = r.json()
            details = reply["usage"].get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is None:
                details = {"cached_tokens": logged_prefix_hit(log, logged)}
            reply["usage"]["prompt_tokens_details"] = details
            return reply, seconds

        ask([{"role": "user", "content": "hi"}], 1)  # warm-up: not timed
        messages, rows = [], []
        for turn in range(turns):
            messages.append({"role": "user",
                             "content": first if turn == 0 else QUESTIONS[(turn - 1) % len(QUESTIONS)]})
            reply, seconds = ask(messages, max_tokens)
            usage = reply["usage"]
            rows.append({"turn": turn + 1, "seconds": seconds,
                         "prompt_tokens": usage["prompt_tokens"],
                         "completion_tokens": usage["completion_tokens"],
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                             "cached_tokens")})
            messages.append({"role": "assistant",
                             "content": reply["choices"][0]["message"]["content"] or ""})
        client.close()
    finally:
        server.terminate()
        server.wait(60)
    return {"turns": rows}


def run(args, out_dir: Path) -> tuple[dict, str]:
    import shlex

    from moeswap.bench.worker import run_call

    model = args.model or args.default_model
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise MoeswapError(f"--engines: {', '.join(unknown) or 'none given'}; choose from "
                           f"{', '.join(ENGINES)}")
    serve_flags, peer_flags = shlex.split(args.serve_args), shlex.split(args.peer_args)
    taken = [w for w in serve_flags if w.split("=", 1)[0] in SET_HERE]
    if taken:
        raise MoeswapError(f"--serve-args may not set {', '.join(taken)}: the suite sets it "
                           "(--ctx and --threads are the suite's own)")
    args.ctx = args.ctx or 4096
    first = first_message(model, args.first_tokens)
    logs = out_dir / "runs"
    logs.mkdir(parents=True, exist_ok=True)
    results = {}
    for engine in engines:
        r = run_call("moeswap.bench.suites.server_chat:chat_turns", dict(
            engine=engine, model=model, ctx=args.ctx, threads=args.threads, first=first,
            turns=args.chat_turns, max_tokens=args.max_tokens,
            flags=serve_flags if engine == "moeswap" else peer_flags,
            log_dir=str(logs)), logs, engine, args.timeout)
        if r.pop("status") != "ok":
            raise MoeswapError(f"{engine}: {r['failure']}: {r['error']} (log: {logs / engine}.log)")
        turns = r["turns"]
        later = [t["seconds"] for t in turns[1:]]
        results[engine] = {"turns": turns, "later_speedup":
                           turns[0]["seconds"] / (sum(later) / len(later)) if later else None}
    body = {"mode": "chat turns", "model": model, "ctx": args.ctx, "threads": args.threads,
            "max_tokens": args.max_tokens, "first_tokens": args.first_tokens,
            "moeswap_flags": ["--max-batch", "1", *serve_flags], "peer_flags": peer_flags,
            "engines": results}
    return body, report_text(body)


def report_text(body: dict) -> str:
    engines = body["engines"]
    lines = [f"{Path(body['model']).name}: a {len(next(iter(engines.values()))['turns'])}-turn "
             f"chat, first message {body['first_tokens']}+ tokens, {body['max_tokens']} reply "
             f"tokens per turn, greedy, --ctx {body['ctx']}, threads "
             f"{body['threads'] or 'default'}; moeswap serve {' '.join(body['moeswap_flags'])}"
             + (f"; llama_cpp.server {' '.join(body['peer_flags'])}" if body["peer_flags"] else ""),
             "", "| turn | " + " | ".join(f"{e} prompt tokens | {e} cached | {e} s"
                                         for e in engines) + " |",
             "|---" * (1 + 3 * len(engines)) + "|"]
    for i, _ in enumerate(next(iter(engines.values()))["turns"]):
        cells = []
        for r in engines.values():
            t = r["turns"][i]
            cached = "not reported" if t["cached_tokens"] is None else str(t["cached_tokens"])
            cells += [str(t["prompt_tokens"]), cached, f"{t['seconds']:.2f}"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    if "llama-cpp-python" in engines:
        lines.append("llama-cpp-python's cached tokens: its log's \"Llama.generate: N prefix-match "
                     "hit\" (its usage has no prompt_tokens_details)")
    for engine, r in engines.items():
        if r["later_speedup"] is not None:
            lines.append(f"{engine}: later turns {r['later_speedup']:.1f}x faster than turn 1")
    return "\n".join(lines)
