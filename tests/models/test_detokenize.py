"""Answer text streamed token by token adds up to the answer decoded whole, with pieces that
only decode in groups (byte-level tokens of one character) held back until they do."""

import pytest

from mminfer.models.detokenize import IncrementalText
from lab.toy.tiny_longvila import tiny_tokenizer


def stream(tok, ids, skip=()):
    inc = IncrementalText(tok, skip)
    pieces = [inc.push(i) for i in ids]
    whole = tok.decode([i for i in ids if i not in skip], skip_special_tokens=True).strip()
    return pieces, inc.finish(whole), whole


@pytest.mark.parametrize("text", ["naïve 日本語 ✓ €5", "  spaced out \n ", "a\u00e9\u20ac\U0001F600b",
                                  "plain ascii answer"])
def test_byte_tokens_add_up_to_the_whole_answer(text):
    tok = tiny_tokenizer()                  # one token per byte: é is 2 tokens, 😀 is 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())
    pieces, rest, whole = stream(tok, ids)
    assert "".join(pieces) + rest == whole == text.strip()
    assert all("\ufffd" not in p for p in pieces)      # never half a character
    multibyte = sum(len(c.encode()) > 1 for c in text)
    # each multi-byte character is held back until its last byte, then sent whole
    assert sum(p == "" for p in pieces) >= sum(len(c.encode()) - 1 for c in text
                                               if len(c.encode()) > 1)
    if multibyte:
        assert any(len(p) == 1 and len(p.encode()) > 1 for p in pieces)


def test_end_tokens_and_an_unfinished_character():
    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("ok €", add_special_tokens=False)["input_ids"][:-1] + [eos]   # € cut short
    pieces, rest, whole = stream(tok, ids, skip={eos})
    assert "".join(pieces) == "ok"                     # the space waits, the piece of € too
    assert rest == whole[2:] and whole.startswith("ok ") and whole.endswith("\ufffd")


def test_embedded_model_tokenizer():
    from transformers import AutoTokenizer

    from mminfer.models.embedded import default_model
    tok = AutoTokenizer.from_pretrained(default_model())    # its own small vocabulary
    ids = tok("the number is 99, the red ball", add_special_tokens=False)["input_ids"]
    pieces, rest, whole = stream(tok, ids)
    assert "".join(pieces) + rest == whole == "the number is 99, the red ball"
    assert len([p for p in pieces if p]) > 5          # streamed in many pieces, not at the end
