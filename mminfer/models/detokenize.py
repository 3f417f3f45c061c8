"""Answer text as it grows, one token at a time, equal in the end to the answer decoded whole.

Tokens do not always decode on their own: a byte-level BPE splits one character into several
byte tokens (the pieces decode to U+FFFD until the last arrives), and a SentencePiece token's
leading space depends on the token before it. So each new token decodes a short window of
the tokens before it together with it (vLLM's prefix/read offsets): the text the window
adds beyond its prefix is the delta, held back while it ends in an incomplete character.

The finished answer is ``tokenizer.decode(ids, skip_special_tokens=True).strip()``; the
deltas add up to exactly that: leading whitespace is never sent, trailing whitespace waits
until something else follows it, and ``finish`` sends what is still owed.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, skip_ids=()):
        self.tokenizer = tokenizer
        self.skip = set(skip_ids)       # end-of-answer tokens: never part of the text
        self.ids: list[int] = []
        self._prefix = 0                # window start: context for the next token's text
        self._read = 0                  # tokens whose text is already in ``_raw``
        self._raw = ""                  # the decoded text so far, unstripped
        self.sent = ""                  # what ``push``/``finish`` have returned, in order

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """The text this token adds to what was sent ("" while it is held back)."""
        if token_id in self.skip:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""                   # nothing yet, or an unfinished character
        self._raw += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._send(self._raw.strip())

    def finish(self, text: str | None = None) -> str:
        """What is still owed of the whole answer ``text`` (default: decoded here)."""
        full = self._decode(self.ids).strip() if text is None else text
        return self._send(full) if full.startswith(self.sent) else ""

    def _send(self, visible: str) -> str:
        # ``visible`` only ever grows at its end (stripping a longer text keeps the shorter's
        # stripped form as its prefix), so the new part is what follows the sent part
        if not visible.startswith(self.sent):
            return ""
        delta = visible[len(self.sent):]
        self.sent = visible
        return delta
