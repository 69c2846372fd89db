"""Chat datasets: prompts as lists of {"role", "content"} messages, rendered with the model's chat template.

The tiny qwen2.5 model has a BPE tokenizer with a ChatML template (lit_ess.tiny.CHAT_TEMPLATE); the
rendered prompts below are written out by hand from that template."""
from __future__ import annotations

import json
import warnings

import pytest
import yaml

from e2e_utils import cli_each, rl_config, scalars, write_config
from lit_ess.chat import ChatFormat
from lit_ess.datamodules import HFPrompts, RolloutDataModule
from lit_ess.datamodules.prompts import check_chat, encode_prompt
from lit_ess.engines import HFConfig
from lit_ess.datamodules.settings import BatchShape

SYS = {"role": "system", "content": "Be brief."}
ROWS = [{"prompt": [SYS, {"role": "user", "content": "1+1="}], "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},
        {"prompt": "3+3=", "answer": "6"}]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny Qwen2.5 (one layer, width 64) with the BPE chat tokenizer."""
    from lit_ess.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("chat") / "model", family="qwen2.5", hidden_size=64,
                                num_layers=1, num_heads=1, max_position_embeddings=512))


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rendered(tok, prompt, chat=ChatFormat()):
    ids = encode_prompt(tok, prompt, chat)
    text = tok.decode(ids)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]       # the text below is exactly these ids
    return text


def test_chat_rows_are_read_and_rendered_with_the_template(tmp_path, tok):
    """Before: a list-valued prompt was a malformed row, so a chat file had no usable rows."""
    src = HFPrompts(jsonl(tmp_path / "chat.jsonl", ROWS))
    assert [e.prompt for e in src.examples] == [r["prompt"] for r in ROWS] and src.skipped == 0
    assert rendered(tok, src.examples[0].prompt) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                     "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")
    assert rendered(tok, src.examples[1].prompt) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    # a text prompt is one user message, as before
    assert rendered(tok, "3+3=") == "<|im_start|>user\n3+3=<|im_end|>\n<|im_start|>assistant\n"


def test_chat_rows_from_parquet_and_a_local_datasets_folder(tmp_path):
    """Parquet keeps the messages as a list of structs; a folder goes through `datasets.load_dataset`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [r for r in ROWS if isinstance(r["prompt"], list)]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    folder = tmp_path / "dataset"
    folder.mkdir()
    jsonl(folder / "train.jsonl", chat)
    for path in (str(tmp_path / "chat.parquet"), str(folder)):
        src = HFPrompts(path)
        assert [e.prompt for e in src.examples] == [r["prompt"] for r in chat] and src.skipped == 0, path


def test_system_prompt_is_added_where_a_prompt_has_none(tmp_path, tok):
    chat = ChatFormat(system_prompt="Think.")
    head = "<|im_start|>system\nThink.<|im_end|>\n"
    assert rendered(tok, "3+3=", chat) == head + "<|im_start|>user\n3+3=<|im_end|>\n<|im_start|>assistant\n"
    assert rendered(tok, ROWS[1]["prompt"], chat) == head + "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    # a row's own system message is kept, and setup says so once, with the count
    assert rendered(tok, ROWS[0]["prompt"], chat).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    src = HFPrompts(jsonl(tmp_path / "chat.jsonl", ROWS))
    with pytest.warns(UserWarning, match="system_prompt is not used for 1 of 3 prompts: they have their own"):
        check_chat(tok, chat, [src])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_chat(tok, ChatFormat(), [src])                       # no system_prompt: nothing to say


def test_the_sft_warm_start_renders_prompts_as_rl_does(tmp_path, chat_model_dir, tok):
    from lit_ess.datamodules import SFTDataModule

    chat = ChatFormat(system_prompt="Think.")
    src = HFPrompts(jsonl(tmp_path / "chat.jsonl", ROWS))
    dm = SFTDataModule(model_path=chat_model_dir, source=src, chat=chat)
    dm.setup("fit")
    assert [p for p, _ in dm.items] == [encode_prompt(tok, e.prompt, chat) for e in src.examples]
    assert tok.decode(dm.items[1][0]).startswith("<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\n2+2=")


def test_chat_template_kwargs_reach_the_template(tok):
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                         "<think>\n\n</think>\n\n{% endif %}")
    assert rendered(tok, "1+1=").endswith("assistant\n")
    assert rendered(tok, "1+1=", ChatFormat(chat_template_kwargs={"enable_thinking": False})).endswith(
        "assistant\n<think>\n\n</think>\n\n")


