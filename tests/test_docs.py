"""The documentation: README.md stays a short front page whose links resolve, and the MkDocs site under
docs/ builds with --strict (a broken link or anchor, a page left out of the nav, a docstring mkdocstrings
cannot parse: each fails the build)."""
from __future__ import annotations

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
