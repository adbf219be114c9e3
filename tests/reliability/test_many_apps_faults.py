"""RELIABILITY.md §F: two apps in one vhost, a worker of each SIGKILLed mid-chord (MA1).

``shop`` and ``billing`` (tests/integration/shop_app.py, billing_app.py) each run two workers in
their own app namespace, in one vhost. Chords of both apps, from our client and from a Celery
client (``ChordBackend``), are in flight when the first worker of each app, its chord joiner,
is SIGKILLed; a new worker takes its place. Every chord must return its value (0 lost), and each
body run once: the joiner that takes over rebuilds the chords from the parts the broker gives
back, and its transaction sends each body once (a body runs again only if its own worker dies
mid-run, as any task; the figures count the runs).
"""

from __future__ import annotations

import signal
from collections import Counter
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chord

from broker_svc import App, Settings
from broker_svc import chord as our_chord
from tests.infra.session_broker import SessionBroker
from tests.integration.many_apps_notes import read_notes
from tests.interop.conftest import close_celery_client
from tests.reliability.journal import report
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

APPS = {
    "shop": ("tests.integration.shop_app:app", ["shop"], "shop.add", "shop.xsum"),
    "billing": (
        "tests.integration.billing_app:app",
        ["billing", "billing-totals"],
        "billing.mul",
        "billing.total",
    ),
}
BACKEND = "broker_svc.celery_backend:ChordBackend"
PARTS = 4
HEADER_DELAY_S = 0.05
CHORDS_PER_CLIENT = 15


def expected(app: str, n: int) -> int:
    return sum(i + n for i in range(PARTS)) if app == "shop" else sum(i * n for i in range(PARTS))


def start(stack: ExitStack, url: str, app: str, notes: Path) -> WorkerProcess:
    spec, queues, _, _ = APPS[app]
    env = {"MANY_APPS_NOTES": str(notes), "CLOCKWORK_APP_NAMESPACE": app}
    worker = stack.enter_context(WorkerProcess(url, app=spec, queues=queues, concurrency=2, env=env))
    worker.wait_ready()
    return worker


def send_ours(client: App, app: str) -> list[tuple[int, Any]]:
    _, _, part, body = APPS[app]
    delay = {"delay_s": HEADER_DELAY_S}
    return [
        (
            expected(app, n),
            our_chord([client.signature(part, (i, n), delay) for i in range(PARTS)])(client.signature(body)),
        )
        for n in range(CHORDS_PER_CLIENT)
    ]


def send_celery(client: Celery, app: str) -> list[tuple[int, Any]]:
    _, _, part, body = APPS[app]
    return [
        (
            expected(app, n),
            chord(
                client.signature(part, args=(i, n), kwargs={"delay_s": HEADER_DELAY_S}) for i in range(PARTS)
            )(client.signature(body)),
        )
        for n in range(CHORDS_PER_CLIENT)
    ]


@pytest.mark.timeout(300)
def test_ma1_a_sigkilled_worker_of_each_app_mid_chord_loses_no_chord(
    session_broker: SessionBroker, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.jsonl"
    with session_broker.own_vhost("clockwork-ma1") as url, ExitStack() as stack:
        joiners = {app: start(stack, url, app, notes) for app in APPS}
        for app in APPS:
            start(stack, url, app, notes)
        for joiner in joiners.values():
            joiner.first("chord_joiner_subscribed")
        sent: dict[str, list[tuple[int, Any]]] = {}
        for app in APPS:
            ours = stack.enter_context(
                closing(
                    App(
                        f"{app}-client",
                        settings=Settings(broker_url=url, default_queue=app, app_namespace=app),
                    )
                )
            )
            ours.task(name="billing.total", queue="billing-totals")(sum)
            celery = Celery(f"{app}-celery", broker=url, backend=BACKEND)
            celery.conf.update(
                accept_content=["json"], result_accept_content=["json"], task_serializer="json",
                task_default_queue=app, app_namespace=app,
                task_routes={"billing.total": {"queue": "billing-totals"}},
            )  # fmt: skip
            stack.callback(close_celery_client, celery)
            sent[app] = [*send_ours(ours, app), *send_celery(celery, app)]
        # Mid-chord: the joiners hold parts of chords whose other header tasks still run.
        wait_for(
            lambda: all(joiner.count("chord_body_sent") >= 2 for joiner in joiners.values()),
            timeout_s=60,
            message="each joiner sent a first body",
        )
        held = {app: joiner.count("chord_body_sent") for app, joiner in joiners.items()}
        for joiner in joiners.values():
            joiner.signal_tree(signal.SIGKILL)
        for app in APPS:
            start(stack, url, app, notes)  # the killed worker's replacement
        returned: dict[str, int] = {}
        lost: dict[str, int] = {}
        for app, chords in sent.items():
            ok = 0
            for value, result in chords:
                try:
                    ok += int(result.get(timeout=60) == value)
                except Exception:  # a chord that never returns (or returns wrong) is lost
                    pass
            returned[app], lost[app] = ok, len(chords) - ok
        bodies = Counter(what for _, what in read_notes(notes) if what in ("shop.xsum", "billing.total"))
        report(
            "MA1",
            chords=sum(len(c) for c in sent.values()),
            returned=sum(returned.values()),
            lost_chords=sum(lost.values()),
            bodies_run=sum(bodies.values()),
            bodies_sent_before_kill=held,
            killed="the chord joiner of each app (SIGKILL of the worker's process tree)",
        )
        assert lost == {"shop": 0, "billing": 0}, lost
        # Sent once each; a body whose own worker was killed mid-run may run again (at least once).
        assert bodies["shop.xsum"] >= len(sent["shop"]) and bodies["billing.total"] >= len(sent["billing"]), (
            bodies
        )
