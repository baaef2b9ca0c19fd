"""Evaluator: validation loss and bits per byte, HellaSwag, samples, during training and in score.py.

Evaluation during training (and after it, through score.py): validation loss and bits per byte over a fixed
slice of the val split, HellaSwag accuracy, and a text sample, at a cadence the Evaluator decides itself.

    evaluator = Evaluator(cfg.eval, data, info, device, vocab_size, seed)   # data: --data, one dir or a mixture
    evaluator.check(micro_batch, seq_len)      # at start-up: the val split, the prompt, the HellaSwag rows
    if evaluator.due(done, max_steps):  # -> (val_loss, val_bpb, hellaswag_acc..., a sample), None: out of memory
        result = evaluator.measure(forward, model, autocast, autocast_dtype, micro_batch, seq_len, warn, done)

Bits per byte: the val loss depends on the tokenizer (a larger vocabulary makes fewer, harder predictions),
so models with different tokenizers are compared on the text instead: val_bpb is the summed loss in nats of
the target tokens over ln 2 times their UTF-8 bytes, counted with the tokenizer that made the shards (their
data.json; GPT-2's for shards without one). A token's bytes are exact for tiktoken and byte-level BPE; for
other tokenizers they are its text decoded on its own (docs/data.md says what that leaves out). Special
tokens (GPT-2's end-of-text, 50256) have no bytes of text: they mark document boundaries, which the text
itself does not contain, so they are left out of both sums (the usual choice). val_loss still counts every
target, as training does.

HellaSwag: each example is a context and four endings, one of them right. Each ending (with a space before
it) is scored by the mean loss of its tokens given the context, and the lowest wins (hellaswag_acc, length-
normalised); the summed loss's choice is reported too (hellaswag_acc_sum), as it costs nothing more.
"""

import json
import math
import os
import re
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

import distributed
import hardware
import split
from cli import DataError, UsageError, first_line, plural
from data import ShardLoader, data_tokenizer
from mixture import Source, is_mixture, label, parse_data, record_dir
from loss import IGNORE_INDEX
from progress import Progress
from sample import sample_text
from shards import data_record
from telemetry import message
from tokenizer import Tokenizer, load_tokenizer, padded_vocab

HELLASWAG_ENDINGS = 4


# ----------------------------------------------------------------------------- bits per byte


def token_byte_lengths(enc: Tokenizer, size: int) -> torch.Tensor:
    """[size] int64: the UTF-8 bytes of each token id's text (Tokenizer.byte_lengths, built once per
    tokenizer); 0 for the tokenizer's special tokens (no text) and for ids it does not have (the vocabulary's
    padding). Indexed by target ids."""
    lengths = torch.zeros(size, dtype=torch.int64)
    n = min(size, enc.n_vocab)
    lengths[:n] = torch.from_numpy(enc.byte_lengths[:n])
    return lengths


def bpb_sums(losses: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor) -> torch.Tensor:
    """Per-token losses (nats) and their target ids, any shape -> [2] float32: the nats of the targets that
    have bytes of text, and those bytes. Sums rather than a ratio, so batches and ranks add up."""
    n_bytes = token_bytes[targets]
    nats = torch.where(n_bytes > 0, losses.float(), 0.0).sum()
    return torch.stack([nats, n_bytes.sum().float()])


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Nats over bytes, in bits: sum(loss) / (ln 2 * sum(bytes))."""
    return nats / (math.log(2) * n_bytes)


class ValRead(NamedTuple):
    """What each eval reads of one source's val split (Evaluator.check_val)."""
    name: str  # the source's ("" for a plain --data DIR)
    windows: int  # read, all ranks together
    seq_len: int  # tokens each
    split_tokens: int  # the val split's
    chosen: str  # how prepare.py chose the split (split.describe)
    split_windows: int  # the windows the split holds


# ----------------------------------------------------------------------------- HellaSwag


