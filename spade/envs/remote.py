"""Env code in one process, the checker in another: the env host and the checker's proxies.

The checker must never share a process with the code it judges: env code could patch the checker's
modules or write its own verdict. So in the sandbox the checker drives the env from a separate
process, through a small request/response protocol of JSON-safe messages:

- ``EnvHost`` runs where the env code runs. It loads the code, keeps the env instances and answers
  ``load``, ``new``, ``call``, ``get`` and ``seed`` requests; every reply echoes its request's
  ``id`` and says whether the call touched the process's global ``random`` state. Nothing it
  answers is trusted: an answer is only ever judged as the env's behaviour, and a frame that is not
  the reply to the request in flight ends the host as a protocol breach.
- ``RemoteRuntime`` runs in the checker's process. Its ``load`` returns a proxy class that the
  checker and ``EnvSession`` use exactly like a loaded env class; each method call and attribute
  read is one request over a ``Link``. A link that times out or whose process dies is dropped and
  the next instance made starts a fresh host (the code is loaded again).

How a ``Link`` reaches its host (a forked process, a socket) is the runtime's business
(``services/sandbox/runtime``); ``LoopbackLink`` answers in-process, through the same JSON round trip,
for tests. Standard library only.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from spade.envs.actions import ToolCall
from spade.envs.contract import ContractError, unpack_reset, unpack_step
from spade.envs.limits import CallTimeout, describe_exception, guarded
from spade.envs.loader import LoadResult, load_env_class
from spade.envs.session import jsonable
from spade.envs.tool_env import ToolEnv, as_tool_call
from spade.envs.types import CheckConfig, Setting

MAX_INSTANCES = 64
"""Env instances a host keeps (least recently used first out); the checker needs a handful at once."""
CALL_GRACE_S = 2.0
"""How much longer than the per-call limit the checker waits for a host's answer before stopping it."""
METHODS = frozenset({"reset", "step", "solution", "solution_calls", "criterion_holds"})
"""The env methods a checker may call through a host."""
ATTRIBUTES = frozenset({"max_turns", "current", "instructions", "criterion_errors", "state", "turn"})
"""The env attributes a checker may read through a host (as JSON-safe values)."""


class HostTimeout(Exception):
    """The host did not answer within the time it was given (the link has stopped it)."""


class HostGone(Exception):
    """The host's process ended or broke the protocol; the message says how (a signal, memory, ...)."""


class Link(Protocol):
    """One host, as the checker reaches it."""

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and return the host's reply.

        Raises:
            HostTimeout: No reply within ``timeout_s`` (the host was stopped).
            HostGone: The host's process ended or answered something that is not a reply.
        """
        ...

    def close(self) -> None:
        """Stop the host (idempotent)."""
        ...


# -- the host: where env code runs ----------------------------------------------------------------


def _error(kind: str, exc: BaseException | None = None, message: str = "") -> dict[str, Any]:
    """A failed reply: ``type`` and ``message`` read like the env's exception (without its traceback)."""
    name = "Error"
    if exc is not None:
        name = type(exc).__name__
        text = describe_exception(exc)
        message = text[len(name) + 2 :] if text.startswith(name + ": ") else ("" if text == name else text)
    return {"ok": False, "kind": kind, "type": name, "message": message}


