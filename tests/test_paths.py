"""The default model and the model of each recipe toggle, taken through every path a user takes a model:
DDP and FSDP2 (gloo), torch.compile, torchao FP8, Transformer Engine FP8, checkpoint and resume, export to
transformers, sample.py and score.py. Each cell either works, checked against the plain path, or is refused
in one line that names the toggle; a traceback or a silent fallback fails. PATHS is the table docs/recipe.md
shows, and a toggle with no row here fails the first test: a new toggle cannot skip a path unnoticed."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint
import config
import distributed
import fp8
import hf
import hf_layout
import sample
import score
from conftest import REPO, spawn_on_gloo
from model import ARCHITECTURE_TOGGLES, GPT, ModelConfig
from runlog import read_metrics

# Each model by the flags that make it from the defaults (attention gates, the smear and the bigram table on).
MODELS = {
    "default": [],
    "no-attn-gate": ["--no-attn-gate"],
    "relu2": ["--mlp", "relu2"],
    "softcap": ["--logit-softcap", "15"],
    "value-embeds": ["--value-embeds", "1"],
    "unet-skips": ["--unet-skips"],
    "no-smear": ["--no-smear"],
    "no-bigram-embed": ["--bigram-embed", "0"],
    "qwen3-next": ["--no-smear", "--bigram-embed", "0"],
    "embed-skips": ["--embed-skips"],
    "tied": ["--tie-embeddings"],
}
COLUMNS = ("DDP", "FSDP2", "compile", "torchao FP8", "TE FP8", "resume", "export", "sample.py", "score.py")
# What each cell does: "yes" (works), a layout name (export works, in that transformers class), or "refused".
EXPORT = {"default": "look-back Qwen3-Next", "no-attn-gate": "look-back Qwen3", "no-smear": "look-back Qwen3-Next",
          "no-bigram-embed": "look-back Qwen3-Next", "qwen3-next": "Qwen3-Next", "tied": "look-back Qwen3-Next"}
CLASSES = {"Qwen3": "Qwen3ForCausalLM", "Qwen3-Next": "Qwen3NextForCausalLM",
           "look-back Qwen3": "LookBackQwen3ForCausalLM", "look-back Qwen3-Next": "LookBackQwen3NextForCausalLM"}
PATHS = {model: {column: "refused" if (column, model) == ("TE FP8", "value-embeds") else
                 EXPORT.get(model, "refused") if column == "export" else "yes" for column in COLUMNS}
         for model in MODELS}
SHAPE = ["--vocab-size", "50257", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "64",
         "--seq-len", "32", "--batch-size", "4"]  # GPT-2's vocabulary: the export writes its tokenizer


def model_config(name: str) -> ModelConfig:
    """The ModelConfig train.py builds from the model's flags, at a tiny shape."""
    return config.parse_args([*SHAPE, *MODELS[name]]).model


def refusal(stderr: str) -> str:
    """The one error line of a refused command; fails on a traceback or more than one line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def toggle_flags(name: str) -> str:
    """How a refusal names the model's toggle: as ModelConfig.toggles_on writes it."""
    return ", ".join(model_config(name).toggles_on(hf_layout.UNEXPORTABLE_TOGGLES))


def test_every_toggle_has_a_row():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    rowed = {re.sub(r"^--(no-)?", "", flags[0]).replace("-", "_") for flags in MODELS.values() if flags}
    assert set(ARCHITECTURE_TOGGLES) | {"tie_embeddings"} <= rowed <= fields


def test_docs_recipe_shows_the_table():
    rows = ["| model | flags | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    rows += [f"| {m} | {' '.join(MODELS[m]).join('``') if MODELS[m] else 'none'} | " + " | ".join(PATHS[m].values())
             + " |" for m in MODELS]
    with open(os.path.join(REPO, "docs", "recipe.md"), encoding="utf-8") as f:
        assert "\n".join(rows) in f.read()


# ----------------------------------------------------------------------------- one process: the model's own paths


