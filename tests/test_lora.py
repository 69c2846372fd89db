"""LoRA on the policy: merged weights equal peft's own merge, only the adapters train and are saved,
and an end-to-end run with vLLM stays on-policy (the engine samples from the merged weights), resumes
exactly after a kill -9 from an adapter-only checkpoint, and exports through `lit-ess-export`."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from e2e_utils import cli, cli_each, kill_after_checkpoint, pythonpath, rl_config, scalars, write_config
from lit_ess.lora import LoRA, merged_weights
from lit_ess.module import PolicyModule


@pytest.fixture(scope="module")
def adapted(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = LoRA(rank=4, alpha=8).apply(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.2)                       # B = 0 at init would make every check trivial
    return model


def test_merged_weights_equal_peft_merge_and_leave_the_base_untouched(adapted, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    before = {k: v.clone() for k, v in adapted.state_dict().items()}
    merged = dict(merged_weights(adapted))
    reference = copy.deepcopy(adapted).merge_and_unload().state_dict()
    assert list(merged) == list(base)                                  # Hugging Face names, base order
    for k, v in reference.items():
        assert torch.allclose(merged[k], v, atol=1e-6), k
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert any("q_proj" in k for k in changed) and any("down_proj" in k for k in changed)
    assert all(torch.equal(v, before[k]) for k, v in adapted.state_dict().items())     # nothing merged in place


def test_only_adapters_train_and_a_reference_needs_no_second_model(tiny_model_dir):
    from lit_ess.objectives import P3O

    m = PolicyModule(tiny_model_dir, objective=P3O(ref_kl_coef=0.1), lora=LoRA(rank=4, target_modules=["q_proj", "v_proj"]))
    m.configure_model()
    trainable = [n for n, p in m.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trainable)
    opt = m.configure_optimizers()["optimizer"]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    assert m.ref_policy is None                             # the base with the adapters off is the reference


@pytest.mark.parametrize("bad, says", [(dict(rank=0), "rank"), (dict(dropout=1.0), "dropout"),
                                       (dict(target_modules="attn"), "target_modules")])
def test_bad_lora_settings_name_the_field(bad, says):
    with pytest.raises(ValueError, match=f"lora.{says}"):
        LoRA(**bad)


LORA_RUN = {"rank": 4, "alpha": 32.0}


def lora_config(model_dir, out):
    """The LoRA run of this file: 4 steps, checkpoints at steps 2 and 4 (and last.ckpt); at the end both
    sync payloads (out/payloads.pt) and an ExportHF folder (out/hf)."""
    cfg = rl_config(model_dir, out, max_steps=4, ckpt_every=2, lr=1e-2, extra_model={"lora": LORA_RUN})
    cfg["trainer"]["callbacks"] += [{"class_path": "e2e_utils.SaveSyncPayloads", "init_args": {"path": str(out / "payloads.pt")}},
                                    {"class_path": "lit_ess.callbacks.ExportHF", "init_args": {"dirpath": str(out / "hf")}}]
    return cfg


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, tmp_path_factory):
    """The uninterrupted LoRA run, "run": (folder, scalars), and the same run killed (kill -9) right after its
    step-2 checkpoint, then resumed with --ckpt_path last, "killed": (folder, whether the kill came before
    the last step, the resume's CompletedProcess). The resume, then the uninterrupted run, in one process
    (e2e_utils.cli_each: one start of Lightning and vLLM fewer); the resume first, in a fresh process as a user's."""
    root = tmp_path_factory.mktemp("lora_run")
    out, run_dir = root / "run", root / "killed"
    cfg = lora_config(tiny_model_dir, run_dir)
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                        "init_args": {"path": str(run_dir / "prompts.jsonl")}})
    path = write_config(cfg, run_dir / "config.yaml")
    kill_after_checkpoint(path, run_dir / "ckpt", 2)
    before_end = not list((run_dir / "ckpt").glob("*step=4.ckpt"))
    done = cli_each({"resumed": (["fit", "--config", str(path), "--ckpt_path", "last"], None),
                     "run": (["fit", "--config", str(write_config(lora_config(tiny_model_dir, out),
                                                                  out / "config.yaml"))], None)})
    assert done["run"].returncode == 0, done["run"].stderr[-4000:]
    return {"run": (out, scalars(out)), "killed": (run_dir, before_end, done["resumed"])}


