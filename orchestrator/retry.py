"""Retries for storage: bounded exponential backoff with jitter, for transient errors only."""

from __future__ import annotations

from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from orchestrator.policy_sections import PersistPolicy

TRANSIENT = (OSError, TimeoutError)  # what storage throws when it is only having a bad moment


def storage_retry(
    policy: PersistPolicy, before_sleep: Callable[[RetryCallState], None] | None = None
) -> Retrying:
    """Bounded exponential backoff with jitter for transient storage errors."""
    return Retrying(
        stop=stop_after_attempt(policy.retries),
        wait=wait_random_exponential(multiplier=0.2, max=policy.retry_max_wait_s),
        retry=retry_if_exception_type(TRANSIENT),
        before_sleep=before_sleep,
        reraise=True,
    )
