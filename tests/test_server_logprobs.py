"""logprobs / top_logprobs on chat and completions (issue 24, part), through the official
client against a live server: the model's own log-probabilities (before sampling's filters),
whole and streamed, in OpenAI's two shapes."""

from __future__ import annotations

import pytest
import torch

from test_server import MODEL, TEMPLATE, load, write_model  # noqa: F401
from test_server_live import live_server


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return load(write_model(tmp_path_factory.mktemp("logprobs"), TEMPLATE))


def expected(runtime, prompt_ids, tokens, top):
    """Per generated token: (its log-probability, the top ids) from a plain forward."""
    logits = runtime.forward_logits(torch.tensor(prompt_ids + tokens))  # [T, V]
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1].double(), dim=-1)  # [n, V]
    return [(float(row[t]), torch.topk(row, top).indices.tolist()) for row, t in zip(logp, tokens)]


def test_chat_and_completion_logprobs_are_the_models(runtime):
    openai = pytest.importorskip("openai", reason="the official client is what is being checked")
    messages = [{"role": "user", "content": "bcd"}]
    prompt_ids = runtime.chat_prompt_ids(messages)
    with live_server(runtime) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=3)
        content = chat.choices[0].logprobs.content
        tokens = list(runtime.generate(prompt_ids, 4, temperature=0.0))
        assert len(content) == len(tokens) == 4
        for entry, (logprob, top), token in zip(content, expected(runtime, prompt_ids, tokens, 3),
                                                 tokens):
            assert entry.logprob == pytest.approx(logprob, abs=1e-4)
            assert entry.token == runtime.tokenizer.decode([token], skip_special=False)
            assert [t.token for t in entry.top_logprobs] == \
                [runtime.tokenizer.decode([t], skip_special=False) for t in top]
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best
        assert "".join(e.token for e in content) == chat.choices[0].message.content

        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                  temperature=0, logprobs=True, stream=True)
        entries = [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                   for e in chunk.choices[0].logprobs.content]
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])
        assert all(e.top_logprobs == [] for e in entries)  # top_logprobs not asked for

        completion = client.completions.create(model=MODEL, prompt="abcab", max_tokens=3,
                                               temperature=0, logprobs=2)
        lp = completion.choices[0].logprobs
        ids = runtime.encode("abcab")
        tokens = list(runtime.generate(ids, 3, temperature=0.0))
        assert lp.token_logprobs == pytest.approx([e for e, _ in expected(runtime, ids, tokens, 2)],
                                                  abs=1e-4)
        assert [len(t) for t in lp.top_logprobs] == [2, 2, 2]
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        plain = client.completions.create(model=MODEL, prompt="abcab", max_tokens=3, temperature=0)
        assert plain.choices[0].logprobs is None
