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


def stop_stream(tok, text, stop):
    inc = IncrementalText(tok, (), stop)
    pieces, stopped_at = [], None
    for n, i in enumerate(tok(text, add_special_tokens=False)["input_ids"]):
        pieces.append(inc.push(i))
        if inc.stopped:
            stopped_at = n
            break
    return pieces, inc, stopped_at


def test_a_stop_string_across_tokens_ends_the_answer_before_it():
    tok = tiny_tokenizer()                  # one token per byte: "99" spans two tokens
    pieces, inc, at = stop_stream(tok, "The answer is 99, sure", ["99"])
    assert at == len("The answer is 99") - 1         # the token that completes it
    assert "".join(pieces) + inc.finish() == inc.text() == "The answer is"
    assert all("9" not in p for p in pieces)         # never a piece of the stop string
    # the first of several, wherever it starts; a stop string of whitespace
    _, inc, _ = stop_stream(tok, "a, b. c", [".", ","])
    assert inc.text() == "a"
    _, inc, _ = stop_stream(tok, "  line one\nline two", ["\n"])
    assert inc.text() == "line one" and inc.stopped


def test_a_held_back_prefix_that_is_no_stop_string_is_sent():
    tok = tiny_tokenizer()
    pieces, inc, at = stop_stream(tok, "x ab abc", ["abd"])
    assert at is None and not inc.stopped
    # "ab" waited while it could begin "abd"
    assert "".join(pieces) == "x ab abc" and inc.finish() == ""
    assert pieces[2:5] == ["", "", " ab"]        # "a", "ab" held back, sent with the space
    _, inc, at = stop_stream(tok, "stop at once", ["stop"])
    assert at == 3 and inc.text() == ""
