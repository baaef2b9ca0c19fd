"""Every check a run's settings get from the flags alone, before anything is built: ranges, combinations
that cannot work, and the size dial's inputs; one UsageError naming every problem at once.

    validate(cfg, machine_checks)    # config.parse_command_line's last step; cfg: a config.Config

Each check reads a Config's sections by name and yields the problems it finds, in the flags' own words, so
that a user fixes a command in one round. Shapes against the machine (FP8, memory) are checked later, still
before the first step (fp8.prepare, headroom.py).
"""

import dataclasses
import math
import re

import fp8
from cli import UsageError
from optim import OPTIMIZERS, with_property
from option import flag_name


def validate(cfg, machine_checks=()) -> None:
    """Every check that needs only the flags, and those of the machine that cost nothing (machine_checks:
    functions Config -> problems, such as CUDA or a W&B key); UsageError with one line naming every problem at
    once, so that a user fixes a command in one round. Shapes against the machine (FP8, memory) are checked in
    fp8.prepare and train.setup, still before the first step."""
    machine = [problem for check in machine_checks for problem in check(cfg)]
    problems = [*_range_problems(cfg), *_combination_problems(cfg), *machine]
    # The sections' own checks (optim.py's run again when it builds), here with the rest and in the flags' words
    for section in (cfg.model, cfg.optim):
        try:
            section.validate()
        except ValueError as e:
            problems.append(in_flags(str(e), section))
    try:
        fp8.check_fp8_flags(cfg.fp8.mode, cfg.fp8.recipe, cfg.fp8.attn, cfg.fp8.fused_wgrad)
    except ValueError as e:
        problems.append(str(e))
    refuse(problems)


def in_flags(message: str, section) -> str:
    """A config section's own validate message (model.py, optim.py: they know nothing of flags) in the flags'
    words: "n_head (2) must be divisible by n_kv_head (3)" -> "--n-head (2) must be divisible by --n-kv-head (3)".
    A field's name is its flag where it is an identifier: one with an underscore, or any opening the message
    ("lr must be positive"); a plain word in the prose ("Muon's momentum: it needs ...") stays a word."""
    flags = {f.name: flag_name(f) for f in dataclasses.fields(section)}
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, flags)) + r")\b"
    return re.sub(pattern, lambda m: flags[m[1]] if "_" in m[1] or m.start() == 0 else m[1], message)


def refuse(problems: list[str]) -> None:
    """UsageError with one line naming every problem, if there is one."""
    if len(problems) == 1:
        raise UsageError(problems[0])
    if problems:
        raise UsageError(f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))


def _flag_values(*sections):
    """(flag, value) of every field of these config sections."""
    for values in sections:
        for f in dataclasses.fields(values):
            yield flag_name(f), getattr(values, f.name)


def _finite_problems(cfg):
    """Every float flag: nan and inf pass every comparison below unnoticed (nan < 0 is False)."""
    for flag, value in _flag_values(*vars(cfg).values()):
        if isinstance(value, float) and not math.isfinite(value):
            yield f"{flag} must be a finite number, got {value}"


def integer_problems(cfg):
    """Every integer flag, as given: no tensor, file format or C library takes more than 64 bits, and the size
    checks' float arithmetic (parameters x 4 bytes / 2**30) overflows long before Python's ints do. Checked
    before the size dial, whose derived values (tokens of a huge model) may rightly be larger."""
    for flag, value in _flag_values(*vars(cfg).values()):
        if type(value) is int and not -2**63 <= value < 2**63:  # no range: the flag's own check says that
            yield f"{flag} must be a 64-bit integer, got {value}"


# The model sizes the size dial computes with: each must be a positive count when it is given.
DIAL_SIZES = ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "head_dim", "ffn_dim", "max_seq_len")


def dial_problems(cfg):
    """The size dial's own ranges, and when it runs (--depth, --preset), the sizes it computes with, as given,
    checked before it does: a width of 0 divides by zero, a negative one makes a negative parameter count.
    validate checks the sizes again, with everything else."""
    try:
        cfg.size.validate()
    except ValueError as e:
        yield str(e)
    if cfg.size.depth is None and cfg.size.preset is None:
        return
    sizes = [(flag_name(f), getattr(cfg.model, f.name)) for f in dataclasses.fields(cfg.model)
             if f.name in DIAL_SIZES and getattr(cfg.model, f.name) is not None]
    if cfg.data.batch_size != "auto":
        sizes.append(("--batch-size", cfg.data.batch_size))
    yield from (f"{flag} must be >= 1, got {value}" for flag, value in sizes if value < 1)


# torch's collectives count whole milliseconds (less is a timeout of 0); past a billion seconds (32 years)
# Python's timedelta overflows.
MIN_COLLECTIVE_TIMEOUT, MAX_COLLECTIVE_TIMEOUT = 1e-3, 1e9


