"""Non-finite state and length limits fail fast (issue 25): a NaN weight is named at start, a run whose
steps are all skipped stops, the hf engine never samples from NaN, and no checkpoint holds a NaN."""
import pytest
import torch

from e2e_utils import cli, nan_model_copy, rl_config, write_config

NAN_TENSOR = "model.layers.0.mlp.up_proj.weight"


def fault_line(res, code=1, prog="lit-ess"):
    """The single `prog: error:` line of a run stopped by a fault (no traceback)."""
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def _finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_skipped_steps_bound_counts_consecutive_ones():
    from lit_ess.health import NonFiniteError, SkippedSteps

    guard = SkippedSteps(3)
    for step, skipped in enumerate([True, True, False, True, True]):      # reset by a finite step
        guard.update(skipped, step, float("nan") if skipped else 1.0)
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps skipped at optimizer step 5 .*max_consecutive_skipped_steps=3"):
        guard.update(True, 5, float("nan"))
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="max_consecutive_skipped_steps must be an integer >= 1"):
            SkippedSteps(bad)


def test_first_nonfinite_names_the_first_bad_tensor():
    from lit_ess.health import first_nonfinite

    ok, nan, inf = torch.zeros(3), torch.tensor([0.0, float("nan")]), torch.tensor([float("-inf")])
    assert first_nonfinite([("a", ok), ("b", torch.arange(3))]) is None
    assert first_nonfinite([("a", ok), ("b", nan), ("c", inf)]) == "b (NaN)"
    assert first_nonfinite([("c", inf)]) == "c (inf)"


@pytest.fixture(scope="module")
def refused_at_start(tiny_model_dir, tmp_path_factory):
    """`lit-ess fit` runs that stop before their first rollout, in one Python process (e2e_utils.cli_each):
    a NaN weight in the policy's or the reference model's folder (its path is `bad`), and a prompt budget
    above vLLM's max_model_len (the 303-token prompt file)."""
    from e2e_utils import cli_each

    tmp = tmp_path_factory.mktemp("refused")
    bad = str(nan_model_copy(tiny_model_dir, tmp / "nan_model"))
    cfgs = {}
    for which in ("policy", "reference"):
        model = {"ref_model_path": bad, "objective": {"class_path": "lit_ess.objectives.P3O",
                                                      "init_args": {"ref_kl_coef": 0.1}}} if which == "reference" else {}
        cfgs[which] = rl_config(bad if which == "policy" else tiny_model_dir, tmp / which, engine="HFConfig", max_steps=3,
                                extra_model=model)
    source = {"class_path": "lit_ess.datamodules.HFPrompts", "init_args": {"path": _long_prompt_file(tmp)}}
    cfgs["vllm"] = rl_config(tiny_model_dir, tmp / "vllm", engine="VLLMConfig", max_steps=2, prompts=8, samples=2,
                             extra_data={"source": source, "max_prompt_tokens": 512})
    cfgs["vllm"]["data"]["init_args"]["engine"]["init_args"] = {"max_model_len": 64}
    cases = {k: (["fit", "--config", str(write_config(cfg, tmp / k / "c.yaml"))], tmp / k) for k, cfg in cfgs.items()}
    return cli_each(cases, timeout=300), bad


@pytest.mark.e2e
def test_a_nan_weight_is_named_at_start(refused_at_start):
    """One NaN in one weight of the model folder (the policy's, or the reference model's): one line naming
    the tensor, exit 1, before any rollout (main: a bare torch.multinomial traceback with the hf engine;
    a run that never ends with vLLM, every step skipped)."""
    runs, bad = refused_at_start
    for which in ("policy", "reference"):
        line = fault_line(runs[which])
        assert f"weight {NAN_TENSOR} (NaN) is not finite in" in line and bad in line, (which, line)
        assert ("reference model" in line) == (which == "reference"), (which, line)


