"""Prompt sources: a list of (prompt, answer) examples for the rollout DataModule.

    Arithmetic         built-in verifiable task for CPU runs ("37+85=" -> "122")
    CalculatorTranscripts  the Calculator environment's two policy turns per problem, for its warm start
    HFPrompts          a Hugging Face `datasets` name, or local json / jsonl / parquet / csv files

A prompt is text or a conversation (a list of {"role", "content"} messages; lit_ess.chat). Malformed
rows (missing field, non-text value, empty prompt or answer, a message without role or content) are
skipped and counted in `skipped`, with what was wrong in `skip_reasons`. Local files are read as text: an answer is the file's own characters ("007" stays "007",
and a blank cell does not turn the other answers of a CSV into floats).
"""
from __future__ import annotations

import csv
import glob
import hashlib
import json
import random
import warnings
from pathlib import Path
from typing import Literal

from lit_ess.chat import ChatFormat, has_system, message_problem
from lit_ess.envs.arithmetic import Calculator, calculate
from lit_ess.envs.base import Example     # its home: what an environment starts an episode from
from lit_ess.envs.tokens import encode_prompt  # noqa: F401  (its home: the episodes' tokens)
from lit_ess.knobs import check


class PromptOrder:
    """The order prompts are drawn in: epoch after epoch, the indices 0..size-1 shuffled by one
    `random.Random(seed)`, read by a cursor. Its state (order, cursor, rng) goes in checkpoints."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.rng, self.order, self.cursor = size, random.Random(seed), [], 0

    def take(self, k: int) -> list[int]:
        """The next k indices (a new shuffled epoch starts when one runs out)."""
        out = []
        while len(out) < k:
            if self.cursor >= len(self.order):
                self.order = list(range(self.size))
                self.rng.shuffle(self.order)
                self.cursor = 0
            out.append(self.order[self.cursor])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "order": self.order, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.order = state["cursor"], list(state["order"])
        self.rng.setstate(_as_tuple(state["rng"]))


def _as_tuple(x):
    """random.Random state survives torch.save as nested lists/tuples; setstate wants tuples."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class PromptSource:
    """Base class: `examples` (list of Example) and `skipped` (rows dropped as malformed)."""

    examples: list[Example]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.examples)


