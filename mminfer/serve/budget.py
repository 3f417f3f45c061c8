"""What one request may cost the worker, checked before it is queued.

A client chooses fps, max_frames, the question and the attention mode; the server decides
what it will spend. Request numbers are checked first (``request_params``: 400 for a wrong
value, 413 over a server limit); once the video is on
disk, its header is read off the event loop (``check_video``: frames the decoder would
sample, pixels per frame, the decoded RGB bytes, the visual tokens the model would see, the
question's tokens) and a request over any budget is answered 413 with the limit it passed,
before it takes the worker's time or memory.

The header is read in a decode worker process (mminfer.video.sandbox, set up here from
the server's settings): a file that crashes, starves or hangs the parser is refused with 400
``bad_video`` (``UndecodableVideo``, with its ``reason``) and the server goes on.
"""

from __future__ import annotations

import copy
import threading

from mminfer import video as videolib
from mminfer.engine.pipeline import check_request
from mminfer.errors import Forbidden, InputError, OverBudget
from mminfer.models.base import Conversation
from mminfer.video import sandbox


def request_params(s, *, fps, max_frames, max_new_tokens, attention, question) -> tuple[str, dict]:
    """(stripped question, keyword arguments of Pipeline.answer) of a request, with the
    server's defaults and limits applied."""
    fps = s.fps if fps is None else fps
    max_frames = s.max_frames if max_frames is None else max_frames
    max_new_tokens = s.max_new_tokens if max_new_tokens is None else max_new_tokens
    attention = attention or None
    q = check_request(question, fps, max_frames, max_new_tokens, None, None,
                      attention or s.attention)
    if len(q) > s.max_question_chars:
        raise OverBudget(f"the question is {len(q)} characters, over this server's limit of "
                         f"{s.max_question_chars}", limit=s.max_question_chars, field="question")
    if fps > s.max_fps:
        raise OverBudget(f"fps {fps:g} is over this server's limit of {s.max_fps:g}",
                         limit=s.max_fps, field="fps")
    if max_frames > s.max_frames_limit:
        raise OverBudget(f"max_frames {max_frames} is over this server's limit of "
                         f"{s.max_frames_limit}", limit=s.max_frames_limit, field="max_frames")
    if attention == "sparse" and not s.allow_client_sparse:
        raise Forbidden("this server does not let requests choose attention=sparse (it decides "
                        "dense or sparse itself: leave attention out or send auto)")
    return q, {"fps": float(fps), "max_frames": max_frames,
               "max_new_tokens": max_new_tokens, "attention": attention}


class Budget:
    """The per-video checks; ``adapter`` is the loaded model's (tokenizer, sampling rule,
    visual token layout)."""

    def __init__(self, settings):
        self.s = settings
        self._tok = None
        self._tok_of = None
        self._lock = threading.Lock()
        configure_decoding(settings)

    def _templater(self, adapter):
        # The adapter with a tokenizer of its own: the worker thread encodes with the
        # model's tokenizer at the same time, and a fast tokenizer is not meant to be shared
        # across threads. A shallow copy: the model's weights are shared, never used here.
        with self._lock:
            if self._tok_of is not adapter:
                mine = copy.copy(adapter)
                mine.tokenizer = copy.deepcopy(adapter.tokenizer)
                self._tok, self._tok_of = mine, adapter
            return self._tok

    def question_tokens(self, adapter, question: str, conversation=None) -> int:
        """The prompt's text tokens as the model's chat template lays them out: every
        turn's text and the template's own tokens around each turn (so empty turns count),
        the default system prompt included; the video's tokens not."""
        conv = conversation if conversation is not None else Conversation.single(question)
        mine = self._templater(adapter)
        with self._lock:
            prefix, suffix = mine.split_prompt(conv, 0)
        return len(prefix) + len(suffix)

    def check_video(self, path: str, question: str, params: dict, adapter) -> dict:
        """Raise OverBudget (413) or the context error (400) for a request the server will
        not run; return what was found. Blocking (reads the file header): run in a thread.
        ``adapter`` None (a stand-in model without one): the frame and pixel budgets only."""
        s = self.s
        info = videolib.probe(path)         # in a decode worker: UndecodableVideo (400)
        # the frames the pipeline decodes: the model's rule and limit (the default rule
        # without a model)
        sampling = adapter.sampling_args(params["fps"], params["max_frames"]) \
            if adapter is not None else {"fps": params["fps"], "max_frames": params["max_frames"]}
        frames = len(videolib.sample_indices(info.frames, info.fps, **sampling,
                                             timestamps=info.timestamps))
        pixels = info.width * info.height
        if pixels > s.max_frame_pixels:
            raise OverBudget(f"the video is {info.width}x{info.height} ({pixels} pixels per "
                             f"frame), over this server's limit of {s.max_frame_pixels} pixels "
                             f"per frame", limit=s.max_frame_pixels, pixels=pixels)
        decoded = frames * pixels * 3
        limit = int(s.max_decode_mb * 2**20)
        if decoded > limit:
            raise OverBudget(f"{frames} frames of {info.width}x{info.height} decode to "
                             f"{decoded / 2**20:.0f} MiB, over this server's limit of "
                             f"{s.max_decode_mb:g} MiB; lower fps or max_frames",
                             limit_bytes=limit, frames=frames)
        facts = {"frames": frames, "width": info.width, "height": info.height}
        if adapter is None:
            return facts
        conv = params.get("conversation")
        q_tokens = self.question_tokens(adapter, question, conv)
        if q_tokens > s.max_question_tokens:
            what = (f"the conversation ({len(conv.turns)} turns)" if conv is not None
                    else "the question")
            raise OverBudget(f"{what} is {q_tokens} tokens in the model's chat template (its "
                             f"text and the template's tokens around each turn), over this "
                             f"server's limit of {s.max_question_tokens}",
                             limit=s.max_question_tokens, tokens_counted=q_tokens,
                             field="question")
        visual = adapter.visual_tokens(frames, info.height, info.width)
        if visual is not None and s.max_visual_tokens is not None \
                and visual > s.max_visual_tokens:
            raise OverBudget(f"the video would be {visual} visual tokens ({frames} frames), "
                             f"over this server's limit of {s.max_visual_tokens}; lower fps "
                             f"or max_frames", limit=s.max_visual_tokens, tokens=visual)
        context = getattr(adapter, "max_context", 0) or 0
        if visual is not None and context and visual + q_tokens + params["max_new_tokens"] \
                > context:
            least = visual + q_tokens
            raise InputError(
                f"the prompt is at least {least} tokens ({visual} visual) and "
                f"{params['max_new_tokens']} new tokens are asked for, over the model's "
                f"context of {context} tokens; lower fps or max_frames", tokens=least,
                limit=context)
        return {**facts, "visual_tokens": visual, "question_tokens": q_tokens}


def configure_decoding(settings) -> None:
    """The decode sandbox's limits from the server's settings, and its workers started in the
    background (the first request does not wait for one)."""
    sandbox.configure(
        memory_mb=float(getattr(settings, "decode_memory_mb", 1024.0)),
        timeout_s=float(getattr(settings, "decode_timeout_s", 30.0)),
        workers=int(getattr(settings, "decode_workers", 2)))
    if sandbox.config().sandbox:
        sandbox.decoder_pool().warm()