@pytest.fixture(scope="module")
def lora_run(lora_runs):
    """(run folder, scalars) of the uninterrupted LoRA run, shared by the tests that read its logs or
    its checkpoints."""
    return lora_runs["run"]


def adapted_policy(model_dir, ckpt):
    """The LoRA policy of a checkpoint file, as the trainer held it."""
    m = PolicyModule(model_dir, lora=LoRA(**LORA_RUN))
    m.configure_model()
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    missing, unexpected = m.policy.load_state_dict({k.removeprefix("policy."): v for k, v in state.items()}, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    return m.policy.eval()


@pytest.mark.e2e
def test_lora_run_is_on_policy_and_saves_adapters_only(lora_run, tiny_model_dir):
    """vLLM samples from the merged weights (ESS 1 on every step, and the weights do move); the
    checkpoint holds the adapters only."""
    full_dir, full = lora_run
    assert min(v for _, v in full["train/ess"]) >= 0.9999
    assert min(v for _, v in full["train/grad_norm"]) > 0
    ckpt = torch.load(next((full_dir / "ckpt").glob("*step=2.ckpt")), map_location="cpu", weights_only=True)
    assert ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
    n_adapter = sum(v.numel() for v in ckpt["state_dict"].values())
    from transformers import AutoModelForCausalLM

    n_base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert n_adapter < 0.2 * n_base, (n_adapter, n_base)


@pytest.mark.e2e
def test_kill_9_and_resume_last_equals_the_uninterrupted_run(lora_runs):
    """SIGKILL of the whole run right after its step-2 checkpoint (adapters only), then `--ckpt_path
    last`: every step's loss, ESS and gradient norm equal the uninterrupted run's, the resumed engine
    samples from the resumed adapters (ESS 1), and steps 0-1 are not trained again."""
    full = lora_runs["run"][1]
    run_dir, before_end, res = lora_runs["killed"]
    assert before_end, "the run ended before the kill"
    assert res.returncode == 0, res.stderr[-4000:]
    steps = [json.loads(ln)["step"] for ln in (run_dir / "prompts.jsonl").read_text().splitlines()]
    assert steps.count(0) == steps.count(1) == 1 and steps[-2:] == [2, 3], steps      # resumed, not restarted
    got = scalars(run_dir)
    for tag in ("train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean"):
        assert [s for s, _ in got[tag]] == [s for s, _ in full[tag]] and len(got[tag]) == 4, tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in full[tag]], abs=1e-6), tag
    assert min(v for _, v in got["train/ess"]) >= 0.9999


def _export(*args) -> subprocess.CompletedProcess:
    """`lit-ess-export ARGS` in a subprocess (the console script's module)."""
    return subprocess.run([sys.executable, "-m", "lit_ess.export", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=pythonpath()))


def _export_error(capsys, *args) -> str:
    """The one error line of `lit-ess-export ARGS` (run in this process: its exit status 2 and stderr)."""
    from lit_ess.export import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lit-ess-export: error:")]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.e2e
