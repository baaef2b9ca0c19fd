"""Pretrain a Qwen3-style GPT on token shards: main wires small builders into a loop.Run, then runs the loop.

    python train.py                          # small model on the embedded stdlib corpus
    python train.py --data DIR --n-layer 12  # your own shards (see `python prepare.py --help`)
    torchrun --nproc_per_node=8 train.py --dist fsdp --data DIR ...   # data parallel, one node

This file only wires the pieces, and reads top to bottom: config.py turns the flags into a checked Config;
setup() builds the model (fp8.py, memory.py), wraps it (distributed.py), and builds the optimizer (optim.py),
the data (data.py) and the components that decide their own cadence: Evaluator (evaluation.py), Checkpointer
(checkpoint.py), Guard (resilience.py) and Telemetry (telemetry.py), into a loop.Run; startup.py says what
it is and what it will cost. loop.run_loop() then steps and asks each of them whether it is due.
"""

import functools
import os
import random
import sys
import time
from dataclasses import replace

import torch

import batch
import config
import distributed
import fp8
import hardware
import headroom
import memory
import mixture
import report
from checkpoint import Checkpointer, CheckpointError, config_changes, load_newest, read_meta, tokens_trained
from cli import DataError, UsageError, WriteError, report_error, report_startup_error, speaks_for_the_run
from config import PROFILE_ACTIVE, PROFILE_WAIT, Config
from data import tokenizer_id
from evaluation import Evaluator
from hf import hf_model_config, load_hf
from loop import Run, run_loop
from model import GPT
from optim import build_optimizer
from resilience import Guard, TrainingHalted, stop_at_once
from rundir import NothingToDo, prepare_outputs, replace_outputs
from schedule import resume_lr
from shards import data_record
from sizing import flops_per_token
from startup import announce, plan_run
from telemetry import Telemetry, logger_problems, message, start_wandb

# ----------------------------------------------------------------------------- setup


def build_model(cfg: Config, device: torch.device, autocast_dtype: torch.dtype | None = None):
    """-> (model, its config, where its weights come from). FP8 and memory.configure are applied here, before
    anything wraps the model (distributed.parallelize documents the order)."""
    torch.manual_seed(cfg.data.seed)
    random.seed(cfg.data.seed)
    model_cfg, init_state, init_reason = cfg.model, None, f"random (seed {cfg.data.seed})"
    if cfg.ckpt.from_hf:
        hf_cfg, init_state = load_hf(cfg.ckpt.from_hf)
        model_cfg = replace(hf_cfg, max_seq_len=cfg.model.max_seq_len)
        init_reason = f"weights of {cfg.ckpt.from_hf}"
    model = GPT(model_cfg, block=fp8.block_class(cfg.fp8)).to(device)
    if init_state is not None:  # loaded while the parameters are plain tensors, before any FP8 conversion
        model.load_state_dict(fp8.block_state_dict(init_state, cfg.fp8.mode))
    fp8.convert(model, cfg.fp8)
    memory.configure(model, cfg.speed, device, autocast_dtype)
    model.activation_dtype = hardware.activation_dtype(cfg.speed.activation_dtype, autocast_dtype, device)
    return model, model_cfg, init_reason


def build_layout(cfg: Config, model, info, device, autocast_dtype, fp8_recipe) -> batch.BatchLayout:
    """The batch layout; --batch-size auto on CUDA probes the bare model, under the training forward's autocast
    (FP8 delayed scaling's without its cross-rank amax reduction, its state reset afterwards: fp8.probing), for
    the largest micro-batch that fits; elsewhere it takes the largest whose estimate fits the memory the
    process has left (headroom.auto_micro_batch)."""
    micro = None
    if cfg.data.batch_size == "auto" and device.type != "cuda":
        micro = headroom.auto_micro_batch(cfg, model, device, autocast_dtype, info)
    elif cfg.data.batch_size == "auto":
        multiple = fp8.batch_multiple(cfg.fp8, model.config.max_seq_len)
        reserve = memory.probe_reserve_bytes(model.config, cfg.optim.name, info.mode, info.world_size)
        with fp8.probing(model, fp8_recipe) as probe_recipe:
            micro = memory.auto_batch_size(model, batch.per_rank_sequences(cfg, info.world_size), multiple,
                                           reserve, lambda: hardware.forward_context(device, autocast_dtype,
                                                                                   fp8.fp8_context(probe_recipe)),
                                           device, info)
    return batch.batch_layout(cfg, info.world_size, micro)


