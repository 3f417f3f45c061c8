"""How a live stream's prompt is laid out, per model: the tokens, positions, ModalityIndex span
and embeddings of each appended piece of video, and the suffix a question adds.

A stream's prompt is the one-shot prompt of the video seen so far, cut where the video's frames
end::

    head         the chat template up to the first frame (system prompt, the user turn's
                 opening, Qwen2.5-VL's <|vision_start|>): prefilled with the first piece
    piece 1..k   the frames of each piece, as the one-shot prompt lays frames out
    ------------ the stream's KV cache holds everything above this line
    question     the video's closing tokens (Qwen2.5-VL's <|vision_end|>; none for LongVILA),
                 then the question's turn and the assistant's opening, exactly the one-shot
                 suffix: prefilled over the stream's cache, then truncated away

so a question asked after k pieces sees the prompt a one-shot request on the same frames
would build, token for token and position for position:

- Qwen2.5-VL: a piece is a whole number of temporal pairs (an odd last frame waits for the
  next piece); pair ``g`` of the stream (counted from its first frame) takes M-RoPE temporal
  position ``s + floor(g * 2/fps * tokens_per_second)``, its absolute media time, where ``s``
  is the video's start; rows and columns ``s + r``, ``s + c``. The frame size is fixed by the
  first piece under the per-frame pixel budget (a stream has no whole-video budget: its length
  is unknown), and the text after the video starts one past the largest position so far.
- LongVILA: a piece is any number of frames, each ``P`` visual rows and a newline; 1-D
  positions continue the cache's length.

The vision towers see one temporal pair (Qwen2.5-VL) or one frame (SigLIP) at a time, so a
piece's embeddings are the one-shot embeddings of its frames.
"""

from __future__ import annotations

import math

import torch

from mminfer.errors import Cancelled, InputError, VideoError
from mminfer.models.base import Conversation


class StreamLayout:
    """One stream's layout on one adapter (see the module doc). ``unit_frames``: frames of one
    unit the prompt is made of (a temporal pair, a frame); ``unit_tokens``: its tokens;
    ``span``: the keyword arguments of its ModalityIndex video span (frame_stride, grid_h,
    grid_w, separators)."""

    unit_frames: int = 1
    unit_tokens: int = 0
    span: dict = {}

    def __init__(self, adapter, conversation: Conversation, fps: float, frame_hw):
        self.adapter, self.fps = adapter, float(fps)
        self.source_hw = (int(frame_hw[0]), int(frame_hw[1]))
        self.digest = conversation.prefix_digest()
        prefix, _ = adapter.split_prompt(conversation, 0)
        close = self.close_len()
        self.head_ids = prefix[:len(prefix) - close]
        self.close_ids = prefix[len(prefix) - close:]

    # ---------------------------------------------------------------- per model
    def close_len(self) -> int:
        """Tokens the adapter's prefix puts after the video's frames (they go to questions)."""
        return 0

    def check_frames(self, frames) -> None:
        """Refuse frames the stream cannot continue with (VideoError): another size than the
        first piece's."""
        hw = tuple(int(x) for x in frames.shape[1:3])
        if hw != self.source_hw:
            raise VideoError(f"the piece's frames are {hw[1]}x{hw[0]}, the stream's are "
                             f"{self.source_hw[1]}x{self.source_hw[0]}: a stream keeps one "
                             "frame size (start a new stream for the new size)")

    def positions(self, start: int, first_unit: int, n_units: int):
        """position_ids of the rows of units ``[first_unit, first_unit + n_units)``, whose
        first row is token ``start`` (1-D RoPE: ``start ..``)."""
        n = n_units * self.unit_tokens
        return torch.arange(start, start + n, device=self.adapter.device)[None]

    def head_positions(self):
        return torch.arange(len(self.head_ids), device=self.adapter.device)[None]

    def rope_delta(self, units: int, length: int) -> int:
        """Position of a token ``i`` after the video, ``i + rope_delta``, once ``units`` units
        fill the prompt up to ``length`` tokens."""
        return 0

    def embed_units(self, frames, *, timer=None, cancel=None) -> torch.Tensor:
        """Embeddings ``[1, n_units * unit_tokens, hidden]`` of whole units of ``frames``."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def head_embeds(self) -> torch.Tensor:
        ad = self.adapter
        ids = torch.tensor([self.head_ids], dtype=torch.long, device=ad.device)
        with torch.inference_mode():
            return ad.text_model.get_input_embeddings()(ids)

    def question_ids(self, conversation: Conversation) -> list[int]:
        """The suffix of a question about the stream: the video's closing tokens, then what
        follows the video in ``conversation``, whose turns before the video must be the
        stream's."""
        if conversation.prefix_digest() != self.digest:
            raise InputError("a question about a stream may not change what comes before the "
                             "video (the system prompt, earlier turns): the stream's cache "
                             "was built with its own")
        _, suffix = self.adapter.split_prompt(conversation, 0)
        return self.close_ids + suffix

    def question_embeds(self, conversation: Conversation) -> torch.Tensor:
        ad = self.adapter
        ids = torch.tensor([self.question_ids(conversation)], dtype=torch.long,
                           device=ad.device)
        with torch.inference_mode():
            return ad.text_model.get_input_embeddings()(ids)


