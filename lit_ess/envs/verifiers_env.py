"""A `verifiers` environment (the `verifiers` package's v1 API, `pip install 'lit-ess[envs]'`) played by the
policy token in, token out: its Env's own `run()` holds the exchange, its Task's rubric (`@vf.reward`
methods, and whatever `run()` or `finalize()` records on the trace) is the episode's reward.

    source: {class_path: lit_ess.datamodules.VerifiersTasks, init_args: {env: {taskset: {id: ...}}}}
    env:    {env: {class_path: lit_ess.envs.verifiers_env.Verifiers, init_args: {max_turns: 3}}, max_turns: 3}

How. verifiers runs an episode as `Env.run(task, agents)`, a coroutine in which each agent (seat) plays
through `agent.run(task)` (one reply to the task's prompt) or `agent.interaction(task)` (`turn(message)`
returns the next reply: a multi-turn exchange). Its own agents send every model call through an
OpenAI-compatible client and a harness program; here each seat is a stand-in (`_Seat`) whose turns are the
episode runner's turns: `reset` starts `run()` on an event loop of this process and returns the messages
of its first turn as the first observation, `step` hands the policy's reply (the text of the ids the engine
sampled; the runner keeps the ids) back to `run()` and returns the next turn's messages, or, once `run()`
ends, the trace's reward (`Task.score` on the trace built from the exchange, then `Env.finalize`). So no
OpenAI client and no re-tokenised conversation: the runner appends each new message as the chat template's
delta (lit_ess/envs/tokens.py) and trains the sampled ids.

What a stand-in seat does not do: run a harness program (tools through MCP, code in a sandbox), a judge that
calls a model, or a second model seat. An env with more than one seat is refused at start; tool messages
and rewards that need a runtime do not occur here (verifiers skips runtime-dependent rewards without one).
The seat's `max_turns` (verifiers' AgentConfig), else this adapter's, ends the exchange the way verifiers'
own limit does: the turn after the last one comes back `terminated`, and `run()` goes on to score.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
from contextlib import asynccontextmanager

from .base import Action, Environment, Example, Step

INSTALL = "pip install 'lit-ess[envs]' (or verifiers)"
_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_ENVS: dict[str, tuple[object, list]] = {}


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"the verifiers adapter needs the verifiers package ({e}): {INSTALL}") from None
    return vf


def load(env: dict) -> tuple[object, dict]:
    """The verifiers Env of config `env` (a verifiers EnvConfig as a dict: taskset id and settings, seats, env
    knobs) and its taskset's tasks by their own key, in the taskset's order, loaded once per process (the prompt
    source and every episode share them; a task is found by its key, so a taskset loaded again in another
    process, in another order, still gives each example its task)."""
    key = json.dumps(env, sort_keys=True)
    with _LOCK:
        if key not in _ENVS:
            vf = _verifiers()
            try:
                loaded = vf.load_environment(vf.resolve_env_config(env))
            except Exception as e:
                raise ValueError(f"verifiers cannot load the environment {env}: {type(e).__name__}: "
                                 f"{' '.join(str(e).split())}") from None
            from verifiers.v1.configs.agent import agent_config_fields

            seats = list(agent_config_fields(loaded.config))
            if len(seats) != 1:
                raise ValueError(f"verifiers environment {loaded.config.env_id!r} has seats {seats}; lit-ess plays "
                                 f"one policy seat, its turns token in, token out")
            if not loaded.taskset.bounded:
                raise ValueError(f"verifiers taskset {loaded.config.taskset.id!r} is infinite: bound it in its config "
                                 f"(e.g. its size) so the prompt source can hold its tasks")
            tasks = {}
            for task in loaded.taskset:
                if task.key in tasks:
                    raise ValueError(f"verifiers taskset {loaded.config.taskset.id!r} has two tasks with key "
                                     f"{task.key!r}: lit-ess finds an episode's task by its key")
                tasks[task.key] = task
            _ENVS[key] = (loaded, tasks)
        return _ENVS[key]


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop per process, in a daemon thread, that runs every episode's `Env.run()`."""
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, daemon=True, name="lit-ess-verifiers").start()
        return _LOOP


