"""Benchmark: publish a weight version of SmolLM2-135M and reload it in the embedded inference server.

What the learner does every ``publish_every`` steps, on CPU, broken down:

- learner: ``gather`` (the model's state: ``full_model_state``), ``serialise_write`` (safetensors
  and config files, ``save_model_files``), ``tokenizer`` (linked files), ``fsync`` (every file and
  the directory), ``rename`` (into ``v<N>``, parent fsynced);
- server: ``server_load`` (what ``/update_weights_from_disk`` does before the swap:
  ``load_model(path, like=served)``) and ``swap`` (the engine's scheduler installs the model);
- ``end_to_end``: ``write_weights`` then ``WeightPublisher.publish`` over real HTTP to the embedded
  server (``serve_in_thread``, the embedded run's layout), measured on its own version.

The baseline, in the same run, is the code before this benchmark existed: ``save_pretrained`` of
``get_model_state_dict``, copied tokenizer files, no fsync, and a full ``from_pretrained`` on the
server. After the last end-to-end publish the served weights are compared with the learner's. The
machine's floor (a plain write of as many bytes, and its fsync) is measured in the same run: on a
loaded machine it says how much of the time is the disk and the memory bus, not the code.

Usage::

    .venv/bin/python bench/publish_bench.py [--repeats 3] [--threads 1] [--json]

``--json`` prints one object: the settings, ``os.getloadavg()`` at start, our figures (median per
phase), the baseline's, the machine's floor and the ratios. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
PHASES = ("gather", "serialise_write", "tokenizer", "fsync", "rename", "server_load", "swap")
TARGET_S = 2.0


def _timed(times: dict[str, float], name: str, fn: Callable[[], T]) -> T:
    start = time.perf_counter()
    out = fn()
    times[name] = time.perf_counter() - start
    return out


async def _swap(engine: Any, model: Any, path: Path, version: int, times: dict[str, float]) -> None:
    start = time.perf_counter()
    outcome = await engine.swap_weights(model, path, str(version))
    times["swap"] = time.perf_counter() - start
    if not outcome.success:
        raise RuntimeError(f"swap failed: {outcome.message}")


async def ours(model: Any, engine: Any, base: Path, target: Path, version: int) -> dict[str, float]:
    """The publish path as the learner and the server run it, phase by phase."""
    from services.learner import checkpoint as ck
    from spade.inference.models import load_model

    times: dict[str, float] = {}
    state = _timed(times, "gather", lambda: ck.full_model_state(model))
    tmp = ck.staging_dir(target)
    _timed(times, "serialise_write", lambda: ck.save_model_files(model, state, tmp))
    _timed(times, "tokenizer", lambda: ck.link_tokenizer_files(base, tmp))
    _timed(times, "fsync", lambda: ck.fsync_tree(tmp))
    _timed(times, "rename", lambda: ck.install(tmp, target))
    loaded = _timed(times, "server_load", lambda: load_model(target, engine.dtype, like=engine.model))
    await _swap(engine, loaded, target, version, times)
    return times


async def baseline(model: Any, engine: Any, base: Path, target: Path, version: int) -> dict[str, float]:
    """The path before: save_pretrained of the gathered state, copied tokenizer files, from_pretrained."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.learner.checkpoint import TOKENIZER_FILES, staging_dir
    from spade.inference.models import load_model

    times: dict[str, float] = {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = _timed(times, "gather", lambda: get_model_state_dict(model, options=options))
    tmp = staging_dir(target)
    _timed(times, "serialise_write", lambda: model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True))

    def copy_tokenizer() -> None:
        for name in TOKENIZER_FILES:
            if (base / name).is_file():
                shutil.copy2(base / name, tmp / name)

    _timed(times, "tokenizer", copy_tokenizer)
    times["fsync"] = 0.0  # it did not fsync
    _timed(times, "rename", lambda: os.replace(tmp, target))
    loaded = _timed(times, "server_load", lambda: load_model(target, engine.dtype))
    await _swap(engine, loaded, target, version, times)
    return times


async def end_to_end(
    model: Any, base: Path, weights: Path, url: str, version: int, admin_key: str
) -> tuple[float, str]:
    """``write_weights`` + ``WeightPublisher.publish`` over HTTP: the learner's publish as it runs."""
    from services.learner.checkpoint import write_weights
    from services.learner.publisher import WeightPublisher
    from spade.endpoints import InferenceEndpoint
    from spade.queues.config import InProcessQueueConfig
    from spade.queues.inprocess import InProcessQueue

    queue = InProcessQueue(InProcessQueueConfig())
    learner = InferenceEndpoint.model_validate({"api_key": admin_key})
    publisher = WeightPublisher([url], queue, weights_dir=weights, keep=100, inference=learner)
    try:
        start = time.perf_counter()
        path = write_weights(model, weights / f"v{version:08d}", base_model_dir=base)
        assert path is not None
        result = await publisher.publish(version, path)
        return time.perf_counter() - start, result.outcome.value
    finally:
        await publisher.close()
        await queue.close()


def machine_floor(directory: Path, nbytes: int) -> dict[str, float]:
    """The machine's own cost of the same bytes: a plain sequential write, then its fsync."""
    chunk = bytes(8 << 20)
    path = directory / "floor.bin"
    times: dict[str, float] = {}
    start = time.perf_counter()
    with path.open("wb") as fh:
        for _ in range(0, nbytes, len(chunk)):
            fh.write(chunk)
        fh.flush()
        times["write"] = time.perf_counter() - start
        start = time.perf_counter()
        os.fsync(fh.fileno())
        times["fsync"] = time.perf_counter() - start
    path.unlink()
    return times


