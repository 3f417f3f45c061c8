"""ModalityIndex: the token layout of one request, built from the layout, never from values.

Everything downstream (row grouping for Q/2D boundaries, grid stride candidates, where the
last queries of a modality are) reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

TEXT, VIDEO, IMAGE = "text", "video", "image"
MODALITIES = (TEXT, VIDEO, IMAGE)


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of one modality. For video: frames start every ``frame_stride``
    tokens (separators included), each frame holds a ``grid_h x grid_w`` merged patch grid in
    row-major order (row stride ``grid_w``) followed by ``separators`` tokens."""
    start: int
    end: int
    modality: str
    frame_stride: int = 0
    grid_h: int = 0
    grid_w: int = 0
    separators: int = 0

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"unknown modality {self.modality!r}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"bad span [{self.start}, {self.end})")
        if self.modality != TEXT:
            if self.grid_h <= 0 or self.grid_w <= 0:
                raise ValueError(f"{self.modality} span needs its merged patch grid h x w")
            want = self.grid_h * self.grid_w + self.separators
            if self.frame_stride != want:
                raise ValueError(f"frame stride {self.frame_stride} != h*w + separators = {want}")
            if (self.end - self.start) % self.frame_stride:
                raise ValueError(f"{self.modality} span of {self.end - self.start} tokens is not "
                                 f"a whole number of {self.frame_stride}-token frames")

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def n_frames(self) -> int:
        return self.length // self.frame_stride if self.frame_stride else 0

    @property
    def row_stride(self) -> int:
        return self.grid_w

    def frame_starts(self) -> list[int]:
        return list(range(self.start, self.end, self.frame_stride)) if self.frame_stride else []


