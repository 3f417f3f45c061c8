"""Errors a user can act on. Each carries a short machine-readable ``code`` and a message
that says what was wrong; the service maps them to HTTP statuses."""


class MMInferError(Exception):
    code = "error"
    http_status = 400

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, **self.details}


class VideoError(MMInferError):
    """The video cannot be used: unreadable, truncated, empty, no video stream, an image..."""
    code = "bad_video"


class InputError(MMInferError):
    """A request field is wrong (bad fps, empty question, prompt over the context...)."""
    code = "bad_input"


class ConfigError(MMInferError):
    """A head-pattern config or model file does not match what it is loaded for."""
    code = "bad_config"
    http_status = 500


class Cancelled(MMInferError):
    """The request was stopped before its answer (client gone, deadline passed, shutdown).
    Raised by the engine between stages and between decoder layers when the request's
    ``cancel()`` callable returns True."""
    code = "cancelled"
    http_status = 499
