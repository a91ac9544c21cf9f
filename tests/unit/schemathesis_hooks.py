"""Schemathesis hooks for the fuzz run (loaded by name through SCHEMATHESIS_HOOKS).

The schema cannot say which model the server serves, so nearly every
generated body would stop at the 404 for an unknown model; naming the served
model lets the fuzzer reach the validation and generation behind it.
"""

from typing import Any

import schemathesis


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        body["model"] = "scripted"
    return body