def _text(messages) -> list[dict[str, str]]:
    """verifiers messages (typed, or wire dicts) as the runner's {'role', 'content'} text messages."""
    from verifiers.v1.types import ToolMessage, content_text

    out = []
    for m in messages:
        if isinstance(m, dict):
            from verifiers.v1.dialects import parse_message

            m = parse_message(m)
        if isinstance(m, ToolMessage):
            raise ValueError("a tool message: tools (a harness program with MCP servers) are not played by lit-ess")
        out.append({"role": m.role, "content": content_text(m.content) or ""})
    return out


class _Exchange:
    """The hand-off between an episode's `run()` (on the event loop) and the runner's threads: `run()` asks
    (`ask`: the messages of a turn), the runner answers (`answer`: the policy's reply). `events` carries
    ("ask", messages), ("done", reward) or ("error", exception) to the runner."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.events, self.reply, self.traces = loop, queue.Queue(), None, []

    async def ask(self, messages: list[dict[str, str]]) -> str:
        self.reply = self.loop.create_future()
        self.events.put(("ask", messages))
        return await self.reply

    def answer(self, text: str) -> None:
        self.loop.call_soon_threadsafe(self.reply.set_result, text)


class _Seat:
    """A verifiers agent seat whose turns are the policy's, through the runner (`_Exchange`)."""

    trainable = True

    def __init__(self, name: str, config, exchange: _Exchange, max_turns: int):
        self.name, self.config, self.exchange = name, config, exchange
        self.max_turns = min(max_turns, config.max_turns or max_turns)

    async def run(self, task, **_) -> object:
        """One segment: the policy's reply to the task's prompt (verifiers' `Agent.run`)."""
        if task.data.prompt is None:
            raise ValueError(f"task {task.data.name!r} has no prompt: a seat's run() answers the task's prompt")
        async with self.interaction(task) as talk:
            await talk.turn()
        return talk.trace

    @asynccontextmanager
    async def interaction(self, task, **_):
        """A turn-by-turn exchange (verifiers' `Agent.interaction`): scored when it closes."""
        talk = _Interaction(self, task)
        try:
            yield talk
        finally:
            await talk.close()


class _Interaction:
    """verifiers' `Interaction` for a stand-in seat: `turn(message)` -> the reply as a `Segment`; a real
    `Trace` records the exchange (prompt and user messages, the policy's replies as sampled nodes)."""

    def __init__(self, seat: _Seat, task):
        import verifiers.v1 as vf

        self.seat, self.task, self.turns, self.started, self.closed = seat, task, 0, False, False
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                hash=task.hash),
                              agent=vf.AgentInfo(config=seat.config, name=seat.name))

    def _add(self, message, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(message=message, parent=parent, sampled=sampled))

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        new = []
        if not self.started:
            self.started = True
            data = self.task.data
            if data.system_prompt:
                new.append(SystemMessage(content=data.system_prompt))
            if data.prompt is not None:
                new += [UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt)
            elif message is None:
                raise ValueError("nothing to run a turn on: the task has no prompt and turn() was given no message")
        if message is not None:
            new += [UserMessage(content=message)] if isinstance(message, str) else \
                [parse_message(m) if isinstance(m, dict) else m for m in message]
        if self.turns >= self.seat.max_turns:
            self.trace.stop("max_turns")
            return Segment(messages=[], terminated=True)
        for m in new:
            self._add(m)
        reply = AssistantMessage(content=await self.seat.exchange.ask(_text(new)))
        self.turns += 1
        self._add(reply, sampled=True)
        return Segment(messages=[reply])

    async def close(self):
        if not self.closed:
            self.closed = True
            self.trace.stop("user_closed")
            await self.task.score(self.trace)
            self.trace.ok = True
            self.seat.exchange.traces.append(self.trace)
        return self.trace


class _Seats:
    """verifiers' `Agents`: the env's seats by name (one here)."""

    def __init__(self, seats: dict):
        self.__dict__.update(seats)


