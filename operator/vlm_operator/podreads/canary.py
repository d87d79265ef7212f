"""The stall canary: the smallest completion a vLLM pod can be asked for (max_tokens 1, a fixed
1-token prompt), one bounded exchange per request (podreads/podhttp.py: no redirects, a byte cap,
one deadline for the whole canary), and what it got.

Its results are podhttp's error kinds plus ANSWERED, UNAUTHORIZED and reader.HTTP_ERROR; stall
detection (stalls/verdicts.py) judges them: only TIMEOUT, on a connection the pod accepted, is
evidence of a stall. /v1/models and the completion's answer are small JSON: reader.SMALL_CAP.
"""

from __future__ import annotations

import json
import time
import uuid

from vlm_operator.api import names
from vlm_operator.podreads import podhttp
from vlm_operator.podreads.podhttp import BAD_ANSWER, PodHTTPError
from vlm_operator.podreads.reader import HTTP_ERROR, SMALL_CAP

ANSWERED = "answered"
UNAUTHORIZED = "unauthorized"  # HTTP 401/403: an API key guards /v1; the operator holds none
ID_PREFIX = "vlm-operator-canary-"
PROMPT = "Hi"


def new_id() -> str:
    """A request id that marks a canary as the operator's in vLLM's logs."""
    return ID_PREFIX + uuid.uuid4().hex[:12]


def send(ip: str, timeout_s: float, request_id: str) -> str:
    """The smallest completion for the model the pod serves, both exchanges within timeout_s:
    ANSWERED, or an error kind (TIMEOUT only on a connection the pod accepted; UNREACHABLE when
    none could be made; UNAUTHORIZED: HTTP 401/403, an API key guards /v1 and the operator
    holds none; HTTP_ERROR, no model listed: BAD_ANSWER). The request id (X-Request-Id) and
    user field mark it as the operator's in vLLM's logs."""
    deadline = time.monotonic() + timeout_s
    try:
        models = podhttp.exchange(ip, names.PORT, "GET", "/v1/models", timeout_s=timeout_s,
                                  cap=SMALL_CAP)
        if models.status != 200:
            return UNAUTHORIZED if models.status in (401, 403) else HTTP_ERROR
        try:
            model = json.loads(models.body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            return BAD_ANSWER
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1,
                           "temperature": 0, "user": "vlm-operator-canary"}).encode()
        left = max(0.1, deadline - time.monotonic())
        answer = podhttp.exchange(ip, names.PORT, "POST", "/v1/completions", timeout_s=left,
                                  cap=SMALL_CAP, body=body,
                                  headers={"Content-Type": "application/json",
                                           "X-Request-Id": request_id})
    except PodHTTPError as exc:
        return exc.kind
    if answer.status in (401, 403):
        return UNAUTHORIZED
    return ANSWERED if 200 <= answer.status < 300 else HTTP_ERROR
