"""BatchLayout: micro-batch, accumulation and world size; the run's steps and epochs; what a resume keeps.

Where the batch is decided: how a step's tokens are cut into micro-batches across ranks, how many steps a
run takes and how many passes over the data they make, and what a resume keeps of its global batch.

    layout = batch_layout(cfg, world_size)             # micro-batch, seq-len, grad accumulation, world size
    steps = max_steps(cfg, layout)                     # --max-steps, or the steps --max-tokens takes
    layout = resume_layout(cfg, layout, meta, warn)    # a resume at another world size keeps the global batch
    tokens = planned_tokens(cfg, layout, start_step, steps, start_tokens)   # what the run trains on, in all
    describe_epochs(tokens, loader.tokens_per_epoch, bos)  # how many epochs of the train split that is
    plan_warnings(cfg, layout, steps, loader.epoch_plan(tokens))  # e.g. a train split read more than once
"""

import dataclasses
import math
from dataclasses import dataclass

from cli import UsageError
from config import Config, flat_dict, flat_values
from schedule import BATCH_KEYS, schedule_warning


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's batch is cut: micro-batches of `micro_batch` sequences of `seq_len` tokens,
    `grad_accum` of them on each of `world_size` ranks."""

    micro_batch: int
    seq_len: int
    grad_accum: int
    world_size: int

    @property
    def tokens_per_step(self) -> int:
        """Global: all ranks and micro-steps together."""
        return self.micro_batch * self.seq_len * self.grad_accum * self.world_size

    @property
    def sequences_per_rank(self) -> int:
        return self.micro_batch * self.grad_accum

    def with_micro_batch(self, micro_batch: int) -> "BatchLayout":
        """The same global batch cut into smaller micro-batches (micro_batch must divide sequences_per_rank)."""
        return dataclasses.replace(self, micro_batch=micro_batch,
                                   grad_accum=self.sequences_per_rank // micro_batch)

    def at_step(self, step: int, warmup_steps: int, start: float) -> "BatchLayout":
        """The layout of optimizer step `step` (0-based) under the batch warm-up: fewer micro-steps, same
        micro-batch (warmup_micro_steps); itself once the warm-up is over. Telemetry counts tokens from it."""
        micro_steps = warmup_micro_steps(step, self.grad_accum, warmup_steps, start)
        return self if micro_steps == self.grad_accum else dataclasses.replace(self, grad_accum=micro_steps)


def warmup_micro_steps(step: int, grad_accum: int, warmup_steps: int, start: float) -> int:
    """Micro-steps of optimizer step `step` (0-based) when the global batch ramps linearly from `start` x itself
    at step 0 to all of it at step warmup_steps, rounded to whole micro-steps (at least one): the batch grows
    by gradient accumulation, so the micro-batch, its memory and the data order stay as they are, and a
    resumed run recomputes the same count from the step alone."""
    if step >= warmup_steps:
        return grad_accum
    fraction = start + (1 - start) * step / warmup_steps
    return max(1, min(grad_accum, math.floor(fraction * grad_accum + 0.5)))  # halves round up, not to even


def steps_for_tokens(max_tokens: int, layout: BatchLayout, warmup_steps: int = 0, start: float = 1.0) -> int:
    """Optimizer steps until at least max_tokens are trained, counting the smaller steps of the batch warm-up,
    so that --max-tokens is the same budget with it or without it."""
    tokens, step = 0, 0
    while step < warmup_steps and tokens < max_tokens:
        tokens += layout.at_step(step, warmup_steps, start).tokens_per_step
        step += 1
    return step + max(0, math.ceil((max_tokens - tokens) / layout.tokens_per_step))


def tokens_for_steps(layout: BatchLayout, first: int, end: int, warmup_steps: int = 0, start: float = 1.0) -> int:
    """Tokens that optimizer steps first to end - 1 (0-based) train, counting the smaller steps of the batch
    warm-up: one term per warm-up step, and one product for the steps after it."""
    ramp = sum(layout.at_step(step, warmup_steps, start).tokens_per_step
               for step in range(first, min(end, warmup_steps)))
    return ramp + max(0, end - max(first, warmup_steps)) * layout.tokens_per_step


def per_rank_sequences(cfg: Config, world_size: int) -> int:
    """Sequences each rank trains on per step under --total-batch-tokens (what --batch-size auto divides)."""
    return cfg.data.total_batch_tokens // (cfg.model.max_seq_len * world_size)


def dividing_batch_size(tokens: int, micro: int, seq_len: int, world_size: int) -> int | None:
    """A --batch-size whose micro-steps make exactly `tokens` on world_size ranks (a common divisor of `micro` and
    the sequences each rank takes, not searched for), or None when the tokens are not whole sequences a rank."""
    per_rank, rest = divmod(tokens, seq_len * world_size)
    return math.gcd(micro, per_rank) if per_rank and not rest else None


def total_batch_advice(total: int, micro: int, seq_len: int, world_size: int) -> str:
    """What fits a --total-batch-tokens that micro-batches of `micro` sequences do not divide: a --batch-size
    that does, or the nearest total that these micro-batches make."""
    per_micro = micro * seq_len * world_size
    nearest = max(1, round(total / per_micro)) * per_micro
    fits = dividing_batch_size(total, micro, seq_len, world_size)
    smaller = f"--batch-size {fits} divides it, or " if fits else ""
    return f"{smaller}--total-batch-tokens {nearest} fits --batch-size {micro}"


def batch_layout(cfg: Config, world_size: int = 1, micro_batch: int | None = None) -> BatchLayout:
    """The layout the flags ask for; micro_batch: the size --batch-size auto found. With
    --total-batch-tokens, grad_accum is derived so that the global batch is exactly that many tokens."""
    micro = cfg.data.batch_size if micro_batch is None else micro_batch
    seq_len = cfg.model.max_seq_len
    grad_accum = cfg.data.grad_accum
    if cfg.data.total_batch_tokens:
        per_micro = micro * seq_len * world_size
        if cfg.data.total_batch_tokens % per_micro:
            raise UsageError(f"--total-batch-tokens {cfg.data.total_batch_tokens} is not a multiple of "
                             f"batch-size * seq-len * world-size = {per_micro}: "
                             + total_batch_advice(cfg.data.total_batch_tokens, micro, seq_len, world_size))
        grad_accum = cfg.data.total_batch_tokens // per_micro
    return BatchLayout(micro_batch=micro, seq_len=seq_len, grad_accum=grad_accum, world_size=world_size)


def max_steps(cfg: Config, layout: BatchLayout) -> int:
    """--max-steps, or the steps --max-tokens takes with this layout (and the batch warm-up, if on)."""
    s = cfg.schedule
    if not s.max_tokens:
        return s.max_steps
    return steps_for_tokens(s.max_tokens, layout, s.batch_warmup_steps, s.batch_warmup_start)


def planned_tokens(cfg: Config, layout: BatchLayout, start_step: int, max_steps: int, start_tokens: int = 0) -> int:
    """The tokens a run will have trained at its last step: start_tokens before start_step (a resumed run's,
    as its checkpoint counted them, whatever the batch was then), then this layout's steps up to max_steps."""
    s = cfg.schedule
    return start_tokens + tokens_for_steps(layout, start_step, max_steps, s.batch_warmup_steps, s.batch_warmup_start)


