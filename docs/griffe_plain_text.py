"""A griffe extension for the API pages: the docstrings' aligned plain-text tables render as written.

lit-ess docstrings lay formulas and tables out in aligned columns (`token-mean   sum_{b,t} x m / N`), as
plain text. Markdown would join such lines into one paragraph, and griffe would read a line ending in a
colon followed by indented lines as an admonition. A line at the docstring's margin with a run of 3 or
more spaces inside it starts a block; the block takes the following aligned or indented lines and is
indented 4 spaces, which Markdown shows as preformatted text. A line such as `kind: "nccl" (...)` whose
sentence goes on in indented lines keeps them in its paragraph instead of becoming an admonition titled
by the sentence. The sources stay as they are.
"""
from __future__ import annotations

import re

import griffe

ALIGNED = re.compile(r"^\S.*\S {3,}\S")
TERM = re.compile(r"^[A-Za-z][\w\s-]*:\s+\S")       # "word: text", read by griffe as an admonition's title


def preformat(text: str) -> str:
    out: list[str] = []
    block = term = False
    for line in text.split("\n"):
        if term and line.startswith(" ") and line.strip():
            out.append(line.strip())                      # the sentence goes on: same paragraph
            continue
        term = bool(TERM.match(line)) and not ALIGNED.match(line)
        if ALIGNED.match(line) or (block and line.startswith(" ") and line.strip()):
            if not block and out and out[-1].strip():
                out.append("")
            block = True
            out.append("    " + line)
            continue
        if block and line.strip():
            out.append("")
        block = False
        out.append(line)
    return "\n".join(out)


class PlainTextTables(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = preformat(obj.docstring.value)
