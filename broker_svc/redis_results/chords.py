"""``ChordCounter``: a chord's header counted in Redis exactly as Celery's Redis backend counts it.

A mixed fleet (Celery workers and ours on one Redis) joins one chord, so every step keeps
Celery's keys and rules (``celery/backends/redis.py``, ``on_chord_part_return``):

1. each header task that ends adds ``[1, id, state, result]`` to ``<group>.j`` (a sorted set by
   its ``group_index``), once per (id, index), remembered in ``<group>.d``; the Celery client set
   the size in ``<group>.s`` before it sent the last header task; ``<group>.t`` counts tasks added
   to the chord later;
2. the worker whose part makes the count reach size + added claims ``<group>.c`` with a token,
   in the same script, so one worker sends the body;
3. it reads the results, extends its claim, sends the body, then deletes the chord's keys and
   leaves ``done`` in ``<group>.c``, so a late copy of a header task changes nothing.

The scripts are ours; what they do to the keys is what Celery's do.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.redis_results.connection import with_retries
from broker_svc.redis_results.writer import ResultWriter
from broker_svc.wire.results.meta import chord_member

__all__ = ["ChordClaim", "ChordCounter", "DependencyFailed", "header_ids", "header_values"]

# Count one part, claim the dispatch when it completes the chord. KEYS: .j .t .s .d group .c;
# ARGV: id, member, ordered (1: sorted set), score, expires, group expires, claim s, token.
# Returns {count, added, size, claimed}, or {-1, 0, 0, 0} for a chord already done.
_PART_RETURN: Final = """
local results, added, size_key, counted, group, claim = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local task_id, member, ordered, score = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local expires, group_expires = tonumber(ARGV[5]), tonumber(ARGV[6])
local claim_s, token = tonumber(ARGV[7]), ARGV[8]
if redis.call('GET', claim) == 'done' then
    return {-1, 0, 0, 0}
end
local seen = task_id .. ':' .. score
if redis.call('SISMEMBER', counted, seen) == 0 then
    if ordered == '1' then redis.call('ZADD', results, score, member)
    else redis.call('RPUSH', results, member) end
    redis.call('SADD', counted, seen)
end
local count
if ordered == '1' then count = redis.call('ZCOUNT', results, '-inf', '+inf')
else count = redis.call('LLEN', results) end
if expires > 0 then
    redis.call('EXPIRE', results, expires)
    redis.call('EXPIRE', added, expires)
    redis.call('EXPIRE', size_key, expires)
    redis.call('EXPIRE', counted, expires)
    if group_expires > 0 then redis.call('EXPIRE', group, group_expires) end
end
local extra = redis.call('GET', added)
local size = redis.call('GET', size_key)
local claimed = 0
if size and count == tonumber(size) + tonumber(extra or 0) then
    if redis.call('SET', claim, token, 'NX', 'EX', claim_s) then claimed = 1 end
end
return {count, extra, size, claimed}
"""

# Keep the claim while it is ours, or take it again if it lapsed and the chord is still there.
_EXTEND: Final = """
local claim, size_key, token, seconds = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local holder = redis.call('GET', claim)
if holder == token then return redis.call('EXPIRE', claim, seconds) end
if not holder and redis.call('EXISTS', size_key) == 1 then
    if redis.call('SET', claim, token, 'EX', seconds, 'NX') then return 1 end
