"""The start-up table, then what the run will cost: said before the run allocates anything the size of a batch.

    announce(run, sources, reasons, planned_tokens)   # rank 0: the table, what is active and why, each detected
    plan_run(run, planned_tokens)                     # every rank: the first step's memory; rank 0: the time row

The table comes first, so that a run refused because its first step would not fit the memory the process has
left (headroom.py), or one whose timing probe takes a while (plan.py), has already said what it is.
"""

import os

import fp8
import headroom
import memory
import mixture
import optim
import plan
import sizing
from batch import describe_epochs, plan_warnings
from cli import plural
from config import flat_values
from hardware import cpu_bf16_warning, cpu_flags, describe_precision
from loop import Run
from optim import describe_param_groups
from runlog import TENSORBOARD_DIR
from telemetry import message, print_table

KEY_WIDTH = len("activation ckpt")  # the table's longest name, so that the time row, printed later, lines up


def announce(run: Run, sources: list, reasons: dict, planned_tokens: int) -> None:
    """Rank 0's start-up table (startup_rows), all but its time row (plan_run)."""
    if run.info.is_main:
        run.telemetry.eval_plan = run.evaluator.describe_val()  # the summary keeps it for report.py
        run.telemetry.precision = describe_precision(reasons["dtype"], run.model.activation_dtype,
                                                     run.autocast_dtype, run.cfg.speed.activation_dtype)
        print_table(startup_rows(run, sources, reasons, planned_tokens), KEY_WIDTH)


def plan_run(run: Run, planned_tokens: int) -> None:
    """Every rank: refuse a first step that does not fit the memory the process has left (headroom, a
    UsageError on a CPU, a warning on CUDA). Rank 0: time a micro-step on the bare model (plan.step_time, only
    probes that fit), price the optimizer, the evals and the checkpoints, and print the time row and the plan's
    warnings: bf16 emulated on a CPU, the schedule's, a train split read more than once (batch.plan_warnings),
    a run over a day or a step over a minute (plan.warnings)."""
    cfg, layout, info, device = run.cfg, run.layout, run.info, run.device
    extra = headroom.first_step_bytes(cfg, run.model, device, run.autocast_dtype, info, state_restored=run.start_step > 0)
    room = headroom.host_room(device, info)
    warning = headroom.check_first_step(cfg, layout, extra, room, fp8.batch_multiple(cfg.fp8, layout.seq_len),
                                        device)
    if not info.is_main:
        return
    if warning:
        message(warning)
    fits = None if room is None or device.type == "cuda" else lambda b, s: extra(b, s) <= room.bytes
    steps, to_train = run.max_steps - run.start_step, planned_tokens - run.telemetry.start_tokens
    step = plan.step_time(run.model, layout, device, run.autocast_dtype, run.fp8_recipe, info.mode == "fsdp",
                          steps * layout.grad_accum, fits)
    step = step._replace(optimizer_s=optimizer_seconds(run))
    extras = run_extras(run, step)
    print_table([("time", plan.describe(step, layout.grad_accum, to_train, layout.tokens_per_step, extras))],
                KEY_WIDTH)
    length_flag = "--max-tokens" if cfg.schedule.max_tokens else "--max-steps"
    warnings = [cpu_bf16_warning(cfg.speed.dtype, device.type, cpu_flags()),
                *plan_warnings(cfg, layout, run.max_steps, run.loader.epoch_plan(planned_tokens)),
                *plan.warnings(step, layout.grad_accum, to_train, layout.tokens_per_step, length_flag,
                               run.telemetry.flops_per_token * to_train if device.type == "cpu" else None, extras)]
    for line in filter(None, warnings):
        message(line)


def optimizer_seconds(run: Run) -> float:
    """plan.optimizer_seconds of the run's optimizer: its Newton-Schulz GEMMs timed at their own shape and
    dtype ([d, ffn] x [ffn, d], d the width), its elementwise bytes at the device's copy rate."""
    cfg, info, m = run.cfg, run.info, run.model_cfg
    state = memory.optimizer_state_bytes_estimate(m, cfg.optim.name, info.world_size == 1)
    work = optim.step_work(run.optimizer, state, info.world_size, info.mode == "fsdp")
    ns_rate = (plan.matmul_rate(run.device, work.ns_dtype, m.n_embd, m.resolved_ffn_dim, m.n_embd)
               if work.ns_flops else None)
    return plan.optimizer_seconds(work, ns_rate, plan.copy_rate(run.device, work.elementwise_bytes))


