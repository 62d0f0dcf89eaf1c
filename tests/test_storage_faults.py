"""Storage that fails for real: which errors are retried (the classes s3fs, botocore, gcsfs,
aiohttp and the local file system really raise), the S3 endpoint stopped during a write and
during a resume, throttled, refusing permission, a missing bucket, and a full disk.

The S3 server is moto on 127.0.0.1, reached through a TCP proxy (tests/s3_server.py) that
the tests stop and start: moto keeps its objects in memory, so the endpoint dies at the
proxy, which the client cannot tell from a dead server (connections refused, and the ones
open are reset)."""

from __future__ import annotations

import errno
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from inproc import events
from inproc import train as train_inproc

from conftest import assert_bitwise_equal, final_states, kinds, train
from orchestrator.retry import is_transient
from orchestrator.store import DurableStore

pytestmark = pytest.mark.timeout(300)


def _client_error(code: str, status: int) -> Exception:
    """What botocore raises for an S3 error response, as s3fs translates it."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )
    out: Exception = translate_boto_error(err)
    return out


def test_real_storage_error_classes_are_told_apart() -> None:
    """Throttling, timeouts and connection loss are retried; permission, not found, disk
    full and invalid requests are not (each built as its library raises it)."""
    pytest.importorskip("s3fs")
    import aiohttp
    import botocore.exceptions as be
    from torch.distributed.checkpoint.api import CheckpointException

    transient = [
        _client_error("SlowDown", 503),
        _client_error("ServiceUnavailable", 503),
        _client_error("InternalError", 500),
        _client_error("RequestTimeout", 400),
        be.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),  # the server is down
        be.ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
        be.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
        be.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientConnectionError(),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
        TimeoutError(),
        OSError(errno.EIO, "Input/output error"),
        OSError("a remote backend's error without an errno"),
        CheckpointException("dcp", {0: (ConnectionResetError(errno.ECONNRESET, "x"), None)}),
    ]
    permanent = [
        _client_error("AccessDenied", 403),
        _client_error("InvalidAccessKeyId", 403),
        _client_error("NoSuchBucket", 404),
        _client_error("NoSuchKey", 404),
        _client_error("InvalidArgument", 400),
        be.NoCredentialsError(),
        PermissionError(errno.EACCES, "Permission denied"),
        FileNotFoundError(errno.ENOENT, "No such file or directory"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError("Forbidden: gs://bucket/x"),  # gcsfs's 403
        CheckpointException("dcp", {0: (OSError(errno.ENOSPC, "full"), None)}),
        ValueError("not a storage error"),
    ]
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []
    gcsfs = pytest.importorskip("gcsfs.retry", reason="gcsfs is optional ([gcs])")
    assert is_transient(gcsfs.HttpError({"code": 429, "message": "rate"}))
    assert is_transient(gcsfs.HttpError({"code": 503, "message": "unavailable"}))
    assert not is_transient(gcsfs.HttpError({"code": 400, "message": "bad"}))
