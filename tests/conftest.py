"""Fixtures the test files share: tiny token shards, GPT-2's tokenizer loaded offline, a tokenizer.json of over
65,535 ids, the tiny model's flags, train.py run in the test's process, a tiny GPT-2-vocabulary model, and a NaN
injected into one training step (tests poison a step by patching it, so the product carries no test-only flag),
the process group every multi-process test runs in, and stand-in Transformer Engine modules for the CPU."""

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tiktoken.load
import tiktoken.registry
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import distributed
import fp8
import loop
import model as model_module
import split
import tokenizer
from model import GPT, ModelConfig
from shards import write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest.ini runs a worker a core (pytest-xdist): one thread each, and so their train.py children, or the
# workers' thread pools would fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# A model and batch small enough for a CPU test to train a few steps in about a second.
TINY_FLAGS = ["--vocab-size", "256", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
              "--seq-len", "32", "--batch-size", "4"]
# The flags that give Qwen3's architecture where the defaults differ: what the Transformer Engine blocks build.
QWEN3_FLAGS = ["--mlp", "swiglu", "--no-attn-gate"]
HELLASWAG_FIXTURE = os.path.join(REPO, "tests", "fixtures", "hellaswag_mini.jsonl")
# Text the word_tokenizer knows every word of.
WORD_TEXT = "the cat sat on the mat . a dog ran to the park , and the cat slept !"
# The GPT-2 vocabulary (HellaSwag's text needs it), otherwise as small as TINY_FLAGS.
GPT2_TINY = dict(vocab_size=50257, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=32)


def pytest_terminal_summary(terminalreporter):
    """The machine, beside the slowest tests at the end of every run's output (-q too): a time means little
    without it."""
    import hardware

    terminalreporter.write_line(f"machine: {hardware.cpu_name()}; torch {torch.__version__}")


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles from empty Dynamo caches: the tests a worker ran before it, in whatever order the
    workers took them, must not have used up a code object's recompile limit (a fullgraph test then fails)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@pytest.fixture(autouse=True)
def windowed_read_back(monkeypatch):
    """Every test's loop reads its steps back in windows, as on a GPU, since those are what the loop's tests
    exercise; a CPU run reads each step (loop.reads_every_step), which a test restores to check it."""
    monkeypatch.setattr(loop, "reads_every_step", lambda device: False)


@pytest.fixture
def train_in_process(capsys):
    """-> run(*argv): train.main(argv) in this process, read back as a subprocess.CompletedProcess (returncode,
    stdout, stderr). A tiny run in a new process is mostly its start-up (importing torch and the checkpoint
    stack, about 3 s), so tests of what a run says, refuses and leaves behind call main here; the entry point
    itself (exit code 2, one line, no traceback) is tested in a real process in tests/test_train.py."""
    import train

    def run(*argv):
        capsys.readouterr()
        try:
            train.main([str(arg) for arg in argv])
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out.out, out.err)

    return run


def targets_with_ignored(shape=(2, 32), vocab=200, seed=1) -> torch.Tensor:
    """Random targets with ignored (-100) entries: a row's head, and every third of the last row."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, shape, generator=g)
    targets[0, :5] = -100
    targets[-1, ::3] = -100
    return targets


def write_tiny_shards(root, train_tokens=(5000, 5000, 5000), val_tokens=2000, seed=0, vocab_size=256) -> str:
    """Random uint16 tokens below vocab_size, drawn in order (train shards, then val) from one seeded
    generator, as llm.c shards under root; -> root as a string."""
    rng = np.random.default_rng(seed)
    for i, n in enumerate(train_tokens):
        write_shard(os.path.join(root, f"train_{i:06d}.bin"), rng.integers(0, vocab_size, n, dtype=np.uint16),
                    vocab_size=vocab_size)
    write_shard(os.path.join(root, "val_000000.bin"), rng.integers(0, vocab_size, val_tokens, dtype=np.uint16),
                vocab_size=vocab_size)
    return str(root)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Three train shards of 5,000 random tokens and a val shard of 2,000, over a 256-entry vocabulary:
    enough to exercise every code path quickly."""
    return write_tiny_shards(tmp_path_factory.mktemp("tiny_data"))


