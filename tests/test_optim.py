"""Tests for optim.py: parameter groups, AdamW and cautious AdamW, 8-bit AdamW, resume, the recipe options' checks.
Muon's own tests are in test_muon.py, on the stand-in model defined here."""

import dataclasses
import io
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import config
import optim
import train as train_py
from cli import UsageError
from config import Config
from conftest import TINY_FLAGS
from model import ModelConfig
from optim import OptimConfig, build_optimizer, describe_param_groups, optimizer_state_bytes
from sizing import SizeConfig

# ----------------------------------------------------------------------------- a stand-in model
# Same parameter names and shapes as model.py's contract, with a cheap mixing rule in place of
# attention, so these tests (and test_muon.py's) depend on optim.py and muon.py alone.


class Params(nn.Module):
    def __init__(self, **params):
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name, p)


def matrix(rows, cols):
    return nn.Parameter(torch.randn(rows, cols) / math.sqrt(cols))


def ones(n):
    return nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n))


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class ToyBlock(nn.Module):
    def __init__(self, d, h, k, hd, f):
        super().__init__()
        self.h, self.k, self.hd = h, k, hd
        self.attn = Params()
        self.attn.qkv = Params(weight=matrix((h + 2 * k) * hd, d), layer_norm_weight=ones(d))
        self.attn.q_norm = Params(weight=ones(hd))
        self.attn.k_norm = Params(weight=ones(hd))
        self.attn.proj = Params(weight=matrix(d, h * hd))
        self.mlp = Params(layer_norm_weight=ones(d), fc1_weight=matrix(2 * f, d), fc2_weight=matrix(d, f))

    def forward(self, x):
        a = self.attn
        qkv = rms_norm(x, a.qkv.layer_norm_weight) @ a.qkv.weight.T
        q, k, v = qkv.split([self.h * self.hd, self.k * self.hd, self.k * self.hd], dim=-1)
        q = rms_norm(q.unflatten(-1, (self.h, self.hd)), a.q_norm.weight)
        k = rms_norm(k.unflatten(-1, (self.k, self.hd)), a.k_norm.weight).repeat_interleave(self.h // self.k, -2)
        v = v.unflatten(-1, (self.k, self.hd)).repeat_interleave(self.h // self.k, -2)
        x = x + (torch.tanh(q * k) * v).flatten(-2).cumsum(1) / 4 @ a.proj.weight.T
        gate, up = (rms_norm(x, self.mlp.layer_norm_weight) @ self.mlp.fc1_weight.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.mlp.fc2_weight.T


class ToyGPT(nn.Module):
    def __init__(self, vocab=11, d=8, h=2, k=1, hd=4, f=6, n_layer=2, tied=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.shape = dict(h=h, k=k, hd=hd, f=f)
        self.embed = Params(weight=matrix(vocab, d))
        self.blocks = nn.ModuleList(ToyBlock(d, h, k, hd, f) for _ in range(n_layer))
        self.norm = Params(weight=ones(d))
        self.lm_head = Params(weight=self.embed.weight if tied else matrix(vocab, d))

    def forward(self, idx, targets):
        x = F.embedding(idx, self.embed.weight)
        for block in self.blocks:
            x = block(x)
        logits = rms_norm(x, self.norm.weight) @ self.lm_head.weight.T
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def row_blocks(self):
        s = self.shape
        return {name: blocks for i in range(len(self.blocks)) for name, blocks in [
            (f"blocks.{i}.attn.qkv.weight", [s["h"] * s["hd"], s["k"] * s["hd"], s["k"] * s["hd"]]),
            (f"blocks.{i}.mlp.fc1_weight", [s["f"], s["f"]])]}


def batches(n, vocab=11, batch=6, seq=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g))
            for _ in range(n)]


def train(model, optimizer, data):
    for x, y in data:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def names_by_group(optimizer):
    return [(g["kind"], g["weight_decay"], g["names"]) for g in optimizer.param_groups]


MATRICES = ["attn.qkv.weight", "attn.proj.weight", "mlp.fc1_weight", "mlp.fc2_weight"]
NORMS = ["attn.qkv.layer_norm_weight", "attn.q_norm.weight", "attn.k_norm.weight", "mlp.layer_norm_weight"]


def test_muon_stackss_hidden_matrices_and_decays_only_matrices():
    model = ToyGPT(n_layer=2, tied=False)
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.02, adam_lr=0.003, weight_decay=0.1),
                          model.row_blocks(), "cpu")
    per_block = lambda suffixes: [f"blocks.{i}.{s}" for i in range(2) for s in suffixes]  # noqa: E731
    assert sorted(names_by_group(opt)) == sorted([
        ("muon", 0.1, per_block(MATRICES)),
        ("adamw", 0.1, ["embed.weight", "lm_head.weight"]),
        ("adamw", 0.0, per_block(NORMS) + ["norm.weight"]),
    ])
    assert {g["kind"]: g["base_lr"] for g in opt.param_groups} == {"muon": 0.02, "adamw": 0.003}
    assert all(g["lr"] == g["base_lr"] for g in opt.param_groups)
    muon = next(g for g in opt.param_groups if g["kind"] == "muon")
    assert muon["row_blocks"][:4] == [[8, 4, 4], [8], [6, 6], [8]]