def test_export_cli_writes_the_adapter_and_on_request_the_merged_model(lora_run, tiny_model_dir, tmp_path, capsys):
    """`lit-ess-export` of the run's LoRA checkpoint: peft's adapter folder (PeftModel.from_pretrained on
    the base) and, with --merged, a plain Hugging Face model; both give the trained policy's logits. A
    changed or missing base stops with one line saying so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = lora_run[0] / "ckpt" / "last.ckpt"
    policy = adapted_policy(tiny_model_dir, ckpt)
    x = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = policy(x).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        assert (want - base(x).logits).abs().max() > 1e-3                  # the adapters trained

        res = _export(ckpt, tmp_path / "adapter")
        assert res.returncode == 0, res.stderr[-3000:]
        assert not (tmp_path / "adapter" / "config.json").exists()          # an adapter folder, not a model
        got = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(x).logits
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

        res = _export(ckpt, tmp_path / "merged", "--merged")
        assert res.returncode == 0, res.stderr[-3000:]
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(x).logits
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert (tmp_path / "merged" / "adapter" / "adapter_config.json").exists()

    changed = shutil.copytree(tiny_model_dir, tmp_path / "changed_base")      # the base folder, retrained since
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)
    other.save_pretrained(changed)
    assert f"--model_path='{changed}' is not the base this LoRA checkpoint was trained on" in \
        _export_error(capsys, ckpt, tmp_path / "x", "--model_path", changed)

    moved = torch.load(ckpt, map_location="cpu", weights_only=False)   # its base folder since removed
    moved["hyper_parameters"]["model_path"] = str(tmp_path / "gone")
    torch.save(moved, tmp_path / "moved.ckpt")
    assert f"the checkpoint's model_path='{tmp_path / 'gone'}' is missing: a LoRA checkpoint holds the adapters " \
        f"only" in _export_error(capsys, tmp_path / "moved.ckpt", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.e2e
@pytest.mark.dist
def test_lora_on_two_ddp_or_fsdp2_ranks_equals_one_rank(lora_run, tiny_model_dir, tmp_path):
    """The same global batch on 1 rank (the file's LoRA run), on 2 DDP ranks (adapters replicated) and on 2
    FSDP2 ranks (the peft model sharded per decoder layer: frozen base and adapters alike; gradients averaged and
    rescaled; activation checkpointing on): losses, ESS, gradient norms and rewards agree. Under FSDP2 the engines sample from merged
    weights gathered from the shards (ESS 1); both sync payloads (merged, adapter), gathered on every
    rank, equal 1 rank's in value and order; the checkpoint is a folder of adapter shards only (and
    their optimizer state), and ExportHF and `lit-ess-export --merged` of it give 1 rank's model."""
    from transformers import AutoModelForCausalLM

    from lit_ess.export import export_hf

    runs = {"one": lora_run[1]}
    for name in ("ddp", "fsdp2"):
        out = tmp_path / name
        cfg = lora_config(tiny_model_dir, out)
        cfg["trainer"]["devices"] = 2
        if name == "ddp":
            cfg["trainer"]["strategy"] = "ddp"
        if name == "fsdp2":
            cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                          "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
            cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.FSDP2",      # checkpoint wrappers rename
                                                "init_args": {"activation_checkpointing": True}})   # the parameters
        res = cli(["fit", "--config", str(write_config(cfg, out / "config.yaml"))])
        assert res.returncode == 0, res.stderr[-4000:]
        runs[name] = scalars(out)
    # Float32 order noise, amplified by Adam. 2 ranks train the same rows as 1 (tokens, behaviour logprobs, advantages
    # equal) in another order: each rank shuffles its own prompts r, r + 2, ... and the gradient is two partial sums.
    # That moves a gradient entry by ~1e-11: nothing on most, a large relative error on one near 0, and Adam's update
    # lr m / (sqrt(v) + eps) is scale-free: it turns relative error into weight error. Here step 1's entry -3.8e-10
    # (-3.9e-10 on 2 ranks) moves lr g / (|g| + eps) = 3.6e-4, 1.2e-5 apart; step 2's lora_A entry 1.1e-9 (7.6e-10)
    # moves 1.7e-4 apart; after 4 steps the merged weights differ by 5.5e-5 (DDP and FSDP2 alike), step 4's gradient
    # norm by 6.2e-5 relative. One rank with its rows reversed drifts as much (6.6e-5, 6.5e-5). The size depends on
    # the completions drawn: per-sample seeds (before 7de4ef1) drew others for the same prompts, in the same order,
    # and drifted 3.0e-6 and 4.8e-7 (5.0e-6 and 1.9e-6 reversed). Step 1 (equal weights, no Adam step yet) holds 1e-5.
    for name in ("ddp", "fsdp2"):
        for key in ("train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean"):
            a, b = [v for _, v in runs["one"][key]], [v for _, v in runs[name][key]]
            assert len(a) == len(b) == 4 and a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-5), (name, key, a, b)
            rel = 2e-4 if key == "train/grad_norm" else 1e-5
            assert a == pytest.approx(b, rel=rel, abs=1e-5), (name, key, a, b)
    assert min(v for _, v in runs["fsdp2"]["train/ess"]) >= 0.9999

    one, two = (torch.load(d / "payloads.pt") for d in (lora_run[0], tmp_path / "fsdp2"))
    # after 4 steps of the order noise Adam amplifies (above): merged 5.5e-5 here, the adapter payload (s B, s = alpha / r
    # = 8) 8x the merged tolerance
    for mode, atol in (("merged", 1e-4), ("adapter", 8e-4)):
        assert [k for k, _ in two[mode]] == [k for k, _ in one[mode]], mode
        for (k, a), (_, b) in zip(one[mode], two[mode]):
            assert torch.allclose(a, b, atol=atol), (mode, k, (a - b).abs().max())
    shards = tmp_path / "fsdp2" / "ckpt" / "last.ckpt"
    import torch.distributed.checkpoint as dcp

    stored = [k for k in dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata if k.startswith("state_dict.")]
    assert stored and all(".lora_" in k for k in stored), stored[:3]
    fsdp2_cfg = yaml.safe_load((tmp_path / "fsdp2" / "config.yaml").read_text())     # resumed with other settings:
    fsdp2_cfg["model"]["init_args"]["lora"]["rank"] = 8           # one line, before the shards are read
    fsdp2_cfg["data"]["init_args"]["engine"] = {"class_path": "lit_ess.engines.HFConfig"}     # (no vLLM start-up)
    res = cli(["fit", "--config", str(write_config(fsdp2_cfg, tmp_path / "resume.yaml")), "--ckpt_path", str(shards)])
    assert res.returncode == 2 and "trained with model.lora rank=4 (now rank=8)" in res.stderr, res.stderr[-3000:]
    assert "CheckpointException" not in res.stderr, res.stderr[-3000:]
    export_hf(shards, tmp_path / "exported", merged=True)         # the console script: the export test above
    want = dict(one["merged"])
    for folder in (tmp_path / "exported", tmp_path / "fsdp2" / "hf"):
        got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert all(torch.allclose(got[k], v, atol=1e-4) for k, v in want.items()), folder   # Adam's drift (above)