def _range_problems(cfg):
    yield from _finite_problems(cfg)
    d, s, e = cfg.data, cfg.schedule, cfg.eval
    # Not --seq-len: ModelConfig.validate checks it with the model's other sizes, and one problem is one line
    positive = {"--batch-size": 1 if d.batch_size == "auto" else d.batch_size, "--grad-accum": d.grad_accum,
                "--log-interval": cfg.log.log_interval, "--keep-ckpts": cfg.ckpt.keep_ckpts,
                "--max-bad-steps": cfg.resilience.max_bad_steps}
    yield from (f"{name} must be >= 1, got {value}" for name, value in positive.items() if value < 1)
    non_negative = {"--max-steps": s.max_steps, "--max-tokens": s.max_tokens, "--warmup": s.warmup,
                    "--sample-tokens": e.sample_tokens, "--eval-interval": e.eval_interval,
                    "--eval-hellaswag": e.eval_hellaswag,
                    "--ckpt-interval": cfg.ckpt.ckpt_interval, "--total-batch-tokens": d.total_batch_tokens,
                    "--grad-clip": s.grad_clip, "--peak-tflops": cfg.log.peak_tflops, "--seed": d.seed,
                    "--loss-chunk-tokens": cfg.speed.loss_chunk_tokens, "--batch-warmup-steps": s.batch_warmup_steps,
                    "--spike-factor": cfg.resilience.spike_factor, "--max-rollbacks": cfg.resilience.max_rollbacks,
                    "--early-stop-patience": cfg.resilience.early_stop_patience}
    yield from (f"{name} must be >= 0, got {value}" for name, value in non_negative.items() if value < 0)
    if d.data is not None and not d.data.strip():  # "" would fall back to the built-in corpus unsaid
        yield "--data is empty: name a directory of shards (or a mixture), or leave it out for the built-in corpus"
    if e.eval_interval and e.eval_tokens < 1:
        yield "--eval-tokens must be >= 1 when evaluating"
    yield from _fraction_problems(cfg)
    if s.batch_warmup_steps and d.grad_accum == 1 and not d.total_batch_tokens:
        yield ("--batch-warmup-steps ramps the micro-steps of each step: it needs --grad-accum > 1 (or "
               "--total-batch-tokens)")
    if 0 < d.total_batch_tokens < cfg.model.max_seq_len:  # on any number of ranks
        yield (f"--total-batch-tokens {d.total_batch_tokens:,} is less than one sequence (--seq-len "
               f"{cfg.model.max_seq_len:,}): a step trains whole sequences")
    if not 0 < cfg.dist.ddp_bucket_mb <= 1 << 20:  # DDP takes it as a byte count it can hold
        yield f"--ddp-bucket-mb must be in (0, {1 << 20}], got {cfg.dist.ddp_bucket_mb}"
    if not MIN_COLLECTIVE_TIMEOUT <= cfg.dist.collective_timeout <= MAX_COLLECTIVE_TIMEOUT:
        yield (f"--collective-timeout must be in [{MIN_COLLECTIVE_TIMEOUT:g}, {MAX_COLLECTIVE_TIMEOUT:g}] seconds, "
               f"got {cfg.dist.collective_timeout:g}")


def _fraction_problems(cfg):
    """The flags that are fractions, each named alone when it is out of its interval."""
    s = cfg.schedule
    intervals = {"--min-lr-ratio": (s.min_lr_ratio, "[0, 1]", 0 <= s.min_lr_ratio <= 1),
                 "--decay-frac": (s.decay_frac, "(0, 1]", 0 < s.decay_frac <= 1),
                 "--batch-warmup-start": (s.batch_warmup_start, "(0, 1]", 0 < s.batch_warmup_start <= 1),
                 "--rollback-lr-factor": (cfg.resilience.rollback_lr_factor, "(0, 1]",
                                          0 < cfg.resilience.rollback_lr_factor <= 1)}
    yield from (f"{flag} must be in {interval}, got {value}" for flag, (value, interval, inside) in intervals.items()
                if not inside)


def _combination_problems(cfg):
    """Combinations that cannot work, refused at start-up instead of crashing mid-run."""
    mode = cfg.dist.dist
    if cfg.data.batch_size == "auto":
        if not cfg.data.total_batch_tokens or mode == "fsdp":
            yield ("--batch-size auto needs --total-batch-tokens (the global batch it keeps), and --dist none or ddp "
                   "(under FSDP2 a probe that runs out of memory would stall the other ranks)")
    if cfg.speed.activation_dtype == "bf16" and cfg.speed.dtype in ("fp16", "fp32"):
        yield (f"--activation-dtype bf16 runs between bf16 autocast's GEMMs: it needs --dtype bf16 (or auto), not "
               f"{cfg.speed.dtype}")
    if mode == "fsdp" and cfg.speed.dtype == "fp16":
        yield "--dist fsdp with --dtype fp16 is not supported (needs a sharded grad scaler); use bf16"
    if mode == "fsdp" and not OPTIMIZERS[cfg.optim.name].fsdp:
        yield (f"--optimizer {cfg.optim.name} does not support FSDP2's sharded (DTensor) parameters; use --optimizer "
               f"{' or '.join(with_property('fsdp'))}, or --dist ddp")
    if cfg.ckpt.overwrite and cfg.ckpt.resume == "on":
        yield "--overwrite replaces an earlier run and --resume continues it: give one of them"
    at_evals = (("--eval-hellaswag", cfg.eval.eval_hellaswag, "runs"),
                ("--sample-tokens", cfg.eval.sample_tokens, "runs"),
                ("--early-stop-patience", cfg.resilience.early_stop_patience, "counts"))
    for flag, value, acts in at_evals:
        if value and not cfg.eval.eval_interval:
            yield f"{flag} {acts} at evals: it needs --eval-interval > 0"
    if cfg.speed.target_gpu and not cfg.speed.estimate_memory:
        yield "--target-gpu names the GPU for --estimate-memory; a training run uses the GPU it runs on"
    if cfg.fp8.fused_wgrad and mode != "none":
        yield (f"--fp8-fused-wgrad runs in one process (--dist none), not under --dist {mode}: its weight gradients "
               f"bypass autograd, where {'DDP' if mode == 'ddp' else 'FSDP2'} reduces them")
    if cfg.fp8.mode == "te" and cfg.eval.sample_tokens:
        yield "--sample-tokens needs the plain backend's KV cache; it does not run with --fp8 te"
