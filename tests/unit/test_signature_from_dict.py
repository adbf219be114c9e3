"""``Signature.from_dict``: a task rebuilds nested chains, groups and chords from their maps."""

from __future__ import annotations

import json

from broker_svc import App, Settings, Signature, chain, chord, group


def test_a_nested_canvas_rebuilds_from_its_json_map_with_its_kinds_and_arguments():
    app = App("from-dict", settings=Settings())
    try:
        s = lambda name, *args: app.signature(name, args)  # noqa: E731
        canvas = chain(
            s("t.a", 1),
            group(s("t.b", 2), chain(s("t.c", 3), s("t.d"))),
            chord([s("t.e", 4), s("t.f", 5)], s("t.g")),
            s("t.h").set(queue="elsewhere"),
        )
        wire = json.loads(json.dumps(canvas))  # what a task receives: a plain map
        rebuilt = Signature.from_dict(wire, app=app)
        assert isinstance(rebuilt, chain) and rebuilt == canvas
        first, grouped, chorded, last = rebuilt.tasks
        assert first.task == "t.a" and list(first.args) == [1]
        assert isinstance(grouped, group) and isinstance(grouped.tasks[1], chain)
        assert isinstance(chorded, chord) and chorded.body is not None and chorded.body.task == "t.g"
        assert last.options["queue"] == "elsewhere"
        assert all(step._app is app for step in rebuilt.tasks)
        plain = Signature.from_dict(
            {"task": "t.x", "args": [1], "kwargs": {}, "options": {}, "subtask_type": None}
        )
        assert type(plain) is Signature and plain.task == "t.x"
    finally:
        app.close()