@dataclass(frozen=True)
class Example:
    """One multiple-choice item: the context, its candidate endings, and the index of the right one."""

    context: str
    endings: tuple[str, ...]
    label: int


def hellaswag_example(row, where: str) -> Example:
    """A row in HellaSwag's format (ctx, endings, label as an int or a digit string; other fields ignored)
    -> Example; UsageError naming `where` for a row that is not one."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: not a HellaSwag row (a JSON object with ctx, endings, label)")
    ctx, endings, label = row.get("ctx"), row.get("endings"), row.get("label")
    if not isinstance(ctx, str):
        raise UsageError(f"{where}: 'ctx' must be a string, got {ctx!r}")
    if not (isinstance(endings, list) and len(endings) == HELLASWAG_ENDINGS
            and all(isinstance(e, str) for e in endings)):
        raise UsageError(f"{where}: 'endings' must be a list of {HELLASWAG_ENDINGS} strings, got {endings!r}")
    try:
        index = int(label) if isinstance(label, (int, str)) and not isinstance(label, bool) else None
    except ValueError:
        index = None
    if index is None or not 0 <= index < HELLASWAG_ENDINGS:
        raise UsageError(f"{where}: 'label' must be 0..{HELLASWAG_ENDINGS - 1} (an int or a digit string), "
                         f"got {label!r}")
    return Example(ctx, tuple(endings), index)


def _jsonl_rows(path: str, limit: int | None):
    """(where, row) for the first `limit` non-blank lines; where names the line, for error messages."""
    with open(path, encoding="utf-8") as f:
        rows = 0
        for lineno, line in enumerate(f, 1):
            if rows == limit:
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            rows += 1
            yield f"{path}:{lineno}", row


def _parquet_rows(path: str, limit: int | None):
    """(where, row) for the first `limit` rows; HellaSwag's validation split is small enough to read whole."""
    import pyarrow.parquet as pq  # only needed for parquet input

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:
        raise UsageError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    for i, row in enumerate(rows[:limit]):
        yield f"{path}: row {i}", row


def _hub_rows(name: str, limit: int | None):
    """The first `limit` rows (None: all) of a Hugging Face dataset's validation split, downloaded once into
    the datasets cache (HF_HUB_OFFLINE=1: the cache only)."""
    try:
        import datasets
    except ImportError:
        raise UsageError("loading HellaSwag from the hub needs the datasets package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, split="validation" if limit is None else f"validation[:{limit}]")
    except Exception as e:
        raise UsageError(f"could not load HellaSwag {name!r} from the Hugging Face hub ({first_line(e)}); offline, "
                         "pass --hellaswag-path FILE.jsonl or .parquet") from None
    return ((f"{name} validation row {i}", row) for i, row in enumerate(ds))


def _is_hub_name(source: str) -> bool:
    """"owner/name" that is not a path here (nor a file name with our extensions): a hub dataset."""
    return (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source) is not None
            and not source.endswith((".jsonl", ".parquet")) and not os.path.exists(source))


def load_hellaswag(source: str, limit: int | None = None) -> list[Example]:
    """The first `limit` examples (None: all) of `source`: a local .jsonl or .parquet file in HellaSwag's
    format, or the name of a Hugging Face dataset (its validation split). Local files are read directly, not
    through datasets, so a bad one is reported by line. One-line UsageError when it cannot be read."""
    if _is_hub_name(source):
        rows = _hub_rows(source, limit)
    elif not os.path.isfile(source):
        raise UsageError(f"--hellaswag-path {source}: no such file")
    elif source.endswith(".jsonl"):
        rows = _jsonl_rows(source, limit)
    elif source.endswith(".parquet"):
        rows = _parquet_rows(source, limit)
    else:
        raise UsageError(f"--hellaswag-path {source}: expected a .jsonl or .parquet file, or a hub dataset name")
    try:
        examples = [hellaswag_example(row, where) for where, row in rows]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--hellaswag-path {source}: cannot read it ({e})") from None
    if not examples:
        raise UsageError(f"--hellaswag-path {source}: no examples")
    return examples


