"""What an operator can set: the model, the request defaults, and every limit a client
cannot exceed (``mminfer serve --help`` lists them with their defaults)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mminfer.offline.thresholds import MAX_KL, MAX_SERVED_DENSITY, MIN_AGREEMENT

from .tenants import env_keys

# --affinity-max-imbalance: requests in flight on a video's engine beyond the least loaded
# engine before a question about it goes to the least loaded one instead, so a follow-up waits
# behind a busy engine rather than pay a whole prefill elsewhere. A first guess until measured
# on several GPUs (docs/deployment.md).
DEFAULT_MAX_IMBALANCE = 8


@dataclass
class Settings:
    model: str | None = None
    attention: str = "auto"
    device: str | None = None
    dtype: str | None = None
    min_sparse_len: int | None = None   # None: the pipeline's default (GPU 65536, CPU dense)
    kv_cache_dtype: str = "auto"        # "auto" (the model dtype), "fp8" / "fp8_e4m3"
    quantization: str | None = None     # "fp8": FP8 linear layers (None: the dtype's weights)
    data_dir: str = "./mminfer-data"
    served_model_names: tuple[str, ...] = ()   # the first is the id shown; all are accepted
    api_key: str | None = field(default_factory=lambda: os.environ.get("MMINFER_API_KEY") or None)

    # tenants (serve/tenants.py): more keys, each naming a tenant, and what a tenant may hold
    api_keys: tuple[tuple[str, str], ...] = field(default_factory=env_keys)  # (tenant, key)
    api_keys_file: str | None = None   # lines `<key> <tenant> [admin] [quota=value ...]`, or JSON
    share_cache_across_tenants: bool = False   # one tenant's cached prefix serves another's
    tenant_max_videos: int | None = None       # None: an equal share of --video-store-max
    tenant_max_video_gb: float | None = None   # None: an equal share of --video-store-gb
    tenant_max_uploads: int | None = None      # None: half the upload places (one tenant: all)
    tenant_max_queue: int | None = None        # None: half the queue (one tenant: all)
    metrics_token: str | None = field(
        default_factory=lambda: os.environ.get("MMINFER_METRICS_TOKEN") or None)
    session_ttl_s: float = 12 * 3600.0  # a /login session cookie lasts this long

    # request defaults
    fps: float = 2.0
    max_frames: int = 768
    max_new_tokens: int = 32

    # the queue and time
    queue_size: int = 8                # waiting (or uploading) requests; more get 503
    # requests in progress at once, taking turns on the model (engine/scheduler.py; vLLM's
    # name); 1 answers them one after the other. A question about a cached video holds a place
    # until its last token, so at 8 places they fill with decoding answers while a long
    # prefill runs and new questions queue (H100: cache hits' p50 TTFT 25 s, BENCHMARKS.md);
    # a place costs a thread and the fork's own rows, not the prefix
    max_num_seqs: int = 32
    # the share of the GPU's time decode steps (answers' tokens after the first) get while a
    # long prefill waits to resume
    decode_share: float = 0.25
    timeout_s: float = 600.0           # from arrival to answer; then 504 and the job stops
    retry_after_max_s: int = 120       # Retry-After never says more than this

    # intake: before a request holds a queue slot for long
    max_upload_mb: float = 512.0
    max_data_url_mb: float = 64.0      # a video inside a chat JSON body
    max_concurrent_uploads: int | None = None   # bodies received at once (None: queue_size)
    upload_deadline_s: float = 300.0   # the whole body within this
    min_upload_kbps: float = 64.0      # ... and at least this fast (KiB/s) once past the grace
    upload_grace_s: float = 10.0
    max_uploads_per_client: int | None = None  # bodies one client address sends at once
                                       # (None: half of max_concurrent_uploads; 0: no limit)

    # connections (serve/protocol.py): before a request exists
    header_timeout_s: float = 10.0     # a request's headers must arrive within this (else 408)
    max_connections: int = 512         # open connections at most; more are refused at once
    max_connections_per_client: int = 128   # ... from one client address

    # JSON bodies (serve/jsonbody.py): bounded before they are validated
    max_json_items: int = 10_000       # values (objects, arrays, strings, numbers) in a body
    max_json_depth: int = 32           # nesting of arrays and objects

    # budgets: what one request may cost the worker, checked before it is queued
    max_fps: float = 8.0
    max_frames_limit: int = 1024       # a client's max_frames at most (over: 413)
    max_frame_pixels: int = 3840 * 2160
    max_decode_mb: float = 4096.0      # sampled frames as RGB, before any resize
    max_visual_tokens: int | None = None   # None: the model's context decides
    max_question_chars: int = 8192
    max_question_tokens: int = 2048
    allow_client_sparse: bool = True   # may a request ask for attention=sparse?

    # the decode sandbox (video/sandbox.py): probes and decodes run in worker processes
    decode_memory_mb: float = 1024.0   # a worker's memory beyond its footprint and frames
    decode_timeout_s: float = 30.0     # to open a file, and for each batch of frames
    decode_workers: int = 2            # workers kept started

    # media URLs in chat requests
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allow_private_media_addresses: bool = False   # names resolving to loopback/private IPs
    media_fetch_timeout_s: float = 30.0           # per read
    media_fetch_deadline_s: float = 120.0         # the whole download

    # the video cache (the engine's: prefixes kept between questions about one video)
    kv_cache_gb: float | None = None   # GPU tier; None: the engine's default share
    kv_host_cache_gb: float = 0.0      # pinned host tier the GPU tier spills to (0: none)
    video_cache: bool = True           # False: every request prefills its whole prompt
    stream_kv_gb: float | None = None  # the live streams' KV caches together; None: kv_cache_gb's
    stream_host_kv_gb: float = 0.0     # pinned host tier idle streams move to (0: none)

    # the video store (POST /v1/videos: upload once, ask by id)
    video_store_gb: float = 20.0       # distinct stored files, bytes at most
    video_store_max: int = 1000        # stored ids at most
    video_ttl_s: float = 86400.0       # an id expires this long after its upload (0: never)

    # the latency store
    report_retention_days: float = 30.0
    report_max_rows: int = 200_000

    # the shadow-dense monitor (serve/shadow.py): sparse requests re-run dense while idle
    shadow_rate: float = 0.01          # the fraction of requests sampled (0: off)
    shadow_max_mb: float = 1024.0      # a sampled request's kept inputs at most (CPU memory)
    shadow_max_new_tokens: int = 8     # answer tokens the dense re-run generates at most

    # self-calibration (serve/selfcal.py): weights without a measured head-pattern config get
    # one measured in idle time, gated, served and checked
    self_calibrate: bool = True
    calibration_dir: str | None = None    # None: <data_dir>/calibration
    calibrate_from_requests: bool = True  # keep the first requests' prompts (host memory)
    calibration_capture_mb: float = 8192.0    # kept prompts at most (host memory)
    calibration_min_agreement: float = MIN_AGREEMENT  # greedy answers as dense's, at least
    calibration_max_kl: float = MAX_KL    # mean last-token KL(dense || sparse), at most
    calibration_max_density: float = MAX_SERVED_DENSITY   # denser: no faster than dense
    calibration_requests: int = 8         # requests calibrated on
    calibration_gate_requests: int = 16   # held-out requests the gate runs on
    calibration_window: int = 50          # shadow comparisons judged for drift
    calibration_synthetic: int = 3        # synthetic videos calibrated on
    calibration_synthetic_frames: int = 0     # their frames (0: as many as fit 16K tokens)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)

    @property
    def uploads_per_client(self) -> int | None:
        """Bodies one client address may send at once (None: no limit)."""
        if self.max_uploads_per_client is not None:
            return self.max_uploads_per_client or None
        return max(1, (self.max_concurrent_uploads or self.queue_size) // 2)

    @property
    def max_data_url_bytes(self) -> int:
        """A decoded data: URL is an upload too: the smaller of both limits."""
        return min(int(self.max_data_url_mb * 2**20), self.max_upload_bytes)

    @property
    def max_json_bytes(self) -> int:
        """A chat body: a base64 data: URL of the largest accepted video and some text."""
        return self.max_data_url_bytes * 4 // 3 + 2**20
