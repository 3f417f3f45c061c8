"""The sampler (mminfer.models.sampler): greedy is the argmax, a seed gives the same tokens,
draws follow softmax(logits / temperature) inside the top-p nucleus, rows of one batch with
different params choose as they would alone, logprobs are the model's log-softmax."""

import math

import pytest
import torch

from mminfer.errors import InputError
from mminfer.models.sampler import (GREEDY, Sampler, SamplingParams, generator,
                                    openai_logprobs, pick, token_text)
from lab.toy.tiny_longvila import tiny_tokenizer


def test_greedy_is_the_argmax_bit_for_bit():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(6, 1000).to(dtype)
        x[2, 17] = x[2, 900] = x[2].max() + 1           # a tie: the first index, as argmax
        tokens, lps = pick(x, [GREEDY] * 6, [None] * 6)
        assert torch.equal(tokens, x.argmax(-1)) and lps == [None] * 6


def test_logprobs_are_the_models_log_softmax():
    torch.manual_seed(1)
    x = torch.randn(1, 50)
    s = Sampler(SamplingParams(logprobs=True, top_logprobs=3))
    t = s(x)
    want = torch.log_softmax(x[0], -1)
    (lp,) = s.logprobs
    assert lp.token_id == t == int(x.argmax())
    assert lp.logprob == pytest.approx(float(want[t]), abs=1e-6)
    top = want.topk(3)
    assert [i for i, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    # temperature does not change what is reported: the model's own distribution
    s2 = Sampler(SamplingParams(temperature=1.5, seed=3, logprobs=True))
    t2 = s2(x)
    assert s2.logprobs[0].logprob == pytest.approx(float(want[t2]), abs=1e-6)
    assert s2.logprobs[0].top == ()


def test_same_seed_same_tokens_and_seeds_differ():
    torch.manual_seed(2)
    x = torch.randn(1, 200)
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(params):
        s = Sampler(params)
        return [s(x) for _ in range(40)]

    assert run(p) == run(p)
    assert run(p) != run(SamplingParams(temperature=1.0, seed=1235))
    assert len(set(run(p))) > 5                          # it does sample
    # a huge or negative seed is a seed too
    assert run(SamplingParams(temperature=1.0, seed=-5)) == run(
        SamplingParams(temperature=1.0, seed=-5))
    assert run(SamplingParams(temperature=1.0, seed=2**70)) == run(
        SamplingParams(temperature=1.0, seed=2**70))


def test_draws_follow_the_tempered_distribution():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temp in (1.0, 0.5):
        s = Sampler(SamplingParams(temperature=temp, seed=7))
        n = 4000
        counts = torch.bincount(torch.tensor([s(x) for _ in range(n)]), minlength=4)
        want = torch.softmax(x[0] / temp, -1)
        assert torch.allclose(counts / n, want, atol=0.025), (counts / n, want)


def test_top_p_keeps_the_nucleus_only():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    seen = {s(x) for _ in range(500)}
    assert seen == {0, 1}                                # 0.5 + 0.3 reaches 0.8
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.81, seed=0))
    assert {s(x) for _ in range(500)} == {0, 1, 2}
    tiny = Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=0))
    assert {tiny(x) for _ in range(50)} == {0}           # the first token always stays


def test_rows_of_a_batch_choose_as_they_would_alone():
    torch.manual_seed(3)
    x = torch.randn(4, 300)
    params = [SamplingParams(temperature=0.7, seed=11),
              SamplingParams(logprobs=True, top_logprobs=2),
              SamplingParams(temperature=1.3, top_p=0.5, seed=12, logprobs=True),
              GREEDY]
    gens = [generator(p.seed) if not p.greedy else None for p in params]
    tokens, lps = pick(x, params, gens)
    for i, p in enumerate(params):
        alone, lp = pick(x[i:i + 1], [p], [generator(p.seed) if not p.greedy else None])
        assert int(tokens[i]) == int(alone[0])
        assert lps[i] == lp[0]
    assert lps[0] is None and lps[3] is None and len(lps[1].top) == 2
    with pytest.raises(ValueError):
        pick(x, params[:2], gens[:2])


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"), ({"seed": 1.5}, "seed"), ({"stop": ("",)}, "stop"),
    ({"stop": "x"}, "stop"), ({"stop": ("a",) * 17}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_params_are_input_errors(kw, field):
    with pytest.raises(InputError) as e:
        SamplingParams(**kw)
    assert e.value.details["field"] == field


def test_token_text_and_bytes():
    tok = tiny_tokenizer()                               # one token per byte
    ids = tok("é!", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3
    text, raw = token_text(tok, ids[0])
    assert text == "\ufffd" and raw == [0xC3]            # half a character: its own byte
    assert token_text(tok, ids[2]) == ("!", [0x21])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_text(tok, eos)[0] == "<|im_end|>"
    s = Sampler(SamplingParams(logprobs=True, top_logprobs=1))
    x = torch.full((1, len(tok)), -math.inf)
    x[0, ids[2]] = 0.0
    s(x)
    (entry,) = openai_logprobs(tok, s.logprobs)
    assert entry["token"] == "!" and entry["logprob"] == 0.0 and entry["bytes"] == [0x21]
    assert entry["top_logprobs"] == [{"token": "!", "logprob": 0.0, "bytes": [0x21]}]
