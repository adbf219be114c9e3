"""``ctl`` starts lean: its parser loads nothing a command needs, and ``ctl inspect ping`` loads only
the blocking client (pika) and what the mailbox commands print with.

Not a timing test: a module that slips back into the start path shows up here by name, whatever
the machine's speed. What each one cost when it was there is in BENCHMARKS.md ("ping as a command").
"""

from __future__ import annotations

from tests.support.imports import heavy, loaded_after

# Never needed to parse ``ctl``'s arguments or to run ``ctl inspect ping``. structlog (with the
# asyncio it imports) is loaded only when ``ctl`` writes a log line; the canvas, the result
# backends and the schedule only by the commands that use them (``ctl task``, ``ctl schedule``).
NEVER_FOR_PING = (
    "structlog",
    "aio_pika",
    "aiormq",
    "pamqp",
    "celery",
    "kombu",
    "control.aio",
    "control.api",
    "broker_svc.app",
    "broker_svc.canvas",
    "broker_svc.results",
    "broker_svc.schedules",
    "broker_svc.sending",
    "broker_svc.connection.state_feed",
    "control.cli.task_history",
    "control.cli.schedule",
    "control.cli.watch",
    "control.cli.events",
    "control.cli.dead",
    "control.blocking.dead_letters",
)
# Not even the blocking client: the parser is all ``--help`` or a usage error needs.
NEVER_FOR_THE_PARSER = (
    *NEVER_FOR_PING,
    "pika",
    "msgpack",
    "asyncio",
    "control.blocking",
    "broker_svc.settings",
)


def test_parsing_ctls_arguments_loads_no_amqp_client_structlog_or_command_module() -> None:
    loaded = loaded_after(
        "from control.cli.main import build_parser\nbuild_parser().parse_args(['inspect', 'ping'])"
    )
    assert "control.cli.parser" in loaded  # the probe did run
    assert heavy(loaded, NEVER_FOR_THE_PARSER) == []


def test_inspect_ping_loads_the_blocking_client_and_nothing_of_the_other_commands() -> None:
    # What ``main`` imports for ``ctl inspect ping`` before it connects: the settings, the
    # client, the command's module; logging set up as ``ctl`` does (deferred).
    loaded = loaded_after(
        "from control.cli import main\n"
        "from broker_svc.logging import configure_logging\n"
        "from broker_svc.settings import Settings\n"
        "from control.blocking.client import ControlClient\n"
        "configure_logging('warning', defer=True)\n"
        "main._command('inspect')\n"
        "ControlClient(Settings.from_env())"
    )
    assert {"pika", "control.blocking.client", "control.cli.mailbox"} <= loaded
    assert heavy(loaded, NEVER_FOR_PING) == []


def test_every_command_name_has_a_function_to_run_it() -> None:
    from control.cli import main
    from control.cli.parser import build_parser

    parser = build_parser()
    names = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert names
    for name in names:
        assert callable(main._command(name)), name
