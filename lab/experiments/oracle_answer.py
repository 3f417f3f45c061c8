"""How far is the estimator from the best block-sparse prefill? On the same videos: the dense
answer, a head-pattern config as served (estimated online), and an **oracle** that sees the
exact attention and keeps, per block of query rows and per head, the key tiles holding the
most mass (a fixed share ``--rho`` of the causal tiles, or the fewest tiles reaching a mass
``--gamma``), plus the diagonal tile; the question's (text) rows stay dense as in the shipped
configs. The oracle is not a method (it costs a dense pass to know what to skip); it is the
floor of what any estimator of this tile shape can do. If the oracle at the config's density
keeps the answers and the config does not, estimation is what to improve; if the oracle
moves them too, the model's attention is not sparse enough at that density.

    python3 lab/experiments/oracle_answer.py --model mminfer/models/mminfer-embedded \
        --videos eval:count:2048:500017 eval:count:2048:500106 --rho 0.1 0.2 --gamma 0.9 \
        --out /tmp/oracle.json

Videos are ``RENDERER:TASK:FRAMES:SEED[:DEPTH]`` (renderer ``eval``: lab.toy.render_eval, or
``synth``); the config is the model folder's own ``mminfer_patterns.json`` unless
``--config`` names another. CPU, fp32, the reference engine: slow (tens of seconds a video at
12K tokens) and exact.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch


class _Density:
    def __init__(self, kept: float, causal: float):
        self.kept, self.causal = kept, causal

    def density(self):
        return {"logical": self.kept / max(self.causal, 1.0)}


def text_rows(index, n: int) -> torch.Tensor:
    rows = torch.ones(n, dtype=torch.bool)
    for s in index.visual_spans():
        rows[s.start:s.end] = False
    return rows


def oracle_head(q, k, v, scale, *, rho=None, gamma=None, rb=128, kb=64, dense_rows=None,
                chunk=1024, select="exact", sink=0):
    """One head's oracle attention. q/k/v ``[N, D]`` (fp32). Returns ``(out [N, D], kept
    pairs, causal pairs)``. Per block of ``rb`` rows: the top tiles of ``kb`` keys by the
    block's summed attention probability (``rho``: that share of its causal tiles, at least
    one; ``gamma``: the fewest tiles reaching that share of its mass), plus the tiles on its
    diagonal; rows in ``dense_rows`` see every key. ``select`` says what ranks the tiles:
    "exact" (the block's attention), "pooled" (the attention of the block's mean query
    against every key: a cheap proxy, one row per block), "sampledK" (K evenly spaced rows
    of the block, exact). ``sink``: the first tiles every row block keeps besides (the
    attention sink and the first frames)."""
    N, D = q.shape
    chunk = max(rb, chunk // rb * rb)
    nt = -(-N // kb)
    out = torch.empty_like(q)
    kept = causal = 0.0
    keys = torch.arange(N)
    for r0 in range(0, N, chunk):
        r1 = min(N, r0 + chunk)
        rows = torch.arange(r0, r1)
        s = (q[r0:r1] @ k[:r1].T) * scale
        cm = keys[None, :r1] > rows[:, None]
        s = s.masked_fill(cm, float("-inf"))
        p = torch.softmax(s, -1)
        pp = torch.nn.functional.pad(p, (0, nt * kb - r1, 0, (-(r1 - r0)) % rb))
        nb = pp.shape[0] // rb
        if select == "exact":
            mass = pp.view(nb, rb, nt, kb).sum((1, 3))          # [nb, nt]
        else:
            mass = _proxy_mass(q, k, scale, r0, r1, rb, kb, nt, select)
        keep = torch.zeros(nb, nt, dtype=torch.bool)
        for b in range(nb):
            b0 = r0 + b * rb
            b1 = min(r1, b0 + rb)
            last = (b1 - 1) // kb                                # tiles 0..last are causal
            first_diag = b0 // kb
            m = mass[b, :last + 1]
            order = torch.argsort(m, descending=True)
            if rho is not None:
                n_keep = max(1, math.ceil(rho * (last + 1)))
            else:
                c = torch.cumsum(m[order], 0) / m.sum().clamp(min=1e-30)
                n_keep = int((c < gamma).sum()) + 1
            keep[b, order[:n_keep]] = True
            keep[b, first_diag:last + 1] = True
            keep[b, :min(sink, last + 1)] = True
        km = keep.repeat_interleave(rb, 0)[: r1 - r0].repeat_interleave(kb, 1)[:, :r1]
        if dense_rows is not None:
            km = km | dense_rows[r0:r1, None]
        km = km & ~cm
        p2 = torch.softmax(s.masked_fill(~km, float("-inf")), -1)
        out[r0:r1] = p2 @ v[:r1]
        kept += float(km.sum())
        causal += float((~cm).sum())
    return out, kept, causal


def _proxy_mass(q, k, scale, r0, r1, rb, kb, nt, select):
    """Per row block of rows [r0, r1): a proxy of its attention mass per key tile."""
    if select.startswith("antidiag"):
        return _antidiag_mass(q, k, scale, r0, r1, rb, kb, nt, int(select.removeprefix("antidiag")))
    out = []
    for b0 in range(r0, r1, rb):
        b1 = min(r1, b0 + rb)
        if select == "pooled":
            qs, last = q[b0:b1].mean(0, keepdim=True), torch.tensor([b1 - 1])
        else:
            n = int(select.removeprefix("sampled"))
            idx = torch.linspace(b0, b1 - 1, min(n, b1 - b0)).round().long()
            qs, last = q[idx], idx
        s = (qs @ k[:b1].T) * scale
        s = s.masked_fill(torch.arange(b1)[None, :] > last[:, None], float("-inf"))
        p = torch.nn.functional.pad(torch.softmax(s, -1).sum(0), (0, nt * kb - b1))
        out.append(p.view(nt, kb).sum(-1))
    return torch.stack(out)


def _antidiag_mass(q, k, scale, r0, r1, rb, kb, nt, S):
    """The served antidiagonal proxy (``estimate._antidiag_logmass``, block heads with a
    ``stride``) for the row blocks of rows [r0, r1)."""
    from mminfer.sparse.estimate import _antidiag_logmass
    N, D = k.shape
    G = -(-N // S)
    kr = torch.nn.functional.pad(k, (0, 0, 0, G * S - N)).reshape(1, 1, G, S * D)
    rows = torch.tensor([(b0, min(r1, b0 + rb), 0) for b0 in range(r0, r1, rb)])
    lm = _antidiag_logmass(q[None, None], torch.tensor([0]), kr, rows, S, rb, kb, nt, scale,
                           torch.ones(nt, dtype=torch.bool))
    return lm.exp()[0, 0]


def oracle_layer_attention(settings, only=None, real=None, n_layers=None):
    """A stand-in for ``mminfer.sparse.attention.layer_attention`` that runs the oracle; with
    ``only`` (a set of (layer, head)), the oracle on those heads and ``real`` (the served
    estimator + kernels) on the others: which heads' estimates cost the answer."""
    calls = [0]

    def layer_attention(q, k, v, index, heads, *, return_plan=False, scale=None, out=None,
                        **kw):
        B, H, N, D = q.shape
        g = H // k.shape[1]
        layer = calls[0] % n_layers if n_layers else None
        calls[0] += 1
        scale = D ** -0.5 if scale is None else scale
        dense_rows = text_rows(index, N)
        kept = causal = 0.0
        res = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device) if out is None else out
        mine = range(H) if only is None else [h for h in range(H) if (layer, h) in only]
        if only is not None:
            res, plan = real(q, k, v, index, heads, return_plan=True, scale=scale, out=res, **kw)
            d = plan.density()
            d = float(d.get("physical", d["logical"])) if isinstance(d, dict) else float(d)
            causal = N * (N + 1) / 2 * B * H
            kept = d * causal
        for b in range(B):
            for h in mine:
                o, kk, cc = oracle_head(q[b, h].float(), k[b, h // g].float(),
                                        v[b, h // g].float(), scale, dense_rows=dense_rows,
                                        **settings)
                res[b, h] = o.to(res.dtype)
                if only is None:
                    kept += kk
                    causal += cc
        plan = _Density(kept, causal)
        return (res, plan) if return_plan else res
    return layer_attention


def load_video(spec: str):
    """``eval:TASK:FRAMES:SEED[:DEPTH]`` (the held-out renderer; a needle at DEPTH, as
    quality.py draws it) or ``synth:TASK:FRAMES:SEED[:DEPTH]`` (calibration's renderer, at
    its 224 x 224) -> (DecodedVideo at 2 fps, question, answer)."""
    from mminfer.video import DecodedVideo
    renderer, task, frames, seed, *depth = spec.split(":")
    kw = {"depth": float(depth[0])} if depth else {}
    if renderer == "eval":
        from lab.toy import render_eval
        ex = render_eval.make_example(task, int(seed), n_frames=int(frames), **kw)
    elif renderer == "synth":
        from mminfer.offline import synthetic as synth
        ex = synth.make_example(task, int(seed), n_frames=int(frames), height=224, width=224,
                                **kw)
    else:
        raise SystemExit(f"bad video {spec!r}: RENDERER:TASK:FRAMES:SEED[:DEPTH], RENDERER "
                         f"eval or synth")
    return DecodedVideo.from_frames(ex.frames, backend=renderer), ex.question, ex.answer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", help="head-pattern config (default: the model's own)")
    p.add_argument("--videos", nargs="+", required=True, help="RENDERER:TASK:FRAMES:SEED[:DEPTH]")
    p.add_argument("--rho", type=float, nargs="*", default=[0.1, 0.2])
    p.add_argument("--gamma", type=float, nargs="*", default=[])
    p.add_argument("--select", nargs="*", default=["exact"],
                   help="what ranks the tiles: exact, pooled, sampledK (see oracle_head)")
    p.add_argument("--no-config", action="store_true", help="skip the config's run")
    p.add_argument("--only", nargs="*", default=[],
                   help="runs with the oracle on these heads only (LAYER or LAYER.HEAD), the "
                        "config's estimate elsewhere; at the first --rho/--gamma and --select")
    p.add_argument("--sink", type=int, default=0,
                   help="the first key tiles every row block of the oracle keeps besides")
    p.add_argument("--row-block", type=int, default=128)
    p.add_argument("--key-block", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args(argv)

    import mminfer.sparse.attention as attn
    from mminfer.engine.pipeline import Pipeline
    from mminfer.offline.answer_kl import AnswerProbe, kl_divergence
    from mminfer.sparse.patterns import HeadPatternConfig

    torch.set_grad_enabled(False)
    pipe = Pipeline(a.model, attention="dense", device="cpu", dtype="float32")
    ad = pipe.adapter
    cfg_path = a.config or str(Path(a.model) / "mminfer_patterns.json")
    cfg = HeadPatternConfig.load(cfg_path)
    probe = AnswerProbe(ad, engine="reference", block=(a.row_block, a.key_block))
    real = attn.layer_attention
    tok = ad.tokenizer
    rows = []
    for spec in a.videos:
        t0 = time.time()
        vid, question, answer = load_video(spec)
        inp = probe.prepare(spec, vid, question)
        row = {"video": spec, "answer": answer, "tokens": int(inp.embeds.shape[1]),
               "dense": tok.decode([int(inp.dense_logp.argmax())]).strip()}
        if not a.no_config:
            logp, dens = probe.logprobs(inp.prep, inp.embeds, cfg)
            row["config"] = {"answer": tok.decode([int(logp.argmax())]).strip(),
                             "kl": kl_divergence(inp.dense_logp, logp), "density": dens}
        settings = [(sel, "rho", r) for sel in a.select for r in a.rho] + \
                   [(sel, "gamma", g) for sel in a.select for g in a.gamma]
        for sel, kind, val in settings:
            attn.layer_attention = oracle_layer_attention(
                {kind: val, "rb": a.row_block, "kb": a.key_block, "select": sel,
                 "sink": a.sink})
            try:
                logp, dens = probe.logprobs(inp.prep, inp.embeds, cfg)
            finally:
                attn.layer_attention = real
            name = f"{sel}_{kind}{val}" + (f"_sink{a.sink}" if a.sink else "")
            row[name] = {"answer": tok.decode([int(logp.argmax())]).strip(),
                         "kl": kl_divergence(inp.dense_logp, logp), "density": dens}
        if a.only and not settings:
            raise SystemExit("--only needs an oracle setting (--rho or --gamma)")
        n_layers = len(cfg.layers)
        for spec_only in a.only:
            sel, kind, val = settings[0]
            lay, _, hd = spec_only.partition(".")
            heads = [int(hd)] if hd else range(len(cfg.layers[int(lay)]))
            only = {(int(lay), h) for h in heads}
            attn.layer_attention = oracle_layer_attention(
                {kind: val, "rb": a.row_block, "kb": a.key_block, "select": sel}, only=only,
                real=real, n_layers=n_layers)
            try:
                logp, dens = probe.logprobs(inp.prep, inp.embeds, cfg)
            finally:
                attn.layer_attention = real
            row[f"only{spec_only}_{sel}_{kind}{val}"] = {
                "answer": tok.decode([int(logp.argmax())]).strip(),
                "kl": kl_divergence(inp.dense_logp, logp), "density": dens}
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({"model": a.model, "config": cfg_path,
                                               "row_block": a.row_block,
                                               "key_block": a.key_block, "rows": rows},
                                              indent=1))
    keys = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print("\n| method | mean KL | agree | mean density |\n|---|---:|---:|---:|")
    for k in keys:
        kl = sum(r[k]["kl"] for r in rows) / len(rows)
        ag = sum(r[k]["answer"] == r["dense"] for r in rows)
        dn = sum((r[k]["density"] or 0) for r in rows) / len(rows)
        print(f"| {k} | {kl:.4f} | {ag} / {len(rows)} | {dn:.3f} |")
    return rows


if __name__ == "__main__":
    main()
