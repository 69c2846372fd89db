"""LoRA on the policy: merged weights equal peft's own merge, only the adapters train and are saved,
and an end-to-end run with vLLM stays on-policy (the engine samples from the merged weights) and resumes
exactly from an adapter-only checkpoint."""
import copy
import re

import pytest
import torch

from e2e_utils import cli, rl_config, scalars, write_config
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


@pytest.mark.e2e
def test_lora_run_is_on_policy_saves_adapters_only_and_resumes_exactly(tiny_model_dir, tmp_path):
    """vLLM samples from the merged weights (ESS 1 on every step, and the weights do move); the
    checkpoint holds the adapters only; resuming from the step-2 checkpoint reproduces steps 2-3."""
    lora = {"rank": 4, "alpha": 16.0}

    def config(out):
        return rl_config(tiny_model_dir, out, max_steps=4, ckpt_every=2, lr=1e-2, extra_model={"lora": lora})

    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    res = cli(["fit", "--config", str(write_config(config(full_dir), full_dir / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    full = scalars(full_dir)
    assert min(v for _, v in full["train/ess"]) >= 0.9999
    assert min(v for _, v in full["train/grad_norm"]) > 0
    ckpt = torch.load(next((full_dir / "ckpt").glob("*step=2.ckpt")), map_location="cpu", weights_only=True)
    assert ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
    n_adapter = sum(v.numel() for v in ckpt["state_dict"].values())
    from transformers import AutoModelForCausalLM

    n_base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert n_adapter < 0.2 * n_base, (n_adapter, n_base)

    step2 = next((full_dir / "ckpt").glob("*step=2.ckpt"))
    res = cli(["fit", "--config", str(write_config(config(resumed_dir), resumed_dir / "config.yaml")),
               "--ckpt_path", str(step2)])
    assert res.returncode == 0, res.stderr[-4000:]
    got = scalars(resumed_dir)
    assert [s for s, _ in got["train/loss"]] == [s for s, _ in full["train/loss"]][2:]       # the last 2 steps
    assert [v for _, v in got["train/loss"]] == pytest.approx([v for _, v in full["train/loss"]][2:], abs=1e-6)
    assert min(v for _, v in got["train/ess"]) >= 0.9999             # the engine got the resumed adapters


@pytest.mark.e2e
@pytest.mark.dist
def test_lora_on_two_ddp_ranks_equals_one_rank(tiny_model_dir, tmp_path):
    """The same global batch on 2 DDP ranks (adapters replicated, gradients averaged and rescaled) and on
    1 rank: losses, ESS and gradient norms agree; FSDP2 with LoRA stops with one line."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        cfg = rl_config(tiny_model_dir, out, max_steps=3, lr=1e-2, extra_model={"lora": {"rank": 4}})
        cfg["trainer"]["devices"] = world
        if world == 2:
            cfg["trainer"]["strategy"] = "ddp"
        res = cli(["fit", "--config", str(write_config(cfg, out / "config.yaml"))])
        assert res.returncode == 0, res.stderr[-4000:]
        runs[world] = scalars(out)
    for key in ("train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean"):
        a, b = [v for _, v in runs[1][key]], [v for _, v in runs[2][key]]
        assert len(a) == len(b) == 3 and a == pytest.approx(b, rel=1e-5, abs=1e-5), (key, a, b)

    cfg = rl_config(tiny_model_dir, tmp_path / "fsdp", max_steps=1, extra_model={"lora": {"rank": 4}})
    cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                  "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1}}
    cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.FSDP2"})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "fsdp" / "config.yaml"))])
    assert res.returncode == 2 and "model.lora is not supported with FSDP2" in res.stderr, res.stderr[-2000:]


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
    runs, alarms, console = {}, {}, {}
    for name, sync in (("adapter", "lit_ess.callbacks.WeightSync"), ("stale", "e2e_utils.StaleWeightSync")):
        out = tmp_path / name
        cfg = rl_config(tiny_model_dir, out, max_steps=3, lr=2e-2, extra_model={"lora": {"rank": 4, "sync": "adapter"}},
                        extra_data={"engine": {"class_path": "lit_ess.engines.VLLMConfig",
                                               "init_args": {"max_lora_rank": 4}}})
        cfg["trainer"]["callbacks"][0] = {"class_path": sync}
        res = cli(["fit", "--config", str(write_config(cfg, out / "config.yaml"))])
        assert res.returncode == 0, res.stderr[-4000:]
        runs[name] = [v for _, v in scalars(out)["train/ess"]]
        alarms[name] = [v for _, v in scalars(out)["train/ess_alarms"]]
        console[name] = res.stderr
    assert len(runs["adapter"]) == 3 and min(runs["adapter"]) >= 0.9999, runs
    assert runs["stale"][0] >= 0.9999 and min(runs["stale"][1:]) < 0.999, runs
    assert alarms == {"adapter": [0.0, 0.0, 0.0], "stale": [0.0, 1.0, 2.0]}, alarms
    assert "ess_alarm" not in console["adapter"]
    assert console["stale"].count("below ess_alarm=0.999") == 1, console["stale"][-3000:]
    assert re.search(r"step 1: ESS 0\.\d+ \(mean ratio pi_theta/pi_b [\d.e+-]+\) below ess_alarm=0\.999 .*"
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
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    for c in cfg["trainer"]["callbacks"]:
        if "dirpath" in c.get("init_args", {}):
            c["init_args"]["dirpath"] = str(tmp_path / Path(c["init_args"]["dirpath"]).name)
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
    ckpt["state_dict"] = {f"policy.{k}": v for k, v in saver.policy.state_dict().items()}
    saver.on_save_checkpoint(ckpt)
    other = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, alpha=4.0))
    other.configure_model()
    with pytest.raises(ValueError, match=r"trained with model.lora alpha=32.0 \(now alpha=4.0\)"):
        other.on_load_checkpoint(ckpt)
    same = PolicyModule(tiny_model_dir, lora=LoRA(rank=4, alpha=32.0, sync="adapter"))   # the sync mode may change
    same.configure_model()
    same.on_load_checkpoint(ckpt)


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