def setup(cfg: Config, command_line: dict | None = None) -> Run:
    """Build and check everything; every user mistake surfaces here, before the first step. command_line: the
    flags that made cfg, as config.build_parser parses them, for config.check_config_edits."""
    if problem := distributed.check_launch(cfg.dist.dist):
        raise UsageError(problem)
    cfg = replace(cfg, data=replace(cfg.data, data=mixture.absolute_data(cfg.data.data)))  # as the run records it
    device, device_reason = hardware.resolve_device(cfg.speed.device)
    autocast_dtype, dtype_reason = hardware.resolve_dtype(cfg.speed.dtype, device)
    auto_batch = cfg.data.batch_size == "auto"
    fp8_recipe = fp8.prepare(cfg.fp8, cfg.model, None if auto_batch else cfg.data.batch_size, device, autocast_dtype)
    info = distributed.init(cfg.dist.dist, device.type, cfg.dist.collective_timeout)
    # A CPU's auto dtype comes from a timing probe, which ranks sharing a host could answer differently.
    autocast_dtype, dtype_reason = distributed.broadcast_object((autocast_dtype, dtype_reason), info)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank if info.mode != "none" else torch.cuda.current_device())
    reasons = {"device": device_reason, "dtype": dtype_reason, "tf32": hardware.set_tf32(device, cfg.speed.tf32)}
    hardware.keep_freed_memory(device)
    data, resume, lock, replaced, staged = prepare_outputs(cfg, info, command_line or {})
    try:
        run = build_run(cfg, info, device, autocast_dtype, fp8_recipe, data, resume, lock, reasons)
    except BaseException:
        if staged is not None:
            os.remove(staged)
        if lock is not None:  # a run built in this process later (bench/ladder.py, tests) may claim it again
            lock.abandon()
        raise
    replace_outputs(replaced, staged)  # only now that this run has passed every start-up check
    return run


def nothing_to_do(start_step: int, max_steps: int) -> str:
    """What a run that has no step left to train says (exit 0, so that a restart loop stops)."""
    if max_steps == 0:
        return "nothing to do: --max-steps 0 trains no steps"
    if start_step > max_steps:
        return f"nothing to do: the checkpoint is at step {start_step}, past this run's last step, {max_steps}"
    return f"nothing to do: already at step {start_step} of {max_steps}"


def build_run(cfg: Config, info, device, autocast_dtype, fp8_recipe, data: str, resume: bool, lock,
              reasons: dict) -> Run:
    """The model, its wrappers, the optimizer, the data (--data: mixture.py) and the components, restored when
    resuming. The model's vocabulary is settled with the flags (mixture.data_vocab)."""
    sources = mixture.open_sources(data, cfg.model.max_seq_len)  # refused before anything that size is allocated
    check_run_config = functools.partial(config.check_resume, cfg=cfg)  # the run's settings against a checkpoint's
    newest = resume and not cfg.ckpt.from_hf and load_newest(cfg.ckpt.out_dir, read_meta, lambda line: None)
    if newest:  # the checkpoint's record is enough to refuse other model flags: before the model exists or is timed
        config_changes(newest[1], cfg.model, cfg.ckpt.out_dir, check_run_config)
    memory.check_fits(cfg.model, cfg.optim.name, device, info.world_size if info.mode == "fsdp" else 1)
    model, model_cfg, reasons["init"] = build_model(cfg, device, autocast_dtype)
    if problem := mixture.vocab_problem(model_cfg.vocab_size, sources):
        raise DataError(f"--from-hf {cfg.ckpt.from_hf}: {problem}" if cfg.ckpt.from_hf else problem)
    layout = build_layout(cfg, model, info, device, autocast_dtype, fp8_recipe)
    wrapped, compiled = distributed.parallelize(model, info, device, autocast_dtype, cfg.dist, cfg.speed.compile)
    optimizer = build_optimizer(model, cfg.optim, model.row_blocks(), device.type, compile=cfg.speed.compile != "off")
    loader = mixture.open_loader(sources, split="train", batch_size=layout.micro_batch, seq_len=layout.seq_len,
                                 rank=info.rank, world_size=info.world_size, seed=cfg.data.seed, device=str(device),
                                 vocab_size=model_cfg.vocab_size, packing=cfg.data.packing)
    evaluator = Evaluator(cfg.eval, data, info, device, model_cfg.vocab_size, cfg.data.seed)
    evaluator.check(layout.micro_batch, layout.seq_len)

    checkpointer = Checkpointer(cfg.ckpt.out_dir, cfg.ckpt.ckpt_interval, cfg.ckpt.keep_ckpts, info, model_cfg,
                                config.to_dict(cfg), loader.fingerprint(), cfg.data.allow_data_change,
                                check_run_config, tokenizer_id(data_record(mixture.record_dir(sources))))
    guard, start_step, start_tokens, meta = Guard(cfg.resilience), 0, 0, {}
    if resume:
        warn = message if info.is_main else lambda _: None
        meta = checkpointer.restore(model, optimizer, loader, warn=warn)
        guard.load_state_dict(meta)
        layout = batch.resume_layout(cfg, layout, meta, warn)
        start_step, start_tokens = meta["step"], tokens_trained(meta, layout.tokens_per_step)
    max_steps = batch.max_steps(cfg, layout)
    if start_step >= max_steps:  # before the LR check: a finished run has no next step to re-warm
        raise NothingToDo(nothing_to_do(start_step, max_steps))
    if resume and (note := resume_lr(cfg, config.flat_dict(meta.get("train_config", {})), config.flat_values(cfg),
                                     meta, max_steps)):
        warn(note)
    if cfg.log.profile and max_steps - start_step < PROFILE_WAIT + PROFILE_ACTIVE:
        raise UsageError(f"--profile needs at least {PROFILE_WAIT + PROFILE_ACTIVE} steps to run; this run has "
                         f"{max_steps - start_step} (--max-steps / --max-tokens)")

    peak, reasons["peak"] = hardware.peak_flops(device, cfg.log.peak_tflops)
    wandb_run, reasons["wandb"] = (start_wandb(cfg.log, cfg.ckpt.out_dir, resume, config.to_dict(cfg))
                                   if info.is_main else (None, ""))
    telemetry = Telemetry(cfg, info.is_main, device, start_step, max_steps, flops_per_token(model_cfg, layout.seq_len),
                          peak, wandb_run, optimizer, start_tokens, meta.get("record"), loader.tokens_per_epoch)
    run = Run(cfg=cfg, model_cfg=model_cfg, info=info, device=device, autocast_dtype=autocast_dtype,
              fp8_recipe=fp8_recipe, model=model, wrapped=wrapped, compiled=compiled, optimizer=optimizer,
              scaler=torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16), loader=loader,
              layout=layout, max_steps=max_steps, start_step=start_step, guard=guard, evaluator=evaluator,
              checkpointer=checkpointer, telemetry=telemetry, lock=lock)
    planned = batch.planned_tokens(cfg, layout, start_step, max_steps, start_tokens)
    try:  # the table, then (every rank) the first step's memory, then the time a timing probe gives
        announce(run, sources, reasons, planned)
        plan_run(run, planned)
    except BaseException:
        run.close()
        raise
    return run


