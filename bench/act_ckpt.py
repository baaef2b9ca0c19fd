"""What each activation-checkpointing mode saves: bytes held for backward, measured and estimated.

    python bench/act_ckpt.py [--out bench/results/act_ckpt_cpu.md]

Measured: memory.saved_tensor_bytes (saved-tensor hooks: the distinct storages autograd keeps from one
forward to its backward, the model's own parameters excluded) on a fixed model and batch, in fp32 and under
bf16 autocast with the residual stream in float32 and in bf16 (--activation-dtype), on this machine.
Estimated: memory.activation_bytes for the same model, batch and device. The last table is the estimate
alone for a GPT-2-small-shaped model as train.py runs it on CUDA, bf16 autocast and the bf16 stream (not
measured here).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from atomic import atomic_write  # noqa: E402
import memory  # noqa: E402
from cli import HelpFormatter, ScriptParser, out_problem, run_writing_results  # noqa: E402
from hardware import cpu_name  # noqa: E402
from config import ACT_CKPT_MODES  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from sizing import param_numels  # noqa: E402

MODEL = ModelConfig(vocab_size=4096, n_layer=4, n_head=4, n_kv_head=2, n_embd=256, max_seq_len=256, tie_embeddings=True)
BATCH = 4
GPT2_SMALL = ModelConfig(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, max_seq_len=1024, tie_embeddings=True)
GPT2_BATCH = 16
MIB = 2**20


def measured_table(device):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.max_seq_len), generator=g).to(device)
    targets = torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.max_seq_len), generator=g).to(device)
    lines = ["| act-ckpt | fp32 measured | fp32 estimate | bf16 measured | bf16 estimate | bf16 stream measured "
             "| bf16 stream estimate | bf16 stream vs none |", "|---|---|---|---|---|---|---|---|"]
    baseline = None
    for mode in ACT_CKPT_MODES:
        cells = []
        for dtype, stream in ((None, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)):
            torch.manual_seed(0)
            model = memory.apply_activation_checkpointing(GPT(MODEL).to(device), mode)
            model.activation_dtype = stream
            measured = memory.saved_tensor_bytes(model, idx, targets, dtype)
            estimated, _ = memory.activation_bytes(MODEL, BATCH, MODEL.max_seq_len, mode, dtype, device.type,
                                                   stream)
            cells += [f"{measured / MIB:.2f} MiB", f"{estimated / MIB:.2f} MiB ({100 * (estimated / measured - 1):+.1f}%)"]
        baseline = baseline or measured
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {measured / baseline:.2f} |")
    return "\n".join(lines)


def estimate_table():
    lines = ["| act-ckpt | activations | recomputed in backward (transient) | vs none |", "|---|---|---|---|"]
    base = None
    for mode in ACT_CKPT_MODES:
        held, recompute = memory.activation_bytes(GPT2_SMALL, GPT2_BATCH, GPT2_SMALL.max_seq_len, mode,
                                                  torch.bfloat16, "cuda", torch.bfloat16)
        base = base or held
        lines.append(f"| {mode} | {held / 2**30:.2f} GiB | {recompute / 2**30:.2f} GiB | {held / base:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = ScriptParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    if problem := out_problem(args.out):
        p.error(problem)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_params = sum(param_numels(MODEL).values())
    text = "\n\n".join([
        f"Measured on {device.type if device.type == 'cuda' else cpu_name()} (torch {torch.__version__}): "
        f"{n_params / 1e6:.2f}M-parameter model "
        f"({MODEL.n_layer} layers, d={MODEL.n_embd}, heads {MODEL.n_head}q/{MODEL.n_kv_head}kv, vocab "
        f"{MODEL.padded_vocab_size}), batch {BATCH} x {MODEL.max_seq_len} tokens, eager. Bytes autograd holds "
        "from forward to backward (saved-tensor hooks, distinct storages, parameters excluded):",
        measured_table(device),
        f"Estimate only (memory.py, not measured here): GPT-2-small shape ({GPT2_SMALL.n_layer} layers, "
        f"d={GPT2_SMALL.n_embd}, vocab {GPT2_SMALL.padded_vocab_size}), batch {GPT2_BATCH} x "
        f"{GPT2_SMALL.max_seq_len}, bf16 autocast and the bf16 stream on CUDA (train.py's default there):",
        estimate_table(),
    ])
    print(text)
    if args.out:
        atomic_write(args.out, f"# Activation checkpointing: saved bytes per mode\n\n{text}\n".encode())


if __name__ == "__main__":
    run_writing_results(main)
