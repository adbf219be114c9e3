"""``Task.replace`` run eagerly (``apply()``): the replacement's value is the replaced task's."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc import App, Settings, chain


def test_an_eager_replace_returns_the_replacements_value_and_refuses_what_celery_refuses():
    app = App("replace-eager", settings=Settings())
    try:

        @app.task(name="t.add")
        def add(x: int, y: int) -> int:
            return x + y

        @app.task(name="t.replaced", bind=True)
        def replaced(self: Any, kind: str) -> Any:
            if kind == "sig":
                return self.replace(add.si(2, 3))
            if kind == "chain":
                return self.replace(chain(add.si(1, 1), add.s(10)))
            if kind == "empty":
                return self.replace(chain())
            return self.replace(add.si(1, 1).set(chord={"task": "t.body"}))

        assert replaced.apply(("sig",)).get() == 5
        assert replaced.apply(("chain",)).get() == 12
        with pytest.raises(ValueError, match="empty chain"):
            replaced.apply(("empty",)).get()
        with pytest.raises(ValueError, match="part of a chord"):
            replaced.apply(("chord",)).get()
    finally:
        app.close()