def no_network(*args, **kwargs):
    raise ConnectionError("no network in this test")


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory):
    """GPT-2 loaded from an empty cache with tiktoken's own download disabled: only the PyPI route can work.
    The loaded encoding stays cached in tokenizer for the rest of the session."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        mp.setattr(tiktoken.load, "read_file", no_network)
        mp.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
        tokenizer._load_encoding.cache_clear()
        enc = tokenizer.get_tokenizer("gpt2")
    return enc, cache


def write_word_tokenizer(path, words=(), size: int = 70_000, separator: str | None = "<|endoftext|>") -> str:
    """A WordLevel tokenizer.json at path: [UNK] (id 0), the words, then fillers <0>, <1>, ... up to size ids, a
    vocabulary over 65,535 (uint32 shards) by default; text splits into words and runs of punctuation;
    separator, if any, is a special token after them. -> path as a string."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    for word in words:
        vocab.setdefault(word, len(vocab))
    vocab.update({f"<{i}>": len(vocab) + i for i in range(size - len(vocab))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if separator is not None:
        tok.add_special_tokens([AddedToken(separator, special=True, normalized=False)])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory):
    """A 70,001-id WordLevel tokenizer.json (write_word_tokenizer) that knows the words of the HellaSwag fixture
    and of WORD_TEXT, its separator <|endoftext|> the last id."""
    words = re.findall(r"\w+|[^\w\s]+", WORD_TEXT + "\n" + open(HELLASWAG_FIXTURE, encoding="utf-8").read())
    return write_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer") / "tokenizer.json", words)


def write_checkpoint(path, model, train_config=None, tokenizer=None):
    """A checkpoint of the model as train.py writes one, with a TE block's empty extra state; tokenizer: the
    data.tokenizer_id it records (None: shards without data.json, so nothing to check a tool's against)."""
    import checkpoint

    state = model.state_dict()
    state["blocks.0.attn.qkv._extra_state"] = torch.zeros(0)  # as a Transformer Engine block writes
    checkpoint.save_file({"version": checkpoint.CHECKPOINT_VERSION, "step": 1, "model": state, "optimizer": {},
                          "loader": {}, "rng": {}, "model_config": dataclasses.asdict(model.config),
                          "train_config": train_config or {}, "tokenizer": tokenizer}, str(path))


def gpt2_model(seed: int = 0, **overrides) -> GPT:
    """Weights larger than the init's, so that the endings' losses are far apart (no near-ties)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**{**GPT2_TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def inject_nan(monkeypatch):
    """poison(n): the n-th call of loop.train_step (0-based: step n of a fresh run) gets a NaN loss, once;
    a rollback that redoes that step meets a finite one."""
    original = loop.train_step

    def poison(n):
        calls = {"count": 0}

        def step(run, *args):
            index, calls["count"] = calls["count"], calls["count"] + 1
            if index != n:
                return original(run, *args)
            forward = run.compiled
            run.compiled = lambda x, y: (lambda out: (out[0], out[1] * float("nan")))(forward(x, y))
            try:
                return original(run, *args)
            finally:
                run.compiled = forward

        monkeypatch.setattr(loop, "train_step", step)

    return poison


def step_values(loss: float, grad_norm: float = 1.0, finite: bool = True) -> dict:
    """A step's metrics as the loop reads them back (loop.read_back), for telemetry.step_record."""
    return {"train_loss": loss, "grad_norm": grad_norm, "finite": float(finite)}


def split_by_hand(stream, val_tokens: int, eot: int = 50256) -> list:
    """split.py's rule, written out one document at a time (tests/test_split.py, tests/test_prepare.py): val
    takes documents in order of (draw, position), the last one cut at val_tokens; train is every other token
    in stream order. -> val + train, as a preparation's val shard and train shards hold them."""
    starts = [i for i, t in enumerate(stream) if t == eot] or [0]
    starts[0] = 0
    docs = [list(stream[a:b]) for a, b in zip(starts, starts[1:] + [len(stream)])]
    val, taken = [], {}
    for position in sorted(range(len(docs)), key=lambda p: (split.draw_of(p), p)):
        taken[position] = min(len(docs[position]), val_tokens - len(val))
        val += docs[position][:taken[position]]
    return val + [t for p, doc in enumerate(docs) for t in doc[taken.get(p, 0):]]


@pytest.fixture
def small_filesystem(tmp_path):
    """mount(kib) -> a new directory holding a tmpfs of that size, to fill for real (root only: skipped, with
    the reason, where the machine does not allow a mount); unmounted after the test."""
    mounted = []

    def mount(kib: int):
        if os.geteuid() != 0:
            pytest.skip("a small filesystem needs a tmpfs mount, which needs root")
        where = tmp_path / f"small{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def write_doc_shards(root, doc_lengths, shard_tokens, bos=50256, vocab_size=50257) -> list[int]:
    """Documents of the given lengths (each counting its leading bos token) laid end to end and cut into train
    shards of shard_tokens tokens under root, as prepare.prepare cuts them (a document may span two shards).
    Every other token is its position in the stream (below bos), so a row's tokens tell where they came from;
    -> the documents' start positions."""
    starts = np.cumsum([0, *doc_lengths[:-1]])
    tokens = np.arange(sum(doc_lengths))
    assert len(tokens) < bos, "positions must stay below the bos token"
    tokens[starts] = bos
    for i, first in enumerate(range(0, len(tokens), shard_tokens)):
        write_shard(os.path.join(root, f"train_{i:06d}.bin"), tokens[first:first + shard_tokens], vocab_size)
    return starts.tolist()


def spawn_on_gloo(body, world_size: int, tmp_path, *args) -> None:
    """Run body(rank, world_size, *args) in world_size processes joined by gloo; raises if any rank fails."""
    mp.spawn(_gloo_process, args=(body, world_size, str(tmp_path / "rdzv"), args), nprocs=world_size, join=True)


def _gloo_process(rank, body, world_size, init_file, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    info = distributed.DistInfo(rank=rank, local_rank=rank, world_size=world_size, mode="ddp")
    try:
        body(rank, world_size, *args)  # returns, so its models are unreferenced before the shutdown collects
        dist.barrier()  # neither rank tears down gloo while another still works
    finally:
        distributed.shutdown(info)


def pytest_runtest_logreport(report):
    """With PYTEST_FAILURES=FILE (bench/gpu_check.sh sets it), append each failure's traceback to FILE as it
    happens: a run stopped by its time limit keeps the tracebacks that pytest prints only at the end. Under
    pytest-xdist the controller writes, not the workers, so each failure is written once."""
    path = os.environ.get("PYTEST_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"\n### {report.nodeid} ({report.when})\n\n```\n{report.longreprtext[-4000:]}\n```\n")


def with_spectrum(rows, cols, largest, smallest):
    """A random rows x cols matrix whose singular values run evenly from largest to smallest."""
    n = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, n))
    v, _ = torch.linalg.qr(torch.randn(cols, n))
    return u @ torch.diag(torch.linspace(largest, smallest, n)) @ v.T


# Transformer Engine cannot be imported without CUDA: fp8.py's TE blocks are checked on the CPU on these.


class ExtraState:
    """A TE module's `_extra_state` entry: empty, as TE 2.18+ writes it for a stateless recipe."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        assert state.numel() == 0


class IntoMainGrad(torch.autograd.Function):
    """A weight's way into a GEMM under TE's fuse_wgrad_accumulation: its gradient goes into weight.main_grad,
    overwriting it when the forward ran with is_first_microbatch=True and adding to it otherwise (None or
    False), and autograd gets none (TE 2.20.2 module/linear.py: accumulate = fuse_wgrad_accumulation and not
    is_first_microbatch; wgrad None)."""

    @staticmethod
    def forward(ctx, weight, first):
        ctx.weight, ctx.first = weight, first
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if ctx.first:
            ctx.weight.main_grad.copy_(grad)
        else:
            ctx.weight.main_grad.add_(grad)
        return None, None


class TEKeywords(ExtraState):
    """What every TE GEMM module takes besides its shapes: fuse_wgrad_accumulation at construction and
    is_first_microbatch at each call, which it records in `seen`. Its forward runs outside torch.compile's
    graph, as LayerNormLinear's and LayerNormMLP's always do in TE 2.20 (no_torch_dynamo), and te.Linear's does
    where TE's compiled path is off (torch < 2.14) or falls back (fused weight gradients, a weight cache), so
    `seen` holds every call. TE's compiled te.Linear itself is not modelled here."""

    def take_te_keywords(self, fuse_wgrad_accumulation):
        self.fuse_wgrad_accumulation, self.seen = fuse_wgrad_accumulation, []

    def te_matmul(self, first):
        def matmul(x, weight):
            return F.linear(x, IntoMainGrad.apply(weight, first) if self.fuse_wgrad_accumulation else weight)
        return matmul

    @torch._dynamo.disable
    def forward(self, x, is_first_microbatch=None):
        self.seen.append(is_first_microbatch)
        self.matmul = self.te_matmul(is_first_microbatch)
        return self.plain_forward(x)


class StandInLayerNormLinear(TEKeywords, model_module.LayerNormLinear):
    """te.LayerNormLinear's keywords as fp8.py passes them (TE 2.20.2, module/layernorm_linear.py), plain
    numerics: forward returns (out, normed input) with return_layernorm_output."""

    def __init__(self, in_features, out_features, eps=1e-5, *, bias=True, normalization="LayerNorm",
                 return_layernorm_output=False, fuse_wgrad_accumulation=False, device="cuda"):
        assert not bias and normalization == "RMSNorm"
        super().__init__(in_features, out_features, eps, return_layernorm_output)
        self.take_te_keywords(fuse_wgrad_accumulation)

    plain_forward = model_module.LayerNormLinear.forward


class StandInLinear(TEKeywords, nn.Linear):
    def __init__(self, in_features, out_features, *, bias=True, fuse_wgrad_accumulation=False, device="cuda"):
        assert not bias
        super().__init__(in_features, out_features, bias=False)
        self.take_te_keywords(fuse_wgrad_accumulation)

    def plain_forward(self, x):
        return self.matmul(x, self.weight)


class StandInLayerNormMLP(TEKeywords, model_module.LayerNormMLP):
    """te.LayerNormMLP (module/layernorm_mlp.py): activation swiglu (gate = fc1's first half) or srelu."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, *, bias=True, normalization="LayerNorm",
                 activation="gelu", fuse_wgrad_accumulation=False, device="cuda"):
        assert not bias and normalization == "RMSNorm"
        super().__init__(hidden_size, ffn_hidden_size, eps, {"swiglu": "swiglu", "srelu": "relu2"}[activation])
        self.take_te_keywords(fuse_wgrad_accumulation)

    plain_forward = model_module.LayerNormMLP.forward


class StandInDotProductAttention(ExtraState, nn.Module):
    """te.DotProductAttention in bshd layout with a causal mask: [B, T, heads, hd] in, [B, T, H * hd] out."""

    def __init__(self, num_attention_heads, kv_channels, *, num_gqa_groups, attention_dropout, qkv_format,
                 attn_mask_type):
        super().__init__()
        assert qkv_format == "bshd" and attn_mask_type == "causal" and attention_dropout == 0.0

    def forward(self, q, k, v):
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).flatten(2)


STAND_IN_TE = type("StandInTE", (), {
    "LayerNormLinear": StandInLayerNormLinear, "Linear": StandInLinear, "LayerNormMLP": StandInLayerNormMLP,
    "DotProductAttention": StandInDotProductAttention, "checkpoint": torch.utils.checkpoint.checkpoint})


@pytest.fixture
def stand_in_te(monkeypatch):
    """fp8's TE blocks built from the stand-ins, on the CPU."""
    monkeypatch.setattr(fp8, "import_te", lambda: STAND_IN_TE)
    monkeypatch.setattr(fp8, "_te_device", lambda: "cpu")
