"""Video: which frames a model sees, what a file is, and decoding the frames (decord, then
PyAV) in a sandboxed worker process, handed on as a stream. A layer below the engine: it
knows nothing of models, the engine or HTTP. Every failure a user can cause comes out as
``VideoError`` with a message that says what is wrong with the file or the arguments;
backend exceptions never reach the caller.

- ``sampling``: the frame-sampling rules (Qwen2.5-VL's, VILA's), by time at a variable rate
- ``filekind``: what a file's first bytes say it is
- ``readers``: the decord and PyAV readers, and the container facts from PyAV
- ``session``: one video's decoding: backends in order, the rest handed on mid-read
- ``stream``: ``probe``, ``decode``, ``open_stream`` (frames decoded ahead in a thread)
- ``sandbox``, ``remote``, ``worker``, ``wire``: the decode worker processes (settings and
  pool, the parent's session, the child's loop, their messages)
"""
from mminfer.video.filekind import FileKind, sniff
from mminfer.video.readers import BACKENDS
from mminfer.video.sampling import SAMPLINGS, is_variable_rate, sample_indices, vila_indices
from mminfer.video.stream import DecodedVideo, VideoInfo, VideoStream, decode, open_stream, probe

__all__ = ["BACKENDS", "SAMPLINGS", "DecodedVideo", "FileKind", "VideoInfo", "VideoStream",
           "decode", "is_variable_rate", "open_stream", "probe", "sample_indices", "sniff",
           "vila_indices"]
