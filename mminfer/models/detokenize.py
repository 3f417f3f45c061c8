"""Answer text as it grows, one token at a time, equal in the end to the answer decoded whole,
and cut before the first stop string.

Tokens do not always decode on their own: a byte-level BPE splits one character into several
byte tokens (the pieces decode to U+FFFD until the last arrives), and a SentencePiece token's
leading space depends on the token before it. So each new token decodes a short window of
the tokens before it together with it (vLLM's prefix/read offsets): the text the window
adds beyond its prefix is the delta, held back while it ends in an incomplete character.

The finished answer is ``tokenizer.decode(ids, skip_special_tokens=True).strip()``; the
deltas add up to exactly that: leading whitespace is never sent, trailing whitespace waits
until something else follows it, and ``finish`` sends what is still owed.

Stop strings (``stop``): the answer ends before the first place one of them occurs in its text
(the text after leading whitespace, so a stop string may span tokens and may be whitespace
itself), and is stripped as any answer is. ``push`` sets ``stopped`` on the token that
completes one (the decode loop ends there), and never sends text that may still turn out to
begin a stop string: a tail of the text that is a proper prefix of one waits until the next
tokens show it is not.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """``text`` (leading whitespace removed) up to the first stop string, stripped, and
    whether one occurred."""
    text = text.lstrip()
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut].strip(), True
    return text.strip(), False


def _partial_stop(text: str, stop) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalText:
    def __init__(self, tokenizer, skip_ids=(), stop=()):
        self.tokenizer = tokenizer
        self.skip = set(skip_ids)       # end-of-answer tokens: never part of the text
        self.stop = tuple(stop)
        self.stopped = False            # a stop string occurred: the answer ends here
        self.ids: list[int] = []
        self._prefix = 0                # window start: context for the next token's text
        self._read = 0                  # tokens whose text is already in ``_raw``
        self._raw = ""                  # the decoded text so far, unstripped
        self.sent = ""                  # what ``push``/``finish`` have returned, in order

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """The text this token adds to what was sent ("" while it is held back)."""
        if token_id in self.skip or self.stopped:
            return ""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""                   # nothing yet, or an unfinished character
        self._raw += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        if not self.stop:
            return self._send(self._raw.strip())
        visible, self.stopped = cut_at_stop(self._raw, self.stop)
        if not self.stopped:            # hold back what may begin a stop string
            text = self._raw.lstrip()
            visible = text[:len(text) - _partial_stop(text, self.stop)].strip()
        return self._send(visible)

    def text(self) -> str:
        """The whole answer: every token decoded together, cut at the first stop string."""
        return cut_at_stop(self._decode(self.ids), self.stop)[0]

    def finish(self, text: str | None = None) -> str:
        """What is still owed of the whole answer ``text`` (default: :meth:`text`)."""
        full = self.text() if text is None else text
        return self._send(full) if full.startswith(self.sent) else ""

    def _send(self, visible: str) -> str:
        # ``visible`` only ever grows at its end (stripping a longer text keeps the shorter's
        # stripped form as its prefix, and a held-back tail is the longest that may begin a
        # stop string), so the new part is what follows the sent part
        if not visible.startswith(self.sent):
            return ""
        delta = visible[len(self.sent):]
        self.sent = visible
        return delta