def describe_epochs(tokens: int, epoch_tokens: int, at_least: bool, source: str = "") -> str:
    """Tokens against a train split, as "307,200 tokens of a 92,160-token train split: 3.33 epochs". epoch_tokens:
    what one epoch of the loader trains on (data.epoch_tokens); at_least: that is an upper bound (--packing bos),
    so the epochs are a lower one; source: the mixture's source whose split it is ("" for --data DIR)."""
    whose = f"source {source}'s" if source else "a"
    split = (f"{whose} train split that --packing bos packs into at most {epoch_tokens:,} tokens an epoch" if at_least
             else f"{whose} {epoch_tokens:,}-token train split")
    return f"{tokens:,} tokens of {split}: {'at least ' if at_least else ''}{tokens / epoch_tokens:.2f} epochs"


def epochs_warning(cfg: Config, tokens: int, epoch_tokens: int, source: str = "") -> str | None:
    """A warning for a run planned to read more than one epoch of its train split (planned_tokens against
    data.epoch_tokens; a mixture's source: its share of them), naming the flag that sets the run's length;
    None for one epoch or less."""
    if tokens <= epoch_tokens:
        return None
    flag = "--max-tokens" if cfg.schedule.max_tokens else "--max-steps"
    what = describe_epochs(tokens, epoch_tokens, cfg.data.packing == "bos", source)
    return (f"warning: the run will read {what}, so it trains on the same data more than once; lower {flag} for "
            f"one epoch or less, or prepare more data" + (f", or lower the weight of {source}" if source else ""))