def test_adapter_payload_reproduces_the_adapted_model(adapted, tiny_model_dir, tmp_path):
    """The pushed adapters (scale folded into B) written as a peft folder and loaded on the base give the
    adapted model's logits: what vLLM is handed in lora.sync: adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lit_ess.lora import adapter_weights, is_adapter_payload, write_adapter

    tensors = dict(adapter_weights(adapted))
    assert is_adapter_payload(list(tensors)) and not is_adapter_payload(["model.embed_tokens.weight"])
    folder = write_adapter(tmp_path / "v1", tensors)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)
    x = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        assert torch.allclose(reloaded(x).logits, adapted(x).logits, atol=1e-5)


@pytest.mark.e2e
def test_adapter_sync_is_on_policy_and_a_stale_adapter_shows_in_the_ess(tiny_model_dir, tmp_path):
    """lora.sync: adapter with vLLM serving the pushed adapters: ESS 1 on every step. The same run with
    a sync that keeps handing the engine the first adapter (labelled as current) drops below 1, and the
    lag-0 ESS alarm (issue 18 item 6) warns once with the numbers and counts every such step."""
    runs, alarms, console, cases = {}, {}, {}, {}
    for name, sync in (("adapter", "lit_ess.callbacks.WeightSync"), ("stale", "e2e_utils.StaleWeightSync")):
        cfg = rl_config(tiny_model_dir, tmp_path / name, max_steps=3, lr=2e-2,
                        extra_model={"lora": {"rank": 4, "sync": "adapter"}},
                        extra_data={"engine": {"class_path": "lit_ess.engines.VLLMConfig",
                                               "init_args": {"max_lora_rank": 4}}})
        cfg["trainer"]["callbacks"][0] = {"class_path": sync}
        cases[name] = (["fit", "--config", str(write_config(cfg, tmp_path / name / "config.yaml"))], None)
    # both runs in one process (e2e_utils.cli_each), each with its own vLLM engine: one start of Lightning and
    # vLLM fewer (the stale run second: its warning is the process's first)
    for name, res in cli_each(cases).items():
        assert res.returncode == 0, res.stderr[-4000:]
        runs[name] = [v for _, v in scalars(tmp_path / name)["train/ess"]]
        alarms[name] = [v for _, v in scalars(tmp_path / name)["train/ess_alarms"]]
        console[name] = res.stderr
    assert len(runs["adapter"]) == 3 and min(runs["adapter"]) >= 0.9999, runs
    assert runs["stale"][0] >= 0.9999 and min(runs["stale"][1:]) < 0.999, runs
    assert alarms == {"adapter": [0.0, 0.0, 0.0], "stale": [0.0, 1.0, 2.0]}, alarms
    assert "ess_alarm" not in console["adapter"]
    assert console["stale"].count("below model.ess_alarm.threshold=0.999") == 1, console["stale"][-3000:]
    assert re.search(r"step 1: ESS 0\.\d+ \(mean ratio pi_theta/pi_b [\d.e+-]+\) below model\.ess_alarm\.threshold=0\.999 .*"
                     r"check the weight sync", console["stale"]), console["stale"][-3000:]


def test_demo_lora_config_builds_as_written(tiny_model_dir, tmp_path):
    """configs/demo_lora.yaml through the CLI's parser (no run): the LoRA settings reach the module."""
    import sys
    from pathlib import Path
    from unittest import mock

    import yaml

    from lit_ess.cli import LitESSCLI, _Parser

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "demo_lora.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    cfg["output_dir"] = str(tmp_path / "run")
    path = write_config(cfg, tmp_path / "demo_lora.yaml")
    with mock.patch.object(sys, "argv", ["lit-ess"]):
        cli_ = LitESSCLI(None, None, subclass_mode_model=True, subclass_mode_data=True, parser_class=_Parser,
                         args=["--config", str(path)], auto_configure_optimizers=False, run=False)
    assert cli_.model.lora == LoRA(rank=16, alpha=32.0, dropout=0.0, target_modules="all-linear")
    cli_.model.configure_model()
    assert all("lora_" in n for n, p in cli_.model.policy.named_parameters() if p.requires_grad)


