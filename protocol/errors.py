"""Refusals as values with a type, the same on both ends of the wire.

A store refuses a request for one of a few reasons (:class:`Problem`), always naming the field
that is wrong. The reason is not an HTTP status: the HTTP plane maps it to one (``HTTP_STATUS``,
used by store/http.py) and the client maps the status it received back (``problem_of_status``),
so code on either side branches on ``err.problem`` and ``err.field``, never on the text.

Per item, offers, puts, commits and gets answer an :class:`ItemStatus` instead of failing the
request; ``DROPPED`` exists only on the client (a save the client could not hand to a store).
"""

from __future__ import annotations

import enum


class Problem(enum.Enum):
    """Why a request was refused, independent of transport."""

    INVALID = "invalid"  # malformed input; the field says which
    UNKNOWN = "unknown"  # a namespace (or path) this caller cannot see: unregistered, or another tenant's
    FORBIDDEN = "forbidden"  # understood and refused (another tenant's registration, a limit on counts)
    TOO_LARGE = "too_large"  # over a size or count bound
    QUOTA = "quota"  # the tenant's quota_bytes would be exceeded
    TIMEOUT = "timeout"  # the body did not arrive in time
    UNSUPPORTED = "unsupported"  # a content type this endpoint does not take
    UNAUTHORIZED = "unauthorized"  # missing or unknown bearer token
    CONFLICT = "conflict"  # not this way here: e.g. a single-node call to a node of a larger cluster
    UNAVAILABLE = "unavailable"  # the store cannot serve it now (damage, overload); retry later
    INTERNAL = "internal"  # a bug on the store's side (logged there)


HTTP_STATUS: dict[Problem, int] = {
    Problem.INVALID: 400, Problem.UNAUTHORIZED: 401, Problem.FORBIDDEN: 403, Problem.UNKNOWN: 404,
    Problem.TIMEOUT: 408, Problem.CONFLICT: 409, Problem.TOO_LARGE: 413, Problem.QUOTA: 413, Problem.UNSUPPORTED: 415,
    Problem.INTERNAL: 500, Problem.UNAVAILABLE: 503,
}


def problem_of_status(status: int, field: str = "") -> Problem:
    """The problem behind an HTTP status a store answered (a 413 naming ``quota`` is QUOTA)."""
    if status == 413 and field == "quota":
        return Problem.QUOTA
    for problem, code in HTTP_STATUS.items():
        if code == status and problem is not Problem.QUOTA:
            return problem
    return Problem.INTERNAL if status >= 500 else Problem.INVALID


class RequestError(ValueError):
    """A refused request: ``field`` names what is wrong, ``problem`` why, ``message`` in words."""

    def __init__(self, field: str, message: str, problem: Problem = Problem.INVALID) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.problem = problem


class StoreError(Exception):
    """A call to a store that did not succeed, as its caller sees it (transport/frames.py raises
    it; the client turns it into a miss or a dropped save).

    ``path``: the endpoint; ``status``: the HTTP status the store answered (None: no answer — a
    connection error, a timeout, a malformed answer); ``field``: the field the store named in its
    refusal (``"ns"``, ``"quota"``, ``"nixl"``, ...); ``problem``: why, from the status and field."""

    def __init__(self, path: str, message: str, *, status: int | None = None, field: str = "",
                 problem: Problem | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
        self.status = status
        self.field = field
        if problem is None:
            problem = problem_of_status(status, field) if status is not None else Problem.UNAVAILABLE
        self.problem = problem

    def is_refusal(self, problem: Problem, field: str | None = None) -> bool:
        """Whether the store answered this refusal (``problem``, naming ``field`` when given)."""
        return self.status is not None and self.problem is problem and (field is None or self.field == field)


class ItemStatus(enum.StrEnum):
    """Per-item answer of an offer, put, commit or get (the wire carries the value)."""

    WANT = "want"  # offer: send it
    HAVE = "have"  # offer/put/commit: already stored
    OK = "ok"  # put/commit: stored; get: here are its bytes
    PENDING = "pending"  # put without commit (or NIXL reserve): its pages are reserved
    REJECTED = "rejected"  # offer/put/commit: not taken (the reason says why)
    MISSING = "missing"  # get/commit: not stored (or expired)
    CORRUPT = "corrupt"  # get: its bytes failed their checksum on the store; it was dropped
    HTTP = "http"  # NIXL get: not in registered memory here; read it over HTTP
    ELSEWHERE = "elsewhere"  # cluster offer: below a fork head; offer it to that branch's node (the reason names it)
    DROPPED = "dropped"  # client only: the save could not reach a store (a future miss)


__all__ = ["HTTP_STATUS", "ItemStatus", "Problem", "RequestError", "StoreError", "problem_of_status"]
