"""Keyed deduplication on the client: a task's ``dedup_key`` option and the key of each call.

Pure: no broker. ``@app.task(dedup_key=..., dedup_timeout=...)`` is checked when the task is
declared (``task_dedup``); each send's key is formed and checked as the task is sent
(``resolve_dedup``), and a canvas that carries a key where a worker, not this client, will send
the task is refused then (the gate sees only what a client sends: ``broker_svc/wire/records/dedup.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.canvas.signature import Signature
from broker_svc.wire.records.dedup import DEFAULT_DEDUP_TIMEOUT_S, MAX_DEDUP_TIMEOUT_S

__all__ = [
    "KEY_MAX_BYTES",
    "DedupCall",
    "TaskDedup",
    "check_dedup_key",
    "check_dedup_timeout",
    "dedup_call",
    "resolve_dedup",
    "task_dedup",
]

# A key travels in a header and the gate keeps every live one in memory: keep keys short.
KEY_MAX_BYTES: Final = 200

# Where a signature rides in a task's options when a worker, not the client, sends it later.
_SENT_BY_A_WORKER: Final = {
    "link": "a callback (link) of",
    "link_error": "an errback (link_error) of",
    "chain": "a chain's step after",
    "chord": "the chord's body after",
}


@dataclass(frozen=True, slots=True)
class DedupCall:
    """The dedup key of one send and its safety timeout (seconds), checked."""

    key: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class TaskDedup:
    """A task's own ``dedup_key`` and ``dedup_timeout``, as ``@app.task`` was given them.

    Attributes:
        task_name: the task's name, which prefixes every key it forms.
        argument: the name of the argument whose value is the key, or None.
        function: a callable of the call's ``(*args, **kwargs)`` returning the key, or None.
        signature: the task function's signature (to bind ``argument``), when ``argument`` is set.
        bind: the function takes the task as its first argument (``bind=True``).
        timeout_s: the task's ``dedup_timeout``, or None for ``DEFAULT_DEDUP_TIMEOUT_S``.
    """

    task_name: str
    argument: str | None = None
    function: Callable[..., object] | None = None
    signature: inspect.Signature | None = None
    bind: bool = False
    timeout_s: float | None = None

    @property
    def keyed(self) -> bool:
        """Whether the task forms a key for every call (not only a default timeout)."""
        return self.argument is not None or self.function is not None

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The key of a call with these arguments: ``"<task name>:<value>"``; None if not keyed.

        Raises:
            TypeError: the arguments do not bind to the function (the key's argument is missing).
            ValueError: the key is over ``KEY_MAX_BYTES``.
        """
        if self.argument is not None:
            value = self._argument_value(args, kwargs)
        elif self.function is not None:
            value = self.function(*args, **kwargs)
        else:
            return None
        return check_dedup_key(f"{self.task_name}:{value}", self.task_name)

    def _argument_value(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> object:
        assert self.signature is not None and self.argument is not None
        try:
            if self.bind:  # the task itself comes first; any placeholder binds there
                bound = self.signature.bind(None, *args, **kwargs)
            else:
                bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.task_name!r}: no dedup key ({self.argument!r}): {exc}") from None
        bound.apply_defaults()
        return bound.arguments[self.argument]


