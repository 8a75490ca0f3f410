"""`moeswap chat` driven with scripted stdin on a tiny Mixtral-layout GGUF with a chat template:
replies equal greedy generation over the re-rendered conversation (so the kept KV cache is
right), /reset, /stats, the context limit with both policies, and a turn stopped part-way."""

from __future__ import annotations

import io

import pytest
import torch
from gguf import GGUFValueType as T

import moeswap
from moeswap.chat import HELP, ChatOptions, ChatSession
from moeswap.cli import main
from moeswap.context_window import fit_context
from moeswap.sampling import GREEDY

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}a{% endif %}")
N = 5


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from gguf_builders import mixtral

    spec = mixtral()
    spec.kv["tokenizer.chat_template"] = (TEMPLATE, T.STRING)
    return spec.write(tmp_path_factory.mktemp("chat") / "tiny.gguf")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One kernel thread (ggml's spinning threads crawl on a busy machine); torch's thread
    count is process-wide, so it is restored."""
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def runtime(tiny_path):
    return moeswap.load(tiny_path, threads=1, tokenizer_cache_dir=tiny_path.parent / "cache")


def turn_ids(runtime, messages, ctx=4096, policy="error"):
    """The prompt ids of one turn over the whole conversation."""
    ids = runtime.chat_prompt_ids(messages)
    keep = 1
    if messages[0]["role"] == "system":
        keep = len(runtime.chat_prompt_ids(messages[:1], add_generation_prompt=False))
    return fit_context(ids, ctx, max_tokens=N, policy=policy, keep_prefix=keep)


def reply(runtime, messages, ctx=4096, policy="error"):
    """The greedy reply of one turn over the whole conversation, from a fresh cache."""
    ids = turn_ids(runtime, messages, ctx, policy)
    tokens = list(runtime.generate(ids, N, temperature=0.0))
    stream = runtime.tokenizer.stream(ids)
    return "".join(stream.push(t) for t in tokens)


def printed(runtime, messages, ctx=4096, policy="error") -> str:
    """What the turn prints: its reply, marked when -n cut it off (N tokens, no stop token)."""
    ids = turn_ids(runtime, messages, ctx, policy)
    cut = len(list(runtime.generate(ids, N + 1, temperature=0.0))) > N
    return reply(runtime, messages, ctx, policy) + (f" [cut off at -n {N} tokens]" if cut else "")


def chat(tiny_path, monkeypatch, capsys, script: str, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", str(tiny_path), "--temp", "0", "-n", str(N), "--threads", "1", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_turns_reset_and_stats(tiny_path, runtime, monkeypatch, capsys):
    code, out, _ = chat(tiny_path, monkeypatch, capsys,
                        "bcd\n\nefg\n/stats\n/reset\nbcd\n/nope\n", "--system", "hh")
    assert code == 0
    first = [{"role": "system", "content": "hh"}, {"role": "user", "content": "bcd"}]
    r1 = reply(runtime, first)
    second = first + [{"role": "assistant", "content": r1}, {"role": "user", "content": "efg"}]
    lines = out.split("\n")
    assert lines[:3] == [HELP, printed(runtime, first), printed(runtime, second)]
    assert lines[3].startswith("prompt: ") and "tokens/s" in lines[3]
    assert lines[4].startswith("context: ") and lines[4].endswith("MiB")
    assert lines[5:] == ["(conversation reset)", printed(runtime, first),
                         "unknown command /nope; " + HELP, ""]


def test_the_kv_cache_is_kept_between_turns(runtime):
    session = ChatSession(runtime, ChatOptions(max_tokens=N), GREEDY)
    sink = io.StringIO()
    session.turn("bcd", sink)
    first_prompt = session.stats.prompt_tokens
    in_cache = len(session.cached)
    session.turn("efg", sink)
    full = len(runtime.chat_prompt_ids(session.messages[:-1]))
    assert session.stats.prompt_tokens == first_prompt + full - in_cache  # only the new part



class FailingModel:
    """The real model, whose forward number ``fail_at`` raises ``error`` (0: none does)."""

    def __init__(self, model, error: BaseException, fail_at: int):
        self.model, self.error, self.fail_at, self.calls = model, error, fail_at, 0

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.model.forward(tokens, caches, last_only)


class SeenLogits:
    """A sampler that keeps the logits of every pick."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def next_token(self, logits, history):
        self.logits.append(logits.clone())
        return self.sampler.next_token(logits, history)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("the store failed")],
                         ids=["ctrl-c", "error"])
