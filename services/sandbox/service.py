"""The sandbox service's use cases, shared by the gRPC and REST adapters.

Adapters translate wire objects into these calls and map ``SandboxServiceError`` to a status in one
place each; everything else (input rules, auth, quotas, sessions, metrics) happens here once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

from services.sandbox.core.auth import KeyRing, Tenant
from services.sandbox.core.quotas import LocalQuotas, QuotaStore
from services.sandbox.core.requests import (
    RequestLimits,
    check_action,
    check_code,
    check_execution,
    check_seed,
    check_setting,
    check_turn_budget,
)
from services.sandbox.core.sessions import LiveSession, SessionManager
from services.sandbox.metrics import SandboxMetrics
from spade.auth import Role, authorize
from spade.envs import CheckConfig, StepOutcome, ValidationReport
from spade.errors import ServiceError
from spade.serving.logs import get_logger

log = get_logger(__name__)


class Backend(Protocol):
    """What the isolation layer provides (``services.sandbox.isolation.SandboxPool``)."""

    async def validate(self, code: str, setting: str, config: CheckConfig) -> ValidationReport: ...

    async def execute(
        self, code: str, stdin: bytes, files: dict[str, bytes], *, timeout_s: float | None, memory_mb: int | None
    ) -> Any: ...

    async def open_session(self, code: str, setting: str, seed: int, config: CheckConfig) -> LiveSession: ...

    def health(self) -> dict[str, Any]: ...


class SandboxService:
    """Validate, execute and play untrusted code for authenticated tenants."""

    def __init__(
        self,
        backend: Backend,
        authenticator: KeyRing[Tenant],
        limits: RequestLimits,
        checks: CheckConfig,
        *,
        session_ttl_s: float,
        max_sessions: int,
        metrics: SandboxMetrics | None = None,
        quotas: QuotaStore | None = None,
    ) -> None:
        self.backend = backend
        self.authenticator = authenticator
        self.limits = limits
        self.checks = checks
        self.metrics = metrics or SandboxMetrics()
        self.quotas: QuotaStore = quotas or LocalQuotas()
        self.sessions = SessionManager(self._open_live, self.quotas, ttl_s=session_ttl_s, max_sessions=max_sessions)

    async def _open_live(self, code: str, setting: str, seed: int, checks: CheckConfig | None) -> LiveSession:
        return await self.backend.open_session(code, setting, seed, checks or self.checks)

    def checks_for(self, agent_max_turns: int) -> CheckConfig:
        """The checks with the agent's turn budget a request names (0: the configured ones)."""
        return self.checks.with_turn_budget(agent_max_turns) if agent_max_turns else self.checks

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.authenticator.authenticate(authorization)

    @contextlib.contextmanager
    def _observe(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        code = "ok"
        try:
            yield
        except ServiceError as exc:  # the sandbox's own errors and spade.auth's Forbidden
            code = exc.code
            raise
        except Exception:
            code = "internal"
            raise
        finally:
            self.metrics.requests.labels(op, code).inc()
            self.metrics.latency.labels(op).observe(time.perf_counter() - start)
            self.metrics.sessions_open.set(len(self.sessions))

    async def validate(
        self, tenant: Tenant, code: object, setting: object, agent_max_turns: object = 0
    ) -> ValidationReport:
        with self._observe("validate"):
            authorize(tenant, Role.WRITE, "running code")
            code_s = check_code(code, self.limits)
            setting_s = check_setting(setting)
            checks = self.checks_for(check_turn_budget(agent_max_turns))
            await self.quotas.charge_run(tenant)
            report = await self.backend.validate(code_s, setting_s, checks)
            self.metrics.validations.labels(str(report.valid).lower()).inc()
            for check in report.checks:
                if not check.passed:
                    self.metrics.failed_checks.labels(check.name).inc()
            return report

    async def execute(
        self,
        tenant: Tenant,
        code: object,
        stdin: bytes = b"",
        files: dict[str, bytes] | None = None,
        timeout_s: float = 0.0,
        memory_mb: int = 0,
    ) -> Any:
        with self._observe("execute"):
            authorize(tenant, Role.WRITE, "running code")
            code_s = check_code(code, self.limits)
            files = files or {}
            check_execution(stdin, files, timeout_s, memory_mb, self.limits)
            await self.quotas.charge_run(tenant)
            result = await self.backend.execute(
                code_s, stdin, files, timeout_s=timeout_s or None, memory_mb=memory_mb or None
            )
            self.metrics.executions.labels(str(getattr(result.status, "value", result.status))).inc()
            return result

    async def open_session(
        self, tenant: Tenant, code: object, setting: object, seed: object, agent_max_turns: object = 0
    ) -> tuple[str, StepOutcome]:
        with self._observe("open_session"):
            authorize(tenant, Role.WRITE, "running code")
            code_s = check_code(code, self.limits)
            setting_s = check_setting(setting)
            seed_i = check_seed(seed)
            checks = self.checks_for(check_turn_budget(agent_max_turns))
            # Opening runs the env's module code and reset(): it counts as a run.
            session_id, outcome = await self.sessions.open(
                tenant, code_s, setting_s, seed_i, charge=self.quotas.charge_run, options=checks
            )
            self._count(outcome)
            return session_id, outcome

    async def step(self, tenant: Tenant, session_id: str, action: object) -> StepOutcome:
        with self._observe("step"):
            authorize(tenant, Role.WRITE, "running code")
            action_s = check_action(action, self.limits)
            outcome: StepOutcome = await self.sessions.step(tenant, session_id, action_s)
            self._count(outcome)
            return outcome

    async def close_session(self, tenant: Tenant, session_id: str) -> None:
        with self._observe("close_session"):
            authorize(tenant, Role.WRITE, "running code")
            await self.sessions.close(tenant, session_id)

    def _count(self, outcome: StepOutcome) -> None:
        self.metrics.step_outcomes.labels(str(getattr(outcome.outcome, "value", outcome.outcome))).inc()

    async def reap_forever(self, interval_s: float) -> None:
        """Every ``interval_s`` until cancelled: close idle sessions, renew the live ones' quota leases."""
        while True:
            await asyncio.sleep(interval_s)
            reaped = await self.sessions.reap()
            if reaped:
                self.metrics.sessions_reaped.inc(reaped)
                self.metrics.sessions_open.set(len(self.sessions))
            try:
                await self.quotas.renew_sessions(self.sessions.live())
            except Exception as exc:  # the quota store is away: the leases run on; try again next round
                log.warning("could not renew the quota leases of %d sessions: %s", len(self.sessions), exc)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "sessions": len(self.sessions), "sandbox": self.backend.health()}

    async def shutdown(self) -> None:
        await self.sessions.close_all()
        await self.quotas.close()
