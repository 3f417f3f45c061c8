"""Tensor parallelism on the CPU: 2 gloo processes over a tiny real-layout checkpoint give
the same first-token logits (fp32, within 1e-5) and the same answer as one process, dense
and sparse; `torchrun ... -m mminfer answer --tensor-parallel 2` prints that answer."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mminfer.errors import ConfigError

QUESTION = "what is in the video?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_logits(pipe, video, mode):
    """Answer once; the logits lm_head produced for the first answer token."""
    seen = []
    handle = pipe.adapter.lm_head.register_forward_hook(
        lambda mod, args, out: seen.append(out[0, -1].detach().float().clone()))
    try:
        res = pipe.answer(video, QUESTION, attention=mode, max_new_tokens=4)
    finally:
        handle.remove()
    return seen[0], res


def _rank_main(rank, world, port, ckpt, video, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from mminfer.engine.pipeline import Pipeline
    pipe = Pipeline(ckpt, attention="dense", device="cpu", min_sparse_len=16,
                    tensor_parallel=world)
    # every decoder layer holds its share of the heads only
    attn = pipe.adapter.text_model.layers[0].self_attn
    local = {"q_rows": attn.q_proj.weight.shape[0], "kv_rows": attn.k_proj.weight.shape[0]}
    out = {"local": local}
    for mode in ("dense", "sparse"):
        logits, res = _first_logits(pipe, video, mode)
        out[mode] = {"logits": logits.tolist(), "answer": res.answer,
                     "attention": res.attention}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny Qwen2.5-VL with a head-pattern file whose four heads all differ and all drop
    pairs, so a rank that read another rank's heads would give other logits."""
    from mminfer.engine.pipeline import Pipeline
    from mminfer.sparse.patterns import (HeadPattern, HeadPatternConfig, a_shape, grid,
                                         vertical_slash)
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    # three layers: the last runs its last row only (dense), so two carry sparse plans
    path = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tp") / "tiny", heads=4, kv_heads=2,
                                layers=3)
    identity = Pipeline(str(path), attention="dense", device="cpu").adapter.identity
    vs = vertical_slash(n_vertical=4, n_slash=2, window=8, sink=2)
    row = [HeadPattern.single(a_shape(sink=2, window=8)),
           HeadPattern.single(vs, "k"),
           HeadPattern.single(a_shape(sink=8, window=16)),
           HeadPattern("q", {"video": grid(sink=2, window=8, min_lift=0.0, fallback=vs),
                             "text": vs})]
    HeadPatternConfig(identity, [row] * identity.layers).save(path / "mminfer_patterns.json")
    return str(path)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    from conftest import write_video
    return str(write_video(tmp_path_factory.mktemp("tpv") / "v.mp4", n_frames=20, fps=10.0))


def test_two_gloo_ranks_match_one_process(ckpt, video, tmp_path):
    import torch.multiprocessing as mp
    from mminfer.engine.pipeline import Pipeline
    one = Pipeline(ckpt, attention="dense", device="cpu", min_sparse_len=16)
    ref = {mode: _first_logits(one, video, mode) for mode in ("dense", "sparse")}
    heads = one.adapter.text_model.layers[0].self_attn.q_proj.weight.shape[0]
    # the sparse plan really drops pairs here: its logits are not the dense ones (the
    # question's rows run dense over the sparse prefix, so they move by ~3e-4, not more)
    assert (ref["sparse"][0] - ref["dense"][0]).abs().max() > 1e-4

    mp.spawn(_rank_main, args=(2, _free_port(), ckpt, video, str(tmp_path)), nprocs=2,
             join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["local"]["q_rows"] == heads // 2
        for mode in ("dense", "sparse"):
            logits, res = ref[mode]
            assert got[mode]["attention"] == res.attention == mode
            diff = (torch.tensor(got[mode]["logits"]) - logits).abs().max().item()
            assert diff <= 1e-5, (rank, mode, diff)
            assert got[mode]["answer"] == res.answer


def test_torchrun_answer_prints_once(ckpt, video):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = ["answer", video, QUESTION, "--model", ckpt, "--device", "cpu", "--json",
            "--max-new-tokens", "4", "--attention", "dense"]
    single = subprocess.run([sys.executable, "-m", "mminfer", *base], env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(_free_port()), "-m", "mminfer", *base,
                         "--tensor-parallel", "2"],
                        env=env, capture_output=True, text=True, timeout=300)
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert tp.stdout.count('"answer"') == 1          # rank 0 prints, rank 1 stays quiet
    assert json.loads(tp.stdout)["answer"] == json.loads(single.stdout)["answer"]


def test_tensor_parallel_without_torchrun_says_how(ckpt, monkeypatch):
    from mminfer.engine.pipeline import Pipeline
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        Pipeline(ckpt, attention="dense", device="cpu", tensor_parallel=2)


def test_heads_that_do_not_divide_are_refused(ckpt):
    from mminfer.engine.parallel import shard_decoder
    from mminfer.engine.pipeline import Pipeline
    one = Pipeline(ckpt, attention="dense", device="cpu")
    with pytest.raises(ConfigError, match="must divide"):
        shard_decoder(one.adapter.text_model, 0, 3)
