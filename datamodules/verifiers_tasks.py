"""A `verifiers` environment's taskset as a prompt source (the `verifiers` package, `pip install 'lit-ess[envs]'`),
for episodes played by lit_ess.envs.verifiers_env.Verifiers (data.env).

    VerifiersTasks(env={taskset: {id: vf_retry_arithmetic, size: 1000}, player: {max_turns: 3}})

`env` is a verifiers EnvConfig as a dict (what `vf-eval`'s `[env]` block or `--env.*` flags give: the taskset
id and its settings, the seats, the env's knobs), loaded by verifiers' own loader (`vf.load_environment`).
Each task of its taskset is one example: its prompt text (or its name) labels the example, and the row
carries the env's config and the task's key (columns `verifiers_env`, `verifiers_task`), from which
the environment plays the episode: the first observation the policy sees is what the env's `run()` asks
first, not the label.
"""
from __future__ import annotations

from lit_ess.envs.base import Example
from lit_ess.envs.verifiers_env import load
from lit_ess.knobs import check

from .prompts import PromptSource


class VerifiersTasks(PromptSource):
    """The tasks of a verifiers environment's taskset, each an example its episodes start from.

    Args:
        env: the verifiers environment's config as a dict, e.g. {taskset: {id: NAME, ...its settings},
            player: {max_turns: 3}}; `taskset.id` names the taskset package (verifiers' built-ins, an
            installed environment, or a module beside the config, e.g. configs/vf_retry_arithmetic.py).
        limit: keep the first `limit` tasks (>= 1); None = all (the taskset must be finite).
    """

    def __init__(self, env: dict, limit: int | None = None):
        check("VerifiersTasks.limit", limit, ge=1, integer=True, null=True)
        if not isinstance(env, dict) or not isinstance(env.get("taskset"), dict) or not env["taskset"].get("id"):
            raise ValueError(f"VerifiersTasks.env must be a verifiers env config with a taskset id, e.g. "
                             f"{{taskset: {{id: vf_retry_arithmetic}}}}, got {env!r}")
        _, tasks = load(env)
        if not tasks:
            raise ValueError(f"VerifiersTasks: the taskset {env['taskset']['id']!r} holds no task")
        self.skipped, self.examples = 0, []
        for i, task in enumerate(list(tasks.values())[:limit]):
            label = task.data.prompt_text or task.data.name or f"task {i}"
            self.examples.append(Example(label, "", {"verifiers_env": env, "verifiers_task": task.key}))
