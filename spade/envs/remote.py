"""An env played in another process: the one host every session's env process runs, and the
checker's view of such a session.

Validation must be indistinguishable from play (DESIGN §4): an env that could tell the checker from
an agent could play honestly for the one and hand out wins to the other. So the sandbox has one
way to run env code turn by turn, a session, and the checker plays through real sessions too:

- ``SessionHost`` is what an env's process runs, for a rollout's play and for every episode a
  validation plays alike (``services/sandbox/runtime/worker.py``). Its first request loads the code
  and resets an ``EnvSession`` on the request's seed; then one outcome per ``step``. The checker
  may also ask the live instance for ``solution()``, ``solution_calls()``, ``criterion_holds(i)``
  and a few attributes (``ASKS``); a play never does, and nothing the env can see before it is
  asked differs. Every reply says whether the request changed the process's global ``random``
  state (``rng``) and what the env returned before the framework clamped and cut it (``raw``);
  the first also describes the env class (``env``).
- ``RemoteRuntime`` is the checker's runtime (``spade.envs.check_context.EnvRuntime``) over such
  sessions: every episode a check plays is a fresh session, so a fresh process in which no other
  episode ran and ``solution()`` was never called unless this episode asked for it.

How a ``Transport`` reaches a session's process is the sandbox's business
(``services/sandbox/isolation/validation.py``); ``LoopbackTransport`` runs a ``SessionHost`` in this
very process, through the same JSON round trip, for tests. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from spade.envs.actions import ToolCall
from spade.envs.limits import CallTimeout, describe_exception, guarded
from spade.envs.loader import LoadResult, compile_env, load_env_class
from spade.envs.seeds import secret_seeds
from spade.envs.session import EnvFault, EnvLoadError, EnvSession, SessionError, jsonable
from spade.envs.tool_env import ToolEnv, as_tool_call
from spade.envs.types import CheckConfig, Outcome, Setting, StepOutcome

T = TypeVar("T")

ASKS = frozenset({"solution", "solution_calls", "criterion_holds", "get"})
"""What the checker may ask a session's live instance besides ``step``."""
ATTRIBUTES = frozenset({"max_turns", "current", "instructions", "criterion_errors", "state", "turn"})
"""The env attributes a checker may read through ``get`` (as JSON-safe values)."""


# -- the host: what every session's env process runs ------------------------------------------------


def load_session(request: dict[str, Any]) -> EnvSession:
    """An ``EnvSession`` for a session request's code, repaired only where it needs it.

    The service sends code it has already repaired (``repaired``: true), or code its cheap test
    (``spade.envs.repair.needs_repair``) found nothing to repair in; that code is compiled as it is
    and goes through the full repairs only if it does not compile, which gives what ``repair_code``
    gives at the cost of one compile.

    Raises:
        EnvLoadError: The code does not load or defines no valid env class.
    """
    code, setting, seed = str(request["code"]), str(request["setting"]), int(request["seed"])
    config = CheckConfig.from_dict(dict(request["config"]))
    compiled = None
    try:
        compiled = compile_env(code)
    except (SyntaxError, ValueError):
        if not request.get("repaired"):
            return EnvSession(code, setting, seed, config)
    try:
        with guarded(config.call_time_limit_s):
            loaded = load_env_class(code, setting, compiled)
    except CallTimeout:
        raise EnvLoadError(f"loading the env code took longer than {config.call_time_limit_s:g} s") from None
    if not loaded.ok or loaded.env_class is None:
        error = EnvLoadError("; ".join(loaded.problems))
        error.env_class = loaded.env_class
        raise error
    return EnvSession.from_class(loaded.env_class, setting, seed, config)