@pytest.mark.parametrize("name", MODELS)
def test_compile_torchao_and_te_blocks_match_the_plain_model(name, stand_in_te):
    """compile: one graph (fullgraph, aot_eager: dynamo and autograd trace every toggle; Inductor's code
    generation is tests/test_compile.py's) equal to eager; torchao: every block GEMM in float8, the loss within
    FP8's error; TE: the blocks on stand-in modules (tests/test_model_te.py; the real ones: the GPU test below)
    equal to the plain blocks, or the refusal naming the toggle."""
    cfg = model_config(name)
    torch.manual_seed(0)
    plain = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len))
    loss = plain(idx, idx)[1]
    loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}

    compiled = GPT(cfg)
    compiled.load_state_dict(plain.state_dict())
    compiled_loss = torch.compile(compiled, backend="aot_eager", fullgraph=True)(idx, idx)[1]
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for n, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)

    converted = fp8.convert_to_torchao_float8(GPT(cfg))
    converted.load_state_dict(plain.state_dict())
    float8 = [m for m in converted.modules() if type(m).__name__ in ("Float8Linear", "Float8Matmul")]
    # Each block's qkv and MLP GEMMs (fc1 and fc2 share their module) and proj: none left in high precision.
    assert len(float8) == 3 * cfg.n_layer
    assert abs(converted(idx, idx)[1].item() - loss.item()) < 0.01 * loss.item()

    if PATHS[name]["TE FP8"] == "refused":
        with pytest.raises(ValueError) as e:
            GPT(cfg, block=fp8.TEBlock)
        assert str(e.value).startswith(toggle_flags(name) + ": not implemented for the te backend")
        return
    te_model = GPT(cfg, block=fp8.TEBlock)
    te_model.load_state_dict(fp8.plain_to_te_state_dict(plain.state_dict()))
    torch.testing.assert_close(te_model(idx, idx)[1], loss, rtol=1e-6, atol=1e-6)


def assert_resume_redoes_step_3(flags: list, full, resumed, train_in_process):
    """train.py with flags (3 steps, a checkpoint at step 2) into full; then a copy of its step-2 checkpoint in
    resumed, resumed: step 3's train loss the same, bit for bit."""
    assert train_in_process(*flags, "--out-dir", full).returncode == 0
    resumed.mkdir()
    step2 = checkpoint.checkpoint_path(str(full), 2, sharded=False)
    for path in (step2, step2 + checkpoint.DIGEST_SUFFIX):
        shutil.copy(path, resumed)
    assert train_in_process(*flags, "--out-dir", resumed, "--resume").returncode == 0
    losses = [{r["step"]: r["train_loss"] for r in read_metrics(str(run / "metrics.jsonl"))[0]}
              for run in (full, resumed)]
    assert losses[1][3] == losses[0][3]


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_resume_export_sample_and_score(name, tiny_data, tmp_path, train_in_process, capsys):
    """train.py for 3 steps (checkpoints at 2 and 3), a resume from step 2 that redoes step 3 bit for bit; the
    export of the run, sample.py and score.py on the checkpoint and on the export, which give the checkpoint's
    text and figures (a layout that dropped a part would not)."""
    flags = ["--data", tiny_data, *SHAPE, *MODELS[name], "--warmup", "1", "--eval-interval", "0", "--dtype", "fp32",
             "--device", "cpu", "--max-steps", "3", "--ckpt-interval", "2", "--keep-ckpts", "2"]
    full = tmp_path / "full"
    assert_resume_redoes_step_3(flags, full, tmp_path / "resumed", train_in_process)

    export = hf.main(["--ckpt", str(full), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    sources = [["--ckpt", str(full)]]
    if PATHS[name]["export"] == "refused":
        assert export == 2 and refusal(err).startswith(f"error: {toggle_flags(name)}: neither Qwen3ForCausalLM")
    else:
        assert export == 0 and "Traceback" not in err
        written = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"]
        assert written == [CLASSES[PATHS[name]["export"]]]
        sources.append(["--hf", str(tmp_path / "hf")])
    texts, figures = [], []
    for source in sources:
        assert sample.main([*source, "--prompt", "ab", "--max-new-tokens", "6", "--greedy", "--device", "cpu"]) == 0
        texts.append(capsys.readouterr().out)
        path = ["--ckpt", source[1]]  # score.py tells an export by its config.json
        assert score.main([*path, "--task", "bpb", "--data", tiny_data, "--n", "256", "--batch-size", "4",
                           "--device", "cpu"]) == 0
        figures.append(re.search(r"val_loss +([\d.]+)", capsys.readouterr().out).group(1))
    assert texts == texts[:1] * len(texts) and figures == figures[:1] * len(figures)


def test_the_default_model_takes_each_path_with_the_bf16_stream(stand_in_te, tiny_data, tmp_path,
                                                                 train_in_process):
    """What CUDA runs by default (--activation-dtype auto: bf16 between the GEMMs), on the CPU: compiled (one
    graph) as eager, torchao's float8 blocks and the TE blocks (stand-ins) fed a bf16 stream, and train.py's
    resume bit for bit. DDP and FSDP2 with it: test_ddp_and_fsdp2_take_every_model."""
    cfg = dataclasses.replace(model_config("default"), vocab_size=256)  # bf16 GEMMs are slow where emulated
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len))
    models = {"plain": GPT(cfg), "compiled": GPT(cfg), "torchao": fp8.convert_to_torchao_float8(GPT(cfg)),
              "te": GPT(cfg, block=fp8.TEBlock)}
    losses = {}
    for name, model in models.items():
        state = models["plain"].state_dict()
        model.load_state_dict(fp8.plain_to_te_state_dict(state) if name == "te" else state)
        model.activation_dtype = torch.bfloat16
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if name == "compiled" else model
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = forward(idx, idx)[1]
        losses[name].backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters()), name
    assert losses["compiled"].item() == pytest.approx(losses["plain"].item(), rel=1e-3)
    assert losses["te"].item() == pytest.approx(losses["plain"].item(), rel=1e-3)
    assert abs(losses["torchao"].item() - losses["plain"].item()) < 0.01 * losses["plain"].item()

    flags = ["--data", tiny_data, *SHAPE, "--vocab-size", "256", "--bigram-embed", "256", "--warmup", "1",
             "--eval-interval", "0", "--dtype", "bf16", "--activation-dtype", "bf16", "--device", "cpu",
             "--max-steps", "3", "--ckpt-interval", "2"]
    assert_resume_redoes_step_3(flags, tmp_path / "full", tmp_path / "resumed", train_in_process)