def choice_batch(enc: Tokenizer, example: Example, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One example as a batch -> (inputs [4, L], targets [4, L]): row i is the context, then " " + ending i,
    its targets IGNORE_INDEX except at the ending's tokens, right-padded (causal attention never looks right).

    The ending is encoded on its own, so every row shares the context's tokens. A row longer than the model's
    max_len + 1 tokens keeps its last ones (the end of the context is what the ending follows); an empty
    context conditions on the document separator, as a new document does."""
    context = enc.encode(example.context) or [enc.eot]
    rows = []
    for ending in example.endings:
        tail = enc.encode(" " + ending)
        tokens = (context + tail)[-(max_len + 1):]
        rows.append((tokens, min(len(tail), len(tokens) - 1)))
    width = max(len(tokens) for tokens, _ in rows) - 1
    x = torch.zeros(len(rows), width, dtype=torch.int64)
    y = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
    for i, (tokens, scored) in enumerate(rows):
        n = len(tokens) - 1
        x[i, :n] = torch.tensor(tokens[:-1])
        y[i, n - scored:n] = torch.tensor(tokens[n + 1 - scored:])
    return x, y


def ending_scores(losses: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses and targets [4, L] -> (each ending's mean loss [4], its summed loss [4]); losses at
    ignored targets are 0 (linear_cross_entropy's reduction "none"), and are masked anyway."""
    scored = targets != IGNORE_INDEX
    total = torch.where(scored, losses.float(), 0.0).sum(dim=1)
    return total / scored.sum(dim=1), total


# ----------------------------------------------------------------------------- how much of the val split


def eval_batches(eval_tokens: int, val_windows: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Batches each rank reads per eval: eval_tokens in whole batches of micro_batch x seq_len on every rank,
    at least one, but no more than the val split's val_windows windows hold. The loader's stream repeats the
    split epoch after epoch, so asking for more would read the same windows again (a 1,000-token split read
    16 times for the default 16,384) and weigh them twice in the mean, for nothing."""
    step = micro_batch * world_size  # windows one batch on every rank takes
    return max(1, min(eval_tokens // (step * seq_len), val_windows // step))


def eval_tokens_note(eval_tokens: int, val_windows: int, val_tokens: int, micro_batch: int, seq_len: int,
                     world_size: int) -> str | None:
    """The start-up note when --eval-tokens asks for less than one batch on every rank (eval_batches reads one),
    or for more than the val split holds (it reads less), or when the split holds less than one batch on every
    rank (some windows are read twice); else None."""
    step = micro_batch * world_size
    batches = eval_batches(eval_tokens, val_windows, micro_batch, seq_len, world_size)
    shape = (f"{plural(batches, 'batch', 'batches')} of {micro_batch} x {seq_len} on each of "
             f"{plural(world_size, 'rank')}")
    if val_windows < step:
        return (f"note: the val split ({plural(val_tokens, 'token')}) holds {plural(val_windows, 'window')} of "
                f"{seq_len}, fewer than one batch on every rank; each eval reads {step * seq_len:,} tokens ({shape}), "
                "some twice")
    if eval_tokens < step * seq_len:
        return (f"note: --eval-tokens {eval_tokens:,} rounds up to one whole batch: each eval reads "
                f"{step * seq_len:,} tokens ({shape})")
    if max(1, eval_tokens // (step * seq_len)) > batches:
        return (f"note: --eval-tokens {eval_tokens:,} is more than the val split holds ({val_tokens:,} tokens); "
                f"each eval reads all of it that whole batches hold: {batches * step * seq_len:,} tokens ({shape})")
    return None


# ----------------------------------------------------------------------------- the Evaluator


@contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode, back in the mode it was in afterwards, even when the eval fails: training goes
    on after an eval skipped for lack of memory (evaluate_if_due)."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


# The val windows' permutation: fixed, so that val losses of runs with different --seed score the same tokens.
VAL_SEED = 0


class Evaluator:
    def __init__(self, cfg, data: str | None, info: "distributed.DistInfo", device: torch.device,
                 vocab_size: int, seed: int, tokenizer: Tokenizer | None = None):
        """cfg: config.EvalConfig. data: --data, whose sources' val splits are evaluated (None when only
        HellaSwag runs, in score.py). tokenizer: the model's; by default the one the data's data.json records
        (a mixture's sources share one: mixture.check_sources), else GPT-2's."""
        self.cfg, self.data, self.info, self.device = cfg, data, info, device
        self.sources: list[Source] = parse_data(data) if data is not None else []
        self.vocab_size, self.seed, self._tokenizer = vocab_size, seed, tokenizer
        self.token_bytes = None  # check_val: bytes per token id, when the model's ids are the tokenizer's
        self.no_bpb_reason = None  # check_val: why there are no bytes per token, when there are none
        self.val_note = None  # check_val: the note when each eval reads other than --eval-tokens (eval_tokens_note)
        self.val_reads = []  # check_val: a ValRead per source
        self.choices = []  # load_hellaswag: (inputs, targets, label) per example, on the CPU

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the shards and the model (the prompt, HellaSwag, val_bpb), loaded on first use."""
        if self._tokenizer is None:
            recorded = data_tokenizer(record_dir(self.sources)) if self.sources else None
            self._tokenizer = recorded or load_tokenizer("gpt2")
        return self._tokenizer

    def due(self, done: int, max_steps: int) -> bool:
        """Evaluate after `done` steps? On the interval, and always at the end (unless evaluation is off)."""
        interval = self.cfg.eval_interval
        return bool(interval) and (done % interval == 0 or done == max_steps)

    def _loader(self, source: Source, micro_batch: int, seq_len: int, ranks: bool = True) -> ShardLoader:
        """The val split's windows in a permutation seeded by VAL_SEED (not the run's seed): each eval reads the
        first of them, windows spread over the split (a split's first tokens are its first documents only), and
        every eval and every run on these shards reads the same ones."""
        rank, world_size = (self.info.rank, self.info.world_size) if ranks else (0, 1)
        return ShardLoader(source.dir, split="val", batch_size=micro_batch, seq_len=seq_len, shuffle=True,
                           seed=VAL_SEED, rank=rank, world_size=world_size, device=str(self.device), prefetch=0,
                           vocab_size=self.vocab_size)

    def check(self, micro_batch: int, seq_len: int) -> None:
        """Fail at start-up, not at the first eval: no usable val split (DataError), a sample prompt whose
        token ids the model's vocabulary cannot hold (an empty one starts from the separator's id), or
        HellaSwag rows that cannot be read or encoded (UsageError). The flags alone are checked in config.py.
        Then, on rank 0, the note (val_note) when each eval reads other than --eval-tokens asks."""
        if self.cfg.eval_interval:
            self.check_val(micro_batch, seq_len)
        if self.cfg.sample_tokens:
            enc = self.tokenizer
            top = max(enc.encode(self.cfg.sample_prompt) or [enc.eot])
            if top >= self.vocab_size:
                raise UsageError(f"--sample-prompt {self.cfg.sample_prompt!r} starts sampling from {enc.name} token "
                                 f"id {top}, beyond --vocab-size {self.vocab_size}; give a prompt within it")
        if self.cfg.eval_hellaswag:
            self.load_hellaswag(seq_len, self.cfg.eval_hellaswag)
        if self.val_note and self.info.is_main:  # last: a refusal above stays the only line printed
            message(self.val_note)

    def check_val(self, micro_batch: int, seq_len: int) -> None:
        """Every source's val split must be readable (a mixture's val_loss is their weighted mean, so a source
        without one is refused); val_note says when each eval reads other than --eval-tokens asks (less than
        one batch, or more than a split holds: eval_batches); and the bytes per token for val_bpb, when the
        model's ids can be the tokenizer's (a larger vocabulary, on shards that record no tokenizer, means
        another tokenizer than GPT-2's, whose bytes we do not know), else no_bpb_reason says why not."""
        notes, self.val_reads = [], []
        for source in self.sources:
            try:
                loader = self._loader(source, micro_batch, seq_len, ranks=False)
            except DataError as e:
                if not is_mixture(self.sources):
                    raise
                raise DataError(f"--data: {label(source)} has no usable val split ({first_line(e)}), so val_loss, "
                                f"the weighted mean of the sources' val losses, would leave out its "
                                f"{100 * source.weight:.1f}%: prepare it with a val split (prepare.py --val-tokens "
                                "N), or train without evaluation (train.py --eval-interval 0)") from None
            loader.close()
            val_tokens = sum(len(shard) for shard in loader.shards)
            batches = eval_batches(self.cfg.eval_tokens, loader.num_windows, micro_batch, seq_len, self.info.world_size)
            chosen = split.describe(data_record(source.dir) or {})
            self.val_reads.append(ValRead(source.name, batches * micro_batch * self.info.world_size, seq_len,
                                          val_tokens, chosen, loader.num_windows))
            note = eval_tokens_note(self.cfg.eval_tokens, loader.num_windows, val_tokens, micro_batch, seq_len,
                                    self.info.world_size)
            if note:
                notes.append(note.replace("note: ", f"note: source {source.name}: ", 1) if source.name else note)
        self.val_note = "\n".join(notes) or None
        try:
            enc = self.tokenizer
        except DataError as e:  # e.g. a tiktoken encoding not cached on an offline node: train, without val_bpb
            self.no_bpb_reason = first_line(e)
            if self.info.is_main:
                message(f"note: no val_bpb: {self.no_bpb_reason}")
            return
        if self.vocab_size <= padded_vocab(enc.n_vocab):  # as a model may pad it (check_vocab)
            self.token_bytes = token_byte_lengths(enc, self.vocab_size).to(self.device)
        else:
            self.no_bpb_reason = (f"the model's vocabulary ({self.vocab_size:,} ids) is larger than the shards' "
                                  f"tokenizer's, {enc.name} ({enc.n_vocab:,} ids; GPT-2's when they record none), "
                                  f"so the bytes per token are unknown")

    def load_hellaswag(self, seq_len: int, limit: int | None) -> None:
        """Read the first `limit` rows (None: all) of --hellaswag-path on rank 0 (one download, not one per
        rank), hand them (or the error) to every rank, and encode them for a model of seq_len positions."""
        examples, failure = None, None
        if self.info.is_main:
            try:
                examples = load_hellaswag(self.cfg.hellaswag_path, limit)
            except UsageError as e:
                failure = e
        examples, failure = distributed.broadcast_object((examples, failure), self.info)
        if failure is not None:
            raise failure
        enc = self.tokenizer
        self.choices = [(*choice_batch(enc, example, seq_len), example.label) for example in examples]
        top = max(max(int(x.max()), int(y.max())) for x, y, _ in self.choices)
        if top >= self.vocab_size:
            raise UsageError(f"HellaSwag's text encodes to {enc.name} token ids up to {top}, beyond --vocab-size "
                             f"{self.vocab_size}: --eval-hellaswag needs the model's vocabulary to be its tokenizer's "
                             f"({enc.n_vocab})")

    def measure(self, forward, model: torch.nn.Module, autocast, autocast_dtype: torch.dtype | None,
                micro_batch: int, seq_len: int, warn, done: int, full: bool = True) -> tuple[dict, str | None] | None:
        """The eval of step `done`: val_metrics, and with `full` hellaswag and a sample -> (metrics, the sample or
        None), or None when it runs out of memory: that eval is skipped with a warning through `warn`, the memory
        it held goes back to the allocator, and training goes on. Any other failure is raised (the step's
        checkpoint is on disk already: loop.run_loop writes it first). Only a single process skips: under DDP or
        FSDP2 a rank that skipped would leave the others waiting in the eval's collectives, so there the error
        is raised and the run ends, its checkpoint on disk."""
        try:
            metrics = self.val_metrics(forward, model, autocast, micro_batch, seq_len)
            if not full:
                return metrics, None
            metrics.update(self.hellaswag(model, autocast_dtype))
            return metrics, self.sample(model, autocast_dtype)
        except torch.cuda.OutOfMemoryError:
            if self.info.world_size > 1:  # the other ranks wait in this eval's collectives: a skip would hang them
                raise
            # the exception holds the eval's tensors until here: the cache is emptied below
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        warn(f"warning: out of memory in the eval of step {done}; skipped, training goes on")
        return None

    def val_metrics(self, forward, model: torch.nn.Module, autocast, micro_batch: int, seq_len: int) -> dict:
        """{"val_loss": mean loss, "val_bpb": bits per byte (when known)} over eval_tokens of the val
        split, or all of it that whole batches hold (eval_batches): the same tokens every time, split across
        ranks. forward: what the training step calls (compiled, wrapped); autocast: the step's context. A
        mixture measures each source's val split so (val_loss/NAME, val_bpb/NAME), and gives the figures of the
        training distribution, whose tokens come from each source in proportion to its weight: val_loss is the
        weighted mean of the sources' losses, val_bpb the weighted mean of their text nats per token over the
        weighted mean of their bytes per token."""
        sums = [self.source_sums(source, forward, model, autocast, micro_batch, seq_len) for source in self.sources]
        if not is_mixture(self.sources):
            return self._figures(*sums[0])
        weights = [source.weight for source in self.sources]
        per_token = [[value / tokens for value in (nats, tokens, text_nats, n_bytes)]
                     for nats, tokens, text_nats, n_bytes in sums]
        metrics = self._figures(*(sum(w * p[i] for w, p in zip(weights, per_token)) for i in range(4)))
        for source, source_sums in zip(self.sources, sums):
            metrics.update({f"{key}/{source.name}": value for key, value in self._figures(*source_sums).items()})
        return metrics

    def _figures(self, nats: float, tokens: float, text_nats: float, n_bytes: float) -> dict:
        metrics = {"val_loss": nats / tokens}
        if self.token_bytes is not None and n_bytes > 0:
            metrics["val_bpb"] = bits_per_byte(text_nats, n_bytes)
        return metrics

    @torch.no_grad()
    def source_sums(self, source: Source, forward, model: torch.nn.Module, autocast, micro_batch: int,
                    seq_len: int) -> list[float]:
        """One source's val split -> [nats, tokens, nats of the tokens with text, their bytes], each a mean over
        ranks. One pass gives both figures (val_metrics): per-token losses."""
        loader = self._loader(source, micro_batch, seq_len)
        n_batches = eval_batches(self.cfg.eval_tokens, loader.num_windows, micro_batch, seq_len,
                                 self.info.world_size)
        sums = torch.zeros(4, device=self.device)  # nats, tokens; nats of the tokens with text, their bytes
        progress = Progress(n_batches, f"eval {source.name}".strip(), unit="batch", enabled=self.info.is_main)
        with eval_mode(model), closing(loader), closing(progress):
            for _ in range(n_batches):
                x, y = next(loader)
                with autocast():
                    _, losses = forward(x, y, reduction="none")
                sums[0] += losses.float().sum()
                sums[1] += y.numel()
                if self.token_bytes is not None:
                    sums[2:] += bpb_sums(losses, y, self.token_bytes)
                progress.update()
        return distributed.mean_across_ranks(sums, self.info).tolist()

    @torch.no_grad()
    def hellaswag(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> dict:
        """{"hellaswag_acc", "hellaswag_acc_sum"} over the loaded examples, or {} when HellaSwag is off.

        Runs the bare model (not the compiled one: every example has its own length, and compile would
        specialise on each) under the training's autocast but not FP8's (whose GEMMs need shapes in multiples
        of 16). Ranks take every world_size-th example and add up their counts; every rank runs the same
        number of forwards (a rank short of one repeats an example and does not count it), since under FSDP2
        each forward is a collective."""
        if not self.choices:
            return {}
        mine = self.choices[self.info.rank::self.info.world_size]
        counted, mine = len(mine), mine or self.choices[:1]
        rounds = math.ceil(len(self.choices) / self.info.world_size)
        counts = torch.zeros(2, device=self.device)  # right by mean loss, right by summed loss
        progress = Progress(rounds, "hellaswag", unit="example", enabled=self.info.is_main)
        with eval_mode(model), closing(progress):
            for i in range(rounds):
                x, y, label = mine[min(i, len(mine) - 1)]
                x, y = x.to(self.device), y.to(self.device)
                with hardware.autocast(self.device, autocast_dtype):
                    _, losses = model(x, y, reduction="none")
                mean, total = ending_scores(losses, y)
                if i < counted:
                    counts += torch.stack([mean.argmin() == label, total.argmin() == label]).float()
                progress.update()
        right, right_sum = (distributed.mean_across_ranks(counts, self.info) * self.info.world_size).tolist()
        n = len(self.choices)
        return {"hellaswag_acc": round(right) / n, "hellaswag_acc_sum": round(right_sum) / n}

    @property
    def tokens_each(self) -> int:
        """The val tokens an eval reads, all ranks and sources together (check sets them)."""
        return sum(read.windows * read.seq_len for read in self.val_reads)

    def describe_val(self) -> str:
        """The start-up table's eval row: how often, and which tokens the val loss is taken on."""
        if not self.cfg.eval_interval:
            return "off (--eval-interval 0)"
        reads = "; ".join(f"{r.name + ': ' if r.name else ''}{r.windows * r.seq_len:,} of the val split's "
                          f"{r.split_tokens:,} tokens ({r.chosen})" for r in self.val_reads)
        return (f"every {plural(self.cfg.eval_interval, 'step')} and at the end: val loss and bpb on {reads}, in "
                f"windows at places a fixed seed draws across the split, the same every eval and every run")

    def describe(self, metrics: dict) -> str:
        """The eval line's figures: 'val loss 4.1234, val bpb 1.2345, hellaswag 0.2500 (sum 0.2500, 8 examples)'."""
        text = f"val loss {metrics['val_loss']:.4f}"
        if is_mixture(self.sources):
            text += " (" + ", ".join(f"{s.name} {metrics[f'val_loss/{s.name}']:.4f}" for s in self.sources) + ")"
        if "val_bpb" in metrics:
            text += f", val bpb {metrics['val_bpb']:.4f}"
        if "hellaswag_acc" in metrics:
            text += (f", hellaswag {metrics['hellaswag_acc']:.4f} (sum {metrics['hellaswag_acc_sum']:.4f}, "
                     f"{plural(len(self.choices), 'example')})")
        return text

    def sample(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> str | None:
        """A sample of --sample-tokens after --sample-prompt, or None when sampling is off. Call it on every
        rank: under FSDP2 each forward is a collective. It runs under the training's autocast: FSDP2's blocks
        hold 16-bit weights while the residual stream is float32."""
        if not self.cfg.sample_tokens:
            return None
        with hardware.autocast(self.device, autocast_dtype):
            return sample_text(model, self.tokenizer, self.cfg.sample_prompt, self.cfg.sample_tokens,
                               seed=self.seed)