def test_the_template_can_be_turned_off_for_text_prompts(tmp_path, tok):
    off = ChatFormat(use_template=False)
    assert encode_prompt(tok, "3+3=", off) == tok("3+3=")["input_ids"]      # plain text (this tokenizer has no bos)
    with pytest.raises(ValueError, match="the prompts are chat messages, but data.chat.use_template is false"):
        encode_prompt(tok, ROWS[1]["prompt"], off)


@pytest.mark.parametrize("kwargs, says", [
    ({"use_template": False, "system_prompt": "x"}, "chat.system_prompt needs the chat template, but chat.use_template is false"),
    ({"use_template": False, "chat_template_kwargs": {"enable_thinking": False}}, "chat.chat_template_kwargs needs the chat"),
    ({"system_prompt": "  "}, "chat.system_prompt must be a non-empty string or null"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, r"\['add_generation_prompt'\] are set by lit-ess"),
    ({"chat_template_kwargs": {1: True}}, "chat.chat_template_kwargs must be a mapping of names"),
    ({"use_template": "no"}, "chat.use_template must be true or false"),
])
def test_chat_knobs_are_validated_in_one_line(kwargs, says):
    with pytest.raises(ValueError, match=says) as e:
        ChatFormat(**kwargs)
    assert "\n" not in str(e.value)


def test_a_model_without_a_chat_template_refuses_chat_rows_in_one_line(tmp_path, tiny_model_dir):
    """The byte-level tiny model has no chat template: its data module refuses at setup, before any engine."""
    src = HFPrompts(jsonl(tmp_path / "chat.jsonl", ROWS))
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=src, batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2))
    with pytest.raises(ValueError) as e:
        dm.setup("fit")
    assert str(e.value).startswith(f"the prompts are chat messages, but the model {tiny_model_dir!r} has no chat "
                                   f"template: use a chat model") and "\n" not in str(e.value)
    text = HFPrompts(jsonl(tmp_path / "text.jsonl", ROWS[2:]))
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=text, chat=ChatFormat(system_prompt="x"),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2))
    with pytest.raises(ValueError, match="data.chat.system_prompt is set, but the model .* has no chat template"):
        dm.setup("fit")


def test_malformed_rows_say_what_was_wrong(tmp_path):
    """Before: 'no usable rows with fields 'prompt' and 'answer' (...): set prompt_field / answer_field',
    pointing at fields that were right."""
    user = {"role": "user", "content": "1+1="}
    bad = [{"prompt": [user, {"role": "assistant"}], "answer": "2"},
           {"prompt": [user, {"role": "assistant"}], "answer": "2"},
           {"prompt": [user, "hi"], "answer": "2"},
           {"prompt": [], "answer": "2"},
           {"prompt": [{"content": "1+1="}], "answer": "2"},
           {"prompt": [{"role": "user", "content": [{"type": "text", "text": "1+1="}]}], "answer": "2"},
           {"prompt": [user]},
           {"prompt": {"text": "1+1="}, "answer": "2"},
           {"prompt": [user], "answer": ""}]
    with pytest.raises(ValueError) as e:
        HFPrompts(jsonl(tmp_path / "bad.jsonl", bad))
    msg = str(e.value)
    for reason in ["2 rows: prompt is a list but message 2 has no 'content'",
                   "1 row: prompt is a list but message 2 is a str, not a {'role', 'content'} object",
                   "1 row: prompt is an empty list", "1 row: prompt is a list but message 1 has no 'role'",
                   "1 row: prompt is a list but message 1's 'content' is a list, not text (content parts are not supported)",
                   "1 row: field 'answer' missing", "1 row: prompt is a dict, neither text nor a list of messages",
                   "1 row: answer is empty"]:
        assert reason in msg, (reason, msg)
    assert "9 malformed rows skipped" in msg and "\n" not in msg
    assert "set prompt_field" in msg                            # a field is missing in some row: the hint is due
    with pytest.warns(UserWarning, match="1 malformed row skipped \\(1 row: prompt is a list but message 2 has no"):
        good = HFPrompts(jsonl(tmp_path / "mixed.jsonl", bad[:1] + ROWS))      # skip and count, as before
    assert len(good) == 3 and good.skipped == 1
    assert good.describe_skips() == "1 row: prompt is a list but message 2 has no 'content'"
    with pytest.raises(ValueError) as e:
        HFPrompts(jsonl(tmp_path / "messages.jsonl", bad[:2]))
    assert "set prompt_field" not in str(e.value) and "2 rows: prompt is a list but message 2" in str(e.value)


