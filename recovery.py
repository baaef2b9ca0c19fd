"""When a step does not go as planned: a stop signal, an out-of-memory error mid-step, a streak of non-finite
steps that needs a rollback, and the reason the run then gives. train.run_loop calls these; they act on its Run.
"""

import torch

import fp8
from checkpoint import tokens_trained
from cli import UsageError
from resilience import TrainingHalted

RESUME_HINT = "Resume with the same command plus --resume"
NOT_IN_A_STREAK = "no checkpoint inside a streak of non-finite steps"


def stop_reason(run, done: int, signals, signalled: bool, stop_early: bool, saved: bool) -> str | None:
    """Why the run stops after step `done` (saved: its checkpoint is on disk), or None when it goes on."""
    if signalled:
        written = "checkpoint written" if saved else NOT_IN_A_STREAK
        return f"stopped by {signals.requested or 'a signal to another rank'} at step {done}; {written}. {RESUME_HINT}"
    if stop_early:
        return (f"early stop at step {done}: val loss has not improved on {run.guard.early_stop.best:.4f} for "
                f"{run.cfg.resilience.early_stop_patience} evals; the best weights are in {run.checkpointer.best_path}")
    return None


def interrupted_reason(signal_name: str, step: int, saved: bool, write_s: float | None) -> str:
    """The stop reason after a signal cut step step + 1 short (train.keep_last_step); write_s: how long step
    `step`'s checkpoint took to write, None when it was on disk already."""
    kept = ("its checkpoint on disk already" if write_s is None else f"its checkpoint written in {write_s:.1f} s"
            ) if saved else NOT_IN_A_STREAK
    return f"stopped by {signal_name} during step {step + 1}, which is dropped; kept step {step}, {kept}. {RESUME_HINT}"


def rollback(run) -> int:
    """After too many non-finite steps: reload the newest good checkpoint and continue with a lower LR."""
    try:
        meta = run.checkpointer.restore(run.model, run.optimizer, run.loader, warn=run.telemetry.write)
    except UsageError:
        raise TrainingHalted(f"{run.cfg.resilience.max_bad_steps} non-finite steps in a row and no checkpoint to "
                             "roll back to yet; restart with a lower --lr") from None
    if fp8.is_delayed(run.fp8_recipe):  # the restored weights start a fresh amax history, as a resume's do
        fp8.reset_delayed_scaling(run.model)
    run.guard.rolled_back(meta)
    run.telemetry.rewind(meta["step"], tokens_trained(meta, run.layout.tokens_per_step), meta.get("record"))
    run.telemetry.write(f"rolled back to step {meta['step']} after {run.cfg.resilience.max_bad_steps} non-finite "
                        f"steps; LR now x{run.guard.lr_scale:g} of the schedule")
    return meta["step"]


def rewind_step(run, loader_state: dict) -> None:
    """Undo a step cut short before its update: its gradients, phase times and batches (the loader as before it)."""
    run.optimizer.zero_grad(set_to_none=True)
    run.telemetry.timer.collect()
    run.loader.load_state_dict(loader_state)


def shrink_micro_batch(run, loader_state: dict, smaller: int) -> None:
    """After an out-of-memory error mid-step: rewind the step and redo it with a smaller micro-batch and more
    micro-steps, so the global batch and the data order stay exactly the same."""
    rewind_step(run, loader_state)
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    run.layout = run.layout.with_micro_batch(smaller)
    run.loader.resize(smaller)
    run.telemetry.write(f"warning: out of memory; retrying the step with micro-batch {smaller} x "
                        f"{run.layout.grad_accum} micro-steps (same global batch)")