@pytest.mark.e2e
def test_skipped_steps_stop_the_run_and_no_checkpoint_holds_a_nan(tiny_model_dir, tmp_path):
    """Every gradient NaN from step 2 on (finite weights; a skipped step does not move the step count, so
    max_steps is never reached): the run stops after max_consecutive_skipped_steps (default 10) with one line and exit 1
    (main: a run that never ends), its checkpoints (steps 1 and 2) hold
    finite weights only; a checkpoint with a NaN weight is named when resumed from."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=20, ckpt_every=1)
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.NaNGradients", "init_args": {"from_step": 2}})
    path = write_config(cfg, tmp_path / "c.yaml")
    res = cli(["fit", "--config", str(path)], timeout=120)
    line = fault_line(res)
    assert "10 consecutive steps skipped at optimizer step 2" in line and "max_consecutive_skipped_steps=10" in line, line
    ckpts = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(ckpts) == 3 and (tmp_path / "ckpt" / "last.ckpt") in ckpts, ckpts      # steps 1, 2 and last
    for c in ckpts:
        assert _finite(torch.load(c, weights_only=False)["state_dict"]), c
    # resume from a checkpoint whose weights hold a NaN: named with the checkpoint, before any step
    state = torch.load(ckpts[0], weights_only=False)
    state["state_dict"][f"policy.{NAN_TENSOR}"].view(-1)[0] = float("nan")
    torch.save(state, tmp_path / "nan.ckpt")
    cfg["trainer"]["callbacks"].pop()
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c2.yaml")), "--ckpt_path", str(tmp_path / "nan.ckpt")],
              timeout=300)
    line = fault_line(res)
    assert f"policy weight {NAN_TENSOR} (NaN) is not finite in the checkpoint {tmp_path / 'nan.ckpt'}" in line, line


@pytest.mark.e2e
def test_a_nan_weight_mid_run_is_one_line_with_the_hf_engine(tiny_model_dir, tmp_path):
    """A NaN written into a policy weight after step 0 reaches the hf engine with the weight push: its
    sampler stops with one line naming the tensor (main: a bare torch.multinomial traceback)."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=4)
    cfg["trainer"]["callbacks"].insert(0, {"class_path": "e2e_utils.NaNWeightAfterStep", "init_args": {"step": 0}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], timeout=300)
    line = fault_line(res)
    assert line.startswith("lit-ess: error: hf engine:") and f"weight {NAN_TENSOR} (NaN) is not finite" in line, line


# ---------------------------------------------------------------- length limits


def test_prompt_budget_against_the_model_length():
    from lit_ess.engines.base import prompt_budget

    limit = (256, "the model's max_position_embeddings")
    assert prompt_budget(None, 6, limit) == 250                   # null: the room the model length leaves
    assert prompt_budget(250, 6, limit) == 250                    # 250 + 6 = 256 fits exactly
    assert prompt_budget(512, 6, None) == 512                     # a model that does not say
    with pytest.raises(ValueError, match=r"max_prompt_tokens=251 \+ sampling.max_new_tokens=6 = 257 exceeds the "
                                         r"model's max_position_embeddings = 256"):
        prompt_budget(251, 6, limit)
    with pytest.raises(ValueError, match="sampling.max_new_tokens=256 leaves no room"):
        prompt_budget(None, 256, limit)


def test_vllm_max_model_len_is_the_engine_limit(tiny_model_dir):
    from lit_ess.engines import HFConfig, VLLMConfig

    assert HFConfig().model_len(tiny_model_dir) == (256, "the model's max_position_embeddings")
    assert VLLMConfig().model_len(tiny_model_dir) == (256, "the model's max_position_embeddings")
    assert VLLMConfig(max_model_len=64).model_len(tiny_model_dir) == (64, "engine.max_model_len")


def test_vllm_server_max_model_len_is_the_engine_limit(tiny_model_dir):
    """VLLMServerConfig.max_model_len is the launched server's --max-model-len (and the least a server by URL
    takes): the prompt budget must use it, not the model's 256 positions (review of issue 25: it did not, so
    a prompt the server rejects was sampled)."""
    from lit_ess.engines import VLLMServerConfig
    from lit_ess.engines.base import prompt_budget

    assert VLLMServerConfig().model_len(tiny_model_dir) == (256, "the model's max_position_embeddings")
    limit = VLLMServerConfig(max_model_len=64).model_len(tiny_model_dir)
    assert limit == (64, "engine.max_model_len")
    assert prompt_budget(None, 8, limit) == 56


def _long_prompt_file(tmp_path) -> str:
    """Short arithmetic prompts and one of 303 tokens (the tiny model's byte tokenizer: a token a digit)."""
    import json

    rows = [(f"{i}+{i}=", str(2 * i)) for i in range(7)] + [("9" * 300 + "+1=", "1")]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in rows))
    return str(f)


@pytest.mark.e2e
def test_a_prompt_longer_than_max_model_len_is_refused_at_start_with_vllm(refused_at_start):
    """max_prompt_tokens (512) + max_new_tokens above the engine's max_model_len (64): one line naming both
    knobs before the engine starts (main: the 303-token prompt, under max_prompt_tokens, kills the run
    with a bare vLLM traceback)."""
    line = fault_line(refused_at_start[0]["vllm"], code=2)
    assert "max_prompt_tokens=512 + sampling.max_new_tokens=6 = 518 exceeds engine.max_model_len = 64" in line, line


@pytest.mark.e2e
def test_a_prompt_longer_than_the_model_is_skipped_and_counted(tiny_model_dir, tmp_path):
    """max_prompt_tokens left null: the 303-token prompt does not fit the tiny model's 256 positions and is
    skipped and counted in rollout/skipped_long_prompts, the run ends normally (main: max_prompt_tokens
    512 let it through, sampled past the model's positions)."""
    from e2e_utils import scalars

    source = {"class_path": "lit_ess.datamodules.HFPrompts", "init_args": {"path": _long_prompt_file(tmp_path)}}
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=8, samples=2,
                    extra_data={"source": source})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert scalars(tmp_path)["rollout/skipped_long_prompts"][-1][1] >= 1
