"""Run a benchmark grid as Ray tasks and write one Parquet dataset of results.

    python jobs/sweep.py --config jobs/configs/cpu-smoke.yaml            # starts a local Ray
    ray job submit --working-dir . -- python jobs/sweep.py --config jobs/configs/cpu-smoke.yaml \
        --results $PWD/results/cpu-smoke --data-dir $PWD/../shared/data

Each cell is one Ray task; models run in one engine actor per model that all cells share (or
in a running service). Finished cells are written atomically, one file per cell, by this
driver only; running the same command again skips them. `--check` prints the integrity counts.
Quiet by default: our `[sweep]` lines only; `--verbose` (or `VERBOSE=1`) shows Ray's and vLLM's logs.
`--in-process` runs the cells one after another in this process, with the engines in it too (no
Ray): for one crowded machine, where a Ray node may not start or its memory monitor kills actors.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jobs.bench.common import sayer

if __package__ in (None, ""):  # run by path (`python jobs/sweep.py`): make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa

from compaction.backend import Backend
from compaction.errors import CompactionError, InvalidInput
from jobs.data.conversations import SHARED_DATA
from jobs.experiments.cells import ModelAccess, run_cell
from jobs.experiments.grid import GENERATED, Cell, SweepConfig, expand, load_config
from jobs.experiments.results import ResultStore, integrity
from serving.local import hush, ray_logging, verbose_requested, worker_env
from serving.models import Catalogue, load_catalogue

REPO_ROOT = Path(__file__).resolve().parents[1]
RAY_START_TIMEOUT = "timed out during startup"  # ray._private.node.Node, its node not registered within 30 s


say = sayer("sweep", clock=True)


class Scheduler:
    """Which cells may start now. Per model, blocks run in config order; a block runs up to its
    `concurrency` cells at once (1 keeps timed cells alone on their engine). Models run in parallel."""

    def __init__(self, cells: Sequence[Cell], concurrency: Mapping[str, int]) -> None:
        self.concurrency = concurrency
        self.queues: dict[str, deque[Cell]] = {}
        self.running: dict[str, list[Cell]] = {}
        for cell in cells:
            self.queues.setdefault(cell.model, deque()).append(cell)
            self.running.setdefault(cell.model, [])

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def ready(self) -> list[Cell]:
        started: list[Cell] = []
        for model, queue in self.queues.items():
            running = self.running[model]
            while queue:
                head = queue[0]
                others = any(c.experiment != head.experiment for c in running)
                if others or len(running) >= self.concurrency[head.experiment]:
                    break
                running.append(queue.popleft())
                started.append(head)
        return started

    def finish(self, cell: Cell) -> None:
        self.running[cell.model].remove(cell)


def cell_task(cell: Cell, paths: dict[str, str], agent: ModelAccess, judge: ModelAccess | None, cold: bool) -> Any:
    """The body of one cell's Ray task: its rows as an Arrow table (returned to the driver)."""
    return asyncio.run(run_cell(cell, paths, agent, judge, cold))


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.failed, self.rows = total, 0, 0, 0
        self.began = time.perf_counter()

    def record(self, store: ResultStore, cell: Cell, began: float, outcome: pa.Table | Exception) -> None:
        """Write a finished cell (or note its failure, which the next run retries) and log a progress line."""
        try:
            if isinstance(outcome, Exception):
                raise outcome
            store.write(cell.cell_id, outcome)
        except Exception as exc:
            store.write_error(cell.cell_id, f"{type(exc).__name__}: {exc}")
            self.failed += 1
            say(self.line(cell, time.perf_counter() - began, f"FAILED ({str(exc).splitlines()[0][:200]})"))
            return
        self.done += 1
        self.rows += outcome.num_rows
        say(self.line(cell, time.perf_counter() - began, f"wrote {outcome.num_rows} rows"))

    def line(self, cell: Cell, seconds: float, outcome: str) -> str:
        elapsed = time.perf_counter() - self.began
        finished = self.done + self.failed
        eta = elapsed / finished * (self.total - finished) if finished else 0.0
        return (
            f"{finished}/{self.total} cells ({self.failed} failed, {self.rows} rows) | {cell.cell_id} "
            f"{outcome} in {seconds:.1f} s | elapsed {elapsed:.0f} s, eta {eta:.0f} s"
        )


