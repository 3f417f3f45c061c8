"""Errors a user can act on: every one mminfer raises on purpose, in one place.

Each carries a short machine-readable ``code``, a message that says what was wrong, and the
HTTP status of its kind (``http_status``), which the service answers with
(``mminfer.serve.errors`` turns them into responses); the CLI and the batch job print the
message. Anything else that escapes is a bug, answered as an internal error.
"""


class MMInferError(Exception):
    code = "error"
    http_status = 400

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, **self.details}


# ------------------------------------------------------------------- the request (4xx)

class VideoError(MMInferError):
    """The video cannot be used: unreadable, truncated, empty, no video stream, an image...
    A 400, as OpenAI and vLLM answer media they cannot use, whichever route it came by, with
    a ``reason``: "invalid" (the file itself; the message says what is wrong with it),
    "fetch" (a video URL could not be fetched), or the decoder's own (UndecodableVideo)."""
    code = "bad_video"

    def __init__(self, message: str, reason: str = "invalid", **details):
        super().__init__(message, reason=reason, **details)


class UndecodableVideo(VideoError):
    """The decoder crashed, ran out of its memory limit or its time limit on the file
    (``reason``: crashed, memory, timeout, error): a crafted or corrupt file, refused
    without harm to the service (mminfer.video.sandbox)."""


class InputError(MMInferError):
    """A request field is wrong (bad fps, empty question, prompt over the context...)."""
    code = "bad_input"


class RemoteRefused(InputError):
    """A remote media URL this server will not fetch (disabled, host not allowed, private
    address)."""
    code = "remote_media_refused"


class StreamNotFound(MMInferError):
    """No live stream by that id (or it is another tenant's)."""
    code = "stream_not_found"
    http_status = 404


class StreamFull(MMInferError):
    """A live stream takes no more video: its KV cache would pass the streams' byte budget
    or the model's context. It stays answerable over what it holds."""
    code = "stream_full"
    http_status = 409


class StreamClosed(MMInferError):
    """The live stream was deleted."""
    code = "stream_closed"
    http_status = 409


class Unauthorized(MMInferError):
    code = "unauthorized"
    http_status = 401


class Forbidden(MMInferError):
    """Allowed to others or elsewhere, not here (a local path outside the allowed folder,
    sparse attention where the server does not offer it to clients)."""
    code = "forbidden"
    http_status = 403


class ModelNotFound(MMInferError):
    code = "model_not_found"
    http_status = 404


class UploadTooSlow(MMInferError):
    """The body did not arrive in time (under the minimum rate, or past the deadline)."""
    code = "upload_too_slow"
    http_status = 408


class TooLarge(MMInferError):
    """A body, file or field over a size limit."""
    code = "too_large"
    http_status = 413


class OverBudget(TooLarge):
    """A request that fits the upload limit but would cost more than the server allows
    (frames, pixels per frame, decoded bytes, visual tokens, question tokens, fps)."""
    code = "over_limit"


class UnsupportedMedia(MMInferError):
    code = "unsupported_media_type"
    http_status = 415


class MissingField(MMInferError):
    code = "missing_field"
    http_status = 422


class Cancelled(MMInferError):
    """The request was stopped before its answer (client gone, deadline passed, shutdown).
    Raised by the engine between stages and between decoder layers when the request's
    ``cancel()`` callable returns True."""
    code = "cancelled"
    http_status = 499


class ClientGone(Cancelled):
    code = "client_disconnected"
    http_status = 499                  # nginx's "client closed request"


# ------------------------------------------------------------------- the server (5xx)

class ConfigError(MMInferError):
    """A head-pattern config or model file does not match what it is loaded for."""
    code = "bad_config"
    http_status = 500


class OutOfMemory(MMInferError):
    code = "out_of_memory"
    http_status = 500


class RankFailed(MMInferError):
    """Tensor parallel: another rank could not take part in this request (engine.lockstep)."""
    code = "tensor_parallel_rank_failed"
    http_status = 500


class ServiceUnavailable(MMInferError):
    """Try again later: the answer carries Retry-After."""
    code = "unavailable"
    http_status = 503


class MemoryBusy(ServiceUnavailable):
    """A new prefill's device memory is held by other requests (their cached videos being
    read, their answers' rows) past the time it may wait for them."""
    code = "device_memory_busy"


class StreamBusy(ServiceUnavailable):
    """A live stream's piece needs device room that other streams hold while questions read
    them: the piece is refused for now, the stream stays open."""
    code = "stream_budget_busy"


class QueueFull(ServiceUnavailable):
    code = "queue_full"


class TooManyUploads(ServiceUnavailable):
    code = "too_many_uploads"


class ShuttingDown(ServiceUnavailable):
    code = "shutting_down"


class WorkerDead(ServiceUnavailable):
    code = "worker_dead"


class EngineRestarted(ServiceUnavailable):
    """``--data-parallel``: the engine process running the request died (it is being
    restarted) after the request could no longer be moved to another engine (its answer had
    begun streaming, or it had been moved once already)."""
    code = "engine_restarted"


class Timeout(MMInferError):
    code = "timeout"
    http_status = 504


class RemoteTimeout(Timeout):
    """The remote media host did not deliver the video within the fetch deadline."""
    code = "remote_media_timeout"