def test_a_text_template_is_refused_for_chat_rows(tmp_path):
    with pytest.raises(ValueError, match="HFPrompts.template='Q: {prompt}' formats text prompts"):
        HFPrompts(jsonl(tmp_path / "chat.jsonl", ROWS), template="Q: {prompt}")


def test_an_environment_refuses_chat_prompts(tmp_path, tiny_model_dir):
    from lit_ess.envs import EnvConfig

    with pytest.raises(ValueError, match="env: an environment starts its episodes from text prompts"):
        RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=HFPrompts(jsonl(tmp_path / "c.jsonl", ROWS)),
                          env=EnvConfig(env="retry_arithmetic"))


def test_fit_on_a_chat_jsonl_from_a_yaml_config(tmp_path, chat_model_dir):
    """`lit-ess fit` on the tiny chat model, reading a chat .jsonl with a system prompt and template kwargs; the
    printed config shows the chat knobs (defaults, and the values given)."""
    rows = ROWS + [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(4, 8)]
    rows.append({"prompt": [{"role": "user"}], "answer": "0"})                  # malformed: skipped and counted
    data = jsonl(tmp_path / "chat.jsonl", rows)
    cfg = rl_config(chat_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=4, samples=2)
    cfg["data"]["init_args"]["source"] = {"class_path": "lit_ess.datamodules.HFPrompts", "init_args": {"path": data}}
    plain = write_config(cfg, tmp_path / "plain.yaml")
    cfg["data"]["init_args"]["chat"] = {"system_prompt": "Answer with a number.",
                                        "chat_template_kwargs": {"enable_thinking": False}}
    path = write_config(cfg, tmp_path / "config.yaml")
    # both configs printed, then the run, in one process (e2e_utils.cli_each): one start of Lightning, not two
    printed = cli_each({"plain": (["fit", "--config", str(plain), "--print_config"], None),
                        "chat": (["fit", "--config", str(path), "--print_config"], None),
                        "fit": (["fit", "--config", str(path)], None)})
    for key, want in (("plain", {"use_template": True, "system_prompt": None, "chat_template_kwargs": {}}),
                      ("chat", {"use_template": True, "system_prompt": "Answer with a number.",
                                "chat_template_kwargs": {"enable_thinking": False}})):
        assert printed[key].returncode == 0, printed[key].stderr[-3000:]
        assert yaml.safe_load(printed[key].stdout)["data"]["init_args"]["chat"] == want
    res = printed["fit"]
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    assert len(s["train/loss"]) == 2 and [v for _, v in s["data/skipped_rows"]] == [1.0, 1.0]
    hparams = yaml.safe_load(next(tmp_path.glob("tb/run/hparams.yaml")).read_text())
    assert hparams["chat"]["system_prompt"] == "Answer with a number."