def test_resume_with_other_adapter_settings_stops_naming_them(tiny_model_dir):
    ckpt = {"state_dict": {}}
    saver = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, alpha=32.0))
    saver.configure_model()
    ckpt["state_dict"] = saver.state_dict()
    saver.on_save_checkpoint(ckpt)
    other = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, alpha=4.0))
    other.configure_model()
    with pytest.raises(ValueError, match=r"trained with model.lora alpha=32.0 \(now alpha=4.0\)"):
        other.on_load_checkpoint(ckpt)
    same = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, alpha=32.0, sync="adapter"))   # the sync mode may change
    same.configure_model()
    same.on_load_checkpoint(ckpt)
    full = PolicyModule(tiny_model_dir)                   # model.lora: null (it named ~7 KB of missing keys)
    full.configure_model()
    with pytest.raises(ValueError, match=r"^this checkpoint holds LoRA adapters \(model.lora rank=4, alpha=32.0, "
                                         r"dropout=0.0, target_modules='all-linear'\), not full weights: set model.lora"):
        full.on_load_checkpoint(ckpt)
    full_ckpt = {"state_dict": full.state_dict()}
    full.on_save_checkpoint(full_ckpt)
    with pytest.raises(ValueError, match="model.lora is set but this checkpoint holds full weights"):
        same.check_checkpoint_settings(full_ckpt["lit_ess"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")        # no_dist: one process on purpose
def test_a_lora_modules_state_dict_is_its_adapters_and_a_sharded_load_asks_for_them_alone(tiny_model_dir, tmp_path):
    """With LoRA the module's state dict is the trainable adapters only: what every checkpoint holds, and
    what ModelParallelStrategy asks a folder of shards for on resume (the keys of get_model_state_dict
    of the module: asking for the frozen base, which the shards never held, failed the load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saver, loader = (PolicyModule(tiny_model_dir, lora=LoRA(rank=4)) for _ in range(2))
    for m in (saver, loader):
        m.configure_model()
    assert set(saver.state_dict()) == {f"policy.{n}" for n, p in saver.policy.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in saver.policy.named_parameters():
            if "lora_B" in n:
                p.normal_()
    dcp.save({"state_dict": saver.state_dict()}, checkpoint_id=str(tmp_path / "shards"), no_dist=True)
    wanted = {"state_dict": get_model_state_dict(loader)}
    dcp.load(wanted, checkpoint_id=str(tmp_path / "shards"), no_dist=True)
    loader.load_state_dict(wanted["state_dict"], strict=loader.strict_loading)
    assert all(torch.equal(v, loader.state_dict()[k]) for k, v in saver.state_dict().items())


def test_tied_ends_and_adapter_synced_embeddings_are_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.tie_word_embeddings                    # the tiny model ties its ends, as Qwen2 small models do
    with pytest.raises(ValueError, match="model.embed_tokens is the input embeddings, tied to the other end"):
        LoRA(rank=4, target_modules=["embed_tokens", "q_proj"]).apply(model)
    untied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    LoRA(rank=4, target_modules=["embed_tokens", "q_proj"]).apply(untied)          # merged sync: fine untied
    with pytest.raises(ValueError, match="is an embedding; lora.sync: adapter pushes linear adapters only"):
        LoRA(rank=4, target_modules=["embed_tokens", "q_proj"], sync="adapter").apply(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False))


def test_export_writes_merged_weights_in_adapter_sync_mode(tiny_model_dir, tmp_path):
    """ExportHF's folder is a whole model whatever the sync mode (the adapter sits beside it)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from lit_ess.callbacks import ExportHF

    m = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, sync="adapter", target_modules=["q_proj"]))
    m.configure_model()
    for n, p in m.policy.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.2)
    ExportHF(str(tmp_path / "out")).on_train_end(SimpleNamespace(is_global_zero=True), m)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    merged = dict(merged_weights(m.policy))
    assert all(torch.allclose(exported[k], merged[k]) for k in merged)
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()