class QwenStreamLayout(StreamLayout):
    unit_frames = 2

    def __init__(self, adapter, conversation, fps, frame_hw, options=None):
        super().__init__(adapter, conversation, fps, frame_hw)
        v = adapter.vcfg
        H, W = self.source_hw
        # a stream's frames are sized by the per-frame budget alone (two frames: one pair)
        (rh, rw), (_, h, w), _ = adapter._grid(v.temporal_patch_size, H, W, options)
        self.resized, self.grid = (rh, rw), (h, w)
        m = v.spatial_merge_size
        self.gh, self.gw = h // m, w // m
        self.unit_frames = v.temporal_patch_size
        self.unit_tokens = self.gh * self.gw
        self.span = dict(frame_stride=self.unit_tokens, grid_h=self.gh, grid_w=self.gw,
                         separators=0)
        self.interval = v.temporal_patch_size / self.fps * float(v.tokens_per_second)
        self.start = len(self.head_ids)          # the head is text: positions 0 .. start-1

    def close_len(self) -> int:
        return 1                                 # <|vision_end|>

    def head_positions(self):
        n = len(self.head_ids)
        return torch.arange(n, device=self.adapter.device).view(1, 1, -1).expand(3, 1, -1)

    def _temporal(self, g):
        return self.start + torch.floor(g.double() * self.interval).long()

    def positions(self, start, first_unit, n_units):
        g = torch.arange(first_unit, first_unit + n_units)
        per = self.unit_tokens
        s = self.start
        pos = torch.empty(3, n_units * per, dtype=torch.long)
        pos[0] = self._temporal(g).repeat_interleave(per)
        pos[1] = (s + torch.arange(self.gh)).repeat_interleave(self.gw).repeat(n_units)
        pos[2] = (s + torch.arange(self.gw)).repeat(n_units * self.gh)
        return pos[:, None].to(self.adapter.device)

    def rope_delta(self, units, length):
        if units == 0:
            return 0
        last = int(self._temporal(torch.tensor([units - 1]))[0])
        top = max(last, self.start + self.gh - 1, self.start + self.gw - 1)
        return top + 1 - length

    def embed_units(self, frames, *, timer=None, cancel=None):
        ad = self.adapter
        frames = torch.as_tensor(frames)
        n = len(frames) // self.unit_frames
        h, w = self.grid
        out = torch.empty(1, n * self.unit_tokens, ad.text_model.config.hidden_size,
                          dtype=ad.dtype, device=ad.device)
        pairs = ad.tower.pairs_per_chunk(h, w, ad.vision_chunk_patches)
        done = 0
        with torch.inference_mode():
            for s in range(0, n, pairs):
                if cancel is not None and cancel():
                    raise Cancelled("request cancelled in the vision tower")
                k = min(pairs, n - s)
                part = frames[s * self.unit_frames:(s + k) * self.unit_frames]
                pixels = ad._patches(part, self.resized)
                feats = ad.tower(pixels, k, h, w, pad_to=pairs)
                out[0, done:done + k * self.unit_tokens] = feats.to(out.dtype)
                done += k * self.unit_tokens
        return out


class LongVILAStreamLayout(StreamLayout):
    unit_frames = 1

    def __init__(self, adapter, conversation, fps, frame_hw, options=None):
        super().__init__(adapter, conversation, fps, frame_hw)
        P = adapter.tokens_per_frame
        side = int(round(math.sqrt(P)))
        self.unit_tokens = P + 1                 # the frame's rows, then a newline
        self.span = dict(frame_stride=P + 1, grid_h=side, grid_w=side, separators=1)

    def embed_units(self, frames, *, timer=None, cancel=None):
        ad = self.adapter
        frames = torch.as_tensor(frames)
        F, P = len(frames), ad.tokens_per_frame
        with torch.inference_mode():
            nl = torch.tensor([[ad.newline_id]], device=ad.device)
            newline = ad.text_model.get_input_embeddings()(nl)[0, 0]
            out = torch.empty(F, P + 1, newline.shape[-1], dtype=newline.dtype,
                              device=ad.device)
            out[:, P] = newline
            for s in range(0, F, ad.vision_batch):
                if cancel is not None and cancel():
                    raise Cancelled("request cancelled in the vision tower")
                chunk = frames[s:s + ad.vision_batch]
                x = ad._normalise(ad._squash(chunk))
                out[s:s + len(chunk), :P] = ad._encode(x).to(out.dtype)
        return out.view(1, F * (P + 1), -1)
