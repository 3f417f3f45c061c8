"""The ``mminfer`` command: instant help, ``answer --json`` record, human output, and errors
as one line with exit status 2."""

import json
import os
import subprocess
import sys

import av
import numpy as np
import pytest

from mminfer.cli import SUBCOMMANDS, main
from lab.toy.tiny import save_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("cli") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("clivid") / "clip.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(12):
            img = np.full((48, 64, 3), 20 * i, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


# what a subcommand loads when it runs, never for --help: seconds of imports
HEAVY = ("torch", "transformers", "triton", "numpy", "decord", "av", "fastapi", "starlette",
         "mminfer.engine", "mminfer.models.base", "mminfer.serve.app", "mminfer.batch",
         "mminfer.offline.calibrate")


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_is_light(command):
    """``mminfer --help`` and every subcommand's ``--help`` print their options without
    importing the engine, the app or their libraries: the command loads them at its edge,
    when a subcommand runs."""
    argv = [command, "--help"] if command else ["--help"]
    code = ("import sys\nfrom mminfer.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         check=True)
    assert out.stderr.strip() == "[]", out.stderr
    assert out.stdout.startswith(f"usage: mminfer {command or ''}".rstrip()), out.stdout
    assert ("--model" if command else "calibrate") in out.stdout
    help_ = subprocess.run([sys.executable, "-m", "mminfer", *argv], capture_output=True,
                           text=True, check=True).stdout
    assert help_ == out.stdout


def test_answer_json(ckpt, mp4, capsys):
    rc = main(["answer", str(mp4), "what color is it?", "--model", str(ckpt), "--json",
               "--attention", "dense", "--fps", "4", "--max-new-tokens", "3"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"answer", "model", "attention", "attention_requested", "video", "tokens",
                      "sparsity", "timings_ms", "cache", "finish_reason", "quantization",
                      "kv_cache_dtype"}
    assert (d["quantization"], d["kv_cache_dtype"]) == (None, "auto")
    assert d["cache"] == "miss" and d["tokens"]["cached"] == 0
    assert d["finish_reason"] == ("length" if d["tokens"]["generated"] == 3 else "stop")
    assert isinstance(d["answer"], str) and d["attention"] == "dense" and d["sparsity"] is None
    assert {"frames", "fps", "sampled_fps", "duration", "width", "height"} <= set(d["video"])
    assert d["video"]["frames"] == 6 and d["video"]["width"] == 64
    assert d["tokens"]["total"] == d["tokens"]["visual"] + d["tokens"]["text"]
    assert set(d["timings_ms"]) == {"wait", "restore", "room", "decode", "preprocess", "vision",
                                    "index", "attention", "llm_other", "suffix", "generate",
                                    "density", "ttft", "total"}
    assert d["timings_ms"]["wait"] == 0            # the command line has the model to itself


def test_answer_samples_with_a_seed_and_stops(ckpt, mp4, capsys):
    def ask(*flags):
        assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--json", "--attention",
                     "dense", "--max-new-tokens", "8", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    greedy = ask()
    a, b = ask("--temperature", "1.5", "--seed", "4"), ask("--temperature", "1.5", "--seed", "4")
    assert a["answer"] == b["answer"]
    assert len({ask("--temperature", "1.5", "--seed", str(s))["answer"]
                for s in (5, 6, 7)} | {a["answer"], greedy["answer"]}) > 2
    stop = greedy["answer"][2:4]
    cut = ask("--stop", stop, "--stop", "never")
    assert cut["answer"] == greedy["answer"][:greedy["answer"].find(stop)].strip()
    assert cut["finish_reason"] == "stop"
    assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--temperature", "3"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_answer_without_the_video_cache(ckpt, mp4, capsys):
    assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--json", "--attention",
                 "dense", "--max-new-tokens", "2", "--no-video-cache"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cache"] == "off" and d["timings_ms"]["restore"] == 0


def test_answer_json_sparse(ckpt, mp4, capsys):
    assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--json", "--attention",
                 "sparse", "--max-new-tokens", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["attention"] == "sparse" and d["timings_ms"]["index"] > 0
    assert {"mean_density", "per_layer", "layers", "uncalibrated"} <= set(d["sparsity"])


def test_answer_human(ckpt, mp4, capsys):
    assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--attention", "dense",
                 "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens" in out and "attention dense" in out
    assert "model  tiny-qwen\n" in out and "FP8" not in out
    lines = out.splitlines()
    assert any(line.strip().startswith("ttft") and line.endswith(" ms") for line in lines)


def test_answer_says_when_fp8_is_on(ckpt, mp4, capsys):
    assert main(["answer", str(mp4), "what?", "--model", str(ckpt), "--attention", "dense",
                 "--max-new-tokens", "2", "--quantization", "fp8",
                 "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert ("model  tiny-qwen, FP8 linear layers (--quantization fp8), FP8 KV cache "
            "(--kv-cache-dtype fp8)") in out


@pytest.mark.parametrize("argv,needle", [
    (["answer", "{mp4}", "what?"], "--model is required"),
    (["answer", "{tmp}/nope.mp4", "what?", "--model", "{ckpt}"], "not found"),
    (["answer", "{mp4}", " ", "--model", "{ckpt}"], "question is empty"),
    (["answer", "{mp4}", "what?", "--model", "{ckpt}", "--fps", "0"], "fps"),
    (["answer", "{mp4}", "what?", "--model", "{tmp}"], "not a checkpoint"),
    # a CPU build of torch, or a GPU that is not there: said, not an internal AssertionError
    (["answer", "{mp4}", "what?", "--model", "{ckpt}", "--device", "cuda:64"], "'cuda:64'"),
    (["answer", "{mp4}", "what?", "--model", "{ckpt}", "--device", "gpu"], "not a device"),
])
def test_errors_are_one_line_exit_2(ckpt, mp4, tmp_path, capsys, monkeypatch, argv, needle):
    from mminfer.models import embedded
    # as on a machine where the embedded default model is not built
    monkeypatch.setattr(embedded, "DEFAULT_MODEL_DIR", tmp_path / "no-model")
    argv = [a.format(mp4=mp4, ckpt=ckpt, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_no_traceback_from_the_console(mp4, tmp_path):
    # the real entry point, as a user runs it, where the embedded model is not built
    env = dict(os.environ, MMINFER_EMBEDDED_MODEL=str(tmp_path / "no-model"))
    r = subprocess.run([sys.executable, "-m", "mminfer.cli", "answer", str(mp4), "what?"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--model" in r.stderr


def test_a_closed_stdout_ends_quietly(ckpt, mp4):
    """`mminfer answer ... | head -1`: the reader is gone before the answer is written; the
    command ends as a Unix tool does on SIGPIPE, saying nothing."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "mminfer.cli", "answer", str(mp4), "what?",
                            "--model", str(ckpt), "--attention", "dense", "--max-new-tokens",
                            "2"], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_make_run_passes_server_flags():
    """`make run ARGS=...` reaches `mminfer serve` (as the README's path/file:// examples need)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(["make", "-n", "-C", root, "run", "ARGS=--allowed-local-media-path /v "
                        "--max-upload-mb 64", "MODEL=/m"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if "mminfer serve" in ln][-1]
    assert line.rstrip().endswith("--model /m --allowed-local-media-path /v --max-upload-mb 64")


@pytest.mark.parametrize("flags, needle", [
    (["--max-frames", "100000000"], "--max-frames-limit (1024)"),
    (["--max-frames", "2048", "--max-frames-limit", "1024"], "--max-frames-limit (1024)"),
    (["--fps", "30"], "--max-fps (8)"),
])
def test_serve_refuses_request_defaults_over_its_own_limits(tmp_path, capsys, flags, needle):
    """A default no request could ask for is refused at start, not capped in silence."""
    rc = main(["serve", "--data-dir", str(tmp_path), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err, err


def test_serve_help_says_max_frames_over_the_limit_is_refused():
    out = subprocess.run([sys.executable, "-m", "mminfer.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "capped" not in flat
    described = flat.split(" --max-frames-limit MAX_FRAMES_LIMIT ")[1]
    assert described.startswith("highest max_frames a request may ask")
    budgets = flat.split("budgets (")[1].split("):")[0]
    assert "over: 413" in budgets


def test_serve_help_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "mminfer.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    for flag, default in (("--queue-size", "8"), ("--max-upload-mb", "512.0"),
                          ("--upload-grace-s", "10.0"), ("--max-fps", "8.0")):
        described = flat.split(f" {flag} {flag.lstrip('-').replace('-', '_').upper()} ")[1]
        text, _, value = described.partition("(default: ")
        assert " --" not in text and value.startswith(f"{default})"), flag


def test_pinned_host_memory_is_registered_unless_the_user_said_how(monkeypatch):
    """The command sets the CUDA allocator to pin host memory by cudaHostRegister (the video
    cache's spills, 3x faster measured) before anything touches CUDA; a user's own setting of
    it, or a PYTORCH_ALLOC_CONF of their own, is kept."""
    from mminfer.cli import PINNED_HOST, allocator_env
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert main([]) == 2                       # help: nothing else runs
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == PINNED_HOST
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    allocator_env(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == f"expandable_segments:True,{PINNED_HOST}"
    for mine in ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"},
                 {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}):
        env = dict(mine)
        allocator_env(env)
        assert env == mine


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_pinned_host_setting_is_one_this_torch_takes():
    """PyTorch accepts the setting and pins under it (an unknown key fails its parser)."""
    from mminfer.cli import PINNED_HOST
    code = ("import torch; t = torch.empty(1 << 20, pin_memory=True); "
            "t.copy_(torch.ones(1 << 20, device='cuda')); assert t.is_pinned(); print('ok')")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": PINNED_HOST})
    assert got.returncode == 0 and "ok" in got.stdout, got.stderr