def task_dedup(
    fn: Callable[..., Any], *, task_name: str, bind: bool, dedup_key: object, dedup_timeout: object
) -> TaskDedup | None:
    """A task's dedup options, checked as it is declared; None when it has neither.

    Args:
        fn: the task's function.
        task_name: the task's name.
        bind: the function's first parameter is the task (``bind=True``): not a key's argument.
        dedup_key: an argument's name (bound by ``fn``'s signature, positional or keyword), or a
            callable of the call's ``(*args, **kwargs)``, or None.
        dedup_timeout: seconds, ``0 < t <= MAX_DEDUP_TIMEOUT_S``, or None.

    Raises:
        TypeError: ``dedup_key`` is not a callable nor the name of one of ``fn``'s arguments (or
            names its ``*args``/``**kwargs``).
        ValueError: ``dedup_timeout`` is not a number of seconds in range.
    """
    if dedup_key is None and dedup_timeout is None:
        return None
    timeout = None if dedup_timeout is None else check_dedup_timeout(dedup_timeout, task_name)
    if dedup_key is None:
        return TaskDedup(task_name, timeout_s=timeout)
    if isinstance(dedup_key, str):
        signature = _signature_of(fn, task_name)
        parameters = list(signature.parameters.values())[1 if bind else 0 :]
        parameter = next((p for p in parameters if p.name == dedup_key), None)
        names = [p.name for p in parameters]
        if parameter is None:
            raise TypeError(
                f"task {task_name!r}: dedup_key={dedup_key!r} is not one of its arguments {names}; "
                "name an argument, or pass a callable taking the task's arguments"
            )
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(
                f"task {task_name!r}: dedup_key={dedup_key!r} names its *args or **kwargs; pass a "
                "callable taking the task's arguments that returns the key instead"
            )
        return TaskDedup(task_name, argument=dedup_key, signature=signature, bind=bind, timeout_s=timeout)
    if callable(dedup_key):
        return TaskDedup(task_name, function=dedup_key, timeout_s=timeout)
    raise TypeError(
        f"task {task_name!r}: dedup_key must be an argument's name or a callable taking the task's "
        f"arguments, not {dedup_key!r}"
    )


def _signature_of(fn: Callable[..., Any], task_name: str) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        raise TypeError(
            f"task {task_name!r}: its function's arguments cannot be read, so dedup_key cannot name "
            "one; pass a callable taking the task's arguments instead"
        ) from None