# ----------------------------------------------------------------------------- two processes: DDP and FSDP2


def parallel_worker(rank, world_size, out_file):
    """Each model under distributed.parallelize (train.py's wrapping) as DDP and as FSDP2, each rank on half of
    the batch, against one process on all of it: the mean loss and every gradient's largest error. The default
    model also with --activation-dtype bf16, under bf16 autocast (FSDP2 then gathers bf16 weights)."""
    results = {}
    cells = [(name, None) for name in MODELS] + [("default", torch.bfloat16)]
    for name, activations in cells:
        cfg = model_config(name)
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=activations is not None)
        torch.manual_seed(0)
        reference = GPT(cfg)
        reference.activation_dtype = activations
        with autocast:
            loss = reference(idx, idx)[1]
        loss.backward()
        for mode in ("ddp", "fsdp"):
            torch.manual_seed(0)
            model = GPT(cfg)
            model.activation_dtype = activations
            info = distributed.DistInfo(rank=rank, local_rank=rank, world_size=world_size, mode=mode)
            wrapped, _ = distributed.parallelize(model, info, torch.device("cpu"), activations, config.DistConfig(),
                                                 "off")
            half = idx[rank * 2:(rank + 1) * 2]
            with autocast:
                part = wrapped(half, half)[1]
            part.backward()
            mean = distributed.mean_across_ranks(part.detach(), info)
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()}
            grad_error = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
            results[f"{name}{' bf16-activations' if activations else ''} {mode}"] = (abs(mean.item() - loss.item()),
                                                                                      grad_error)
    if rank == 0:
        torch.save(results, out_file)


def test_ddp_and_fsdp2_take_every_model(tmp_path):
    spawn_on_gloo(parallel_worker, 2, tmp_path, str(tmp_path / "results.pt"))
    results = torch.load(tmp_path / "results.pt")
    assert set(results) == {f"{name} {mode}" for name in [*MODELS, "default bf16-activations"]
                            for mode in ("ddp", "fsdp")}
    for cell, (loss_error, grad_error) in results.items():
        bound = 2e-2 if "bf16" in cell else 1e-5  # bf16's own rounding, on half the batch against all of it
        assert loss_error < bound and grad_error < bound, (cell, loss_error, grad_error)


# ----------------------------------------------------------------------------- Transformer Engine on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8.te_installed()), reason="needs CUDA and TE")
@pytest.mark.parametrize("name", MODELS)
def test_te_fp8_through_train(name, tiny_data, tmp_path):
    flags = ["--data", tiny_data, "--out-dir", str(tmp_path), *MODELS[name], "--vocab-size", "256", "--n-layer", "2",
             "--n-embd", "256", "--n-head", "2", "--n-kv-head", "1", "--seq-len", "16", "--batch-size", "2",
             "--max-steps", "2", "--eval-interval", "0", "--dtype", "bf16", "--fp8", "te"]
    result = subprocess.run([sys.executable, "train.py", *flags], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    if PATHS[name]["TE FP8"] == "refused":
        assert result.returncode == 2
        assert refusal(result.stderr).startswith(f"error: {toggle_flags(name)}: not implemented for the te backend")
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Transformer Engine, " in result.stdout
