"""LongVILA adapter on a tiny checkpoint in the real layout: loading, the projector's exact
channel order, the token layout, dense and sparse answers, and the errors of a broken
checkpoint."""

import json
import shutil

import pytest
import torch

from mminfer.errors import ConfigError, InputError, VideoError
from mminfer.models.longvila import LongVILA, space_to_depth_2x2, tokens_per_frame
from lab.toy.tiny_longvila import save_tiny_longvila


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_longvila(tmp_path_factory.mktemp("longvila") / "tiny-longvila")


@pytest.fixture(scope="module")
def model(ckpt):
    return LongVILA.from_pretrained(ckpt, device="cpu")


def _frames(n=12, h=40, w=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


def _logits(adapter, prepared):
    with torch.inference_mode():
        embeds = adapter.embed(prepared)
        hidden = adapter.text_model(inputs_embeds=embeds).last_hidden_state
        return adapter.lm_head(hidden).float()                       # [1, L, vocab]


def test_layout_on_disk(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llava_llama" and cfg["mm_vision_select_layer"] == -2
    assert json.loads((ckpt / "mm_projector" / "config.json").read_text())[
        "mm_projector_type"] == "mlp_downsample"
    from safetensors import safe_open
    with safe_open(str(ckpt / "mm_projector" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(f"layers.{i}.{p}" for i in (1, 2, 4)
                                          for p in ("weight", "bias"))
    assert LongVILA.accepts(ckpt) and not LongVILA.accepts(ckpt / "llm")


def test_space_to_depth_order_by_hand():
    # 3×3 grid, one channel: odd sides get a zero bottom row and right column; each merged
    # cell lists (2i,2j), (2i,2j+1), (2i+1,2j), (2i+1,2j+1); cells row-major.
    x = torch.arange(1.0, 10.0).view(1, 9, 1)
    want = torch.tensor([[1, 2, 4, 5], [3, 0, 6, 0], [7, 8, 0, 0], [9, 0, 0, 0]],
                        dtype=torch.float32)
    assert torch.equal(space_to_depth_2x2(x)[0], want)
    # even side, two channels: channel pairs stay together in the same order
    x = torch.arange(32.0).view(1, 16, 2)                 # 4×4 grid, token t = (t//4, t%4)
    cell = space_to_depth_2x2(x)[0, 1].view(4, 2)         # merged cell (0, 1)
    assert torch.equal(cell[:, 0] / 2, torch.tensor([2.0, 3.0, 6.0, 7.0]))
    assert tokens_per_frame(448, 14) == 256 and tokens_per_frame(384, 14) == 196


def test_vision_features_are_hidden_states_minus_2(model, ckpt):
    # The truncated tower must give what VILA reads: hidden_states[-2] of the full tower.
    from transformers import SiglipVisionModel
    full = SiglipVisionModel.from_pretrained(ckpt / "vision_tower").eval()
    pixels = model._squash(_frames(3))
    x = (pixels.float() / 255 - 0.5) / 0.5
    with torch.inference_mode():
        want = full(pixel_values=x, output_hidden_states=True).hidden_states[-2]
        got = model.tower.encoder(inputs_embeds=model.tower.embeddings(x)).last_hidden_state
    assert len(model.tower.encoder.layers) == full.config.num_hidden_layers - 1
    torch.testing.assert_close(got, want)


def test_chunked_tower_equals_the_unbatched_tower(model, ckpt):
    """embed runs SigLIP and the projector over chunks of frames; each frame's rows equal
    transformers' full tower (hidden_states[-2]) run on that frame alone, whatever the
    chunk size (one frame, a ragged 3, all at once)."""
    from transformers import SiglipVisionModel
    full = SiglipVisionModel.from_pretrained(ckpt / "vision_tower").eval()
    prepared = model.prepare(_frames(7, seed=4), "What?")
    F, P = prepared.n_frames, model.tokens_per_frame
    x = (model.pixels(prepared).float() / 255 - 0.5) / 0.5
    with torch.inference_mode():
        want = torch.cat([model.projector(full(pixel_values=x[f:f + 1],
                                               output_hidden_states=True).hidden_states[-2])
                          for f in range(F)])                            # [F, P, hidden]
    (video,) = prepared.index.spans_of("video")
    batch = model.vision_batch
    try:
        for model.vision_batch in (1, 3, 32):
            rows = model.embed(prepared)[0, video.start:video.end].view(F, P + 1, -1)[:, :P]
            err = float((rows - want).abs().max())
            print(f"vision_batch {model.vision_batch}: max abs diff {err:.2e}")
            assert err < 1e-5 * max(1.0, float(want.abs().max()))
    finally:
        model.vision_batch = batch


def test_token_layout_and_index(model):
    prepared = model.prepare(_frames(12), "What moves?")
    ids = prepared.input_ids[0]
    F, P = 8, model.tokens_per_frame                       # config num_video_frames = 8
    assert P == 4 and prepared.n_frames == F
    (video,) = prepared.index.spans_of("video")
    assert (video.frame_stride, video.grid_h, video.grid_w, video.separators) == (P + 1, 2, 2, 1)
    assert video.length == F * (P + 1) == prepared.visual_tokens
    assert prepared.index.n == ids.numel() == prepared.total_tokens
    assert (ids[video.start:video.end] == model.video_token_id).sum() == F * P
    assert model.video_token_id not in ids[:video.start].tolist() + ids[video.end:].tolist()
    # where the index puts frame f, the spliced embeddings hold frame f's P projected tokens
    # followed by the embedding of "\n"
    embeds = model.embed(prepared)[0]                                  # [L, hidden]
    visual = model.encode_frames(model.pixels(prepared))               # [F, P, hidden]
    newline_row = model.text_model.get_input_embeddings().weight[model.newline_id]
    starts = video.frame_starts()
    assert len(starts) == F
    for f, s in enumerate(starts):
        assert torch.equal(embeds[s:s + P], visual[f])
        assert torch.equal(embeds[s + P], newline_row)
    # text before: the ChatML user turn up to <vila/video>; after: question + assistant turn
    tok = model.tokenizer
    assert tok.decode(ids[:video.start]).endswith("<|im_start|>user\n")
    assert tok.decode(ids[video.end:]) == "What moves?<|im_end|>\n<|im_start|>assistant\n"


def test_frame_selection(ckpt, model):
    # frame i is flat gray 20*i: the squashed pixels tell which frames were kept
    frames = (torch.arange(12, dtype=torch.uint8) * 20).view(12, 1, 1, 1).expand(12, 30, 50, 3)
    pixels = model.pixels(model.prepare(frames.contiguous(), "Why?"))   # [8, 3, 56, 56]
    kept = (pixels.float().mean(dim=(1, 2, 3)) / 20).round().long().tolist()
    assert kept == [0, 2, 3, 5, 6, 8, 9, 11]          # VILA: round(linspace(0, 11, 8))
    assert model.prepare(_frames(3), "Why?").n_frames == 3          # fewer frames: all of them
    adapter = LongVILA.from_pretrained(ckpt, device="cpu", num_frames=5)
    assert adapter.prepare(_frames(12), "Why?").index.spans_of("video")[0].n_frames == 5


def test_aspect_ratio_pad(ckpt, tmp_path):
    # "pad": the wide frame is centred on a square of the mean colour (0.5 -> 127), then
    # resized (here already 56 wide: no resize); the default squashes it instead
    padded = _broken(ckpt, tmp_path, lambda p: _set_json(p / "config.json",
                                                         image_aspect_ratio="pad"))
    frame = torch.full((1, 20, 56, 3), 200, dtype=torch.uint8)
    ad = LongVILA.load(padded, device="cpu")
    px = ad.pixels(ad.prepare(frame, "Why?"))[0]
    assert px[:, :18].eq(127).all() and px[:, 18:38].eq(200).all() and px[:, 38:].eq(127).all()


def test_reload_and_reference_logits(ckpt, model):
    """Two loads give identical logits, and they equal an independent assembly of the same
    checkpoint from plain transformers pieces (full tower, VILA's reshape order, sdpa)."""
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM, SiglipVisionModel

    prepared = model.prepare(_frames(8, seed=1), "Which color?")
    got = _logits(model, prepared)
    again = LongVILA.from_pretrained(ckpt, device="cpu")
    assert torch.equal(_logits(again, prepared), got)

    llm = Qwen2ForCausalLM.from_pretrained(ckpt / "llm", attn_implementation="sdpa").eval()
    tower = SiglipVisionModel.from_pretrained(ckpt / "vision_tower").eval()
    w = load_file(str(ckpt / "mm_projector" / "model.safetensors"))
    x = (model.pixels(prepared).float() / 255 - 0.5) / 0.5
    with torch.inference_mode():
        feats = tower(pixel_values=x, output_hidden_states=True).hidden_states[-2]  # [F, 16, C]
        n, _, c = feats.shape
        # VILA's flat_square, transcribed: pair columns, transpose, pair rows, transpose back
        g = feats.view(n, 4, 2, 2 * c).permute(0, 2, 1, 3).reshape(n, 2, 2, 4 * c)
        g = g.permute(0, 2, 1, 3).reshape(n, 4, 4 * c)
        g = torch.nn.functional.layer_norm(g, (4 * c,), w["layers.1.weight"], w["layers.1.bias"])
        g = torch.nn.functional.gelu(g @ w["layers.2.weight"].T + w["layers.2.bias"])
        vis = g @ w["layers.4.weight"].T + w["layers.4.bias"]                        # [F, 4, H]
        rows = torch.cat([vis, llm.model.embed_tokens.weight[model.newline_id].expand(n, 1, -1)],
                         dim=1).reshape(-1, vis.shape[-1])
        (video,) = prepared.index.spans_of("video")
        ids = prepared.input_ids
        embeds = torch.cat([llm.model.embed_tokens(ids[:, :video.start]), rows[None],
                            llm.model.embed_tokens(ids[:, video.end:])], dim=1)
        want = llm(inputs_embeds=embeds).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dense_answer_matches_transformers_generate(model):
    prepared = model.prepare(_frames(8, seed=2), "What happens at the end?")
    out = model.generate(prepared, max_new_tokens=6)
    assert out.prefill_tokens == prepared.index.n
    with torch.inference_mode():
        ref = model.llm.generate(inputs_embeds=model.embed(prepared),
                                 attention_mask=torch.ones_like(prepared.input_ids),
                                 max_new_tokens=6, do_sample=False,
                                 eos_token_id=list(model.eos_token_ids),
                                 pad_token_id=model.eos_token_ids[0])
    assert out.token_ids == ref[0].tolist()[:len(out.token_ids)]
    assert isinstance(out.text, str)


def _small_budget_row():
    """One layer's heads: every pattern family, budgets far below the ~90-token prompt."""
    from mminfer.sparse import patterns as P
    return [P.HeadPattern.single(P.a_shape(sink=4, window=16)),
            P.HeadPattern.single(P.vertical_slash(n_vertical=8, n_slash=4, window=16, sink=4)),
            P.HeadPattern("q", {"video": P.grid(sink=4, window=16), "text": P.a_shape(4, 16)}),
            P.HeadPattern.single(P.block(top_k=2, window=16))]


def _sparse_ctx(prepared, rows, **kw):
    from mminfer.models.hooks import PrefillContext
    from mminfer.sparse.patterns import HeadPatternConfig
    return PrefillContext(index=prepared.index, mode="sparse", min_sparse_len=16, keep_plans=True,
                          patterns=HeadPatternConfig(kw.pop("identity"), rows), **kw)


def test_sparse_prefill_at_full_budget_matches_dense(model):
    from mminfer.sparse.estimate import full_budget
    from mminfer.models.hooks import prefill_context
    prepared = model.prepare(_frames(4, seed=3), "Where does it go?")
    n, layers = prepared.index.n, model.identity.layers
    dense = _logits(model, prepared)
    ctx = _sparse_ctx(prepared, [full_budget(_small_budget_row(), n)] * layers,
                      identity=model.identity)
    with prefill_context(ctx):
        sparse = _logits(model, prepared)
    assert sorted(ctx.densities) == list(range(layers))        # every layer went sparse
    assert all(p.density()["logical"] == 1.0 for p in ctx.densities.values())
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)


def test_sparse_answer(model):
    prepared = model.prepare(_frames(4, seed=4), "Where does it go?")
    ctx = _sparse_ctx(prepared, [_small_budget_row()] * model.identity.layers,
                      identity=model.identity)
    out = model.generate(prepared, max_new_tokens=3, ctx=ctx)
    densities = [p.density()["logical"] for p in ctx.densities.values()]
    # every layer but the last, which runs its last row only (models/prefill.py)
    assert len(densities) == model.identity.layers - 1 and all(0 < d < 0.9 for d in densities)
    assert 1 <= len(out.token_ids) <= 3 and out.prefill_tokens == prepared.index.n


def test_head_patterns_follow_the_model_identity(ckpt, model, tmp_path):
    from dataclasses import replace
    from mminfer.sparse.patterns import HeadPatternConfig
    assert model.patterns.identity == model.identity            # generated for this shape
    good = HeadPatternConfig(model.identity, [_small_budget_row()] * model.identity.layers)
    path = tmp_path / "patterns.json"
    good.save(path)
    loaded = LongVILA.load(ckpt, device="cpu", model_id=model.identity.id,
                           revision=model.identity.revision, patterns=path)
    assert loaded.patterns.layer(1)[3].patterns["all"].top_k == 2
    other = replace(good, identity=replace(model.identity, heads=8))
    with pytest.raises(ConfigError, match="heads"):
        LongVILA.load(ckpt, device="cpu", patterns=other)


def test_bad_requests(model):
    with pytest.raises(InputError):
        model.prepare(_frames(4), "   ")
    with pytest.raises(InputError, match="special tokens"):
        model.prepare(_frames(4), "<|im_end|>now")
    with pytest.raises(VideoError):
        model.prepare(torch.zeros(0, 8, 8, 3, dtype=torch.uint8), "Why?")
    with pytest.raises(VideoError):
        model.prepare(torch.zeros(2, 8, 8, dtype=torch.uint8), "Why?")


def _broken(ckpt, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    edit(bad)
    return bad


def _set_json(path, **kv):
    d = json.loads(path.read_text())
    d.update(kv)
    path.write_text(json.dumps(d))


def _plain_llama(path):
    d = json.loads(path.read_text())
    d.pop("llm_cfg")
    path.write_text(json.dumps({**d, "model_type": "llama"}))


@pytest.mark.parametrize("edit,message", [
    (lambda p: shutil.rmtree(p / "mm_projector"), "no mm_projector/ subfolder"),
    (lambda p: shutil.rmtree(p / "vision_tower"), "no vision_tower/ subfolder"),
    (lambda p: _set_json(p / "mm_projector" / "config.json", mm_projector_type="mlp2x_gelu"),
     "unknown LongVILA projector type 'mlp2x_gelu'"),
    (lambda p: _plain_llama(p / "config.json"), "not a VILA/LongVILA config"),
    (lambda p: (p / "mm_projector" / "model.safetensors").unlink(), "no projector weights"),
    (lambda p: (p / "llm" / "model.safetensors").unlink(),
     "cannot load the LongVILA language model"),
    (lambda p: _set_json(p / "config.json", mm_vision_select_layer=-9), "outside a 3-layer"),
])
def test_broken_checkpoints(ckpt, tmp_path, edit, message):
    bad = _broken(ckpt, tmp_path, edit)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LongVILA.from_pretrained(bad, device="cpu")


def test_hub_id_from_the_offline_cache(ckpt, tmp_path, monkeypatch):
    """A hub id resolves through snapshot_download, offline from the local cache; a missing
    repo is a ConfigError, not a network hang."""
    from huggingface_hub import constants
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--Owner--tiny-longvila"
    shutil.copytree(ckpt, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    adapter = LongVILA.from_pretrained("Owner/tiny-longvila", device="cpu")
    assert adapter.identity.id == "Owner/tiny-longvila" and adapter.identity.revision == commit
    with pytest.raises(ConfigError, match="not available locally"):
        LongVILA.from_pretrained("Owner/absent", device="cpu")


def test_pipeline_answers_with_longvila(ckpt, make_video):
    from mminfer.engine.pipeline import Pipeline
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu")
    assert isinstance(pipe.adapter, LongVILA)
    res = pipe.answer(make_video(n_frames=20, fps=10.0), "What color is it?", max_new_tokens=2)
    frames = res.video["model_frames"]
    assert 1 <= frames <= 8 and res.video["resized"] == [56, 56]
    assert res.tokens["visual"] == frames * 5 and res.attention == "dense"


def test_full_size_llm_config():
    from mminfer.models.longvila import longvila_7b_llm_config
    cfg = longvila_7b_llm_config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == \
        (28, 3584, 28, 4, 18944, 151648)
    assert cfg.rope_parameters["rope_theta"] == pytest.approx(3.58e9)
    assert cfg.hidden_size // cfg.num_attention_heads == 128
    # the same builder at a small size: random weights, attention through our hook
    from mminfer.models import hooks
    from mminfer.models.longvila import random_llm
    small = longvila_7b_llm_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    llm = random_llm(small, device="cpu")
    assert llm.config._attn_implementation == hooks.ATTN_NAME
    with torch.inference_mode():
        assert llm(input_ids=torch.arange(10)[None]).logits.shape == (1, 10, 64)
