"""``make run``: start a worker, send demo tasks, print their results, ask it via ``ctl``, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from broker_svc import App, ResultTimeout, Settings, TaskError
from broker_svc.logging import configure_logging

WORKER_START_TIMEOUT_S = 60.0


def main() -> int:
    """Run the demo; returns the exit status."""
    configure_logging("warning")
    settings = Settings.from_env()
    print(f"broker: {settings.safe_broker_url}")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker",
            "-A",
            "examples.tasks:app",
            "-c",
            "2",
            "-n",
            "demo@%h",
            "-l",
            "warning",
        ],
        env={**os.environ, "CLOCKWORK_BROKER_URL": settings.broker_url},
    )
    # The demo's producer spools: with the broker down, delay() still returns and nothing is lost
    # (docs/guide.md, "When the broker is down"). CLOCKWORK_SPOOL_DIR picks another directory.
    client = App("demo", settings=settings.with_options(spool_dir=settings.spool_dir or ".spool/demo"))
    try:
        wait_until_serving(client)
        show(client)
        inspect(settings.broker_url)
    finally:
        client.close()
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(timeout=60)
        print(f"worker stopped with exit status {status}")
    return 0 if status == 0 else 1


def wait_until_serving(client: App) -> None:
    """Send a no-op until the worker answers (its children import the app first)."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while True:
        try:
            client.send_task("examples.tasks.add", (0, 0)).get(timeout=2)
            return
        except ResultTimeout:
            if time.monotonic() > deadline:
                raise


def show(client: App) -> None:
    """Send the demo tasks and print what comes back."""
    print("add(2, 3) =", client.send_task("examples.tasks.add", (2, 3)).get(timeout=10))
    counts = client.send_task("examples.tasks.word_count", ("the cat and the hat",)).get(timeout=10)
    print("word_count('the cat and the hat') =", counts)
    failing = client.send_task("examples.tasks.fail", ("bad input",))
    try:
        failing.get(timeout=10)
    except ValueError as exc:
        assert isinstance(exc, TaskError)
        print(f"fail('bad input') -> {failing.state}: {exc.exc_type}: {exc}")
    started = time.perf_counter()
    batch = [client.send_task("examples.tasks.add", (i, i)) for i in range(1000)]
    client.flush(timeout=30)
    sent = time.perf_counter()
    total = sum(r.get(timeout=60) for r in batch)
    done = time.perf_counter()
    print(
        f"1000 x add: sum={total}, enqueued+confirmed in {sent - started:.2f} s, "
        f"all results in {done - started:.2f} s"
    )


def inspect(broker_url: str) -> None:
    """What an operator sees: ``ctl`` asks the running worker over the control plane."""
    for command in (["status"], ["inspect", "stats"], ["inspect", "registered"]):
        print(f"$ ctl {' '.join(command)}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "control.cli", "--timeout", "5", *command],
            env={**os.environ, "CLOCKWORK_BROKER_URL": broker_url},
            check=False,
        )


if __name__ == "__main__":
    sys.exit(main())