class SessionHost:
    """One env session in the process that runs its code (see the module docstring).

    ``handle`` takes one request and returns its one reply; a reply whose ``fatal`` is true is the
    last (the process exits after sending it).
    """

    def __init__(self) -> None:
        self.session: EnvSession | None = None

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """The reply to ``message``: an ``outcome``, a ``value``, ``raised`` or ``env_error``."""
        if self.session is None:
            return self._open(message)
        op = message.get("op")
        before = random.getstate()
        if op == "step":
            outcome = self.session.step(str(message["action"]))
            return self._outcome(outcome, before)
        if op in ASKS:
            reply = self._ask(self.session, message)
            reply["rng"] = random.getstate() != before
            return reply
        return {"op": "fault", "error": f"unknown session op {str(op)[:40]!r}"}

    def _open(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self.session = load_session(request)
        except MemoryError:
            raise  # the process serving the host exits as out of memory
        except Exception as exc:
            reply: dict[str, Any] = {"op": "env_error", "error": describe_exception(exc, 500)}
            found = getattr(exc, "env_class", None)
            if isinstance(found, type):  # the class the problems are about
                reply["env"] = {"class": str(found.__name__), "loaded": False}
            return reply
        before = random.getstate()
        reply = self._outcome(self.session.reset(), before)
        reply["env"] = describe_class(self.session.env_class)
        return reply

    def _outcome(self, outcome: StepOutcome, before: Any) -> dict[str, Any]:
        assert self.session is not None
        return {
            "op": "outcome",
            "outcome": outcome.to_dict(),
            "rng": random.getstate() != before,
            "raw": dict(self.session.raw),
            "fatal": outcome.outcome is Outcome.MEMORY_LIMIT,
        }

    @staticmethod
    def _ask(session: EnvSession, message: dict[str, Any]) -> dict[str, Any]:
        env = session.env
        op = str(message["op"])
        try:
            if env is None:
                raise SessionError("the env's reset() failed: there is no instance to ask")
            if op == "solution":
                result = session.guarded_call(env.solution)
                if not (isinstance(result, list | tuple) and all(isinstance(a, str) for a in result)):
                    return {"op": "value", "value": {"not_a_list_of_strings": repr(result)[:200]}}
                value: Any = [str(a) for a in result]
            elif op == "solution_calls":
                blocks = session.guarded_call(env.solution_calls)
                value = [[call.to_dict() for call in block] for block in blocks]
            elif op == "criterion_holds":
                value = bool(session.guarded_call(env.criterion_holds, int(message["index"])))
            else:
                name = str(message["name"])
                if name not in ATTRIBUTES:
                    raise SessionError(f"attribute {name!r} may not be read through a session")
                read = session.guarded_call(getattr, env, name)
                if name == "criterion_errors" and isinstance(read, dict):
                    value = [[k, str(v)] for k, v in read.items() if isinstance(k, int)]
                else:
                    value = jsonable(read)
        except EnvFault as fault:
            return {
                "op": "raised",
                "outcome": fault.outcome.value,
                "error": fault.message,
                "fatal": fault.outcome is Outcome.MEMORY_LIMIT,
            }
        except Exception as exc:  # the env's answer could not be carried (a bad solution call, ...)
            return {"op": "raised", "outcome": Outcome.ENV_ERROR.value, "error": describe_exception(exc)}
        return {"op": "value", "value": jsonable(value)}


def describe_class(env_class: type) -> dict[str, Any]:
    """What the checker learns of a loaded env class: its name, ``max_turns`` and tool schemas."""
    described: dict[str, Any] = {
        "class": str(env_class.__name__),
        "loaded": True,
        "max_turns": jsonable(getattr(env_class, "max_turns", None)),
    }
    if isinstance(env_class, type) and issubclass(env_class, ToolEnv):
        try:
            described["tools"] = jsonable(env_class.tool_schemas())
        except Exception as exc:
            described["problems"] = [f"{env_class.__name__}: its tools cannot be read: {describe_exception(exc)}"]
    return described


# -- the checker's side -----------------------------------------------------------------------------


class Transport(Protocol):
    """One session's process, as the checker reaches it.

    Replies are ``SessionHost`` replies; when the process ended or misbehaved, the transport
    answers an ``outcome`` that says how (``env_error``, ``timeout``, ``cpu_limit``, ...), as a
    play's session would, and every later request gets the same.
    """

    def open(self, seed: int) -> dict[str, Any]:
        """Start the session's process on ``seed``: the reply to its load and reset."""
        ...

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request on the open session and its reply."""
        ...

    def close(self) -> None:
        """End the session's process (idempotent)."""
        ...


class LoopbackTransport:
    """A ``SessionHost`` in this very process (tests: no isolation, the same JSON round trip)."""

    def __init__(self, code: str, setting: Setting, config: CheckConfig) -> None:
        self.request = {"code": code, "repaired": True, "setting": setting.value, "config": config.to_dict()}
        self.host = SessionHost()
        self.ended: dict[str, Any] | None = None

    def open(self, seed: int) -> dict[str, Any]:
        random.seed()  # as a fresh process's global random is, at its start (from os.urandom)
        return self.send({**self.request, "seed": seed})

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.ended is not None:
            return self.ended
        reply = dict(json.loads(json.dumps(self.host.handle(json.loads(json.dumps(message))))))
        if reply.get("fatal"):
            self.ended = {"op": "env_error", "error": "the env's process ended (out of memory)"}
        return reply

    def close(self) -> None:
        self.ended = self.ended or {"op": "env_error", "error": "the session was closed"}


class EnvRaised(Exception):
    """Base of the exceptions the env raised in its process, re-raised in the checker's."""


def remote_exception(message: str) -> Exception:
    """An exception that reads like the one the env raised (``describe_exception`` shows its name)."""
    name, sep, rest = message.partition(": ")
    if sep and name.isidentifier():
        return type(name, (EnvRaised,), {})(rest)
    return type("EnvError", (EnvRaised,), {})(message)


class RemoteRuntime:
    """The checker's runtime over sessions: each episode a check plays is a fresh session.

    Args:
        connect: ``connect(code, setting, config)`` returns a transport to a new, not yet opened
            session of that code.
    """

    def __init__(self, connect: Callable[[str, Setting, CheckConfig], Transport]) -> None:
        self._connect = connect
        self._code = ""
        self._live: list[RemoteSession] = []
        self.touched = 0
        self.sessions_started = 0

    # -- the runtime interface the checker uses ----------------------------------------------------
    def load(self, code: str, setting: Setting, config: CheckConfig) -> LoadResult:
        """Open one session of ``code`` (on a secret seed): its env class, as a stand-in class."""
        self._code = code
        transport = self._open_transport(setting, config)
        try:
            reply = transport.open(secret_seeds(1)[0])
        finally:
            transport.close()
        described = reply.get("env")
        if not isinstance(described, dict) or not described.get("class"):
            return LoadResult(None, [_load_problem(reply)])
        name = str(described["class"])
        tools = described.get("tools")
        attrs: dict[str, Any] = {"_tools": tools if isinstance(tools, dict) else {}}
        if described.get("max_turns") is not None:
            attrs["max_turns"] = described["max_turns"]
        stand_in = type(name if name.isidentifier() else "Env", (RemoteEnvClass,), attrs)
        problems = [str(p) for p in described.get("problems") or []]
        if described.get("loaded") is not True:
            problems.append(_load_problem(reply))
        return LoadResult(stand_in, problems)

    def session(self, env_class: Any, setting: Setting, seed: int, config: CheckConfig) -> EnvSession:
        """A fresh session of the loaded code on ``seed`` (its process starts at ``reset()``)."""
        session = RemoteSession(self, env_class, setting, seed, config)
        self._live.append(session)
        while len(self._live) > LIVE_SESSIONS:
            self._live.pop(0).close()
        return session

    shares_process = False
    """Env code never runs in this process: its calls need no time limit or output capture here."""

    def guard(self, seconds: float) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def seed_global(self, n: int) -> None:
        """Nothing to do: every session is a fresh process, its global ``random`` seeded at its start."""

    def rng_mark(self) -> Any:
        return self.touched

    def rng_touched(self, mark: Any) -> bool:
        return self.touched > int(mark)

    def close(self) -> None:
        while self._live:
            self._live.pop().close()

    # -- plumbing ----------------------------------------------------------------------------------
    def _open_transport(self, setting: Setting, config: CheckConfig) -> Transport:
        self.sessions_started += 1
        return self._connect(self._code, setting, config)

    def _note(self, reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("rng") is True:
            self.touched += 1
        return reply


LIVE_SESSIONS = 4
"""Sessions a validation keeps open at once (the oldest is closed first); a check needs two at most."""


def _load_problem(reply: dict[str, Any]) -> str:
    """The load failure a session's first reply reports, without the framework's prefixes."""
    if reply.get("op") == "outcome":
        text = str(dict(reply.get("outcome") or {}).get("observation", ""))
    else:
        text = str(reply.get("error", ""))
    for prefix in ("env error: ", "EnvLoadError: "):
        text = text.removeprefix(prefix)
    return text or "the env's process ended before it loaded the code"


class RemoteEnvClass:
    """Stand-in for an env class that lives in sessions' processes: its name, ``max_turns`` and
    tool schemas (made by ``RemoteRuntime.load``)."""

    _tools: ClassVar[dict[str, Any]] = {}

    @classmethod
    def tool_schemas(cls) -> dict[str, dict[str, Any]]:
        return dict(cls._tools)


class RemoteSession(EnvSession):
    """An ``EnvSession`` whose env lives in a session's own process (made by ``RemoteRuntime``).

    ``reset()`` starts the process; ``env`` is a ``RemoteInstance`` that asks the live instance.
    A session is one episode: a second ``reset()`` raises ``SessionError`` (ask the runtime for a
    fresh session instead).
    """

    def __init__(self, runtime: RemoteRuntime, env_class: Any, setting: Setting, seed: int, config: CheckConfig):
        self._init(env_class, setting, seed, config)
        self._runtime = runtime
        self._transport: Transport | None = None
        self.raw: dict[str, Any] = {}

    def reset(self, seed: int | None = None) -> StepOutcome:
        if self._transport is not None:
            raise SessionError("a remote session plays one episode: ask for a fresh session")
        if seed is not None:
            self.seed = seed
        assert self.seed is not None
        self._transport = self._runtime._open_transport(self.setting, self.config)
        reply = self._runtime._note(self._transport.open(self.seed))
        if reply.get("op") != "outcome":
            self.last = self._ended(Outcome.ENV_ERROR, f"Environment error in loading: {_load_problem(reply)}")
            return self.last
        outcome = self._take(reply)
        self.env = RemoteInstance(self)
        return outcome

    def step(self, action: str) -> StepOutcome:
        self._check_step(action)
        assert self._transport is not None
        self.turn += 1
        reply = self._runtime._note(self._transport.send({"op": "step", "action": action}))
        if reply.get("op") != "outcome":
            self.last = self._ended(Outcome.ENV_ERROR, f"Environment error in step(): {reply.get('error')}")
            return self.last
        return self._take(reply)

    def ask(self, message: dict[str, Any]) -> Any:
        """The live instance's answer to ``message`` (one of ``ASKS``).

        Raises:
            EnvRaised: The env raised, timed out, or its process is gone (the message says which).
        """
        if self._transport is None:
            raise SessionError("ask() before reset(); call reset() first")
        reply = self._runtime._note(self._transport.send(message))
        op = reply.get("op")
        if op == "value":
            return reply.get("value")
        if op == "raised":
            if reply.get("outcome") == Outcome.TIMEOUT.value:
                raise CallTimeout(str(reply.get("error", "")))
            raise remote_exception(str(reply.get("error", "")))
        if op == "outcome":  # the process ended: the transport says how
            ended = StepOutcome.from_dict(dict(reply.get("outcome") or {}))
            if ended.outcome is Outcome.TIMEOUT:
                raise CallTimeout(ended.observation)
            raise type("EnvProcessDied", (EnvRaised,), {})(ended.observation)
        raise remote_exception(str(reply.get("error", f"the env's process answered {str(op)[:40]!r}")))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def guarded_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call an ask (``fn``); the env's failures become ``EnvFault`` as in ``EnvSession``."""
        try:
            return fn(*args)
        except CallTimeout as exc:
            raise EnvFault(Outcome.TIMEOUT, str(exc) or "the env took too long to answer") from None
        except EnvRaised as exc:
            raise EnvFault(Outcome.ENV_ERROR, describe_exception(exc)) from None

    def _take(self, reply: dict[str, Any]) -> StepOutcome:
        outcome = StepOutcome.from_dict(dict(reply.get("outcome") or {}))
        self.raw = dict(reply.get("raw") or {}) if outcome.outcome is Outcome.OK else {}
        self.turn = outcome.turn
        self.max_turns = outcome.max_turns or self.max_turns
        self.last = outcome
        return outcome

    def _ended(self, outcome: Outcome, message: str) -> StepOutcome:
        return StepOutcome(message, 0.0, False, True, {}, self.turn, self.max_turns, outcome)


class RemoteInstance:
    """The live env instance of a ``RemoteSession``: its methods and attributes are asks."""

    def __init__(self, session: RemoteSession) -> None:
        object.__setattr__(self, "_session", session)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in ATTRIBUTES:
            raise AttributeError(name)
        value = self._session.ask({"op": "get", "name": name})
        if name == "criterion_errors":
            return {int(k): str(v) for k, v in value or []}
        return value

    def solution(self) -> Any:
        value = self._session.ask({"op": "solution"})
        if isinstance(value, dict) and "not_a_list_of_strings" in value:
            return value["not_a_list_of_strings"]
        return value

    def solution_calls(self) -> list[list[ToolCall]]:
        return [[as_tool_call(call) for call in block] for block in self._session.ask({"op": "solution_calls"})]

    def criterion_holds(self, index: int) -> bool:
        return bool(self._session.ask({"op": "criterion_holds", "index": int(index)}))


def loopback_runtime() -> RemoteRuntime:
    """A ``RemoteRuntime`` whose sessions are ``LoopbackTransport``s (tests)."""
    return RemoteRuntime(LoopbackTransport)