@dataclass
class ModalityIndex:
    n: int
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self):
        pos = 0
        for s in self.spans:
            if s.start != pos:
                raise ValueError(f"spans must tile [0, {self.n}) in order; gap or overlap at {pos}")
            pos = s.end
        if pos != self.n:
            raise ValueError(f"spans end at {pos}, expected {self.n}")

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_segments(cls, segments: Sequence[tuple]) -> "ModalityIndex":
        """``segments``: ``("text", n_tokens)`` or ``("video", n_frames, grid_h, grid_w,
        separators)`` / ``("image", 1, grid_h, grid_w, 0)``, in order."""
        spans, pos = [], 0
        for seg in segments:
            kind = seg[0]
            if kind == TEXT:
                if seg[1] > 0:
                    spans.append(Span(pos, pos + seg[1], TEXT))
                    pos += seg[1]
            else:
                n_frames, h, w, sep = seg[1], seg[2], seg[3], seg[4] if len(seg) > 4 else 0
                stride = h * w + sep
                spans.append(Span(pos, pos + n_frames * stride, kind, stride, h, w, sep))
                pos += n_frames * stride
        return cls(pos, _merge_text(spans))

    @classmethod
    def qwen2_5_vl(cls, input_ids, video_grid_thw=None, image_grid_thw=None, *,
                   video_token_id=151656, image_token_id=151655,
                   spatial_merge_size=2) -> "ModalityIndex":
        """Qwen2.5-VL: runs of video/image pad tokens; the k-th video run belongs to
        ``video_grid_thw[k] = (t, h, w)`` (patch units); one temporal group (two sampled
        frames) is ``(h/2)(w/2)`` tokens, no separators."""
        ids = [int(x) for x in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
        if ids and isinstance(ids[0], list):
            raise ValueError("pass the token ids of one request (1-D)")
        grids = {VIDEO: [tuple(int(x) for x in g) for g in (video_grid_thw if video_grid_thw is not None else [])],
                 IMAGE: [tuple(int(x) for x in g) for g in (image_grid_thw if image_grid_thw is not None else [])]}
        used = {VIDEO: 0, IMAGE: 0}
        spans, i, n = [], 0, len(ids)
        media = (video_token_id, image_token_id)
        while i < n:
            tok = ids[i]
            kind = VIDEO if tok == video_token_id else IMAGE if tok == image_token_id else TEXT
            j = i + 1
            if kind == TEXT:
                while j < n and ids[j] not in media:
                    j += 1
                spans.append(Span(i, j, TEXT))
                i = j
                continue
            while j < n and ids[j] == tok:
                j += 1
            # One run may hold several consecutive items of the same kind.
            while i < j:
                if used[kind] >= len(grids[kind]):
                    raise ValueError(f"more {kind} token runs than {kind}_grid_thw entries")
                t, h, w = grids[kind][used[kind]]
                used[kind] += 1
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                size = t * gh * gw
                if i + size > j:
                    raise ValueError(f"{kind} run at {i} has {j - i} tokens, grid {t}x{h}x{w} "
                                     f"needs {size}")
                spans.append(Span(i, i + size, kind, gh * gw, gh, gw, 0))
                i += size
        for kind in (VIDEO, IMAGE):
            if used[kind] != len(grids[kind]):
                raise ValueError(f"{len(grids[kind])} {kind} grids but {used[kind]} token runs")
        return cls(n, _merge_text(spans))

    @classmethod
    def longvila(cls, prefix_len: int, n_frames: int, tokens_per_frame: int, suffix_len: int,
                 separators: int = 1) -> "ModalityIndex":
        """LongVILA: ``P`` visual tokens (a square merged grid) + one newline per frame."""
        side = int(round(tokens_per_frame ** 0.5))
        if side * side != tokens_per_frame:
            raise ValueError(f"LongVILA frames are square grids; {tokens_per_frame} is not")
        return cls.from_segments([(TEXT, prefix_len), (VIDEO, n_frames, side, side, separators),
                                  (TEXT, suffix_len)])

    # ------------------------------------------------------------------ queries
    def modalities(self) -> list[str]:
        """Modalities present, in the fixed order text, video, image (group ids follow it)."""
        present = {s.modality for s in self.spans}
        return [m for m in MODALITIES if m in present]

    def group_of(self, modality: str) -> int:
        return self.modalities().index(modality)

    def row_groups(self) -> list[tuple[int, int, int]]:
        """Spans as ``(start, end, group)`` with compact group ids (see ``modalities``)."""
        ids = {m: g for g, m in enumerate(self.modalities())}
        return [(s.start, s.end, ids[s.modality]) for s in self.spans]

    def spans_of(self, modality: str) -> list[Span]:
        return [s for s in self.spans if s.modality == modality]

    def visual_spans(self) -> list[Span]:
        return [s for s in self.spans if s.modality != TEXT]

    def count(self, modality: str) -> int:
        return sum(s.length for s in self.spans_of(modality))

    def last_positions(self, modality: str, k: int = 64) -> list[int]:
        """The last ``k`` token positions of a modality (fewer if it has fewer)."""
        out: list[int] = []
        for s in reversed(self.spans_of(modality)):
            take = min(k - len(out), s.length)
            out = list(range(s.end - take, s.end)) + out
            if len(out) >= k:
                break
        return out

    def grid_strides(self, multiples: Sequence[int] = (1, 2)) -> list[int]:
        """Candidate grid strides from the layout: frame stride, row stride, small multiples."""
        cands = set()
        for s in self.visual_spans():
            for m in multiples:
                cands.add(s.frame_stride * m)
                cands.add(s.row_stride * m)
        return sorted(c for c in cands if c > 1)

    def to_dict(self) -> dict:
        return {"n": self.n, "spans": [s.__dict__.copy() for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "ModalityIndex":
        return cls(int(d["n"]), [Span(**s) for s in d["spans"]])


def _merge_text(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for s in spans:
        if out and s.modality == TEXT and out[-1].modality == TEXT:
            out[-1] = Span(out[-1].start, s.end, TEXT)
        else:
            out.append(s)
    return out
