"""In-flight weight updates, the bookkeeping: each token's behaviour version read from the server's
spans, carried into the batch ([B, T]), its lag, the staleness bound on a row's oldest token, and the
loss taking each token's own pi_b. (The real server: tests/test_server.py.)"""
import math

import pytest
import torch

from lit_ess.datamodules import RolloutDataModule
from lit_ess.engines import VLLMServerConfig
from lit_ess.engines.vllm_server import span_versions
from lit_ess.objectives import P3O
from lit_ess.rollout import RolloutBuffer
from lit_ess.batch import RolloutBatch, Row, collate
from lit_ess.datamodules.settings import Schedule

LN2 = math.log(2)


def test_spans_give_each_tokens_version():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert span_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert span_versions([{"version": "7", "start": 0, "end": 3}], 3) == [7, 7, 7]
    assert span_versions([], 0) == []


@pytest.mark.parametrize("spans, n, says", [
    ([{"version": "3", "start": 0, "end": 2}], 3, "leave token 2 of 3"),                      # a gap
    ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 1, "end": 3}], 3, "not optimizer steps"),
    ([{"version": "default", "start": 0, "end": 1}], 1, "relabelled"),                       # not a step
    ([{"version": "3", "start": 0, "end": 4}], 3, "over 3 tokens"), (None, 2, "leave token 0"),
])
def test_spans_that_do_not_tile_the_completion_are_one_line(spans, n, says):
    with pytest.raises(ValueError, match=says) as e:
        span_versions(spans, n)
    assert "\n" not in str(e.value)


def two_version_rows() -> list[Row]:
    """Row 0: sampled by version 3 for two tokens, then by 4 (the weights changed in flight); row 1: by 4."""
    return [Row(prompt=[1, 2], completion=[5, 6, 7, 8], logprobs=[math.log(0.25), math.log(0.25), math.log(0.5),
                                                                  math.log(0.5)],
                advantage=1.0, reward=1.0, version=3, prompt_id=0, prompt_text="p", completion_text="c",
                token_versions=[3, 3, 4, 4]),
            Row(prompt=[1], completion=[9, 9], logprobs=[-1.0, -1.0], advantage=-1.0, reward=0.0, version=4,
                prompt_id=1, prompt_text="q", completion_text="d")]


def test_a_row_sampled_by_two_versions_has_each_tokens_lag():
    b = collate(two_version_rows(), pad_id=0, max_staleness=2)
    assert b.token_versions.tolist() == [[0, 0, 3, 3, 4, 4], [0, 4, 4, 0, 0, 0]]      # [B, T], 0 off the completion
    assert b.versions.tolist() == [3, 4]                                                 # a row's: its oldest token's
    assert b.token_lags(5).tolist() == [2, 2, 1, 1, 1, 1]                               # [N], row by row
    assert (5 - b.versions).tolist() == [2, 1]                                           # a row's lag: its largest
    part = b.select([0])
    assert part.token_versions.tolist() == [[0, 0, 3, 3, 4, 4]] and part.token_lags(4).tolist() == [1, 1, 0, 0]
    again = RolloutBatch.from_state(b.to_state())
    assert torch.equal(again.token_versions, b.token_versions)


def test_the_staleness_bound_holds_for_the_oldest_token():
    """S = 1 at step 5: row 0's last tokens are 1 step old, its first two 2: the row is dropped."""
    buf = RolloutBuffer(steps_per_rollout=1, max_staleness=1)
    buf.put(0, [collate(two_version_rows(), pad_id=0, max_staleness=1)])
    b = buf.take(step=5)
    assert b.rows == 1 and b.versions.tolist() == [4] and buf.stale_dropped == 1


def test_a_row_refuses_a_token_older_than_its_version():
    with pytest.raises(ValueError, match="staleness bound"):
        Row(prompt=[1], completion=[5, 6], logprobs=[0.0, 0.0], advantage=0.0, reward=0.0, version=4, prompt_id=0,
            prompt_text="", completion_text="", token_versions=[3, 4])
    with pytest.raises(ValueError, match="3 token versions for 2 tokens"):
        Row(prompt=[1], completion=[5, 6], logprobs=[0.0, 0.0], advantage=0.0, reward=0.0, version=4, prompt_id=0,
            prompt_text="", completion_text="", token_versions=[4, 4, 4])


def test_a_batch_built_without_token_versions_gets_its_rows():
    """A checkpoint written before per-token versions (or a batch built by hand): each token has its row's."""
    state = collate(two_version_rows(), pad_id=0).to_state()
    del state["token_versions"]
    assert RolloutBatch.from_state(state).token_versions.tolist() == [[0, 0, 3, 3, 3, 3], [0, 4, 4, 0, 0, 0]]


def test_the_loss_takes_each_tokens_own_pi_b():
    """Row 0 of a mixed row, the policy at 0.5 on each token: rho = [2, 2, 1, 1] against each token's own
    pi_b (0.25 from version 3, 0.5 from version 4). P3O by hand: e_B = 6^2 / (4 * 10) = 0.9, w = 0.9;
    pg = -mean(0.9 * ln .5 * 1) = 0.9 ln 2; k3 = [ln 2 - 0.5] x 2 and 0 x 2, kl = (ln 2 - 0.5) / 2;
    loss = pg + 0.1 kl. (With the row's oldest pi_b on every token, rho would be [2, 2, 2, 2], e_B 1.)"""
    b = collate(two_version_rows()[:1], pad_id=0)
    lp = torch.where(b.completion_mask, torch.tensor(math.log(0.5)), torch.tensor(0.0)).double()
    out = P3O()(lp, b.behavior_logprobs.double(), b.advantages.double(), b.completion_mask)
    assert out.metrics["train/ess"].item() == pytest.approx(0.9, abs=1e-7)
    assert out.loss.item() == pytest.approx(0.9 * LN2 + 0.1 * (LN2 - 0.5) / 2, abs=1e-6)


def test_weight_update_is_checked_and_needs_async(tiny_model_dir):
    with pytest.raises(ValueError, match="weight_update='later'") as e:
        VLLMServerConfig(weight_update="later")
    assert "\n" not in str(e.value)
    assert VLLMServerConfig(weight_update="in_flight").updates_in_flight()
    assert not VLLMServerConfig().updates_in_flight()
    with pytest.raises(ValueError, match="mode: async") as e:
        RolloutDataModule(model_path=tiny_model_dir, schedule=Schedule(mode="sync"), engine=VLLMServerConfig(weight_update="in_flight"))
    assert "\n" not in str(e.value)
    RolloutDataModule(model_path=tiny_model_dir, schedule=Schedule(mode="async"), engine=VLLMServerConfig(weight_update="in_flight"))