end
return 0
"""

# The body went out: drop the chord's keys and mark it done, if the claim is still ours.
_CLEANUP: Final = """
local claim, token, done_s = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('GET', claim) ~= token then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
if done_s and done_s > 0 then redis.call('SET', claim, 'done', 'EX', done_s) end
return 1
"""

# Ours only: the body could not be sent; let go of the claim so the task's next run sends it.
_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class ChordClaim:
    """This worker completed ``group_id`` and holds the right to send its body (``token``)."""

    group_id: str
    token: str
    claim_s: int
    total: int


class ChordCounter:
    """A worker's side of Celery's Redis chords: count a part, read the results, claim, clean up.

    Args:
        writer: the app's result writer (its client, keys and serializer).
        ordered: ``result_backend_transport_options["result_chord_ordered"]`` (Celery's default:
            a sorted set by header index).
    """

    def __init__(self, writer: ResultWriter, *, ordered: bool = True) -> None:
        self._writer = writer
        self._client = writer.client
        self._keys = writer.conf.keys
        self._ordered = ordered
        self._part_return = self._client.register_script(_PART_RETURN)
        self._extend = self._client.register_script(_EXTEND)
        self._cleanup = self._client.register_script(_CLEANUP)
        self._release = self._client.register_script(_RELEASE)
        conf = writer.conf
        # Celery's numbers: the claim lives twice the join timeout (at least 5 s), "done" 300 s.
        self._claim_s = max(5, int(conf.chord_join_timeout_s * 2))
        self._done_s = int(max(self._claim_s * 2, 300))
        self._expires_s = conf.chord_expires_s
        both = conf.chord_expires_s and conf.expires_s
        self._group_expires_s = max(conf.chord_expires_s, conf.expires_s) if both else 0

    def _chord_keys(self, group_id: str) -> list[str]:
        group = self._keys.group
        return [group(group_id, ".j"), group(group_id, ".t"), group(group_id, ".s"), group(group_id, ".d")]

    def part_return(
        self, group_id: str, task_id: str, index: int | None, state: str, result: Any
    ) -> ChordClaim | None:
        """Count a header task's end; the claim if it completed the chord, else None.

        Raises:
            ResultBackendUnavailable: Redis did not take it within the retries.
            TypeError, ValueError: the result does not encode in the ``result_serializer``.
        """
        member = self._writer.encode(chord_member(task_id, state, result))
        token = uuid.uuid4().hex
        keys = [*self._chord_keys(group_id), self._keys.group(group_id), self._keys.group(group_id, ".c")]
        args = [
            task_id, member, 1 if self._ordered else 0, "+inf" if index is None else index,
            self._expires_s, self._group_expires_s, self._claim_s, token,
        ]  # fmt: skip
        count, added, size, claimed = with_retries(
            lambda: self._part_return(keys=keys, args=args), what=f"count chord part of {group_id}"
        )
        if count == -1 or size is None or not claimed:
            return None
        total = int(size) + int(added or 0)
        return ChordClaim(group_id, token, self._claim_s, total) if count == total else None

    def saved_header(self, claim: ChordClaim) -> list[Any] | None:
        """The header's result tree, if the client saved it (a header nesting chains ending in a
        group, whose values are lists): its members' ``((id, parent), children)`` tuples; else None.

        Raises:
            ResultBackendUnavailable: Redis could not be read.
            MessageError: what is stored does not decode.
        """
        key = self._keys.group(claim.group_id)
        payload = with_retries(lambda: self._client.get(key), what="read a chord's group")
        if payload is None:
            return None
        meta = self._writer.decode(_bytes(payload))
        tree = meta.get("result") if isinstance(meta, dict) else None
        if not isinstance(tree, list | tuple) or len(tree) != 2 or not isinstance(tree[1], list | tuple):
            raise MessageError(f"a saved group must be ((id, parent), members), got {tree!r:.200}")
        return list(tree[1])

    def stored(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored meta of each of ``task_ids`` that has one.

        Raises:
            ResultBackendUnavailable: Redis could not be read.
            MessageError: a meta does not decode.
        """
        keys = [self._keys.task(task_id) for task_id in task_ids]
        raw = with_retries(lambda: self._client.mget(keys), what="read a chord's results") if keys else []
        metas: dict[str, dict[str, Any]] = {}
        for task_id, payload in zip(task_ids, raw, strict=True):
            if payload is not None:
                meta = self._writer.decode(_bytes(payload))
                if isinstance(meta, dict):
                    metas[task_id] = meta
        return metas

    def results(self, claim: ChordClaim) -> list[list[Any]]:
        """The header's ``[1, id, state, result]`` entries, in header order.

        Raises:
            ResultBackendUnavailable: Redis could not be read.
            MessageError: an entry does not decode.
        """
        key = self._keys.group(claim.group_id, ".j")
        if self._ordered:
            raw = with_retries(lambda: self._client.zrange(key, 0, -1), what="read a chord's results")
        else:
            raw = with_retries(
                lambda: self._client.lrange(key, 0, claim.total), what="read a chord's results"
            )
        return [self._writer.decode(_bytes(entry)) for entry in raw]

    def extend(self, claim: ChordClaim, seconds: int) -> bool:
        """Keep the claim for ``seconds`` while the body is sent; False if another worker has it."""
        keys = [self._keys.group(claim.group_id, ".c"), self._keys.group(claim.group_id, ".s")]
        seconds = max(claim.claim_s, math.ceil(seconds))
        return bool(
            with_retries(lambda: self._extend(keys=keys, args=[claim.token, seconds]), what="extend claim")
        )

    def cleanup(self, claim: ChordClaim) -> bool:
        """The body is sent: the chord's keys go and ``done`` stays; False if the claim was lost."""
        keys = [self._keys.group(claim.group_id, ".c"), *self._chord_keys(claim.group_id)]
        return bool(
            with_retries(lambda: self._cleanup(keys=keys, args=[claim.token, self._done_s]), what="cleanup")
        )

    def release(self, claim: ChordClaim) -> None:
        """The body was not sent: let the claim go, so the header task's next run sends it."""
        key = self._keys.group(claim.group_id, ".c")
        with_retries(lambda: self._release(keys=[key], args=[claim.token]), what="release claim")

    def drop_size(self, group_id: str) -> None:
        """A failed chord: drop its size, so a late copy of a header task does not fail it again."""
        key = self._keys.group(group_id, ".s")
        with_retries(lambda: self._client.delete(key), what="drop a chord's size")