def test_adamw_groups_tied_weight_once():
    model = ToyGPT(n_layer=1, tied=True)
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3, weight_decay=0.05), model.row_blocks(), "cpu")
    assert names_by_group(opt) == [
        ("adamw", 0.05, ["embed.weight"] + [f"blocks.0.{s}" for s in MATRICES]),
        ("adamw", 0.0, [f"blocks.0.{s}" for s in NORMS] + ["norm.weight"]),
    ]
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert opt.defaults["fused"] == optim.fused_adamw_available("cpu")
    assert describe_param_groups(opt).startswith("AdamW (fused)" if opt.defaults["fused"] else "AdamW (foreach)")


def test_adamw_falls_back_to_foreach_without_fused_kernel(monkeypatch):
    monkeypatch.setattr(optim, "fused_adamw_available", lambda device_type: False)
    opt = build_optimizer(ToyGPT(n_layer=1), OptimConfig(name="adamw"), {}, "cpu")
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
    assert describe_param_groups(opt).startswith("AdamW (foreach)")


def test_wrapped_names_are_canonical():
    assert optim.canonical_name("_orig_mod.blocks.3._checkpoint_wrapped_module.attn.qkv.weight") == \
        "blocks.3.attn.qkv.weight"
    assert optim.canonical_name("module.blocks.0.mlp.fc1_weight") == "blocks.0.mlp.fc1_weight"


def test_describe_folds_block_indices():
    model = ToyGPT(n_layer=3)
    text = describe_param_groups(build_optimizer(model, OptimConfig(name="muon"), model.row_blocks(), "cpu"))
    assert text.splitlines()[0].startswith("Muon (NS 5 steps in fp32, scale match_rms_adamw")
    assert "blocks.*.attn.qkv.weight, blocks.*.attn.proj.weight, blocks.*.mlp.fc1_weight" in text
    assert "blocks.0." not in text


def test_adamw8bit_state_is_8bit_except_embeddings_and_under_30_percent():
    bnb = pytest.importorskip("bitsandbytes")
    # 10.4M parameters, most of them in the hidden matrices.
    model = ToyGPT(vocab=256, d=256, h=4, k=2, hd=64, f=768, n_layer=13, tied=False)
    assert sum(p.numel() for p in model.parameters()) > 10_000_000
    sizes = {}
    for name in ("adamw", "adamw8bit"):
        opt = build_optimizer(model, OptimConfig(name=name), model.row_blocks(), "cpu")
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        sizes[name] = optimizer_state_bytes(opt)
    assert isinstance(opt, bnb.optim.AdamW8bit)
    assert sizes["adamw8bit"] <= 0.3 * sizes["adamw"], sizes
    names = {id(p): n for g in opt.param_groups for n, p in zip(g["names"], g["params"])}
    for p, state in opt.state.items():
        name = names[id(p)]
        big_matrix = name.endswith(tuple(MATRICES))
        assert state["state1"].dtype == (torch.uint8 if big_matrix else torch.float32), name
    assert "32-bit state for embed.weight, lm_head.weight" in describe_param_groups(opt)