def run_cells(
    cells: Sequence[Cell],
    store: ResultStore,
    launch: Callable[[Cell], Any],
    concurrency: Mapping[str, int],
    stop_after: int | None = None,
) -> Progress:
    """Launch cells as the scheduler allows, write each finished one, log a progress line per cell.

    `stop_after` ends the run after that many cells were written, abandoning the cells in flight
    (what a crash does); their results are never written, so a re-run does them again.
    """
    import ray

    scheduler = Scheduler(cells, concurrency)
    progress = Progress(len(cells))
    inflight: dict[Any, tuple[Cell, float]] = {}
    while scheduler.pending or inflight:
        for cell in scheduler.ready():
            inflight[launch(cell)] = (cell, time.perf_counter())
        (ref,), _ = ray.wait(list(inflight), num_returns=1)
        cell, began = inflight.pop(ref)
        scheduler.finish(cell)
        outcome: pa.Table | Exception
        try:
            outcome = ray.get(ref)
        except Exception as exc:
            outcome = exc
        progress.record(store, cell, began, outcome)
        if stop_after is not None and progress.done >= stop_after:
            for pending in inflight:
                ray.cancel(pending, force=True)
            say(f"stopping after {stop_after} cells as asked; {len(inflight)} cells in flight are abandoned")
            break
    return progress


def start_models(
    config: SweepConfig, catalogue: Catalogue, cells: Sequence[Cell]
) -> tuple[dict[str, ModelAccess], list[Any]]:
    """A ModelAccess per model the cells use (agents and judges); engine actors are started in parallel."""
    import ray

    from jobs.experiments.engines import ActorBackend, EngineHost
    from serving.backends import OpenAIBackend

    names = sorted({c.model for c in cells} | {c.judge_model for c in cells if c.judge_model})
    backend = config.backend
    accesses: dict[str, ModelAccess] = {}
    if backend.kind == "service":
        for name in names:
            spec = catalogue.get(name)
            factory: Callable[[], Backend] = functools.partial(OpenAIBackend, backend.base_url or "", name)
            label = f"service {backend.base_url}"
            window, block = spec.max_model_len, spec.block_size
            source = spec.resolved_source()
            accesses[name] = ModelAccess(name, source, window, block, factory, label, backend.base_url)
        return accesses, []
    actor_class = ray.remote(EngineHost)
    actors: dict[str, Any] = {}
    for name in names:
        spec = catalogue.get(name)
        window = backend.max_model_len or spec.max_model_len
        options = {"num_cpus": backend.engine_cpus, "num_gpus": backend.engine_gpus, "max_concurrency": 256}
        actors[name] = actor_class.options(**options).remote(spec.resolved_source(), window, backend.kv_cache_gib)
    say(f"starting {len(actors)} engine actor(s): {', '.join(actors)} (about 30 s on the CPU)")
    for name, actor in actors.items():
        window, block = ray.get(actor.limits.remote())
        spec = catalogue.get(name)
        factory = functools.partial(ActorBackend, actor)  # picklable: cell tasks call it
        label = f"engine actor ({spec.device})"
        accesses[name] = ModelAccess(name, spec.resolved_source(), window, block, factory, label)
    return accesses, list(actors.values())


def stop_models(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        except Exception as exc:  # the engine may already be gone; kill the actor regardless
            say(f"engine shutdown: {exc!r}")
        ray.kill(actor)


def connect(address: str | None, num_cpus: int, quiet: bool = True) -> bool:
    """Join a cluster (--address, or RAY_ADDRESS as set by `ray job submit`), else start a local one.

    Returns whether this process started Ray (and must shut it down). A local start never
    attaches to some other Ray instance on the machine (address="local").
    """
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, **ray_logging(quiet))
        return False
    runtime_env = {"env_vars": worker_env(quiet)}
    try:
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env, **ray_logging(quiet)
        )
    except Exception as exc:  # Ray waits a fixed 30 s for its own node to register
        if RAY_START_TIMEOUT not in str(exc):
            raise
        raise SystemExit(
            f"{exc}\nThe machine was too busy for Ray to start within its 30 s: run the sweep again (done cells are "
            "skipped), or start Ray first (`ray start --head`) and pass --address 127.0.0.1:6379"
        ) from exc
    return True


def check_data(cells: Sequence[Cell], paths: dict[str, str]) -> None:
    needed = {c.dataset for c in cells} - GENERATED  # summary cells read LoCoMo: their dataset is locomo
    for dataset in sorted(needed):
        if not Path(paths[dataset]).exists():
            raise InvalidInput(
                "data", f"{dataset} file {paths[dataset]} not found; pass --data-dir (or set COMPACTION_DATA)"
            )


def sweep(config: SweepConfig, args: argparse.Namespace, store: ResultStore, cells: Sequence[Cell]) -> int:
    import ray

    paths = config.data.resolve(Path(args.data_dir))
    check_data(cells, paths)
    concurrency = {e.name: e.concurrency for e in config.experiments}
    began = time.perf_counter()
    started = connect(args.address, args.num_cpus, quiet=not args.verbose)
    actors: list = []
    try:
        accesses, actors = start_models(config, load_catalogue(), cells)
        say(f"models ready after {time.perf_counter() - began:.0f} s")
        task = ray.remote(num_cpus=args.task_cpus)(cell_task)

        def launch(cell: Cell) -> Any:
            judge = accesses[cell.judge_model] if cell.judge_model else None
            return task.remote(cell, paths, accesses[cell.model], judge, concurrency[cell.experiment] == 1)

        progress = run_cells(cells, store, launch, concurrency, args.stop_after)
    finally:
        stop_models(actors)
        if started:
            ray.shutdown()
    counts = integrity(store.read())
    say(f"done in {time.perf_counter() - began:.0f} s: {progress.done} cells written, {progress.failed} failed")
    say(f"dataset {store.cells}: {counts}")
    if progress.failed:
        say(f"failed cells are listed in {store.errors}; run the same command again to retry them")
    return 1 if progress.failed else 0


