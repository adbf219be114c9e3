"""Task ids from buffered random bytes: valid uuid4 strings, never repeated across threads or a fork."""

from __future__ import annotations

import os
import threading
import uuid

from broker_svc.wire.ids import uuid4_str


def test_an_id_is_a_uuid4_in_its_canonical_form() -> None:
    for _ in range(1000):
        text = uuid4_str()
        parsed = uuid.UUID(text)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == text


def test_threads_taking_ids_at_once_never_share_one() -> None:
    taken: list[list[str]] = [[] for _ in range(8)]

    def take(into: list[str]) -> None:
        into.extend(uuid4_str() for _ in range(5000))

    threads = [threading.Thread(target=take, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    every = [text for into in taken for text in into]
    assert len(every) == 40_000
    assert len(set(every)) == len(every)


def test_a_forked_child_does_not_repeat_its_parents_next_ids() -> None:
    uuid4_str()  # the parent holds a block with unused ids in it
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read_fd)
        os.write(write_fd, ",".join(uuid4_str() for _ in range(50)).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        child = set(pipe.read().split(","))
    os.waitpid(pid, 0)
    parent = {uuid4_str() for _ in range(50)}
    assert len(child) == 50
    assert not child & parent