@pytest.mark.parametrize("fail_at", [2, 5], ids=["2nd-prefill-chunk", "1st-decode"])
def test_a_turn_stopped_part_way_keeps_the_cache_and_its_ids_in_step(runtime, monkeypatch,
                                                                     error, fail_at):
    """The first prompt (8 tokens) goes in 2 per forward; forward ``fail_at`` raises. The cache
    keeps the forwards before it and the session knows which ids those are, so the next turn
    picks exactly the tokens, from exactly the logits, of a fresh session over the same
    conversation."""
    resident = runtime.model
    failing = FailingModel(resident, error, fail_at)
    monkeypatch.setattr(runtime, "model", failing)
    options = ChatOptions(max_tokens=N, step_tokens=2)
    session = ChatSession(runtime, options, GREEDY)
    first = runtime.chat_prompt_ids([{"role": "user", "content": "abcab"}])
    assert len(first) == 8
    out = io.StringIO()
    if isinstance(error, KeyboardInterrupt):
        session.turn("abcab", out)  # Ctrl-C stops the reply; the session goes on
        assert out.getvalue().endswith(" [interrupted]\n")
    else:
        with pytest.raises(RuntimeError, match="the store failed"):
            session.turn("abcab", out)
    held = 2 * (fail_at - 1) if fail_at <= 4 else len(first)  # forwards that finished
    assert session.cache.length == len(session.cached) == held
    assert session.cached == first[:held]

    failing.fail_at = 0
    history = list(session.messages)
    session.sampler = SeenLogits(session.sampler)
    resumed = io.StringIO()
    session.turn("bca", resumed)
    monkeypatch.setattr(runtime, "model", resident)
    fresh = ChatSession(runtime, options, GREEDY)
    fresh.messages = history
    fresh.sampler = SeenLogits(fresh.sampler)
    expected = io.StringIO()
    fresh.turn("bca", expected)
    assert resumed.getvalue() == expected.getvalue()
    assert session.cached == fresh.cached and session.cache.length == len(fresh.cached)
    assert len(session.sampler.logits) == len(fresh.sampler.logits) > 0
    for seen, want in zip(session.sampler.logits, fresh.sampler.logits):
        assert torch.equal(seen, want)

def test_context_overflow_is_refused_and_the_session_goes_on(tiny_path, runtime, monkeypatch, capsys):
    code, out, _ = chat(tiny_path, monkeypatch, capsys, "b" * 40 + "\nbcd\n", "--ctx", "16")
    assert code == 0
    lines = out.split("\n")
    assert lines[1].startswith("error: the prompt is ") and "--ctx-policy keep-recent" in lines[1]
    assert lines[2] == printed(runtime, [{"role": "user", "content": "bcd"}], ctx=16)


def test_keep_recent_policy_cuts_the_middle(tiny_path, runtime, monkeypatch, capsys):
    long = "bcdefg" * 6
    code, out, _ = chat(tiny_path, monkeypatch, capsys, long + "\n", "--ctx", "24",
                        "--ctx-policy", "keep-recent", "--system", "hh")
    assert code == 0
    messages = [{"role": "system", "content": "hh"}, {"role": "user", "content": long}]
    assert out.split("\n")[1] == printed(runtime, messages, ctx=24, policy="keep-recent")


def test_a_model_without_a_template_chats_on_the_plain_one_or_the_one_given(tmp_path, monkeypatch,
                                                                           capsys):
    from gguf_builders import mixtral

    from moeswap.template_library import BUILT_IN

    path = mixtral().write(tmp_path / "plain.gguf")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(path), "--temp", "0", "-n", "3"]) == 0
    out, err = capsys.readouterr()
    assert "has no chat template: chat uses the plain one" in err and "--chat-template" in err
    assert out.split("\n")[1]  # a reply
    template = tmp_path / "t.jinja"
    template.write_text(BUILT_IN["chatml"])
    for given in ("chatml", str(template)):
        monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
        assert main(["chat", str(path), "--temp", "0", "-n", "3", "--chat-template", given]) == 0
        assert "no chat template" not in capsys.readouterr().err
    assert main(["chat", str(path), "--chat-template", "nope"]) == 2
    assert "--chat-template nope: neither a file nor a built-in" in capsys.readouterr().err