async def _play(env, task, exchange: _Exchange, max_turns: int) -> None:
    """One verifiers episode: setup, run, then finalize over the traces; its reward (or error) to the runner."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import TraceTask

    try:
        seats = _Seats({name: _Seat(name, spec, exchange, max_turns)
                        for name, spec in agent_config_fields(env.config).items()})
        await env.setup(seats)
        await env.run(task, seats)
        if not exchange.traces:
            raise ValueError(f"{type(env).__name__}.run() played no seat")
        episode = Episode(env=EnvInfo(id=env.config.env_id), task=TraceTask(type=type(task).__name__, data=task.data,
                                                                          key=task.key, hash=task.hash))
        episode.traces = list(exchange.traces)
        await env.finalize(task, episode)
        exchange.events.put(("done", sum(t.reward for t in episode.traces)))
    except BaseException as e:      # noqa: BLE001 - the runner counts the episode's failure
        exchange.events.put(("error", e))
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
            raise


class Verifiers(Environment):
    """One episode of the verifiers environment that the example's row names (lit_ess.datamodules.VerifiersTasks:
    columns `verifiers_env`, the env's config, and `verifiers_task`, the task's key in its taskset).

    Args:
        max_turns: the policy's replies per episode when the seat's own `max_turns` (verifiers' AgentConfig)
            is not smaller (>= 1); the turn after the last comes back terminated and `run()` goes on to
            score. Keep `env.max_turns` (the runner's limit) at least this large, or the runner ends the
            episode first, unscored (reward 0, counted in rollout/truncated_turns).
        timeout: seconds `run()` may take to ask the next turn or end (> 0, below env.step_timeout); longer
            is an error of the episode (raised in reset or step, counted by the runner, its `run()` cancelled).
            Below env.step_timeout so this limit, which stops the episode, acts before the runner's, which can
            only abandon the step's thread.
    """

    def __init__(self, max_turns: int = 4, timeout: float = 60.0):
        from lit_ess.knobs import check

        check("Verifiers.max_turns", max_turns, ge=1, integer=True)
        check("Verifiers.timeout", timeout, gt=0, hint=" seconds")
        _verifiers()
        self.max_turns, self.timeout = max_turns, timeout
        self.exchange: _Exchange | None = None
        self.future = None

    @classmethod
    def check_limits(cls, init_args: dict, step_timeout: float) -> None:
        timeout = init_args.get("timeout", inspect.signature(cls).parameters["timeout"].default)
        if isinstance(timeout, (int, float)) and timeout >= step_timeout:
            raise ValueError(f"env.init_args.timeout={timeout} s (Verifiers) must be below env.step_timeout={step_timeout} s, "
                             f"or a slow turn is abandoned by the runner instead of stopped: raise env.step_timeout (a "
                             f"fresh process imports verifiers in its first reset, 20-70 s here) or lower the timeout")

    def reset(self, example: Example) -> list[dict[str, str]]:
        columns = example.columns
        if "verifiers_env" not in columns or "verifiers_task" not in columns:
            raise ValueError("the example has no verifiers task: use lit_ess.datamodules.VerifiersTasks as data.source")
        env, tasks = load(columns["verifiers_env"])
        if columns["verifiers_task"] not in tasks:
            raise ValueError(f"verifiers task {columns['verifiers_task']!r} is not in the taskset this process loaded "
                             f"({len(tasks)} tasks): the taskset changed since the prompt source read it")
        loop = _loop()
        self.exchange = _Exchange(loop)
        self.future = asyncio.run_coroutine_threadsafe(
            _play(env, tasks[columns["verifiers_task"]], self.exchange, self.max_turns), loop)
        kind, value = self._next()
        if kind != "ask":
            raise ValueError(f"verifiers environment ended before the policy's first turn (reward {value})")
        return value

    def step(self, action: Action) -> Step:
        self.exchange.answer(action.text)
        kind, value = self._next()
        if kind == "ask":
            return Step(observation=value)
        return Step(reward=value, done=True)

    def _next(self) -> tuple[str, object]:
        """What `run()` says next: ("ask", messages) or ("done", reward); its error raised here."""
        try:
            kind, value = self.exchange.events.get(timeout=self.timeout)
        except queue.Empty:
            self.close()                        # run() waits for a reply that will not come: cancel it
            raise TimeoutError(f"verifiers environment neither asked a turn nor ended within Verifiers.timeout="
                               f"{self.timeout} s") from None
        if kind == "error":
            raise value
        return kind, value

    def close(self) -> None:
        """Stop an episode the runner ended before `run()` did (a limit, a failure)."""
        if self.future is not None and not self.future.done():
            self.future.cancel()
