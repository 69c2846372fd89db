"""No silent wrong run (issue 16): bad input stops with one line naming the culprit, or is counted;
a run never ends with exit 0 having learned from garbage."""
import json
import shutil

import pytest
import torch

from e2e_utils import cli, rl_config, write_config
from lit_ess.datamodules import Arithmetic, HFPrompts, RolloutDataModule
from lit_ess.rewards import RewardError, RewardScorer
from lit_ess.datamodules.settings import BatchShape, Schedule

NOT_A_FUNCTION = 3


def returns_none(c, a):
    return None


def returns_text(c, a):
    return "1.0"


def returns_inf(c, a):
    return float("inf")


def raises(c, a):
    raise KeyError("no such field")


def one_line(res, prog="lit-ess"):
    """The single `prog: error:` line of a failed command (exit 2, no traceback)."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------- prompt files


def _write(tmp_path, fmt):
    """Three rows: a plain answer, a missing one (blank CSV cell, null), one with leading zeros."""
    rows = [("1+1=", "2"), ("2+2=", None), ("3+4=", "007")]
    f = tmp_path / f"p.{fmt}"
    if fmt == "csv":
        f.write_text("prompt,answer\n" + "".join(f"{p},{a or ''}\n" for p, a in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]}), f)
    else:   # JSON numbers where the text is one, as a spreadsheet export writes them
        objs = [{"prompt": p, "answer": int(a) if a == "2" else a} for p, a in rows]
        f.write_text(json.dumps(objs) if fmt == "json" else "\n".join(json.dumps(o) for o in objs))
    return str(f)


@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl", "parquet"])
def test_local_files_keep_answers_as_written(tmp_path, fmt):
    """A blank cell used to turn every CSV answer into a float ("2.0"), so exact_match scored 0 on
    every row; "007" became "7"."""
    src = HFPrompts(_write(tmp_path, fmt))
    assert [e.answer for e in src.examples] == ["2", "007"] and src.skipped == 1


def test_bad_prompt_files_name_the_file_and_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl.*holds no rows"):
        HFPrompts(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", answer: 4}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not valid JSON"):
        HFPrompts(str(bad))
    with pytest.raises(ValueError, match=r"the rows have fields \['prompt', 'answer'\]"):
        HFPrompts(_write(tmp_path, "csv"), answer_field="solution")


# ---------------------------------------------------------------- rewards


@pytest.mark.parametrize("fn, says", [(returns_none, "returned None"), (returns_text, "returned '1.0'"),
                                      (returns_inf, "returned inf"), (raises, "KeyError")])
def test_a_reward_that_fails_everywhere_is_counted_then_stops(fn, says):
    name = f"test_faults_input:{fn.__name__}"
    counting = RewardScorer(name, max_error_rate=1.0)
    with pytest.warns(UserWarning, match=says):
        assert counting(["a", "b"], ["1", "1"]) == [0.0, 0.0]
    assert counting.errors == 2
    with pytest.raises(RewardError, match=rf"reward '{name}' failed on 2 of 2 completions.*first error: .*{says}"):
        RewardScorer(name)(["a", "b"], ["1", "1"])


def test_reward_and_group_size_are_checked_at_start():
    with pytest.raises(ValueError, match="'test_faults_input:NOT_A_FUNCTION' is a int, not a function"):
        RolloutDataModule(reward="test_faults_input:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="reward .json:loads.: parameter .s. is neither prompt, completion, answer"):
        RolloutDataModule(reward="json:loads")
    with pytest.raises(ValueError, match="samples_per_prompt=1: the group advantage"):
        RolloutDataModule(batch=BatchShape(samples_per_prompt=1))


def test_async_worker_stops_on_a_failing_reward_with_the_same_error(tiny_model_dir):
    from fake_engine import FakeConfig
    from lit_ess.sampling import SamplingConfig

    dm = RolloutDataModule(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0), schedule=Schedule(mode="async"),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), source=Arithmetic(size=10),
                           sampling=SamplingConfig(max_new_tokens=3, seed=0), reward="test_faults_input:returns_inf")
    dm.setup("fit")
    try:
        dm.push_weights({"w": torch.zeros(1)}.items(), 0)
        with pytest.raises(RewardError, match="returns_inf' failed on 4 of 4"):
            dm.next_batch(0)
    finally:
        dm.teardown("fit")


@pytest.mark.e2e
def test_fit_with_an_infinite_reward_stops_naming_it(tiny_model_dir, tmp_path):
    """It used to train to the end with exit 0: reward_mean inf, reward_errors 0, loss 0 every step."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=4, samples=2,
                    extra_data={"reward": "test_faults_input:returns_inf", "sampling": {"max_new_tokens": 4, "seed": 0}})
    line = one_line(cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], cwd=tmp_path))
    assert "reward 'test_faults_input:returns_inf' failed on 8 of 8" in line and "returned inf" in line, line


