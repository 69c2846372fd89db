"""The documentation: README.md stays a short front page whose links resolve, and the MkDocs site under
docs/ builds with --strict (a broken link or anchor, a page left out of the nav, a docstring mkdocstrings
cannot parse: each fails the build)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")        # [text](target) and ![alt](target)
# the API pages: module -> an object its page must render from the docstrings
API = {"objectives": "lit_ess.objectives.P3O", "module": "lit_ess.module.PolicyModule",
       "datamodules": "lit_ess.datamodules.RolloutDataModule", "engines": "lit_ess.engines.VLLMConfig",
       "callbacks": "lit_ess.callbacks.WeightSync", "rollout": "lit_ess.rollout.RolloutWorker",
       "batch": "lit_ess.batch.RolloutBatch", "sampling": "lit_ess.sampling.SamplingConfig",
       "envs": "lit_ess.envs.EpisodeRunner"}


def test_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move the detail to a page under docs/"
    text = "\n".join(lines)
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text and "mkdocs serve" in text


def test_readme_links_resolve():
    targets = LINK.findall((ROOT / "README.md").read_text())
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "no relative links found: the pattern is wrong"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    for page, obj in API.items():
        html = (site / "api" / page / "index.html").read_text()
        assert f'id="{obj}"' in html, f"api/{page}.md rendered no {obj}"
    # the formulas are MathML made at build time (docs/math_hook.py): none left as LaTeX, no script or style
    # sheet fetched from a network (the site reads offline)
    pages = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("*.html")}
    assert pages["objectives/index.html"].count("<math") >= 6 and "<math" in pages["index.html"]
    for name, html in pages.items():
        text = re.sub(r"<(pre|code)\b.*?</\1>", "", html, flags=re.S)        # code may show a $ or \( as itself
        for left in ("arithmatex", "$$", "\\(", "\\["):
            assert left not in text, f"{name}: a formula left unrendered ({left!r})"
        remote = re.findall(r'<(?:script|link)\b[^>]*(?:src|href)="(?:https?:)?//[^"]*"', html)
        assert not [r for r in remote if "<script" in r or "stylesheet" in r], f"{name} loads from a network: {remote}"


def _merge(base: dict, part: dict) -> dict:
    """`part` over `base`, key by key (a YAML fragment of a page over a whole config); a block that names
    its class_path replaces the one there, as a user replaces the demo's source."""
    out = dict(base)
    for k, v in part.items():
        nested = isinstance(v, dict) and isinstance(base.get(k), dict) and "class_path" not in v
        out[k] = _merge(base[k], v) if nested else v
    return out


def test_own_task_page_blocks_build_as_a_config(tiny_model_dir, tmp_path, monkeypatch):
    """docs/own-task.md: each YAML block over configs/demo.yaml, with its data files and reward file written
    as the page shows them, is parsed and every class it names built, as `lit-ess fit --config` does
    (tests/test_configs.py's dry run); the model is the tiny one (the page names a hub model)."""
    import yaml
    from test_configs import _build

    page = (ROOT / "docs" / "own-task.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, re.S)
    assert len(blocks) >= 7, f"own-task.md has {len(blocks)} YAML blocks"
    plain, chat = re.findall(r"```json\n(.*?)```", page, re.S)
    rows = [json.loads(plain), {"prompt": "What is 2 + 2?", "answer": "4"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "chat.jsonl").write_text(chat.strip() + "\n")
    (tmp_path / "my_reward.py").write_text(re.findall(r"```python\n(.*?)```", page, re.S)[0])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)    # another test's my_reward.py (docs/rewards.md's)
    monkeypatch.setenv("WANDB_MODE", "offline")
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    for i, block in enumerate(blocks):
        cfg = _merge(demo, yaml.safe_load(block))
        cfg["model"]["init_args"]["model_path"] = tiny_model_dir
        cfg["output_dir"] = str(tmp_path / f"run{i}")
        cli = _build(cfg, tmp_path)
        dm = cli.datamodule
        assert len(dm.source.examples) >= 1, block
        if "my_reward:score" in block:
            from lit_ess.rewards import resolve_reward
            assert resolve_reward(dm.reward_name)("so 51 #### 51", "51") == 1.0
        if "messages" in block:
            assert dm.chat.system_prompt and isinstance(dm.source.examples[0].prompt, list)