def run_extras(run: Run, step: plan.StepTime) -> plan.RunExtras:
    """The run's evals (Evaluator's cadence: on --eval-interval and at the end) and checkpoints (Checkpointer's:
    on --ckpt-interval and at the end, and a best one at an eval that improves, counted at every eval)."""
    cfg, layout = run.cfg, run.layout
    start, end, every_eval = run.start_step, run.max_steps, cfg.eval.eval_interval
    evals = plan.steps_due(start, end, every_eval) if every_eval else 0
    checkpoint_bytes = (memory.state_bytes(run.model.state_dict())  # state, not Muon's working buffers
                        + memory.optimizer_state_bytes_estimate(run.model_cfg, cfg.optim.name, one_process=False))
    return plan.run_extras(step, layout.micro_batch * layout.seq_len, evals,
                           run.evaluator.tokens_each // run.info.world_size,
                           plan.steps_due(start, end, cfg.ckpt.ckpt_interval, every_eval), checkpoint_bytes,
                           plan.write_rate(cfg.ckpt.out_dir, checkpoint_bytes))


def startup_rows(run: Run, sources: list, reasons: dict, planned_tokens: int) -> list[tuple[str, str]]:
    """The start-up table of a loop.Run: what is active and why, each detected rather than assumed.
    sources: --data's (mixture.parse_data); planned_tokens: what the run will have trained at its last step
    (batch.planned_tokens), which a mixture's sources share by their weights."""
    cfg, m, info, layout = run.cfg, run.model_cfg, run.info, run.layout
    resumed = f", counting the {run.telemetry.start_tokens:,} trained before the resume" if run.start_step else ""
    return [
        ("device", f"{run.device.type} ({reasons['device']})"),
        ("distributed", f"{info.mode}, {plural(info.world_size, 'process', 'processes')}" if info.mode != "none"
                        else "off (single process)"),
        ("precision", run.telemetry.precision),
        ("TF32 matmuls", reasons["tf32"]),
        ("size", sizing.describe(cfg.size, flat_values(cfg))),
        ("model", f"{run.model.num_params() / 1e6:.2f}M params, {plural(m.n_layer, 'layer')}, d={m.n_embd}, "
                  f"heads {m.n_head}q/{m.n_kv_head}kv, vocab {m.padded_vocab_size}"),
        ("optimizer", describe_param_groups(run.optimizer)),
        ("torch.compile", describe_compile(cfg.speed.compile, run.device.type, cfg.fp8.mode == "te")),
        ("FP8", fp8.describe_fp8(run.model, run.fp8_recipe)),
        ("activation ckpt", memory.describe_activation_checkpointing(run.model)),
        ("loss path", memory.describe_loss_path(run.model, layout.micro_batch * layout.seq_len, run.autocast_dtype)),
        ("eval", run.telemetry.eval_plan),
        ("batch", f"{layout.micro_batch} x {layout.seq_len} tokens x {plural(layout.grad_accum, 'micro-step')} x "
                  f"{plural(layout.world_size, 'rank')} = {layout.tokens_per_step:,} tokens/step"),
        ("schedule", f"{cfg.schedule.schedule}, peak lr {cfg.optim.lr:g}, warmup {cfg.schedule.warmup}, "
                     f"{plural(run.max_steps, 'step')}"),
        ("data", f"{mixture.describe(sources)} (" + ("--packing bos: rows start at documents, packed best-fit; the cropped "
                                    "fraction is logged as data_cropped_frac" if cfg.data.packing == "bos"
                                    else "windows at any offset") + ")"),
        ("plan", f"{planned_tokens - run.telemetry.start_tokens:,} tokens in "
                 f"{plural(run.max_steps - run.start_step, 'step')} (their time: the last row)"),
        ("epochs", "reads " + "; ".join(describe_epochs(tokens, per_epoch, cfg.data.packing == "bos", name)
                                        for tokens, per_epoch, name in run.loader.epoch_plan(planned_tokens))
                   + resumed),
        ("MFU peak", reasons["peak"]),
        ("wandb", reasons["wandb"]),
        ("TensorBoard", f"on: {os.path.join(cfg.ckpt.out_dir, TENSORBOARD_DIR)}" if cfg.log.tensorboard
                        else "off (--tensorboard writes metrics.jsonl's scalars for it)"),
        ("init", f"the checkpoint of step {run.start_step}" if run.start_step else reasons["init"]),
        ("resume", f"from step {run.start_step}" if run.start_step else f"off (fresh run; --resume {cfg.ckpt.resume})"),
    ]


def describe_compile(mode: str, device_type: str, te_blocks: bool = False) -> str:
    if mode == "off":
        return "off (not requested)"
    problem = fp8.te_compile_problem() if te_blocks else None
    eager_te = f"; Transformer Engine's modules run eagerly between its graphs ({problem})" if problem else ""
    if mode == "reduce-overhead" and device_type != "cuda":  # inductor skips CUDA graphs off CUDA
        return (f"on, mode reduce-overhead: CUDA graphs do not apply on {device_type}, so it runs as mode "
                f"default{eager_te}")
    return f"on, mode {mode}{eager_te}"
