"""The model families users train, end to end: tiny Qwen2.5, Qwen3 (q/k norms) and Llama 3 (untied
embeddings, llama3 RoPE scaling), each on a BPE tokenizer with merges and a chat template, built by
`lit-ess-tiny --family`. Each trains 2 synchronous steps with the in-process vLLM engine and with the hf
engine (chunked log-probabilities, 7 tokens a chunk), on-policy; its export loads in vLLM."""
import json

import pytest
import torch

from e2e_utils import cli_each, rl_config, scalars, write_config

pytestmark = pytest.mark.e2e

FAMILIES = ("qwen2.5", "qwen3", "llama3")
ENGINES = ("VLLMConfig", "HFConfig")


def tiny(out, family) -> None:
    """`lit-ess-tiny OUT --family FAMILY` at width 128, 2 layers: the command's entry point, in this process."""
    from lit_ess.tiny import main

    main([str(out), "--family", family, "--hidden-size", "128", "--num-layers", "2"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(family, engine): (folder, CompletedProcess)}: every run in one process (cli_each), the hf runs, then
    the vLLM runs, each of which starts its own in-process engine (a run's engine is dropped at its end, not
    torn down: the next one starts in the same process)."""
    root = tmp_path_factory.mktemp("families")
    configs = {}
    for family in FAMILIES:
        model = root / family / "init"
        tiny(model, family)
        for engine in ENGINES:
            out = root / family / engine
            cfg = rl_config(str(model), out, engine=engine, max_steps=2, prompts=4, samples=4,
                            extra_model={"compute": {"logprob_chunk": 7}})
            cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.ExportHF",
                                                "init_args": {"dirpath": str(out / "export")}})
            configs[family, engine] = (out, write_config(cfg, out / "config.yaml"))
    order = sorted(configs, key=lambda k: k[1] == "VLLMConfig")         # the hf runs first
    done = cli_each({k: (["fit", "--config", str(configs[k][1])], None) for k in order}, timeout=1800)
    return {k: (configs[k][0], res) for k, res in done.items()}


def test_tiny_builds_each_family(runs):
    """What sets each family apart is in the model that lit-ess-tiny wrote."""
    out = runs["qwen2.5", "HFConfig"][0].parent.parent
    conf = {f: json.loads((out / f / "init" / "config.json").read_text()) for f in FAMILIES}
    assert conf["qwen2.5"]["model_type"] == "qwen2" and conf["qwen2.5"]["tie_word_embeddings"]
    assert conf["qwen2.5"]["num_key_value_heads"] < conf["qwen2.5"]["num_attention_heads"]
    assert conf["qwen3"]["model_type"] == "qwen3"
    assert conf["llama3"]["model_type"] == "llama" and not conf["llama3"]["tie_word_embeddings"]
    assert conf["llama3"]["rope_parameters"]["rope_type"] == "llama3"
    tok = json.loads((out / "qwen3" / "init" / "tokenizer.json").read_text())
    assert tok["model"]["merges"]                                         # a BPE with merges
    assert "chat_template" in (out / "qwen3" / "init" / "tokenizer_config.json").read_text() or \
        (out / "qwen3" / "init" / "chat_template.jinja").exists()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_policy(runs, family, engine):
    """2 synchronous steps, one optimizer step per rollout: the ESS of both is 1.0000. The second step's rows
    were sampled after the first update, so its ESS of 1 says the engine was sampling the new weights."""
    out, res = runs[family, engine]
    assert res.returncode == 0, res.stderr[-4000:]
    ess = [v for _, v in scalars(out)["train/ess"]]
    assert len(ess) == 2 and all(round(e, 4) == 1.0 for e in ess), ess
    assert (out / "export" / "model.safetensors").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_export_loads_in_vllm(runs, family, vllm_built):
    """The trained export of the vLLM run loads in vLLM, which samples from it what transformers scores:
    its logprobs equal the exported model's (the weights, the untied head, the RoPE scaling all arrived)."""
    from transformers import AutoModelForCausalLM

    from lit_ess.sampling import SamplingConfig
    from lit_ess.logprobs import sequence_logprobs

    out, res = runs[family, "VLLMConfig"]
    assert res.returncode == 0, res.stderr[-4000:]
    engine = vllm_built(str(out / "export"))
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=1)
    prompt = [5, 17, 40, 3]
    completions = engine.generate([prompt], 2, s)[0]
    model = AutoModelForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    for c in completions:
        ids = torch.tensor([prompt + c.token_ids])
        comp = torch.zeros_like(ids, dtype=torch.bool)
        comp[0, len(prompt):] = True
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), comp)
        torch.testing.assert_close(lp[0, len(prompt):], torch.tensor(c.logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def vllm_built():
    """In-process vLLM engines by model folder, all alive until the module ends."""
    from lit_ess.engines import VLLMConfig

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = VLLMConfig().build(path)
        return cache[path]

    yield get
    cache.clear()
