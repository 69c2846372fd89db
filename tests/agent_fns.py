"""Users' agents for the tests (lit_ess.envs.agent): plain HTTP through urllib, as an agent that knows only
an OpenAI-compatible base URL would post. Each answers the arithmetic question, is asked again, answers
again; the reward is the last answer's exact match."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


ANSWERS: dict[str, list[dict]] = {}     # every answer, by the episode's base URL (for the tests' checks)


class HTTPFailure(RuntimeError):
    pass


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as e:
        raise HTTPFailure(f"HTTP {e.code}: {json.load(e)['error']['message']}") from None
    ANSWERS.setdefault(url.rsplit("/v1/", 1)[0], []).append(answer)
    return answer


def two_completions(base_url: str, example) -> float:
    first = post(base_url + "/completions", {"model": "policy", "prompt": example.prompt, "max_tokens": 8})
    prompt = example.prompt + first["choices"][0]["text"] + "\nagain " + example.prompt
    second = post(base_url + "/completions", {"model": "policy", "prompt": prompt, "max_tokens": 8})
    return float(second["choices"][0]["text"].strip() == example.answer)


def two_chats(base_url: str, example) -> float:
    messages = [{"role": "user", "content": example.prompt}]
    first = post(base_url + "/chat/completions", {"model": "policy", "messages": messages, "logprobs": True})
    messages += [first["choices"][0]["message"], {"role": "user", "content": "again " + example.prompt}]
    second = post(base_url + "/chat/completions", {"model": "policy", "messages": messages})
    return float(second["choices"][0]["message"]["content"].strip() == example.answer)


def raises_before_calling_on_odd_sums(base_url: str, example) -> float:
    """two_completions, except that it raises before any call when the answer is odd: episodes with no
    policy token at all."""
    if int(example.answer) % 2:
        raise ValueError("odd")
    return two_completions(base_url, example)
