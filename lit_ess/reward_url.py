"""A remote reward by URL (OpenRLHF's `--reward.remote_url`): `data.reward: http://host:port/score`.

One POST per phase (or validation batch) with a JSON body of lists, one item per completion:

    {"prompts": [...], "completions": [...], "answers": [...], "<column>": [...], ...}

answered with `{"rewards": [float, ...]}` (or the bare list), one number per completion. The request
may take `data.reward_limits.timeout` seconds per completion of the batch. A refused or failed request, a timeout,
an answer that is not JSON or not one finite number per completion scores those completions 0 and is
counted in rollout/reward_errors (lit_ess.rewards.RewardScorer), like any failing reward.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class RemoteReward:
    """A batched reward that posts the batch to `url`; `timeout` is seconds per completion (the scorer
    sets it from data.reward_limits.timeout)."""

    batched = True

    def __init__(self, url: str, timeout: float = 5.0):
        self.url, self.timeout = url, timeout

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str], **columns) -> list:
        body = json.dumps({"prompts": prompts, "completions": completions, "answers": answers, **columns},
                          default=str).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout * max(len(completions), 1)) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url} answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            raise RuntimeError(f"{self.url} did not answer: {getattr(e, 'reason', e)}") from None
        except json.JSONDecodeError:
            raise RuntimeError(f"{self.url} answered with something that is not JSON") from None
        return answer["rewards"] if isinstance(answer, dict) and "rewards" in answer else answer


def is_url(name: str) -> bool:
    return name.startswith(("http://", "https://"))