def _perturb(model: Any, step: int) -> None:
    import torch

    with torch.no_grad():  # a "trained" model: every version differs from the last
        for p in model.parameters():
            p.add_(1e-4 * step)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.inference.settings import InferenceSettings
    from services.inference.wiring import serve_in_thread
    from spade.auth import generate_key
    from spade.inference.models import ensure_default_model

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    base = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    size_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    admin_key, admin_digest = generate_key()  # the admin routes are off without an admin key
    handle = serve_in_thread(
        InferenceSettings(
            http={"port": 0},
            model_path=base,
            torch_threads=args.threads,
            admin_keys=[{"tenant": "bench", "key_sha256": admin_digest}],
        )
    )
    root = Path(tempfile.mkdtemp(prefix="spade-publish-bench-", dir=args.dir))
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "baseline": [], "floor": []}
    e2e: list[float] = []
    version = 0
    try:
        loop_engine = handle.engine

        def on_server(coro: Any) -> Any:  # the engine's futures live on the server's event loop
            return asyncio.run_coroutine_threadsafe(coro, handle.loop).result()

        for _ in range(args.repeats):  # alternate, so the machine's load hits both alike
            for name, fn in (("ours", ours), ("baseline", baseline)):
                version += 1
                _perturb(model, version)
                target = root / name / f"v{version:08d}"
                target.parent.mkdir(parents=True, exist_ok=True)
                runs[name].append(on_server(fn(model, loop_engine, base, target, version)))
                shutil.rmtree(target, ignore_errors=True)
            runs["floor"].append(machine_floor(root, int(size_mib * 2**20)))
            version += 1
            _perturb(model, version)
            seconds, outcome = await end_to_end(model, base, root / "published", handle.url, version, admin_key)
            if outcome != "all_acknowledged":
                raise RuntimeError(f"the end-to-end publish ended {outcome}")
            e2e.append(seconds)
        served = {k: v for k, v in handle.engine.model.state_dict().items()}
        verified = all(bool(torch.equal(served[k], v)) for k, v in model.state_dict().items())
    finally:
        handle.stop()
        shutil.rmtree(root, ignore_errors=True)

    def medians(rs: list[dict[str, float]]) -> dict[str, float]:
        out = {p: statistics.median(r[p] for r in rs) for p in PHASES}
        out["total"] = sum(out[p] for p in PHASES)
        out["publish"] = sum(out[p] for p in PHASES[:5])
        out["reload"] = out["server_load"] + out["swap"]
        return out

    figures, base_figures = medians(runs["ours"]), medians(runs["baseline"])
    figures["end_to_end"] = statistics.median(e2e)
    floor = {f"{k}_s": statistics.median(r[k] for r in runs["floor"]) for k in ("write", "fsync")}
    return {
        "machine_floor": {"what": "plain sequential write of the model's bytes, then fsync", **floor},
        "figures": figures,
        "baseline": {"name": "save_pretrained + copied tokenizer, no fsync; from_pretrained", **base_figures},
        "ratios": {
            "total_baseline_over_ours": base_figures["total"] / figures["total"],
            "server_load_baseline_over_ours": base_figures["server_load"] / figures["server_load"],
            "publish_baseline_over_ours": base_figures["publish"] / figures["publish"],
            "end_to_end_over_target": figures["end_to_end"] / TARGET_S,
            "serialise_write_over_plain_write": figures["serialise_write"] / floor["write_s"],
            "fsync_over_plain_fsync": figures["fsync"] / floor["fsync_s"],
        },
        "served_weights_equal_learner": verified,
        "model_mib": size_mib,
        "runs": {**runs, "end_to_end": e2e},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each publishes ours, the baseline, end to end")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (learner and server)")
    parser.add_argument("--dir", default=None, help="where to write the versions (default: the temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    result = asyncio.run(run(args))
    settings = {"model": "SmolLM2-135M-Instruct", "device": "cpu", "repeats": args.repeats, "threads": args.threads}
    if args.json:
        print(
            json.dumps({"benchmark": "publish", "loadavg_start": list(load_at_start), "settings": settings, **result})
        )
        return
    ours_f, base_f = result["figures"], result["baseline"]
    print(
        f"SmolLM2-135M ({result['model_mib']:.0f} MiB fp32) on CPU, median of {args.repeats}; "
        f"load average at start {load_at_start[0]:.2f}"
    )
    print(f"{'phase':18}{'ours s':>10}{'before s':>10}")
    for phase in (*PHASES, "publish", "reload", "total"):
        print(f"{phase:18}{ours_f[phase]:>10.3f}{base_f[phase]:>10.3f}")
    print(
        f"{'end_to_end':18}{ours_f['end_to_end']:>10.3f}   (write_weights + publish over HTTP; target < {TARGET_S} s)"
    )
    floor = result["machine_floor"]
    print(f"machine floor: plain write of the same bytes {floor['write_s']:.3f} s, its fsync {floor['fsync_s']:.3f} s")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}")
    print(f"served weights equal the learner's: {result['served_weights_equal_learner']}")


if __name__ == "__main__":
    main()
