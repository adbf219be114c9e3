"""The messages of a leader election queue: bids and term tokens, as JSON bodies.

Pure (``broker_svc/amqp/lease_connection.py`` sends and receives them; the election in
``worker/leader/election.py`` gives them meaning). Two kinds travel in an election queue:

- a **bid**: published by every candidate when it joins, so that a fresh queue holds a message and
  whoever the broker makes the active consumer learns it (AMQP 0-9-1 tells a consumer it is active
  only by delivering to it). A leader acks bids as they come.
- a **token**: published by the leader of term ``epoch`` to itself, again and again (each one renews
  its lease and lets it ack the one before, so no delivery outlives ``consumer_timeout``). The last
  one of a term carries ``handed_over`` and the state its ``hand_over()`` returned, for the next
  leader's ``inaugurate()``. The next leader takes ``epoch + 1`` of the highest token it finds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from broker_svc.errors import DecodeError

__all__ = ["CONTENT_TYPE", "Token", "decode_token", "encode_token", "last_term"]

CONTENT_TYPE = "application/json"

Kind = Literal["bid", "token"]


@dataclass(frozen=True, slots=True)
class Token:
    """One message of an election queue.

    Attributes:
        kind: ``bid`` (a candidate joined) or ``token`` (a leader's).
        holder: the candidate that sent it (its identity).
        epoch: the term (tokens); 0 for bids.
        seq: which of its term's tokens, counted from 0 (a leader waits for its own by this).
        handed_over: the last token of a term that ended by a handover: its leader stopped acting
            before sending it, so the next one need not wait out the lease.
        state: what the leader's ``hand_over()`` returned (JSON), for the next ``inaugurate()``.
    """

    kind: Kind
    holder: str
    epoch: int = 0
    seq: int = 0
    handed_over: bool = False
    state: Any = None


def encode_token(token: Token) -> bytes:
    """The JSON body of ``token``.

    Raises:
        TypeError: ``state`` is not JSON (a ``hand_over()`` hook returned something else).
    """
    return json.dumps({
        "kind": token.kind, "holder": token.holder, "epoch": token.epoch, "seq": token.seq,
        "handed_over": token.handed_over, "state": token.state,
    }, separators=(",", ":")).encode()  # fmt: skip


def decode_token(body: bytes) -> Token:
    """The token in ``body``.

    Raises:
        DecodeError: not a token of ours (anything else published to the queue by mistake).
    """
    try:
        data = json.loads(body)
        kind = data["kind"]
        if kind not in ("bid", "token"):
            raise ValueError(f"unknown kind {kind!r}")
        return Token(
            kind=kind,
            holder=str(data["holder"]),
            epoch=int(data.get("epoch", 0)),
            seq=int(data.get("seq", 0)),
            handed_over=bool(data.get("handed_over", False)),
            state=data.get("state"),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise DecodeError(f"not an election token: {exc}") from exc


def last_term(tokens: Iterable[Token]) -> Token | None:
    """The token that tells how the last term ended: of the highest epoch, the handover if any,
    else the latest by ``seq``. None when there was no term yet (only bids)."""
    best: Token | None = None
    for token in tokens:
        if token.kind != "token":
            continue
        if best is None or (token.epoch, token.handed_over, token.seq) > (
            best.epoch,
            best.handed_over,
            best.seq,
        ):
            best = token
    return best