class EnvHost:
    """Answers a checker's requests about one env's code (see the module docstring).

    The ``fatal`` flag of a reply tells the process serving the host to exit after sending it
    (a ``MemoryError`` leaves the interpreter in no state to go on).
    """

    def __init__(self) -> None:
        self.env_class: type | None = None
        self.setting = Setting.GAME
        self.call_time_limit_s = CheckConfig().call_time_limit_s
        self.instances: OrderedDict[int, Any] = OrderedDict()

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request in, one JSON-safe reply out; never raises."""
        before = random.getstate()
        try:
            reply = self._dispatch(message)
        except CallTimeout:
            reply = _error("timeout", message=f"the call took longer than {self.call_time_limit_s:g} s")
        except MemoryError:
            self.instances.clear()
            reply = _error("memory", message="the env's process ran out of its memory limit")
            reply["fatal"] = True
        except ContractError as exc:
            reply = _error("contract", message=str(exc))
        except BaseException as exc:  # env code's failure is an answer, never the host's end
            reply = _error("raised", exc)
        reply["rng"] = message.get("op") != "seed" and random.getstate() != before
        if "id" in message:
            reply["id"] = message["id"]
        return reply

    def _dispatch(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "load":
            return self._load(message)
        if op == "seed":
            random.seed(int(message["n"]))
            return {"ok": True}
        if self.env_class is None:
            raise RuntimeError("no env code is loaded in this host: send 'load' first")
        if op == "new":
            with guarded(self.call_time_limit_s):
                instance = self.env_class()
            self.instances[int(message["h"])] = instance
            while len(self.instances) > MAX_INSTANCES:
                self.instances.popitem(last=False)
            return {"ok": True}
        instance = self._instance(int(message["h"]))
        if op == "call":
            return {"ok": True, "value": self._call(instance, str(message["method"]), list(message.get("args") or []))}
        if op == "get":
            return {"ok": True, "value": self._get(instance, str(message["name"]))}
        raise RuntimeError(f"unknown host request {op!r}")

    def _instance(self, handle: int) -> Any:
        try:
            instance = self.instances[handle]
        except KeyError:
            raise RuntimeError(f"env instance {handle} is gone (the host keeps {MAX_INSTANCES})") from None
        self.instances.move_to_end(handle)
        return instance

    def _load(self, message: dict[str, Any]) -> dict[str, Any]:
        self.setting = Setting.parse(str(message["setting"]))
        self.call_time_limit_s = float(message.get("call_time_limit_s") or self.call_time_limit_s)
        self.env_class = None
        self.instances.clear()
        with guarded(self.call_time_limit_s):
            loaded = load_env_class(str(message["code"]), self.setting)
        cls = loaded.env_class
        reply: dict[str, Any] = {"ok": True, "problems": [str(p) for p in loaded.problems], "class": None}
        if cls is None:
            return reply
        self.env_class = cls
        reply["class"] = str(cls.__name__)
        reply["max_turns"] = jsonable(getattr(cls, "max_turns", None))
        if isinstance(cls, type) and issubclass(cls, ToolEnv):
            try:
                reply["tools"] = jsonable(cls.tool_schemas())
            except Exception as exc:
                reply["problems"].append(f"{cls.__name__}: its tools cannot be read: {describe_exception(exc)}")
        return reply

    def _call(self, instance: Any, method: str, args: list[Any]) -> Any:
        if method not in METHODS:
            raise RuntimeError(f"method {method!r} may not be called through a host")
        fn = getattr(instance, method)
        with guarded(self.call_time_limit_s):
            if method == "reset":
                result: Any = fn(seed=args[0] if args else None)
            else:
                result = fn(*args)
        if method == "reset":
            observation, info = unpack_reset(result)
            return [observation, jsonable(info)]
        if method == "step":
            observation, reward, terminated, truncated, info = unpack_step(result)
            return [observation, reward, terminated, truncated, jsonable(info)]
        if method == "solution_calls":
            return [[call.to_dict() for call in block] for block in result]
        if method == "criterion_holds":
            return bool(result)
        if method == "solution" and not (isinstance(result, list | tuple) and all(isinstance(a, str) for a in result)):
            return {"not_a_list_of_strings": repr(result)[:200]}
        return jsonable(result)

    def _get(self, instance: Any, name: str) -> Any:
        if name not in ATTRIBUTES:
            raise RuntimeError(f"attribute {name!r} may not be read through a host")
        value = getattr(instance, name)
        if name == "criterion_errors" and isinstance(value, dict):
            return [[k, str(v)] for k, v in value.items() if isinstance(k, int)]
        return jsonable(value)


class LoopbackLink:
    """A link to an ``EnvHost`` in this very process (tests; no isolation, same JSON round trip)."""

    def __init__(self, host: EnvHost | None = None) -> None:
        self.host = host or EnvHost()
        self.closed = False

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.closed:
            raise HostGone("the host was stopped")
        reply = self.host.handle(json.loads(json.dumps(message)))
        if reply.get("fatal"):
            self.closed = True
        return dict(json.loads(json.dumps(reply)))

    def close(self) -> None:
        self.closed = True


# -- the checker's side ---------------------------------------------------------------------------


def remote_exception(type_name: str, message: str) -> Exception:
    """An exception that reads like the one the env raised (``describe_exception`` shows its name)."""
    name = type_name if type_name.isidentifier() else "EnvError"
    return type(name, (EnvRaised,), {})(message)


class EnvRaised(Exception):
    """Base of the exceptions the env raised in its host, re-raised in the checker's process."""


