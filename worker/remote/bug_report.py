"""The text ``inspect report`` answers: software versions, platform and settings, as Celery's."""

from __future__ import annotations

import platform
import pprint
from collections.abc import Mapping
from typing import Any

from broker_svc.version import version

__all__ = ["bug_report"]


def bug_report(*, app_spec: str, results: str, settings: Mapping[str, Any]) -> str:
    """The report, laid out as Celery's ``app.bugreport()`` so people read it the same way.

    Args:
        app_spec: the app the worker loaded (``package.module:app``), where Celery names its loader.
        results: where results go (``rpc://``, or the app's ``result_backend``).
        settings: the settings table without defaults (``conf_table``), censored.
    """
    arch = ", ".join(part for part in platform.architecture() if part)
    return (
        f"\nsoftware -> clockwork:{version()} py:{platform.python_version()}\n"
        f"            pika:{_version('pika')} aio-pika:{_version('aio-pika')}\n"
        f"platform -> system:{platform.system()} arch:{arch}\n"
        f"            kernel version:{platform.release()} imp:{platform.python_implementation()}\n"
        f"loader   -> {app_spec}\n"
        f"settings -> transport:amqp results:{results}\n\n"
        + "\n".join(f"{key}: {_pretty(value)}" for key, value in settings.items())
        + "\n"
    )


def _version(distribution: str) -> str:
    from importlib import metadata  # it imports email, zipfile, csv (3 MiB): only for a report

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _pretty(value: Any) -> str:
    # As Celery lays a setting out: maps and lists under their key, indented; the rest inline.
    if isinstance(value, dict | list) and value:
        text = pprint.pformat(value, width=50)
        return "\n    " + text.replace("\n", "\n    ")
    return pprint.pformat(value, width=50)
