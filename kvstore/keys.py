"""Redis key names: one prefix (`ei:`) and a Redis Cluster hash tag around the id.

The part in braces is what a Redis Cluster hashes to pick a slot, so every key about one worker
(or one model, or one session) lands in the same slot however many keys we add for it later:

    ei:w:{<worker_id>}          hash: the worker's WorkerInfo, expires unless heartbeats renew it
    ei:m:{<model>}:workers      set: ids of the workers serving a model
    ei:s:{<session_id>}         string: the session's Placement (orjson), idle TTL
    ei:g:{<gateway_id>}         string: a gateway's marker, renewed each registry read: when
                                it is gone, Redis has lost its data (restart, flush)
    ei:models                   set: the models with workers; every heartbeat adds its own,
                                a registry reader drops one whose set it finds empty

Ids come from outside (headers, CLI flags), so they are checked: a `{` or `}` inside an id would
move the hash tag and scatter keys across slots; an unbounded id would let a client grow keys.
"""

from __future__ import annotations

import logging

PREFIX = "ei:"
MAX_ID_LEN = 256  # longest worker id, model name or session id accepted (characters)
MODELS_KEY = PREFIX + "models"

log = logging.getLogger(__name__)


def check_id(value: str, what: str) -> str:
    """Return `value` if it can go inside a hash tag, else raise ValueError naming `what`."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_ID_LEN:
        raise ValueError(f"{what} is {len(value)} characters long; the limit is {MAX_ID_LEN}")
    if "{" in value or "}" in value:
        raise ValueError(f"{what} must not contain '{{' or '}}': {value!r}")
    return value


def usable_id(value: str, what: str, key: str) -> bool:
    """Whether an id read back from a Redis set (`key`) can name keys. Our processes only write
    checked ids, but anything else with access to Redis could add one: it is logged, for the
    reader to drop it from the set, rather than failing every reader's refresh (the key
    functions here raise on it)."""
    try:
        check_id(value, what)
    except ValueError as e:
        log.warning("dropping an unusable entry of %s: %s", key, e)
        return False
    return True


def worker_key(worker_id: str) -> str:
    """The hash holding one worker's WorkerInfo."""
    return f"{PREFIX}w:{{{check_id(worker_id, 'worker_id')}}}"


def model_workers_key(model: str) -> str:
    """The set of ids of the workers serving `model`."""
    return f"{PREFIX}m:{{{check_id(model, 'model')}}}:workers"


def gateway_marker_key(gateway_id: str) -> str:
    """A gateway's marker (see the module docstring)."""
    return f"{PREFIX}g:{{{check_id(gateway_id, 'gateway_id')}}}"


def session_key(session_id: str) -> str:
    """The string holding a session's Placement."""
    return f"{PREFIX}s:{{{check_id(session_id, 'session_id')}}}"


def as_text(value: bytes | str) -> str:
    """A set member or key as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value