class RemoteRuntime:
    """Loads env code into a host process and hands the checker a proxy of its env class.

    Args:
        connect: Starts a fresh host and returns the link to it.
    """

    def __init__(self, connect: Callable[[], Link]) -> None:
        self._connect = connect
        self._link: Link | None = None
        self._load: dict[str, Any] | None = None
        self._handles = itertools.count(1)
        self._ids = itertools.count(1)
        self.generation = 0
        self.touched = 0
        self.call_time_limit_s = CheckConfig().call_time_limit_s
        self.hosts_started = 0

    # -- the runtime interface the checker uses ----------------------------------------------------
    def load(self, code: str, setting: Setting, config: CheckConfig) -> LoadResult:
        """Load ``code`` in a fresh host; the result's ``env_class`` is a proxy class."""
        self.call_time_limit_s = config.call_time_limit_s
        self._load = {
            "op": "load",
            "code": code,
            "setting": setting.value,
            "call_time_limit_s": config.call_time_limit_s,
        }
        self._drop()
        reply = self._start()
        problems = [str(p) for p in reply.get("problems") or []]
        name = reply.get("class")
        if not isinstance(name, str) or not name:
            return LoadResult(None, problems or ["the env's code defines no env class"])
        tools = reply.get("tools")
        attrs: dict[str, Any] = {"_runtime": self, "_tools": tools if isinstance(tools, dict) else {}}
        if reply.get("max_turns") is not None:
            attrs["max_turns"] = reply["max_turns"]
        proxy = type(name if name.isidentifier() else "Env", (RemoteEnv,), attrs)
        return LoadResult(proxy, problems)

    def seed_global(self, n: int) -> None:
        """Seed the host's global ``random`` module."""
        self.request({"op": "seed", "n": int(n)})

    def rng_mark(self) -> Any:
        return self.touched

    def rng_touched(self, mark: Any) -> bool:
        return self.touched > int(mark)

    def close(self) -> None:
        self._drop()

    # -- plumbing ----------------------------------------------------------------------------------
    def _drop(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def _start(self) -> dict[str, Any]:
        assert self._load is not None
        self._link = self._connect()
        self.hosts_started += 1
        self.generation += 1
        return self._checked(self._send(self._load))

    def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._link is None:
            raise remote_exception("EnvProcessDied", "the env's process was stopped after an earlier failure")
        message = {**message, "id": next(self._ids)}
        try:
            reply = self._link.request(message, self.call_time_limit_s + CALL_GRACE_S)
        except HostTimeout:
            self._drop()
            raise CallTimeout(f"the env took longer than {self.call_time_limit_s:g} s to answer") from None
        except HostGone as exc:
            self._drop()
            raise remote_exception("EnvProcessDied", str(exc)) from None
        if not isinstance(reply, dict) or reply.get("id") != message["id"] or not isinstance(reply.get("ok"), bool):
            self._drop()
            what = f"op {str(reply.get('op'))[:40]!r}" if isinstance(reply, dict) and "op" in reply else "a frame"
            raise remote_exception(
                "EnvProtocolError",
                f"the env's process answered {what} that is not the reply to request {message['id']} "
                "(env code wrote on its host's channel)",
            )
        if reply.get("rng") is True:
            self.touched += 1
        if reply.get("fatal"):
            self._drop()
        return reply

    @staticmethod
    def _checked(reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("ok") is True:
            return reply
        kind, message = reply.get("kind"), str(reply.get("message", ""))[:1000]
        if kind == "timeout":
            raise CallTimeout(message)
        if kind == "contract":
            raise ContractError(message)
        if kind == "memory":
            raise remote_exception("MemoryError", message)
        raise remote_exception(str(reply.get("type", "EnvError")), message)

    def request(self, message: dict[str, Any]) -> Any:
        """Send ``message`` to the current host (starting one if needed); its value, or the env's error."""
        if self._link is None:
            self._start()
        return self._checked(self._send(message)).get("value")

    def new_instance(self) -> tuple[int, int]:
        """Make a fresh env instance in the host (a new host if the last one failed)."""
        handle = next(self._handles)
        self.request({"op": "new", "h": handle})
        return self.generation, handle

    def on_instance(self, generation: int, message: dict[str, Any]) -> Any:
        if generation != self.generation or self._link is None:
            raise remote_exception("EnvProcessDied", "the env's process was stopped after an earlier failure")
        return self._checked(self._send(message)).get("value")


class RemoteEnv:
    """An env instance living in a host; subclasses made by ``RemoteRuntime.load`` carry the class's
    name, ``max_turns`` and tool schemas."""

    _runtime: ClassVar[RemoteRuntime]
    _tools: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        generation, handle = self._runtime.new_instance()
        object.__setattr__(self, "_where", (generation, handle))

    def _call(self, method: str, *args: Any) -> Any:
        generation, handle = self._where
        return self._runtime.on_instance(generation, {"op": "call", "h": handle, "method": method, "args": list(args)})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in ATTRIBUTES:
            raise AttributeError(name)
        generation, handle = self.__dict__["_where"]
        value = self._runtime.on_instance(generation, {"op": "get", "h": handle, "name": name})
        if name == "criterion_errors":
            return {int(k): str(v) for k, v in value or []}
        return value

    @classmethod
    def tool_schemas(cls) -> dict[str, dict[str, Any]]:
        return dict(cls._tools)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        observation, info = self._call("reset", seed)
        return str(observation), dict(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self._call("step", action)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)

    def solution(self) -> Any:
        value = self._call("solution")
        if isinstance(value, dict) and "not_a_list_of_strings" in value:
            return value["not_a_list_of_strings"]
        return value

    def solution_calls(self) -> list[list[ToolCall]]:
        return [[as_tool_call(call) for call in block] for block in self._call("solution_calls")]

    def criterion_holds(self, index: int) -> bool:
        return bool(self._call("criterion_holds", index))