def main(argv=None):
    started = time.perf_counter()
    stop_at_once()
    try:
        cfg, command_line = config.parse_command_line(argv, __doc__, (logger_problems,),
                                                      mixture.data_vocab, hf_model_config)
        if cfg.speed.estimate_memory:
            print(memory.memory_report(cfg))
            return
        run = setup(cfg, command_line)
    except NothingToDo as e:  # a success: a restart loop must stop, not retry
        if speaks_for_the_run():
            message(str(e))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return
    except (UsageError, DataError, CheckpointError, ValueError, WriteError) as e:
        # Only setup is guarded: ValueError there is config validation in model.py / optim.py, while an
        # exception inside the loop is a bug and keeps its traceback. Every rank fails alike; rank 0 says why,
        # and a rank that failed alone has its line quoted by rank 0's lost collective (distributed.lost_rank).
        distributed.leave_error(str(e))
        sys.exit(report_startup_error(e))
    outcome = None  # stays None for a bug, whose traceback is the report
    try:
        outcome = run_loop(run) or "finished"
    except (CheckpointError, DataError, TrainingHalted, WriteError) as e:  # bad tokens, a full disk, a run that cannot go on
        outcome = f"halted: {e}"
        # The guard's halts are agreed across ranks, and a DCP save fails on all of them: rank 0 says those.
        distributed.report_stop(e, run.info, isinstance(e, TrainingHalted) or getattr(e, "every_rank", False))
        sys.exit(1 if isinstance(e, (TrainingHalted, WriteError)) else 2)
    except RuntimeError as e:  # another rank gone: this one says so in a line; anything else is a bug
        if (lost := distributed.lost_rank(e, run.info)) is None:
            raise
        outcome = f"halted: {lost}"
        report_error(lost)
        sys.exit(1)
    finally:
        if outcome is not None:
            report.after_run(run.telemetry.summary(outcome, time.perf_counter() - started, run.guard.early_stop.best,
                                                   run.info.world_size), run.device, run.info.world_size)
        run.close()
        info, run = run.info, None  # the models go before the process group (distributed.shutdown says why)
        distributed.shutdown(info)


if __name__ == "__main__":
    main()
