"""Multi-turn environments and episodes, token in, token out.

    base.py         Environment (reset / step), Action, Step, EnvError
    config.py       EnvConfig: which environment (by class and arguments, or a built-in name), the runner's limits
    single_turn.py  SingleTurn: prompt -> completion -> reward as a one-turn environment
    arithmetic.py   RetryArithmetic (feedback, retries) and Calculator (a tool call) on the arithmetic task
    tokens.py       prompt and observation token ids (chat-template deltas), never re-encoding the policy's
    episodes.py     EpisodeRunner (batched turns, timed environment steps, limits), Episode, collate_episodes
    agent.py        Agent, AgentRunner: a user's function plays episodes through an OpenAI-compatible URL
    proxy.py        that URL: /v1/chat/completions and /v1/completions, recorded token in, token out
    verifiers_env.py  Verifiers: a `verifiers` environment's own run() played turn by turn, its rubric the reward
    openenv_env.py  OpenEnv: an OpenEnv environment's reset/step (a server's sessions, or a class in process)

The last two need the `envs` extra and are named by path (class_path: lit_ess.envs.verifiers_env.Verifiers), not
imported here.
"""
from .agent import Agent, AgentRunner, make_runner
from .arithmetic import Calculator, RetryArithmetic
from .base import Action, EnvError, Environment, Step
from .config import EnvConfig, resolve_env
from .episodes import Episode, EpisodeRunner, collate_episodes, episode_stats, to_row
from .single_turn import SingleTurn
from .tokens import EpisodeTokens, TemplateError

__all__ = ["Action", "Agent", "AgentRunner", "Calculator", "EnvConfig", "EnvError", "Environment", "Episode",
           "EpisodeRunner", "EpisodeTokens", "RetryArithmetic", "SingleTurn", "Step", "TemplateError", "collate_episodes",
           "episode_stats", "make_runner", "resolve_env", "to_row"]
