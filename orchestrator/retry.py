"""Retries for storage: bounded exponential backoff with jitter, for transient errors only.

Which errors are transient is decided from the error classes the storage libraries really
raise (matched by name, so none of them has to be installed):

- the local file system and anything that speaks ``OSError``: by ``errno``. Connection
  loss, timeouts, ``EIO``/``EBUSY`` (s3fs's ``SlowDown``, ``ServiceUnavailable``,
  ``InternalError``) are retried; permission, not found, disk full, read-only file system
  and invalid requests are not: retrying them only delays the message a person must read.
  An ``OSError`` with no errno (what fsspec backends raise for most remote failures) is
  retried, except gcsfs's 403 ("Forbidden").
- botocore (under s3fs): connection and read/connect timeouts that s3fs does not
  translate (``EndpointConnectionError`` when the server is down), throttling codes.
- aiohttp (under s3fs and gcsfs): client connection errors; a response error by status.
- gcsfs: ``HttpError`` with 408, 429 or 5xx; ``ChecksumError``; google-auth transport.
- torch's DCP wraps each rank's error in a ``CheckpointException``: transient when every
  error inside is.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from orchestrator.policy_sections import PersistPolicy

_PERMANENT_ERRNO = {
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EFBIG,
    errno.EINVAL,
    errno.ENAMETOOLONG,
    errno.EMSGSIZE,
    errno.ENOSYS,
    errno.ENOTEMPTY,
    getattr(errno, "EREMCHG", errno.ENOENT),  # s3fs: a redirect (wrong region or endpoint)
}
# Classes whose instances are transient, by (module prefix, class name) anywhere in the MRO.
_TRANSIENT_CLASSES = {
    ("botocore", "EndpointConnectionError"),
    ("botocore", "ConnectionError"),
    ("botocore", "ConnectTimeoutError"),
    ("botocore", "ReadTimeoutError"),
    ("botocore", "ConnectionClosedError"),
    ("botocore", "HTTPClientError"),
    ("botocore", "IncompleteReadError"),
    ("botocore", "ResponseStreamingError"),
    ("aiohttp", "ClientConnectionError"),
    ("aiohttp", "ClientPayloadError"),
    ("aiohttp", "ServerTimeoutError"),
    ("gcsfs", "ChecksumError"),
    ("google.auth", "TransportError"),
    ("google.auth", "RefreshError"),  # an expired token being renewed (gcsfs retries it)
    ("fsspec", "FSTimeoutError"),
    ("asyncio", "TimeoutError"),
    ("concurrent.futures", "TimeoutError"),
}
_PERMANENT_CLASSES = {
    ("botocore", "NoCredentialsError"),
    ("botocore", "PartialCredentialsError"),
    ("botocore", "ParamValidationError"),
    ("gcsfs", "NonRetryableError"),
}
_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_PERMANENT_OSERRORS = (
    PermissionError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
)


def _names(err: BaseException) -> set[tuple[str, str]]:
    """(top package, class name) of every class in the error's MRO, with the first two
    module levels ("google.auth") as well."""
    out = set()
    for cls in type(err).__mro__:
        parts = cls.__module__.split(".")
        out.add((parts[0], cls.__name__))
        out.add((".".join(parts[:2]), cls.__name__))
    return out


def is_transient(err: BaseException) -> bool:
    """Whether retrying the storage operation that raised ``err`` may succeed."""
    names = _names(err)
    if names & _PERMANENT_CLASSES:
        return False
    if names & _TRANSIENT_CLASSES:
        return True
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (err, tb)
    if ("torch", "CheckpointException") in names and isinstance(failures, dict) and failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        return all(isinstance(e, BaseException) and is_transient(e) for e in inner)
    if ("botocore", "ClientError") in names:
        return str(getattr(err, "response", {}).get("Error", {}).get("Code", "")) in _THROTTLE_CODES
    if ("gcsfs", "HttpError") in names:
        status = str(getattr(err, "code", None))
        return status in {str(c) for c in _TRANSIENT_STATUS} or (
            status == "401" and "Invalid Credentials" in str(err)
        )
    if ("aiohttp", "ClientResponseError") in names:
        return getattr(err, "status", None) in _TRANSIENT_STATUS
    if isinstance(err, _PERMANENT_OSERRORS):  # s3fs raises them without an errno
        return False
    if isinstance(err, OSError):
        if err.errno is None:
            return not str(err).startswith("Forbidden")  # gcsfs's 403
        return err.errno not in _PERMANENT_ERRNO
    return False


def storage_retry(
    policy: PersistPolicy, before_sleep: Callable[[RetryCallState], None] | None = None
) -> Retrying:
    """Bounded exponential backoff with jitter for transient storage errors
    (:func:`is_transient`); anything else is raised at once."""
    return Retrying(
        stop=stop_after_attempt(policy.retries),
        wait=wait_random_exponential(multiplier=0.2, max=policy.retry_max_wait_s),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