def test_adamw8bit_loss_tracks_adamw():
    pytest.importorskip("bitsandbytes")
    data = [(x, (3 * x + 1) % 64) for x, _ in batches(30, vocab=64, batch=8, seq=16)]  # a learnable map
    losses = {}
    for name in ("adamw", "adamw8bit"):
        model = ToyGPT(vocab=64, d=64, h=4, k=2, hd=16, f=128, n_layer=2, tied=True)
        opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, weight_decay=0.0), model.row_blocks(), "cpu")
        losses[name] = []
        for x, y in data:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["adamw"][-1] < 0.65 * losses["adamw"][0]
    for a, b in zip(losses["adamw"], losses["adamw8bit"]):
        assert abs(a - b) < 0.01 * a, (losses["adamw"], losses["adamw8bit"])


# ----------------------------------------------------------------------------- checkpoint resume


def scheduled_train(model, opt, data, first_step):
    for step, (x, y) in enumerate(data, start=first_step):
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * (0.5 + 0.1 * step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_resume_is_bit_identical(name):
    if name == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    # d=64 makes the matrices big enough (>= 4096 elements) for 8-bit state.
    make = lambda: ToyGPT(vocab=32, d=64, h=2, k=1, hd=32, f=64, n_layer=1, tied=False)  # noqa: E731
    check_resume_is_bit_identical(make, OptimConfig(name=name, lr=1e-2, adam_lr=1e-3), batches(5, vocab=32))


def check_resume_is_bit_identical(make, cfg: OptimConfig, data) -> dict:
    """Train `make()` on all of data, and another through a save after 3 batches and a restore into a fresh
    model and optimizer; their parameters must be equal bit for bit. -> the saved state, for further checks."""
    straight = make()
    scheduled_train(straight, build_optimizer(straight, cfg, straight.row_blocks(), "cpu"), data, 0)
    first = make()
    opt = build_optimizer(first, cfg, first.row_blocks(), "cpu")
    scheduled_train(first, opt, data[:3], 0)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make()
    resumed.load_state_dict(saved["model"])
    opt = build_optimizer(resumed, cfg, resumed.row_blocks(), "cpu")
    opt.load_state_dict(saved["optimizer"])
    scheduled_train(resumed, opt, data[3:], 3)
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    return saved


# ----------------------------------------------------------------------------- errors and the real model


@pytest.mark.parametrize("bad", [
    dict(name="sgd"), dict(lr=0.0), dict(adam_lr=-1.0), dict(weight_decay=-0.1), dict(beta2=1.0),
    dict(eps=0.0), dict(momentum=1.0), dict(ns_steps=0), dict(ns_steps=2**62), dict(ns_dtype="fp16"),
    dict(muon_scale="moonlight"),
])
def test_bad_config_is_one_line_value_error(bad):
    model = ToyGPT(n_layer=1)
    with pytest.raises(ValueError) as e:
        build_optimizer(model, OptimConfig(**{"name": "muon", **bad}), model.row_blocks(), "cpu")
    assert "\n" not in str(e.value) and str(e.value)


@pytest.mark.parametrize("row_blocks,message", [
    ({"blocks.0.attn.qkv.weight": [8, 4, 5]}, "does not split its 16 rows"),
    ({"blocks.0.attn.q_norm.weight": [4]}, "not a Muon matrix"),
])
def test_bad_row_blocks(row_blocks, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(ToyGPT(n_layer=1), OptimConfig(name="muon"), row_blocks, "cpu")


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ValueError, match="pip install bitsandbytes"):
        build_optimizer(ToyGPT(n_layer=1), OptimConfig(name="adamw8bit"), {}, "cpu")


def test_groups_real_model():
    model_py = pytest.importorskip("model")
    config = model_py.ModelConfig(vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=16,
                                  tie_embeddings=True, zero_init_proj=False)  # every parameter has a gradient at once
    model = model_py.GPT(config)
    opt = build_optimizer(model, OptimConfig(name="muon", lr=0.02), model.row_blocks(), "cpu")
    groups = {(g["kind"], g["weight_decay"]): g for g in opt.param_groups}
    muon = groups["muon", 0.1]
    assert muon["names"] == [f"blocks.{i}.{s}" for i in range(2) for s in MATRICES]
    # Tied: lm_head is the embedding. The attention gates' [n_head, n_embd] matrices, the smear's [1, n_embd] and
    # the bigram table are no Muon matrix.
    assert groups["adamw", 0.1]["names"] == ["smear_weight", "embed.weight", "blocks.0.attn.gate_weight",
                                             "blocks.1.attn.gate_weight", "bigram_embed.weight"]
    assert all(p.ndim == 1 for p in groups["adamw", 0.0]["params"])
    blocks = model.row_blocks()
    for name, p, split in zip(muon["names"], muon["params"], muon["row_blocks"]):
        assert split == blocks.get(name, [p.shape[0]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(100, (2, 8))
    model(idx, idx)[1].backward()
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def reference_cautious_adamw(params, grads, lr, wd, betas, eps):
    """The paper's update written out: x <- x - lr (u + wd 1[u x >= 0] x), u the bias-corrected Adam direction."""
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        for p, g, m_i, v_i in zip(params, step_grads, m, v):
            m_i.lerp_(g, 1 - betas[0])
            v_i.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            u = (m_i / (1 - betas[0] ** t)) / ((v_i / (1 - betas[1] ** t)).sqrt() + eps)
            p.sub_(lr * (u + wd * (u * p >= 0) * p))


@pytest.mark.parametrize("name,fused", [("adamw", True), ("adamw", False), ("muon", False)])
def test_cautious_adamw_matches_the_papers_update(name, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(optim, "fused_adamw_available", lambda device_type: False)
    elif not optim.fused_adamw_available("cpu"):
        pytest.skip("no fused AdamW kernel on this CPU build")
    model = ToyGPT(n_layer=1, tied=False)
    cfg = OptimConfig(name=name, lr=0.05, adam_lr=0.05, weight_decay=0.5, cautious_wd=True, beta1=0.8, beta2=0.9,
                      eps=1e-6)
    opt = build_optimizer(model, cfg, model.row_blocks(), "cpu")
    assert isinstance(opt, optim.CautiousAdamW if name == "adamw" else optim.Muon)
    assert "cautious wd" in describe_param_groups(opt).splitlines()[0]
    group = next(g for g in opt.param_groups if g["kind"] == "adamw" and g["weight_decay"])
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in group["params"]] for _ in range(3)]
    expected = [p.detach().clone() for p in group["params"]]
    reference_cautious_adamw(expected, grads, 0.05, 0.5, (0.8, 0.9), 1e-6)
    for step_grads in grads:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for p, grad in zip(group["params"], step_grads):
            p.grad = grad.clone()
        opt.step()
    assert group["weight_decay"] == 0.5  # restored after the kernels ran without it
    for p, e in zip(group["params"], expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_embedding_and_head_lrs_get_groups_of_their_own(name):
    model = ToyGPT(n_layer=1, tied=False)
    cfg = OptimConfig(name=name, lr=0.02, adam_lr=3e-3, embed_lr=0.1, head_lr=0.004)
    opt = build_optimizer(model, cfg, model.row_blocks(), "cpu")
    by_name = {n: g for g in opt.param_groups for n in g["names"]}
    assert (by_name["embed.weight"]["base_lr"], by_name["lm_head.weight"]["base_lr"]) == (0.1, 0.004)
    assert by_name["embed.weight"]["weight_decay"] == by_name["lm_head.weight"]["weight_decay"] == 0.1
    assert by_name["norm.weight"]["base_lr"] == (3e-3 if name == "muon" else 0.02)
    assert len(by_name["embed.weight"]["names"]) == len(by_name["lm_head.weight"]["names"]) == 1
    default = build_optimizer(model, OptimConfig(name=name), model.row_blocks(), "cpu")
    embed_only = build_optimizer(model, OptimConfig(name=name, embed_lr=0.1), model.row_blocks(), "cpu")
    assert len(embed_only.param_groups) == len(default.param_groups) + 1  # and unset, the groups are as they were
    assert {n: g["base_lr"] for g in embed_only.param_groups for n in g["names"]}["lm_head.weight"] == 3e-3
    with pytest.raises(ValueError, match="not --tie-embeddings"):
        build_optimizer(ToyGPT(n_layer=1, tied=True), OptimConfig(name=name, head_lr=0.1), {}, "cpu")


def test_value_embedding_and_bigram_tables_train_in_the_embeddings_group():
    """Token-indexed like the embedding (a step updates only its batch's rows): its LR, betas and, under
    bitsandbytes, 32-bit state; without an embedding LR of its own, the decayed matrices' group as before."""
    from model import GPT, ModelConfig

    model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, max_seq_len=16,
                            value_embeds=1, bigram_embed=16))
    cfg = OptimConfig(name="muon", adam_lr=1e-3, embed_lr=0.01, embed_beta1=0.8)
    groups = build_optimizer(model, cfg, model.row_blocks(), "cpu").param_groups
    embed = next(g for g in groups if "embed.weight" in g["names"])
    assert embed["names"] == ["embed.weight", "value_embeds.0.weight", "bigram_embed.weight"]
    assert (embed["base_lr"], embed["betas"]) == (0.01, (0.8, 0.95))
    plain = build_optimizer(model, OptimConfig(name="muon", adam_lr=1e-3), model.row_blocks(), "cpu").param_groups
    shared = next(g for g in plain if "embed.weight" in g["names"])
    assert {"value_embeds.0.weight", "lm_head.weight", "blocks.0.attn.gate_weight"} <= set(shared["names"])
    assert optim.as_embedding("value_embeds.0.weight") == optim.as_embedding("bigram_embed.weight") == "embed.weight"
    assert optim.as_embedding("blocks.0.attn.qkv.weight") == "blocks.0.attn.qkv.weight"


def test_an_untied_muon_run_gets_the_embedding_and_head_lrs_the_recipe_sweep_chose():
    """10x and 2x the AdamW side's LR, resolved into the config (its config.toml, the recipe cache), for an
    untied head under Muon only: a tied matrix is also the head, and AdamW runs have no AdamW side of their own."""
    def values(cfg, tied, width=None):
        return {name: value for name, (value, _) in optim.default_lrs(cfg, tied, width).items()}

    muon = OptimConfig(name="muon", lr=6e-3, adam_lr=1.5e-3)
    assert values(muon, tied=False) == {"embed_lr": 0.015, "head_lr": 0.003}
    assert values(muon, tied=True) == {}
    assert values(OptimConfig(name="adamw", lr=3e-3), tied=False) == {}
    given = dataclasses.replace(muon, head_lr=1e-3)  # a given LR stays; the other is still derived
    assert values(given, tied=False) == {"embed_lr": 0.015}


def test_every_lr_default_is_decided_by_default_lrs_and_follows_the_width_with_or_without_the_dial():
    """The registry's LRs at the default width; (128/width) to the entry's exponent elsewhere (Muon's 0.5,
    AdamW's 1), each with its rule; the untied embedding and head follow the derived AdamW side."""
    lrs = optim.default_lrs(OptimConfig(name="muon"), tied=False, width=512)
    assert lrs["lr"] == (0.003, "0.006·(128/n_embd)^0.5; measured at widths 128-512 on two corpora, docs/sizing.md")
    assert lrs["adam_lr"] == (0.0015, "0.003·(128/n_embd)^0.5") and (lrs["embed_lr"], lrs["head_lr"]) == (
        (0.015, "10·adam_lr"), (0.003, "2·adam_lr"))
    assert optim.default_lrs(OptimConfig(name="adamw"), tied=True, width=512) == {"lr": (0.00075, "0.003·128/n_embd")}
    assert optim.default_lrs(OptimConfig(name="adamw"), tied=True) == {"lr": (0.003, "default")}
    # config.Config is where a run's are set: by the model's width, whether the dial or a flag gave it.
    dial, plain = Config(size=SizeConfig(depth=8), model=ModelConfig(n_embd=512)), Config(model=ModelConfig(n_embd=512))
    assert Config().optim.lr == 6e-3 and dial.optim == plain.optim and plain.optim.head_lr == 0.003


@pytest.mark.parametrize("bad,message", [
    (dict(ns_coeffs="cubic"), "ns_coeffs"), (dict(normuon_beta=1.0), "normuon_beta"),
    (dict(embed_lr=0.0), "embed_lr"), (dict(head_lr=-1.0), "head_lr"),
    (dict(name="adamw", normuon=True), "--optimizer muon"),
    (dict(name="adamw", ns_coeffs="polar-express"), "--optimizer muon"),
    (dict(name="adamw8bit", cautious_wd=True), "--cautious-wd"),
    (dict(momentum_warmup=-1), "momentum_warmup"), (dict(momentum_warmup=2.5), "momentum_warmup"),
    (dict(momentum_start=1.0), "momentum_start"), (dict(name="adamw", momentum_warmup=10), "--optimizer muon"),
])
def test_bad_recipe_options_are_one_line_value_errors(bad, message):
    with pytest.raises(ValueError, match=message) as e:
        OptimConfig(**{"name": "muon", **bad}).validate()
    assert "\n" not in str(e.value)


def test_each_beta_is_named_alone():
    with pytest.raises(ValueError, match=r"^beta2 must be in \[0, 1\), got 1.5$"):
        OptimConfig(beta2=1.5).validate()
    with pytest.raises(ValueError, match=r"^beta1 must be in \[0, 1\), got -0.1$"):
        OptimConfig(beta1=-0.1).validate()


# The momentum warm-up outlasts the resumes below (after step 3 of 5; under FSDP2 after 2 of 3): they restart
# mid-ramp.
RECIPE = dict(ns_coeffs="polar-express", normuon=True, cautious_wd=True, embed_lr=0.02, momentum_warmup=4,
              embed_beta1=0.8)


@pytest.mark.parametrize("name,options", [("muon", RECIPE), ("adamw", dict(cautious_wd=True, head_lr=0.02))])
def test_resume_is_bit_identical_with_recipe_options(name, options):
    make = lambda: ToyGPT(vocab=32, d=16, h=2, k=1, hd=8, f=16, n_layer=1, tied=False)  # noqa: E731
    cfg = OptimConfig(name=name, lr=1e-2, adam_lr=1e-3, **options)
    saved = check_resume_is_bit_identical(make, cfg, batches(5, vocab=32))
    if name == "muon":
        assert all("row_sq_avg" in s for i, s in saved["optimizer"]["state"].items() if "momentum_buffer" in s)


def test_embedding_betas_get_a_group_of_their_own():
    model = ToyGPT(n_layer=1, tied=False)
    opt = build_optimizer(model, OptimConfig(name="muon", embed_beta1=0.8), model.row_blocks(), "cpu")
    by_name = {n: g for g in opt.param_groups for n in g["names"]}
    assert by_name["embed.weight"]["betas"] == (0.8, 0.95) and by_name["embed.weight"]["base_lr"] == 3e-3
    assert by_name["lm_head.weight"]["betas"] == (0.7, 0.95)  # muon's AdamW side's default
    assert len(by_name["embed.weight"]["names"]) == 1
    with pytest.raises(ValueError, match="embed_beta2"):
        OptimConfig(embed_beta2=1.0).validate()


def test_an_optimizer_registered_from_a_test_trains_plans_and_resumes(tiny_data, tmp_path, monkeypatch, capsys):
    """One entry is all an optimizer needs: the flag's choices, its default LR, the memory estimate, the plan
    and the checks read it; here plain SGD with momentum, registered from this file alone."""
    def build(roles, cfg, row_blocks, device_type, compile):
        groups = optim.adamw_groups(roles, cfg.lr, cfg.weight_decay, cfg)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)

    monkeypatch.setitem(optim.OPTIMIZERS, "sgd", optim.OptimizerEntry(
        build=build, lr=0.05, state_bytes=lambda name, numel, one_process: 4 * numel, fsdp=False, cautious_wd=False))
    flags = ["--data", tiny_data, *TINY_FLAGS, "--optimizer", "sgd", "--eval-interval", "0", "--out-dir",
             str(tmp_path), "--ckpt-interval", "3", "--warmup", "5"]  # a resume to step 5 re-warms no decay
    train_py.main([*flags, "--max-steps", "3"])
    out = capsys.readouterr().out
    # Its LR (x 128/64 at TINY_FLAGS' width), and the plan priced its step.
    assert "peak lr 0.1" in out and "  time             a step ~" in out
    train_py.main([*flags, "--max-steps", "5", "--resume"])
    assert "resume           from step 3" in capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and all(math.isfinite(r["train_loss"]) for r in records)
    with pytest.raises(UsageError, match="--optimizer sgd does not support FSDP2's sharded"):
        config.parse_args(["--optimizer", "sgd", "--dist", "fsdp"])
    with pytest.raises(ValueError, match="--cautious-wd needs the update's sign, which --optimizer sgd does not"):
        OptimConfig(name="sgd", cautious_wd=True).validate()
