"""Field types shared by the request schemas (pydantic, so /openapi.json and /docs show
them): numbers that refuse booleans and NaN, as a client mistake deserves."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, Strict, StrictBool


def _no_bool(v):
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


Number = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]
Integer = Annotated[int, BeforeValidator(_no_bool)]
Attention = Literal["auto", "sparse", "dense"]
# JSON bodies (the OpenAI-shaped schema): a JSON number or boolean, never a string that
# looks like one ("2", "yes"), as OpenAI's own schema refuses them. Form fields are text and
# keep the lax types above.
JsonNumber = Annotated[float, BeforeValidator(_no_bool), Strict(), Field(allow_inf_nan=False)]
JsonInteger = Annotated[int, BeforeValidator(_no_bool), Strict()]
JsonBool = StrictBool

FPS_DOC = "frames sampled per second (default: the server's --fps; at most its --max-fps)"
MAX_FRAMES_DOC = "at most this many frames (over the server's --max-frames-limit: 413)"
ATTENTION_DOC = ("prefill attention: auto (the server decides by prompt length), sparse "
                 "(if the server allows clients to ask for it) or dense")
CACHE_SALT_DOC = ("vLLM's cache_salt: only requests with the same salt (and the same API key's "
                  "tenant, unless the server shares the cache) share a cached video prefix")
