"""Loading env code: exec it in a fresh module namespace and pick its single env class.

This only ever runs inside the sandbox (or on trusted code in tests). Env code may
``from spade.envs import ToolEnv`` or use the pre-injected ``ToolEnv``/``GameEnv`` and common
standard-library names without importing them. Failures are returned as findings, never
asserted. Standard library only.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import heapq
import itertools
import json
import math
import random
import re
import string
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from spade.envs.contract import GameEnv
from spade.envs.limits import ENV_FILENAME, describe_exception
from spade.envs.tool_env import ToolEnv
from spade.envs.types import Setting

GAME_METHODS = ("reset", "step", "solution")
_counter = itertools.count()

PRELUDE: dict[str, Any] = {
    "ToolEnv": ToolEnv,
    "GameEnv": GameEnv,
    "random": random,
    "math": math,
    "re": re,
    "json": json,
    "string": string,
    "copy": copy,
    "heapq": heapq,
    "itertools": itertools,
    "functools": functools,
    "collections": collections,
    "deque": collections.deque,
    "Counter": collections.Counter,
    "defaultdict": collections.defaultdict,
    "OrderedDict": collections.OrderedDict,
    "dataclass": dataclasses.dataclass,
    "field": dataclasses.field,
    "Any": typing.Any,
    "Dict": typing.Dict,  # noqa: UP006 - LLM code uses the old typing names without importing them
    "List": typing.List,  # noqa: UP006
    "Optional": typing.Optional,
    "Tuple": typing.Tuple,  # noqa: UP006
    "Set": typing.Set,  # noqa: UP006
    "Union": typing.Union,
}
"""Names available to env code without an import (the reference injected a similar set)."""


@dataclass
class LoadResult:
    """What loading env code found.

    Attributes:
        env_class: the single env class, or None when ``problems`` says why there is none.
        problems: findings, each naming the rule, what was found and the fix.
        namespace: the module namespace the code ran in (empty when it did not run).
    """

    env_class: type | None
    problems: list[str] = field(default_factory=list)
    namespace: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.env_class is not None and not self.problems


def compile_env(code: str) -> types.CodeType:
    """``code`` compiled as env code (its frames carry ``ENV_FILENAME``). ``SyntaxError`` propagates."""
    return compile(code, ENV_FILENAME, "exec")


def exec_env_module(code: str, compiled: types.CodeType | None = None) -> dict[str, Any]:
    """Exec ``code`` (or its ``compiled`` form) as a fresh module; returns its namespace.

    Exceptions propagate.
    """
    name = f"spade_env_{next(_counter)}"
    module = types.ModuleType(name)
    module.__dict__.update(PRELUDE)
    if compiled is None:
        compiled = compile_env(code)
    # Registered while it runs: dataclasses and typing look their module up in sys.modules.
    sys.modules[name] = module
    try:
        exec(compiled, module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module.__dict__


def _defines(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base other than the framework's own defines ``name``."""
    for klass in cls.__mro__:
        if klass in (ToolEnv, GameEnv, object):
            return False
        if name in vars(klass):
            return True
    return False


def pick_env_class(namespace: dict[str, Any], setting: Setting) -> LoadResult:
    """The single env class defined in ``namespace`` (a module run by ``exec_env_module``)."""
    module_name = namespace.get("__name__")
    defined = [v for v in namespace.values() if isinstance(v, type) and getattr(v, "__module__", None) == module_name]
    candidates = [c for c in defined if c.__name__.endswith("Env")]
    # Helper base classes that other env classes subclass are not the env.
    leaves = [c for c in candidates if not any(o is not c and issubclass(o, c) for o in candidates)]
    if not leaves:
        others = ", ".join(sorted(c.__name__ for c in defined)) or "none"
        message = f"no class whose name ends in 'Env' is defined (classes found: {others}); "
        return LoadResult(None, [message + "name the env class e.g. PuzzleEnv"], namespace)
    if len(leaves) > 1:
        names = ", ".join(sorted(c.__name__ for c in leaves))
        return LoadResult(
            None,
            [
                f"several env classes are defined ({names}); define exactly one class ending in 'Env' "
                "and give helper classes other names"
            ],
            namespace,
        )
    cls = leaves[0]
    problems: list[str] = []
    if setting is Setting.TOOL:
        if not issubclass(cls, ToolEnv):
            problems.append(f"{cls.__name__} must subclass ToolEnv in the tool setting")
        else:
            for method in ("step", "reset"):
                if _defines(cls, method):
                    problems.append(
                        f"{cls.__name__} overrides {method}(); ToolEnv owns reset()/step(): build the "
                        "instance in setup(self, rng) instead"
                    )
            for method in ("setup", "solution"):
                if not _defines(cls, method):
                    problems.append(f"{cls.__name__} does not define {method}()")
            problems += [f"{cls.__name__}: {p}" for p in cls.declaration_problems()]
    else:
        if issubclass(cls, ToolEnv):
            problems.append(f"{cls.__name__} subclasses ToolEnv but the setting is 'game'; use setting 'tool'")
        missing = [m for m in GAME_METHODS if not callable(getattr(cls, m, None)) or not _defines(cls, m)]
        if missing:
            problems.append(f"{cls.__name__} is missing {', '.join(m + '()' for m in missing)}")
    return LoadResult(cls, problems, namespace)


def load_env_class(code: str, setting: str | Setting, compiled: types.CodeType | None = None) -> LoadResult:
    """Exec ``code`` (or its ``compiled`` form, from ``compile_env``) in a fresh module namespace and
    pick its single env class.

    Returns:
        A ``LoadResult``; ``ok`` is False and ``problems`` explains why when the code raised at
        import, defines no env class, several, or one that misses required methods.
    """
    parsed = Setting.parse(setting)
    try:
        namespace = exec_env_module(code, compiled)
    except (Exception, SystemExit) as exc:
        return LoadResult(None, [f"running the module raised {describe_exception(exc)}"])
    return pick_env_class(namespace, parsed)