# ---------------------------------------------------------------- validate, model files, checkpoints


def test_validate_without_val_source_is_an_error(tiny_model_dir):
    """`lit-ess validate` used to evaluate nothing and exit 0; the CLI prints this error as one line."""
    with pytest.raises(ValueError, match="validate needs held-out prompts: set data.validation.source"):
        RolloutDataModule(model_path=tiny_model_dir).setup("validate")


def test_validate_with_a_truncated_checkpoint_names_it(tiny_model_dir, tmp_path):
    ckpt = _checkpoint(tiny_model_dir, tmp_path / "last.ckpt")
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig",
                    extra_data={"validation": {"source": {"class_path": "lit_ess.datamodules.Arithmetic"}}})
    line = one_line(cli(["validate", "--config", str(write_config(cfg, tmp_path / "c.yaml")), "--ckpt_path", str(ckpt)],
                        cwd=tmp_path))
    assert str(ckpt) in line and "torn or not a checkpoint" in line, line


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_a_damaged_model_file_is_named(tiny_model_dir, tmp_path, damage):
    """It used to end in a bare SafetensorError traceback; the CLI prints this ValueError as one line."""
    from lit_ess.module import PolicyModule

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000] if damage == "truncated" else bytes(range(256)) * 40)
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        PolicyModule(model_path=str(broken))


def _checkpoint(model_dir, path):
    """A policy checkpoint as Lightning writes it (weights under `policy.`), without a run."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    torch.save({"state_dict": {f"policy.{k}": v for k, v in state.items()},
                "hyper_parameters": {"model_path": model_dir}}, path)
    return path


def _export(capsys, *args):
    from lit_ess.export import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lit-ess-export: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_export_errors_name_the_culprit(tiny_model_dir, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from lit_ess.tiny import build_tiny_model

    ckpt = _checkpoint(tiny_model_dir, tmp_path / "last.ckpt")
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    assert "is an existing file" in _export(capsys, ckpt, taken)
    assert taken.read_text() == "x"
    nothing = tmp_path / "nothing"
    assert f"'{nothing}': no such model folder" in _export(capsys, ckpt, tmp_path / "out", "--model_path", nothing)
    wide = build_tiny_model(tmp_path / "wide", hidden_size=256, num_heads=4, num_kv_heads=4)
    assert "has shape [260, 192], the model of" in _export(capsys, ckpt, tmp_path / "out", "--model_path", wide)
    shards = tmp_path / "shards"                        # a folder of shards, as ModelParallelStrategy saves
    dcp.save({"state_dict": torch.load(ckpt)["state_dict"]}, checkpoint_id=str(shards), no_dist=True)
    torch.save({"hyper_parameters": {"model_path": tiny_model_dir}}, shards / "meta.pt")
    assert "has shape [260, 192], the model of" in _export(capsys, shards, tmp_path / "out", "--model_path", wide)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[:5000])
    assert f"{truncated}' cannot be read as a checkpoint" in _export(capsys, truncated, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_callback_refuses_a_file_at_start(tmp_path):
    from lit_ess.callbacks import ExportHF

    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"):
        ExportHF(str(taken))


def test_tiny_takes_any_multiple_of_the_head_size(tmp_path, capsys):
    from transformers import AutoConfig

    from lit_ess.tiny import main

    main([str(tmp_path / "m"), "--hidden-size", "128", "--num-layers", "1"])
    assert AutoConfig.from_pretrained(tmp_path / "m").num_attention_heads == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "n"), "--hidden-size", "100"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("lit-ess-tiny: error: --hidden-size 100 must be") and "\n" not in err


@pytest.mark.parametrize("source, says", [
    ("def score(c, a):\n    return 1.0\nif True\n    pass\n", "line 3: SyntaxError: expected ':'"),
    ("import math\nx = undefined_name\n", "line 2: NameError: name 'undefined_name' is not defined"),
], ids=["syntax error", "error at import"])
def test_a_reward_module_that_fails_to_import_names_its_file_and_line(tiny_model_dir, tmp_path, source, says):
    """(main: `lit-ess: error: expected ':'`, naming neither the file nor the line)"""
    module = tmp_path / "my_reward.py"
    module.write_text(source)
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", extra_data={"reward": "my_reward:score"})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml"))], cwd=tmp_path)
    line = one_line(res)
    assert f"reward 'my_reward:score' cannot be imported: {module}, {says}" in line, line