class Arithmetic(PromptSource):
    """Integer arithmetic prompts like '37+85=' with exact answers.

    Args:
        digits: maximum digits of each operand, >= 1.
        ops: operators to draw from ("+", "-", "*").
        size: number of distinct examples (drawn without replacement where possible), >= 1.
        seed: draws the example pool (an integer >= 0).
        split: "all", or "train" / "test": two disjoint parts of the problem space (a fixed hash of
            each problem puts `test_frac` of them in "test", whatever the seed and size), so a
            held-out set never shares a problem with training.
        test_frac: share of the problem space in the "test" split, in (0, 1).
    """

    def __init__(self, digits: int = 2, ops: str = "+", size: int = 10_000, seed: int = 0,
                 split: Literal["all", "train", "test"] = "all", test_frac: float = 0.05):
        bad = set(ops) - set("+-*")
        if bad or not ops:
            raise ValueError(f"Arithmetic.ops must use only '+', '-', '*', got {ops!r}")
        check("Arithmetic.digits", digits, ge=1, integer=True)
        check("Arithmetic.size", size, ge=1, integer=True)
        check("Arithmetic.seed", seed, ge=0, integer=True)
        if split not in ("all", "train", "test"):
            raise ValueError(f"Arithmetic.split must be 'all', 'train' or 'test', got {split!r}")
        check("Arithmetic.test_frac", test_frac, gt=0, lt=1)
        hi = 10 ** digits
        total = hi * hi * len(ops)
        rng = random.Random(seed)
        def problem(code: int) -> tuple[int, str, int]:
            a, b = divmod(code % (hi * hi), hi)
            return a, ops[code // (hi * hi)], b

        def keep(code: int) -> bool:
            return split == "all" or _in_test(*problem(code), test_frac) == (split == "test")

        if split == "all":
            codes = rng.sample(range(total), min(size, total))
        elif total <= 1_000_000:
            pool = [c for c in range(total) if keep(c)]
            codes = rng.sample(pool, min(size, len(pool)))
        else:                                 # a huge space: draw, keep this split's, until `size`
            if size > total * min(test_frac, 1 - test_frac) / 2:
                raise ValueError(f"Arithmetic: size={size} is too close to the {split} split's share of the "
                                 f"{total} problems; lower size")
            seen: set[int] = set()
            codes = []
            while len(codes) < size:
                c = rng.randrange(total)
                if c not in seen and keep(c):
                    codes.append(c)
                seen.add(c)
        self.examples = []
        for code in codes:
            a, op, b = problem(code)
            self.examples.append(Example(f"{a}{op}{b}=", str(eval_op(a, op, b))))
        self.skipped = 0


class CalculatorTranscripts(PromptSource):
    """Tool-use transcripts for the Calculator environment (lit_ess.envs), as (prompt, answer) pairs for
    SFT: each problem of `source` becomes the policy's two turns of an episode that calls the tool,

        prompt                            answer (trained)
        37*85=                            calc(37*85)
        37*85=calc(37*85)3145\n37*85=     3145

    The second prompt is the episode so far, the environment's inserted '3145\n37*85=' included, so
    the inserted tokens are context (not trained) exactly as in RL. With a byte-level tokenizer its
    ids are the episode's ids (prompt, turn, observation) token for token. SFT ends each answer with
    eos; RL stops the call turn at ')' (sampling.stop), so the eos after a call is never sampled.

    Args:
        source: problems whose prompts end in '=' before an expression the calculator evaluates to the
            answer (e.g. lit_ess.datamodules.Arithmetic with ops "*").
    """

    def __init__(self, source: PromptSource):
        self.examples, self.skipped = [], source.skipped
        for ex in source.examples:
            expr = ex.prompt[:-1] if ex.prompt.endswith("=") else None
            value = calculate(expr) if expr is not None else None
            if value is None or str(value) != ex.answer.strip():
                raise ValueError(f"CalculatorTranscripts.source: {ex.prompt!r} -> {ex.answer!r} is not "
                                 f"'<expression>=' with the calculator's value as its answer")
            call = f"calc({expr})"
            after = ex.prompt + call + Calculator.observation(str(value), ex.prompt)
            self.examples += [Example(ex.prompt, call), Example(after, ex.answer)]


def _in_test(a: int, op: str, b: int, test_frac: float) -> bool:
    """Whether the problem `a op b` belongs to the test split: a fixed hash of the problem itself, so
    the split does not depend on digits, ops, seed or size."""
    h = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2 ** 64 < test_frac


def eval_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class HFPrompts(PromptSource):
    """Prompts from a `datasets` name (e.g. "openai/gsm8k" with name="main") or local data files.

    A row's prompt is text, or a conversation: a list of `{"role", "content"}` messages (TRL's and
    verl's conversational format), with or without a system message. A conversation is rendered with
    the model's chat template and its generation prompt; `data.chat` (lit_ess.chat.ChatFormat) adds a
    system prompt, passes template kwargs, or turns the template off for text prompts.

    Local files (.json, .jsonl, .parquet, .csv) are read here, not by `datasets`, so every value is
    kept as written: CSV cells are text, JSON numbers keep their spelling, and a malformed line is
    named by file and line number. Malformed rows are skipped and counted (`skipped`); `skip_reasons`
    says what was wrong with them (reason -> rows), in a warning when some rows are usable and in the
    error when none is.

    Args:
        path: dataset name, a local dataset folder, or a file / glob / list of files (.json, .jsonl,
            .parquet, .csv).
        name: dataset configuration name.
        split: split to read (a hub dataset's; local files are one split, "train").
        prompt_field: column holding the prompt (text, or a list of messages).
        answer_field: column holding the reference answer.
        template: Python format string applied to text prompts, e.g. "{prompt}\\nAnswer:" (chat prompts
            are not formatted: with chat rows it must stay "{prompt}").
        limit: keep at most this many rows (>= 1); None = all.
    """

    FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

    def __init__(self, path: str | list[str], name: str | None = None, split: str = "train",
                 prompt_field: str = "prompt", answer_field: str = "answer", template: str = "{prompt}",
                 limit: int | None = None):
        check("HFPrompts.limit", limit, ge=1, integer=True, null=True)
        files = [path] if isinstance(path, str) else list(path)
        suffixes = {Path(f).suffix for f in files}
        if len(suffixes) == 1 and suffixes.pop() in self.FILE_TYPES:
            if split != "train":
                raise ValueError(f"HFPrompts(split={split!r}): local files form one split, 'train'; give the "
                                 f"held-out rows as their own file")
            rows = (row for f in _expand(files) for row in _read_rows(f))
        else:
            import datasets

            rows = iter(datasets.load_dataset(files[0], name, split=split))
        self.examples, self.skipped, self.skip_reasons = [], 0, {}
        columns = None
        for row in rows:
            columns = columns or list(row)
            example, problem = _example(row, prompt_field, answer_field, template)
            if problem is not None:
                self.skipped += 1
                self.skip_reasons[problem] = self.skip_reasons.get(problem, 0) + 1
                continue
            self.examples.append(Example(example.prompt, example.answer, dict(row)))    # columns: for rewards
            if limit is not None and len(self.examples) >= limit:
                break
        if columns is None:
            raise ValueError(f"HFPrompts({path!r}) holds no rows (an empty file?): give a file with one example per row")
        if not self.examples:
            missing = any(r.startswith("field ") for r in self.skip_reasons)
            hint = f"; the rows have fields {columns}: set prompt_field / answer_field" if missing else ""
            raise ValueError(f"HFPrompts({path!r}): no usable rows ({self.skipped} malformed rows skipped: "
                             f"{self.describe_skips()}){hint}")
        if self.skipped:
            warnings.warn(f"HFPrompts({path!r}): {self.skipped} malformed row{'s' if self.skipped > 1 else ''} skipped "
                          f"({self.describe_skips()}); "
                          f"they are counted in data/skipped_rows", stacklevel=2)
        if template != "{prompt}" and any(isinstance(e.prompt, list) for e in self.examples):
            raise ValueError(f"HFPrompts.template={template!r} formats text prompts, and the rows' prompts are chat "
                             f"messages: leave template out and put the instruction in the messages or in "
                             f"data.chat.system_prompt")

    def describe_skips(self) -> str:
        """The reasons rows were skipped, most frequent first: "48 rows: field 'answer' missing; ..."."""
        top = sorted(self.skip_reasons.items(), key=lambda kv: -kv[1])
        return "; ".join(f"{n} row{'s' if n > 1 else ''}: {reason}" for reason, n in top)


def _example(row: dict, prompt_field: str, answer_field: str, template: str) -> tuple[Example | None, str | None]:
    """A row as an Example, or what is wrong with it (one reason, in words)."""
    problems = []
    prompt = row.get(prompt_field)
    if prompt is None:
        problems.append(f"field {prompt_field!r} missing" if prompt_field not in row else f"{prompt_field} is null")
    elif isinstance(prompt, list):
        if (problem := message_problem(prompt, prompt_field)) is not None:
            problems.append(problem)
    elif (text := _text(prompt)) is None:
        problems.append(f"{prompt_field} is a {type(prompt).__name__}, neither text nor a list of messages")
    elif not text.strip():
        problems.append(f"{prompt_field} is empty")
    else:
        prompt = template.format(prompt=text)
    answer = row.get(answer_field)
    if answer is None:
        problems.append(f"field {answer_field!r} missing" if answer_field not in row else f"{answer_field} is null")
    elif (answer := _text(answer)) is None:
        problems.append(f"{answer_field} is a {type(row[answer_field]).__name__}, not text")
    elif not answer.strip():
        problems.append(f"{answer_field} is empty")
    if problems:
        return None, "; ".join(problems)
    return Example(prompt, answer), None


def _text(value) -> str | None:
    """A prompt or answer as text: strings as they are, numbers in their own spelling; None for a
    missing value or a nested one (dict, list)."""
    if value is None or isinstance(value, (dict, list, bytes)):
        return None
    return value if isinstance(value, str) else str(value)


def check_chat(tokenizer, chat: ChatFormat, sources: list[PromptSource | None]) -> None:
    """At start, what `encode_prompt` would refuse at the first such prompt (chat prompts or a system
    prompt without a chat template, a template that refuses the messages), on one prompt of each kind;
    and a warning, once, when rows keep their own system message over `chat.system_prompt`."""
    examples = [e for s in sources if s is not None for e in s.examples]
    chats = [e.prompt for e in examples if isinstance(e.prompt, list)]
    texts = [e.prompt for e in examples if isinstance(e.prompt, str)]
    for prompt in chats[:1] + texts[:1]:
        encode_prompt(tokenizer, prompt, chat)
    own = sum(has_system(p) for p in chats)
    if chat.system_prompt is not None and own:
        warnings.warn(f"data.chat.system_prompt is not used for {own} of {len(examples)} prompts: they have their "
                      f"own system message, which is kept", stacklevel=2)


def _expand(files: list[str]) -> list[str]:
    """Files and globs as a list of existing files (a glob in sorted order)."""
    out = []
    for f in files:
        hits = sorted(glob.glob(f)) if glob.has_magic(f) else [f] if Path(f).is_file() else []
        if not hits:
            raise FileNotFoundError(f"HFPrompts: no such file {f!r}")
        out.extend(hits)
    return out


def _read_rows(file: str):
    """The rows of one local file as dicts of text (csv), JSON values with numbers as written
    (json, jsonl), or parquet values."""
    suffix = Path(file).suffix
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(file).to_pylist()
        return
    with open(file, encoding="utf-8-sig", newline="" if suffix == ".csv" else None) as f:
        if suffix == ".csv":
            for row in csv.DictReader(f):
                yield {k: v for k, v in row.items() if k is not None}
            return
        text = f.read()
    as_text = {"parse_int": str, "parse_float": str}
    if suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            data = json.loads(text, **as_text)
        except json.JSONDecodeError:
            data = None                   # perhaps JSON lines in a .json file: read line by line below
        if isinstance(data, list):
            yield from (r if isinstance(r, dict) else {} for r in data)
            return
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            yield from (dict(zip(data, values)) for values in zip(*data.values()))     # columns
            return
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, **as_text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}, line {line_no}: not valid JSON ({e.msg} at column {e.colno}): fix or "
                             f"remove that line") from None
        yield row if isinstance(row, dict) else {}
