"""The one error type of a request that can never be served as given.

Every layer that checks a request (the HTTP models, `SamplingParams`, the scheduler and the engine's wire
validation) raises it with the field at fault, so each process boundary answers the same 4xx naming it.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served as given; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