class DependencyFailed(Exception):
    """A saved header's member failed or was revoked: the chord fails with it."""

    def __init__(self, task_id: str, result: Any) -> None:
        super().__init__(task_id)
        self.task_id = task_id
        self.result = result


def header_ids(members: Sequence[Any]) -> list[str]:
    """The task ids of a saved header's results, groups opened, in header order.

    Raises:
        MessageError: a member is not a result tuple.
    """
    ids: list[str] = []
    for member in members:
        task_id, children = _node(member)
        if children is None:
            ids.append(task_id)
        else:
            ids.extend(header_ids(children))
    return ids


def header_values(members: Sequence[Any], metas: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """A saved header's values, each group's as a list (what Celery's ``GroupResult.join`` gives).

    Raises:
        DependencyFailed: the first member, in header order, that failed or was revoked.
        MessageError: a member has no ready state stored, or is not a result tuple.
    """
    values: list[Any] = []
    for member in members:
        task_id, children = _node(member)
        if children is not None:
            values.append(header_values(children, metas))
            continue
        meta = metas.get(task_id) or {}
        status = meta.get("status")
        if status in ("FAILURE", "REVOKED"):
            raise DependencyFailed(task_id, meta.get("result"))
        if status != "SUCCESS":
            raise MessageError(f"header task {task_id} has no result stored (state {status!r})")
        values.append(meta.get("result"))
    return values


def _node(member: Any) -> tuple[str, list[Any] | None]:
    # Celery's result tuple: ((id, parent), None) for a task, ((id, parent), [members]) for a group.
    if isinstance(member, list | tuple) and len(member) == 2 and isinstance(member[0], list | tuple):
        head, children = member
        if head and isinstance(head[0], str) and (children is None or isinstance(children, list | tuple)):
            return head[0], None if children is None else list(children)
    raise MessageError(f"not a result tuple: {member!r:.200}")


def _bytes(value: Any) -> bytes:
    # redis-py returns bytes (no decode_responses); its type says it may be str.
    return value.encode() if isinstance(value, str) else bytes(value)