def plan_warnings(cfg: Config, layout: BatchLayout, max_steps: int, epoch_plan: list[tuple[int, int, str]]
                  ) -> list[str]:
    """The start-up warnings about the run's plan: a warm-up as long as the run, a batch warm-up that does not
    fit, and a train split read more than once (epochs_warning of each source of the loader's epoch_plan:
    (its tokens, its tokens_per_epoch, its name))."""
    s = cfg.schedule
    warnings = [schedule_warning(s.warmup, max_steps, s.schedule, s.decay_frac),
                batch_warmup_warning(s.batch_warmup_steps, s.batch_warmup_start, max_steps, layout),
                *(epochs_warning(cfg, tokens, per_epoch, source) for tokens, per_epoch, source in epoch_plan)]
    return [warning for warning in warnings if warning]


def resume_batch_advice(saved: int, layout: BatchLayout) -> str:
    """What keeps a checkpoint's global batch of `saved` tokens at this world size, if anything does."""
    if fits := dividing_batch_size(saved, layout.micro_batch, layout.seq_len, layout.world_size):
        return f"--batch-size {fits} divides it, or --total-batch-tokens sets a new batch"
    return (f"no --batch-size can keep it: it is not whole sequences of {layout.seq_len} on each of "
            f"{layout.world_size} ranks; resume at a world size that divides it, or give --total-batch-tokens")


def resume_layout(cfg: Config, layout: BatchLayout, meta: dict, warn) -> BatchLayout:
    """The layout of a resumed run. The global batch in tokens is part of a run's identity: resumed at another
    world size with the same batch settings, the run keeps the checkpoint's global batch by deriving grad
    accumulation, or is refused when whole micro-batches cannot make it. Settings changed on purpose
    (BATCH_KEYS) are the user's new batch. A checkpoint that records no batch_tokens is taken as it is."""
    saved, saved_world = meta.get("batch_tokens"), meta.get("world_size")
    if saved is None or saved_world == layout.world_size or saved == layout.tokens_per_step:
        return layout
    saved_cfg, now = flat_dict(meta.get("train_config", {})), flat_values(cfg)
    if any(key in saved_cfg and saved_cfg[key] != now[key] for key in BATCH_KEYS):
        return layout
    per_micro_step = layout.micro_batch * layout.seq_len * layout.world_size
    if saved % per_micro_step:
        raise UsageError(f"--resume at {layout.world_size} ranks: the checkpoint's global batch of {saved:,} "
                         f"tokens/step ({saved_world} ranks) is not a whole number of micro-steps of "
                         f"{per_micro_step:,} tokens ({layout.micro_batch} x {layout.seq_len} x {layout.world_size} "
                         "ranks); " + resume_batch_advice(saved, layout))
    resumed = dataclasses.replace(layout, grad_accum=saved // per_micro_step)
    warn(f"note: resuming on {layout.world_size} ranks (the checkpoint ran on {saved_world}): grad accumulation "
         f"{layout.grad_accum} -> {resumed.grad_accum} keeps the global batch of {saved:,} tokens/step")
    return resumed


def batch_warmup_warning(warmup_steps: int, start: float, max_steps: int, layout) -> str | None:
    """schedule_warning's counterpart for the batch warm-up: a ramp whose last step, the run's, is still short
    of the whole global batch, or None. layout: the run's batch.BatchLayout, whose at_step gives a step's."""
    last = layout.at_step(max_steps - 1, warmup_steps, start).grad_accum
    if last == layout.grad_accum:
        return None
    return (f"warning: --batch-warmup-steps {warmup_steps} is not shorter than the run ({max_steps} steps): the "
            f"global batch reaches only {last} of its {layout.grad_accum} micro-steps; lower --batch-warmup-steps")
