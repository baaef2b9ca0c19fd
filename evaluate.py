"""Validation during training: the mean loss over a fixed slice of the val split, and a text sample, at a
cadence the Evaluator decides itself.

    evaluator = Evaluator(cfg.eval, data_dir, info, device, vocab_size, seed)
    if evaluator.due(done, max_steps):
        val_loss = evaluator.val_loss(forward, model, autocast, micro_batch, seq_len)
"""

import torch

import distributed
import hardware
from cli import UsageError
from data import ShardLoader, get_tokenizer
from progress import Progress
from sample import sample_text


class Evaluator:
    def __init__(self, cfg, data_dir: str, info: "distributed.DistInfo", device: torch.device, vocab_size: int,
                 seed: int):
        """cfg: config.EvalConfig."""
        self.cfg, self.data_dir, self.info, self.device = cfg, data_dir, info, device
        self.vocab_size, self.seed = vocab_size, seed

    def due(self, done: int, max_steps: int) -> bool:
        """Evaluate after `done` steps? On the interval, and always at the end (unless evaluation is off)."""
        interval = self.cfg.eval_interval
        return bool(interval) and (done % interval == 0 or done == max_steps)

    def _loader(self, micro_batch: int, seq_len: int, ranks: bool = True) -> ShardLoader:
        rank, world_size = (self.info.rank, self.info.world_size) if ranks else (0, 1)
        return ShardLoader(self.data_dir, split="val", batch_size=micro_batch, seq_len=seq_len, shuffle=False,
                           rank=rank, world_size=world_size, device=str(self.device), prefetch=0,
                           vocab_size=self.vocab_size)

    def check(self, micro_batch: int, seq_len: int) -> None:
        """Fail at start-up, not at the first eval: no usable val split (DataError), or a sample prompt whose
        GPT-2 token ids the model's vocabulary cannot hold (an empty one starts from the end-of-text id)."""
        if self.cfg.eval_interval:
            self._loader(micro_batch, seq_len, ranks=False).close()
        if self.cfg.sample_tokens:
            enc = get_tokenizer()
            top = max(enc.encode_ordinary(self.cfg.sample_prompt) or [enc.eot_token])
            if top >= self.vocab_size:
                raise UsageError(f"--sample-prompt {self.cfg.sample_prompt!r} starts sampling from GPT-2 token id "
                                 f"{top}, beyond --vocab-size {self.vocab_size}; give a prompt within it")

    @torch.no_grad()
    def val_loss(self, forward, model: torch.nn.Module, autocast, micro_batch: int, seq_len: int) -> float:
        """Mean loss over the first eval_tokens of the val split: the same tokens every time, split across
        ranks. forward: what the training step calls (compiled, wrapped); autocast: the step's context."""
        loader = self._loader(micro_batch, seq_len)
        n_batches = max(1, self.cfg.eval_tokens // (micro_batch * seq_len * self.info.world_size))
        model.eval()
        total = torch.zeros((), device=self.device)
        progress = Progress(n_batches, "eval", unit="batch", enabled=self.info.is_main)
        for _ in range(n_batches):
            x, y = next(loader)
            with autocast():
                _, loss = forward(x, y)
            total += loss.float()
            progress.update()
        progress.close()
        model.train()
        loader.close()
        return distributed.mean_across_ranks(total / n_batches, self.info).item()

    def sample(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> str | None:
        """A sample of --sample-tokens after --sample-prompt, or None when sampling is off. Call it on every
        rank: under FSDP2 each forward is a collective. It runs under the training's autocast: FSDP2's blocks
        hold 16-bit weights while the residual stream is float32."""
        if not self.cfg.sample_tokens:
            return None
        with hardware.autocast(self.device, autocast_dtype):
            return sample_text(model, get_tokenizer(), self.cfg.sample_prompt, self.cfg.sample_tokens,
                               seed=self.seed)