def check_dedup_key(key: object, task_name: str) -> str:
    """``key`` if it is a non-empty str of at most ``KEY_MAX_BYTES`` in UTF-8.

    Raises:
        ValueError: it is not, with the task's name.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"task {task_name!r}: a dedup key must be a non-empty str, not {key!r}")
    try:
        size = len(key.encode())
    except UnicodeEncodeError:
        raise ValueError(f"task {task_name!r}: the dedup key {key!r} is not valid text (UTF-8)") from None
    if size > KEY_MAX_BYTES:
        raise ValueError(
            f"task {task_name!r}: the dedup key {key[:60]!r}... is {size} bytes in UTF-8, over "
            f"{KEY_MAX_BYTES}; use a shorter value (a hash of a long one)"
        )
    return key


def check_dedup_timeout(value: object, task_name: str) -> float:
    """``value`` as seconds if ``0 < value <= MAX_DEDUP_TIMEOUT_S``.

    Raises:
        ValueError: it is not a number in that range, with the task's name.
    """
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_DEDUP_TIMEOUT_S:
        return float(value)
    raise ValueError(
        f"task {task_name!r}: dedup_timeout must be seconds, above 0 and at most {MAX_DEDUP_TIMEOUT_S:g} "
        f"(the broker's consumer_timeout bounds how long the gate may hold a task), not {value!r}"
    )


def dedup_call(
    task_name: str,
    options: Mapping[str, Any],
    spec: TaskDedup | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> DedupCall | None:
    """The key and timeout of one send, or None without a key.

    A ``dedup_key`` send option is the key as it is; without one, the task's own ``spec`` forms
    it from the call's arguments. ``dedup_timeout``: the option, else the task's, else
    ``DEFAULT_DEDUP_TIMEOUT_S``.

    Raises:
        TypeError: a ``dedup_timeout`` without a key, or arguments that give no key.
        ValueError: a key or timeout that ``check_dedup_key``/``check_dedup_timeout`` refuse.
    """
    key = options.get("dedup_key")
    timeout = options.get("dedup_timeout")
    if key is None and spec is not None:
        key = spec.key(args, kwargs or {})
    if key is None:
        if timeout is not None:
            raise TypeError(f"task {task_name!r}: dedup_timeout without a dedup_key; give the key too")
        return None
    if timeout is None and spec is not None:
        timeout = spec.timeout_s
    if timeout is None:
        timeout = DEFAULT_DEDUP_TIMEOUT_S
    return DedupCall(check_dedup_key(key, task_name), check_dedup_timeout(timeout, task_name))


def resolve_dedup(sig: Signature, specs: Callable[[str], TaskDedup | None]) -> Signature:
    """``sig`` as the client sends it: with its call's key and timeout in its options, if it has one.

    ``specs`` gives a task's own ``TaskDedup`` by name (None for a task without one, or one not
    registered here). Most sends have no key and no canvas, and come back as they are.

    Raises:
        TypeError: a key on a chord's header task, a signature with a key that a worker would send
            later (a callback, an errback, a later step of a chain, a chord's body), or a
            ``dedup_timeout`` without a key.
        ValueError: a key or timeout out of range.
    """
    options = sig.options
    spec = specs(sig.task)
    canvas = "link" in options or "link_error" in options or "chain" in options or "chord" in options
    if spec is None and not canvas and "dedup_key" not in options and "dedup_timeout" not in options:
        return sig
    if canvas:
        _refuse_keys_sent_by_a_worker(sig.task, options, specs)
    call = dedup_call(sig.task, options, spec, sig.args, sig.kwargs)
    if call is None:
        return sig
    if options.get("chord") is not None:
        raise TypeError(
            f"task {sig.task!r}: a chord's header task cannot have a dedup key: declined, it would "
            "never reach the chord's joiner and the chord would never finish"
        )
    keyed = {**options, "dedup_key": call.key, "dedup_timeout": call.timeout_s}
    return Signature(sig.task, sig.args, sig.kwargs, keyed, immutable=sig.immutable, app=sig._app)


def _refuse_keys_sent_by_a_worker(
    task_name: str, options: Mapping[str, Any], specs: Callable[[str], TaskDedup | None]
) -> None:
    for option, place in _SENT_BY_A_WORKER.items():
        value = options.get(option)
        for item in value if isinstance(value, list | tuple) else [value]:
            found = _keyed_task_in(item, specs, depth=0)
            if found is not None:
                raise TypeError(
                    f"task {found!r} has a dedup key, but as {place} {task_name!r} a worker would "
                    "send it later, and only tasks a client sends pass the dedup gate; send it on "
                    "its own, or as a chain's first step"
                )


def _keyed_task_in(sig: object, specs: Callable[[str], TaskDedup | None], depth: int) -> str | None:
    # The name of a task in this signature (a map or a Signature, at any depth) sent with a key.
    if not isinstance(sig, Mapping) or depth > 16:
        return None
    options = sig.get("options")
    options = options if isinstance(options, Mapping) else {}
    inner = sig.get("kwargs")
    inner = inner if isinstance(inner, Mapping) else {}
    nested: list[object] = []
    kind = sig.get("subtask_type")
    if kind in ("chain", "group"):
        nested.extend(_as_list(inner.get("tasks")))
    elif kind == "chord":
        header = inner.get("header")
        if isinstance(header, Mapping):  # a group's map: its members
            members = header.get("kwargs")
            header = members.get("tasks") if isinstance(members, Mapping) else None
        nested.extend([*_as_list(header), inner.get("body")])
    else:
        name = str(sig.get("task") or "")
        spec = specs(name)
        given = options.get("dedup_key") is not None or options.get("dedup_timeout") is not None
        if given or (spec is not None and spec.keyed):
            return name
    for option in _SENT_BY_A_WORKER:
        nested.extend(_as_list(options.get(option)))
    for item in nested:
        found = _keyed_task_in(item, specs, depth + 1)
        if found is not None:
            return found
    return None


def _as_list(value: object) -> list[object]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]
