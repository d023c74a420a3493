"""Refusals as values with a type, the same on both ends of the wire.

A store refuses a request for one of a few reasons (:class:`Problem`), always naming the field
that is wrong. The reason is not an HTTP status: the HTTP plane maps it to one (``HTTP_STATUS``,
used by store/http.py) and the client maps the status it received back (``problem_of_status``),
so code on either side branches on ``err.problem`` and ``err.field``, never on the text.

Per item, offers, puts, commits and gets answer an :class:`ItemStatus` instead of failing the
request; ``DROPPED`` exists only on the client (a save the client could not hand to a store).
Why an item got its status is a :class:`Reason`: a code on the wire, words for humans
(:attr:`Reason.text`); code branches on the member, never on the words.
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


class Reason(enum.StrEnum):
    """Why an item of an offer, put or commit got its status (the store's reasons), or why a save the
    client could not hand to a store was dropped (the client's). The wire carries the value, a short
    code; :attr:`text` says it for humans (logs, warnings, the CLI). A code this end does not know (a
    newer peer's) is read as ``OTHER``, its code kept as the detail."""

    NONE = ""
    # The store's: an offer or put.
    PARENT_MISSING = "parent_missing"  # the block's parent is neither stored nor in the same request
    CONTAINER_MISSING = "container_missing"  # the snapshot's container is not stored
    QUOTA = "quota"  # the tenant's quota_bytes (or its share of max_entries) would be exceeded
    RECORD = "record"  # a payload for a block this node keeps as a fork record (protocol/placement.py)
    FORK_BRANCH = "fork_branch"  # ELSEWHERE: below a fork head; its branch node takes it (ItemResult.branch)
    TOO_LARGE = "too_large"  # larger than the whole RAM arena
    ADMISSION = "admission"  # the admission policy did not take it (second-hit, adaptive)
    CHECKSUM = "checksum"  # the payload's bytes do not match its xxh3-64
    RAM_PINNED = "ram_pinned"  # no arena pages free: the RAM arena is held by pinned or uncommitted entries
    # The store's: a commit.
    NOT_RESERVED = "not_reserved"  # NIXL commit of a key with no reservation (or expired, or committing)
    NOT_PUT = "not_put"  # commit of a key never put (or expired)
    COMMITTING = "committing"  # a commit of this entry is already in flight
    DISK_FULL = "disk_full"  # the LMDB tier's disk is full
    DISK_PINNED = "disk_pinned"  # the LMDB tier's budget is held by pinned entries
    ENTRIES_PINNED = "entries_pinned"  # max_entries is held by pinned entries
    DISK_FAILED = "disk_failed"  # the LMDB write failed (the detail says how)
    DROPPED_BEFORE_COMMIT = "dropped_before_commit"  # dropped (a flush, a reset) while its write was in flight
    ANCHOR_GONE = "anchor_gone"  # its parent or container was deleted before the commit
    MALFORMED = "malformed"  # an answer that does not list one result per item (a node's, to its peer)
    # The client's (with DROPPED, or REJECTED for an offer it could not ask).
    UNAVAILABLE = "unavailable"  # no store answered: a connection error, a timeout, a 5xx, a malformed answer
    PLACEMENT_UNKNOWN = "placement_unknown"  # a cluster client does not know the item's level's home
    TOO_MANY_FORKS = "too_many_forks"  # a cluster save crossed more branches than it may
    NIXL_FAILED = "nixl_failed"  # a NIXL WRITE failed or came too late (the detail says which)
    OTHER = "other"  # not known at this end (a newer peer's code, kept as the detail)

    @property
    def text(self) -> str:
        """The reason in words."""
        return _REASON_TEXT[self]

    @classmethod
    def of_wire(cls, raw: str) -> tuple[Reason, str]:
        """The reason a wire string names and the detail it adds: a code; else the words an older
        peer sent instead of a code (read once, here, into their member); else ``OTHER``."""
        try:
            return cls(raw), ""
        except ValueError:
            known = _REASON_OF_TEXT.get(raw)
            return (known, "") if known is not None else (cls.OTHER, raw)


_REASON_TEXT: dict[Reason, str] = {
    Reason.NONE: "",
    Reason.PARENT_MISSING: "parent not stored",
    Reason.CONTAINER_MISSING: "container not stored",
    Reason.QUOTA: "tenant quota exceeded",
    Reason.RECORD: "held here as a fork record: the block's branch node holds its payload",
    Reason.FORK_BRANCH: "on the branch of its fork head",
    Reason.TOO_LARGE: "larger than the RAM arena",
    Reason.ADMISSION: "admission",
    Reason.CHECKSUM: "payload does not match its checksum",
    Reason.RAM_PINNED: "RAM arena full of pinned or uncommitted entries",
    Reason.NOT_RESERVED: "not reserved, expired, or committing",
    Reason.NOT_PUT: "not put, or expired",
    Reason.COMMITTING: "a commit of this entry is in flight",
    Reason.DISK_FULL: "the LMDB tier's disk is full: not written; writes resume when space returns",
    Reason.DISK_PINNED: "LMDB tier full of pinned entries",
    Reason.ENTRIES_PINNED: "max_entries reached by pinned entries",
    Reason.DISK_FAILED: "disk write failed",
    Reason.DROPPED_BEFORE_COMMIT: "dropped before commit",
    Reason.ANCHOR_GONE: "parent or container gone",
    Reason.MALFORMED: "malformed answer",
    Reason.UNAVAILABLE: "store unavailable",
    Reason.PLACEMENT_UNKNOWN: "placement unknown: look the prompt up first",
    Reason.TOO_MANY_FORKS: "too many forks in one save",
    Reason.NIXL_FAILED: "NIXL transfer failed",
    Reason.OTHER: "other",
}
_REASON_OF_TEXT: dict[str, Reason] = {text: r for r, text in _REASON_TEXT.items() if text}


__all__ = ["HTTP_STATUS", "ItemStatus", "Problem", "Reason", "RequestError", "StoreError", "problem_of_status"]
