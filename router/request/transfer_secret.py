"""The secret a request attempt's KV transfer must present to its decode reservation: an HMAC of
the attempt's id under a key this router process draws at start (it dies with the process)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from router.frontdoor.validation import Job

_SECRET_KEY = secrets.token_bytes(32)  # this router process's: secrets die with it


def transfer_secret(job: Job) -> str:
    """The secret a request attempt's KV transfer must present to its decode reservation: only
    the prefill worker the router places on the attempt learns it (in its Prefill call)."""
    return hmac.new(_SECRET_KEY, job.worker_request_id.encode(), hashlib.sha256).hexdigest()[:32]