async def _run_in_order(
    cells: Sequence[Cell], store: ResultStore, paths: dict[str, str], accesses: Mapping[str, ModelAccess]
) -> Progress:
    progress = Progress(len(cells))
    for cell in cells:
        began = time.perf_counter()
        judge = accesses[cell.judge_model] if cell.judge_model else None
        outcome: pa.Table | Exception
        try:
            outcome = await run_cell(cell, paths, accesses[cell.model], judge, True)
        except Exception as exc:
            outcome = exc
        progress.record(store, cell, began, outcome)
    return progress


def sweep_in_process(config: SweepConfig, args: argparse.Namespace, store: ResultStore, cells: Sequence[Cell]) -> int:
    """The cells in this process, one at a time, on in-process engines (backend kind `engine` only)."""
    from serving.backends import VLLMBackend

    if config.backend.kind != "engine":
        raise InvalidInput("backend", "--in-process runs engines in this process: use backend.kind engine")
    paths = config.data.resolve(Path(args.data_dir))
    check_data(cells, paths)
    catalogue = load_catalogue()
    engines: list[VLLMBackend] = []
    accesses: dict[str, ModelAccess] = {}
    try:
        for name in sorted({c.model for c in cells} | {c.judge_model for c in cells if c.judge_model}):
            spec = catalogue.get(name)
            window = config.backend.max_model_len or spec.max_model_len
            engines.append(
                VLLMBackend.start(
                    spec.resolved_source(), max_model_len=window, kv_cache_gib=config.backend.kv_cache_gib
                )
            )
            engine = engines[-1]
            factory = functools.partial(lambda e: e, engine)
            accesses[name] = ModelAccess(
                name,
                spec.resolved_source(),
                engine.max_model_len,
                engine.block_size,
                factory,
                f"in-process engine ({spec.device})",
            )
        progress = asyncio.run(_run_in_order(cells, store, paths, accesses))
    finally:
        for engine in engines:
            engine.shutdown()
    say(f"{progress.done} cells written, {progress.failed} failed; dataset {store.cells}: {integrity(store.read())}")
    return 1 if progress.failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="Sweep YAML (see jobs/configs/)")
    parser.add_argument("--results", type=Path, default=None, help="Results folder (default: results/<name>)")
    parser.add_argument("--data-dir", type=Path, default=SHARED_DATA, help="Folder of the benchmark files")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)")
    parser.add_argument("--num-cpus", type=int, default=4, help="Logical CPUs of a local Ray (not when joining)")
    parser.add_argument("--task-cpus", type=float, default=0.25, help="Logical CPUs of one cell task")
    parser.add_argument("--stop-after", type=int, default=None, help="Stop after writing this many cells")
    parser.add_argument("--dry-run", action="store_true", help="List the cells and exit")
    parser.add_argument("--in-process", action="store_true", help="No Ray: run the cells one by one in this process")
    parser.add_argument("--check", action="store_true", help="Print the results' integrity counts and exit")
    parser.add_argument("--verbose", action="store_true", help="Show Ray's and vLLM's logs too (or VERBOSE=1)")
    args = parser.parse_args(argv)
    args.verbose = verbose_requested(args.verbose)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        hush()
    try:
        config = load_config(args.config)
        expansion = expand(config, load_catalogue())
    except CompactionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = args.results or Path(os.environ.get("COMPACTION_RESULTS") or "results") / config.name
    store = ResultStore(results.resolve())
    if args.check:
        print(integrity(store.read()))
        return 0
    done = store.done()
    todo = [c for c in expansion.cells if c.cell_id not in done]
    for cell, reason in expansion.dropped:
        say(f"dropped {cell.cell_id}: {reason}")
    total = len(expansion.cells)
    say(f"{config.name}: {total} cells, {total - len(todo)} already done, {len(todo)} to run")
    say(f"results: {store.cells}")
    if args.dry_run:
        print("\n".join(c.cell_id for c in todo))
        return 0
    if not todo:
        return 0
    store.root.mkdir(parents=True, exist_ok=True)
    (store.root / "sweep.yaml").write_text(Path(args.config).read_text())
    try:
        return (sweep_in_process if args.in_process else sweep)(config, args, store, todo)
    except CompactionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
