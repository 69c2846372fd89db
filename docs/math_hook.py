"""MkDocs hook: the formulas of the pages as MathML, made when the site is built, so they render without
a network or a script (browsers draw MathML natively).

pymdownx.arithmatex (generic mode, mkdocs.yml) finds the formulas, `$$ ... $$` blocks and `\\( ... \\)`
inline, and leaves them as `<div class="arithmatex">\\[ ... \\]</div>` and
`<span class="arithmatex">\\( ... \\)</span>`; this hook turns each into `<math>` with latex2mathml (pure
Python). A formula it cannot convert fails the build, naming the page and the formula.
"""
from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

FORMULA = re.compile(r'<(div|span) class="arithmatex">\\([\[(])(.*?)\\[\])]</\1>', re.S)


def on_page_content(content: str, page, **kwargs) -> str:
    def mathml(m: re.Match) -> str:
        latex = html.unescape(m.group(3)).strip()
        try:
            return convert(latex, display="block" if m.group(2) == "[" else "inline")
        except Exception as e:              # latex2mathml raises its own errors and IndexError/KeyError alike
            raise ValueError(f"{page.file.src_path}: formula {latex!r} is not LaTeX latex2mathml reads: {e}") from e

    return FORMULA.sub(mathml, content)
