"""One execution's service side: feed stdin, read capped output, enforce the wall clock, classify.

The program's jail is already spawned (``SandboxPool.execute``); this module only talks to it over
the request's own channels and decides the ``ExecutionResult``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.sandbox.isolation.channels import CappedReader, Channel, write_all
from services.sandbox.isolation.outcomes import ExecutionResult, Observed, SandboxFault, classify_execution

EXIT_GRACE_S = 5.0
"""How long to wait for the pipes to close once the program's processes are gone or killed."""


async def run_execution(
    channel: Channel,
    setup: dict[str, Any],
    stdin: bytes,
    stdin_w: int,
    out_r: int,
    err_r: int,
    *,
    wall: float,
    cpu: float,
    stdout_cap: int,
    stderr_cap: int,
    stop: Callable[[], Awaitable[dict[str, Any] | None]],
) -> ExecutionResult:
    """Drive one execution to its end.

    Args:
        channel: the request's control channel (pid 1 of its jail on the other end).
        setup: ``{"code", "files", "argv"}`` for pid 1.
        stdin, stdin_w: what to feed the program, and the pipe to feed it through (taken over).
        out_r, err_r: the program's stdout/stderr pipes (the caller closes them).
        wall: wall-clock limit (s); cpu: the CPU rlimit it runs under (s).
        stdout_cap, stderr_cap: bytes kept of each stream; more is ``output_limit``.
        stop: kills the request if still running; returns the zygote's ``exited`` message or None.

    Raises:
        SandboxFault: the sandbox (not the program) failed.
    """
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    overflow: asyncio.Future[None] = loop.create_future()

    def overflowed() -> None:
        if not overflow.done():
            overflow.set_result(None)

    feeder: asyncio.Task[None] | None = None
    if stdin:
        feeder = asyncio.create_task(write_all(stdin_w, stdin))
    else:
        os.close(stdin_w)  # the program reads end of file at once
    stdout = CappedReader(out_r, stdout_cap, overflowed)
    stderr = CappedReader(err_r, stderr_cap, overflowed)
    report: dict[str, Any] | None = None
    fault: str | None = None
    timed_out = False

    async def finish() -> None:
        nonlocal report, fault
        await channel.send(setup)
        while report is None:  # pid 1 sends one report (then exits), or a fault (then exits)
            message = await channel.recv()
            if message is None:
                break
            if message.get("op") == "exit":
                report = message
            elif message.get("op") == "fault":
                fault = str(message.get("error"))
        await asyncio.wait({stdout.ended, stderr.ended})

    try:
        body = asyncio.create_task(finish())
        tasks = [body] if feeder is None else [body, feeder]
        try:
            done, _ = await asyncio.wait({body, overflow}, timeout=wall, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                timed_out = True
            elif body in done:
                body.result()  # re-raise a channel failure
        except (OSError, ConnectionError) as exc:
            fault = fault or f"request channel failed: {exc}"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration_ms = (time.perf_counter() - start) * 1000
        exited: dict[str, Any] | None = None
        if report is None or timed_out or overflow.done():
            exited = await stop()
        if fault is not None and report is None and not timed_out:
            raise SandboxFault(f"sandbox fault during execution: {fault}")
        if exited is None and report is None and not timed_out and not overflow.done():
            raise SandboxFault("the sandbox lost the execution (zygote died)")
        # The processes are gone (or were killed): the pipes reach their end promptly.
        await asyncio.wait({stdout.ended, stderr.ended}, timeout=EXIT_GRACE_S)
    finally:
        # Whatever happened (even cancellation), nothing reads the pipes the caller then closes.
        stdout.stop()
        stderr.stop()
    status, exit_code = classify_execution(
        Observed(report, exited, timed_out, overflow.done(), cpu_limit_s=float(math.ceil(cpu)))
    )
    return ExecutionResult(status, exit_code, bytes(stdout.data), bytes(stderr.data), duration_ms)