def test_each_adapter_push_is_loaded_once_and_closing_the_executor_removes_its_folders(tiny_model_dir, monkeypatch):
    """lora.sync: adapter on vLLM: each push is a new adapter that vLLM loads from disk once (it reloaded
    it at every decode step when served in place), including a version pushed again (validation); the
    engine samples with the pushed adapter (its logprobs are the trainer's); replaced folders go once
    vLLM has the new one, the engine's folder goes with InlineExecutor.close(), and a folder left by a
    dead process (kill -9) goes when an engine starts."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from lit_ess.engines import VLLMConfig
    from lit_ess.sampling import SamplingConfig
    from lit_ess.engines.vllm_engine import adapter_root
    from lit_ess.rollout.executor import InlineExecutor
    from lit_ess.rollout.worker import WorkerConfig

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(adapter_root()) / f"lit-ess-adapter-{int(dead.stdout)}-killed"
    (orphan / "a1").mkdir(parents=True)
    sampling = SamplingConfig(max_new_tokens=12, seed=0)
    executor = InlineExecutor(WorkerConfig(model_path=tiny_model_dir, engine=VLLMConfig(max_lora_rank=4), sampling=sampling))
    executor.start()
    assert not orphan.exists()
    engine = executor.worker.engine
    loads = []
    load = LRUCacheWorkerLoRAManager._load_adapter

    def counted(manager, request):                   # instrumentation of vLLM's loader from disk
        loads.append(request.lora_int_id)
        return load(manager, request)

    monkeypatch.setattr(LRUCacheWorkerLoRAManager, "_load_adapter", counted)
    m = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, sync="adapter"))
    m.configure_model()
    prompt = [5, 6, 7, 8]
    for push, version in enumerate((1, 1, 2), start=1):
        with torch.no_grad():
            for n, p in m.policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(push))
        executor.load_weights(m.policy_weights(), version)
        loads.clear()
        out = engine.generate([prompt], 1, sampling)[0][0]
        assert len(out.token_ids) > 2 and loads == [push], (push, len(out.token_ids), loads)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(m.policy(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        got = lp.gather(-1, ids[0, len(prompt):, None])[:, 0]
        assert torch.allclose(got, torch.tensor(out.logprobs), atol=1e-4), (got - torch.tensor(out.logprobs)).abs().max()
        assert os.listdir(engine.adapter_dir) == [f"a{push}"]
    folder = engine.adapter_dir
    executor.close()
    assert not os.path.exists(folder)


def test_activation_checkpointing_keeps_the_adapters_in_the_state_dict(tiny_model_dir):
    """FSDP2's activation checkpointing wraps each decoder layer (parameter names gain
    `_checkpoint_wrapped_module.`, state-dict names do not): the module's state dict is still the
    adapters (it was empty, so checkpoints held nothing), the adapter sync payload too (it was empty:
    peft's get_peft_model_state_dict missed them), and a checkpoint of it loads."""
    from lit_ess.callbacks.fsdp import _checkpoint_layers, decoder_layers
    from lit_ess.lora import adapter_state, adapter_weights, peft_state

    m = PolicyModule(tiny_model_dir, lora=LoRA(rank=4))
    m.configure_model()
    want, pushed = set(m.state_dict()), [n for n, _ in adapter_weights(m.policy)]
    _checkpoint_layers(m.policy, decoder_layers(m.policy))
    assert any("_checkpoint_wrapped_module" in n for n, _ in m.policy.named_parameters())
    assert want and set(m.state_dict()) == want
    assert pushed and [n for n, _ in adapter_weights(m.policy)] == pushed        # the sync: adapter payload too
    assert {f"policy.{k}" for k in adapter_state(m.policy)} == want and set(peft_state(m.policy)) == set(adapter_state(m.policy))
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    m.on_load_checkpoint(ckpt)
    m.load_state_dict(ckpt["state_dict"], strict=m.strict_loading)


def test_lora_dropout_warns_and_stays_while_the_bases_dropout_is_disabled(tiny_model_dir):
    """disable_dropout zeroes the base's dropout; lora.dropout is the user's explicit choice: it stays,
    with a warning (it breaks on-policy ESS 1 and exact resume)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.2)
    base.save_pretrained(Path(tiny_model_dir).parent / "with_dropout")
    with pytest.warns(UserWarning, match=r"model.lora.dropout=0.1: .* on-policy ESS is not 1"):
        m = PolicyModule(str(Path(tiny_model_dir).parent / "with_dropout"), lora=LoRA(rank=4, dropout=0.1))
        m.configure_model()
    lora_p = [mod.p for n, mod in m.policy.named_modules() if isinstance(mod, torch.nn.Dropout)]
    assert lora_p and set(lora_p) == {0.1}
    assert {mod.attention_dropout for mod in m.policy.modules() if hasattr(mod, "attention_dropout")} == {0.0}


def test_adapter_sync_settings_are_checked_before_the_engine_starts(tiny_model_dir, tmp_path):
    """vLLM's LoRA kernels on CUDA take no float32 (the rule, checked here without CUDA); max_lora_rank
    above vLLM's 512 is one line, not pydantic's; sync: adapter with the hf engine stops before any
    engine starts (it stopped at the first push, after the engine had loaded)."""
    from lit_ess.engines import VLLMConfig
    from lit_ess.engines.vllm_engine import lora_dtype_error

    assert "needs data.engine.init_args.dtype: bfloat16 or float16" in lora_dtype_error(True, 16, "float32")
    assert lora_dtype_error(False, 16, "float32") is lora_dtype_error(True, 16, "bfloat16") is \
        lora_dtype_error(True, None, "float32") is None
    with pytest.raises(ValueError, match=r"max_lora_rank must be in \[1, 512\]"):
        VLLMConfig(max_lora_rank=1024)
    assert "started without LoRA" in VLLMConfig().adapter_error(4)
    assert "above data.engine.init_args.max_lora_rank=4" in VLLMConfig(max_lora_rank=4).adapter_error(8)
    assert VLLMConfig(max_lora_rank=8).adapter_error(4) is None
    cfg = rl_config(tiny_model_dir, tmp_path, max_steps=1, extra_model={"lora": {"rank": 4, "sync": "adapter"}},
                    extra_data={"engine": {"class_path": "lit_ess.engines.HFConfig"}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    assert res.returncode == 2 and "adapters, which the HFConfig engine does not take: use model.lora.sync: merged" \
        in res.stderr, res.stderr[-3000:]
