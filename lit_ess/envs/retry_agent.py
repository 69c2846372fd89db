"""An agent written as users write theirs: plain OpenAI client code against a base URL (configs/demo_agent.yaml).

The retry-with-feedback task of RetryArithmetic (arithmetic.py) played through the OpenAI completions
API: the policy answers; a wrong answer is told so and the question asked again, up to `MAX_TRIES`
answers; a right answer earns 1 / tries. Each request only appends to the previous one (the prompt so
far + the reply as returned + the feedback), so lit-ess trains the token sequence the policy sampled:

    37+85=  121<eos>  wrong\\n37+85=  122<eos>                reward 1/2, 2 calls

Copy it, change the conversation and the reward, and name yours in the config:
`env: {env: {class_path: lit_ess.envs.Agent, init_args: {function: mypackage.mymodule:my_agent}}}`.
"""
from __future__ import annotations

from openai import OpenAI             # a dependency of vLLM: there wherever lit-ess's vLLM engines are

MAX_TRIES = 3


def retry_arithmetic(base_url: str, example) -> float:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)   # a refused request is not retried
    prompt = example.prompt
    for tries in range(1, MAX_TRIES + 1):        # max_tokens: the run's sampling.max_new_tokens
        reply = client.completions.create(model="policy", prompt=prompt).choices[0].text
        if reply.strip() == example.answer.strip():
            return 1.0 / tries
        prompt += reply + "wrong\n" + example.prompt
    return 0.0
