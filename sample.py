"""Generate text from a checkpoint or an exported Hugging Face directory, with a KV cache.

    python sample.py --ckpt out/ckpt_00000150.pt --prompt "def main(" --max-new-tokens 100
    python sample.py --ckpt out --num-samples 3            # a run directory: its newest good checkpoint
    python sample.py --hf hf_model --greedy --prompt-file prompt.txt

The text streams to the terminal as it is generated, encoded and decoded with the tokenizer the model was
trained with (trained.model_tokenizer: the one its training data's data.json records, or an --hf directory's
tokenizer.json; GPT-2's when nothing records one; --tokenizer names another). Without --seed a fresh seed is
drawn and printed on stderr, so that a sample worth keeping can be repeated. The library side: `generate`
(token ids in, token ids out) and `sample_text` (a string in, a string out), which train.py calls at eval time.
"""

import argparse
import codecs
import math
import os
import secrets
import sys
from collections.abc import Iterable, Iterator

import torch

from checkpoint import CheckpointError
from cli import ArgumentParser, DataError, HelpFormatter, UsageError, closed_stdout, report_error, unwritable_stdout
from config import DEVICES
from data import tokenizer_id
from hardware import resolve_device
from hf import load_hf
from hf_layout import check_names
from model import GPT, KVCache
from tokenizer import Tokenizer, check_model_vocab, load_tokenizer, tokenizer_flag
from trained import check_tokenizer, is_run_directory, model_tokenizer, read_ckpt

# Below this, sampling is greedy anyway (at 1e-4 a logit gap of 0.01 already means odds of e^100), and far
# below it logits / temperature overflows float32 and the draw fails; 0 is the greedy setting.
MIN_TEMPERATURE = 1e-4
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
DRAWN_SEED_BITS = 32  # a drawn seed: short enough to copy from the terminal, plenty for distinct samples


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError (one line) for settings that cannot be sampled with, opening with the parameter's name (check_args
    turns it into the flag of that name)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_seed(seed: int) -> None:
    """ValueError (one line), opening with "seed", for a seed torch cannot take."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [..., V] with all but the k largest set to -inf (values tied with the k-th largest stay)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits [..., V] with -inf outside the nucleus: the fewest most likely tokens whose probabilities sum
    to at least p. The most likely token always stays."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= p  # the mass before this token already reaches p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
               generator: torch.Generator | None) -> int:
    """One token id from logits [V]: argmax at temperature 0, else temperature, then top-k, then top-p (the
    order transformers applies them in), then a draw."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


def _activation_dtype(model: GPT, device: torch.device) -> torch.dtype:
    """The dtype attention runs in, which the KV cache must store: autocast's when it is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


@torch.no_grad()
def stream(model: GPT, prompt: Iterable[int], max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, eot: int | None = None,
           generator: torch.Generator | None = None, n_vocab: int | None = None) -> Iterator[int]:
    """Yield up to max_new_tokens token ids that follow prompt, one at a time, stopping at eot (not yielded).

    Only the first n_vocab ids are drawn (default: the model's vocab_size), so padding ids never are, nor the
    ids of a model padded beyond its tokenizer's n_vocab (data.check_vocab allows it), which the tokenizer
    could not decode. Sampling runs on the CPU in float32: a seeded CPU generator draws the same tokens on
    every device, given the same logits. A context that outgrows max_seq_len restarts the cache from its
    most recent half, as the model never saw positions past max_seq_len in training.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens == 0:
        return
    config = model.config
    n_vocab = config.vocab_size if n_vocab is None else n_vocab
    device = next(model.parameters()).device
    window = config.max_seq_len
    cache = KVCache(config, 1, min(window, len(tokens) + max_new_tokens), device, _activation_dtype(model, device))
    pending = tokens[-window:]  # tokens not yet in the cache
    for _ in range(max_new_tokens):
        if cache.pos + len(pending) > cache.max_len:
            cache.pos = 0
            pending = tokens[-max(1, window // 2):]
        logits, _ = model(torch.tensor([pending], device=device), cache=cache)
        token = next_token(logits[0, -1, :n_vocab].float().cpu(), temperature, top_k, top_p, generator)
        if token == eot:
            return
        yield token
        tokens.append(token)
        pending = [token]


def generate(model: GPT, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eot: int | None = None,
             generator: torch.Generator | None = None, n_vocab: int | None = None) -> list[int]:
    """The new token ids after idx (a list or a 1-D tensor of ids), without the EOT that ended them."""
    if isinstance(idx, torch.Tensor):
        idx = idx.flatten().tolist()
    return list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, eot, generator, n_vocab))


def decode_stream(enc: Tokenizer, tokens: Iterable[int], context: Iterable[int] = ()) -> Iterator[str]:
    """Text pieces as tokens arrive, which join to what the tokens add to the text of context (the prompt's
    ids). A byte-level tokenizer's tokens are bytes: the pieces join to enc.decode(tokens), a character whose
    UTF-8 bytes are split across tokens coming out once it is whole (invalid bytes become U+FFFD, as in
    decode). Another tokenizer's decoder may join tokens in ways of its own (a space between two words), so
    each piece is what decoding context and the tokens so far adds, held back while it ends in U+FFFD (a
    character not yet whole)."""
    if enc.byte_level:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces = (decoder.decode(enc.token_bytes(token)) for token in tokens)
        yield from (piece for piece in pieces if piece)
        if tail := decoder.decode(b"", final=True):
            yield tail
        return
    ids = list(context)
    shown = len(enc.decode(ids)) if ids else 0
    for token in tokens:
        ids.append(token)
        text = enc.decode(ids).rstrip("\ufffd")
        if len(text) > shown:
            yield text[shown:]
            shown = len(text)
    if tail := enc.decode(ids)[shown:]:
        yield tail


def sample_text(model: GPT, enc: Tokenizer, prompt: str = "", max_new_tokens: int = 64, temperature: float = 0.8,
                top_k: int | None = 200, top_p: float | None = None, seed: int = 0) -> str:
    """prompt plus its continuation, decoded. Draws from its own seeded generator, so calling it leaves
    the global RNG (and a training run's data order and dropout) untouched. An empty prompt starts a
    fresh document: it conditions on the document separator, which also ends the continuation. Draws only ids
    enc has, however far the model's vocabulary is padded."""
    ids = enc.encode(prompt) or [enc.eot]
    generator = torch.Generator().manual_seed(seed)
    new = generate(model, ids, max_new_tokens, temperature, top_k, top_p, enc.eot, generator, enc.n_vocab)
    return prompt + "".join(decode_stream(enc, new, ids if prompt else []))


def say(line: str) -> None:
    """A line about what the program is doing, on stderr: stdout holds only the generated text."""
    print(line, file=sys.stderr, flush=True)


def load_model(ckpt: str | None = None, hf: str | None = None, device: torch.device | str = "cpu",
               report=say) -> GPT:
    """A GPT in eval mode from a train.py checkpoint or run directory (trained.read_ckpt; which checkpoint of a
    run directory is said through report) or from a Hugging Face directory written by hf.py."""
    if ckpt is not None and is_run_directory(ckpt) and os.path.isfile(os.path.join(ckpt, "config.json")):
        raise UsageError(f"--ckpt {ckpt} is a Hugging Face directory (it has a config.json); pass it as --hf")
    config, state = read_ckpt(ckpt, report) if ckpt is not None else load_hf(hf)
    check_names(config, state)
    model = GPT(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # shapes that contradict the config; the first line only names the model
        raise ValueError(f"weights do not fit the model config: {str(e).splitlines()[-1].strip()}") from None
    return model.to(device).eval()


def draw_seed() -> int:
    """A fresh seed from the operating system's randomness, for a run without --seed."""
    return secrets.randbits(DRAWN_SEED_BITS)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt's text: --prompt, or --prompt-file's content as it is (a final newline included), or ""."""
    if prompt_file is None:
        return prompt or ""
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompt-file {prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"--prompt-file {prompt_file}: {e.strerror or e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", metavar="PATH", help="a checkpoint written by train.py (file or sharded "
                                                       "directory), or a run's --out-dir: its newest good one")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face directory written by hf.py")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text to continue (default: start a new document)")
    prompt.add_argument("--prompt-file", metavar="FILE", help="continue the text of FILE (UTF-8, used as it is)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="N samples of the same prompt")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with this mass")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (--temperature 0)")
    p.add_argument("--seed", type=int, help="the sampling seed (default: a fresh one, printed on stderr)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where the model runs")
    p.add_argument("--tokenizer", type=tokenizer_flag, metavar="NAME|PATH",
                   help="the tokenizer the model was trained with, as prepare.py --tokenizer takes it (default: "
                        "the one its training data records, or the --hf directory's; else GPT-2's)")
    return p


def check_args(a: argparse.Namespace, temperature: float, top_k: int | None) -> None:
    """One-line errors for the numbers, before anything is loaded, naming the flag at fault."""
    if a.top_k < 0:  # 0 turns top-k off (main passes None), which check_sampling's "top_k >= 1" leaves unsaid
        raise UsageError(f"--top-k must be >= 0 (0: off), got {a.top_k}")
    try:
        check_sampling(a.max_new_tokens, temperature, top_k, a.top_p)
        if a.seed is not None:
            check_seed(a.seed)
    except ValueError as e:  # "top_p must be in (0, 1], got 1.5" -> "--top-p must be ..."
        name, rest = str(e).split(" ", 1)
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None
    if a.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {a.num_samples}")
    if a.num_samples > 1 and temperature == 0:
        raise UsageError(f"--num-samples {a.num_samples} with greedy decoding gives {a.num_samples} identical "
                         "samples; sample with a temperature instead")


def print_samples(model: GPT, enc: Tokenizer, text: str, a: argparse.Namespace, temperature: float,
                  top_k: int | None, seed: int) -> None:
    """Stream a.num_samples continuations of text to stdout, each from the prompt, one seeded generator across
    them all (so --seed repeats the whole set); several samples are each headed by a line of their own."""
    prompt = enc.encode(text) or [enc.eot]
    context = model.config.max_seq_len
    if len(prompt) > context and a.max_new_tokens > 0:  # stream reads no further back than the model was trained to
        say(f"note: the prompt was cut to its last {context:,} tokens, the model's context (it is {len(prompt):,} "
            f"tokens)")
    generator = torch.Generator().manual_seed(seed)
    for i in range(a.num_samples):
        if a.num_samples > 1:
            print(f"{'=' * 20} sample {i + 1} of {a.num_samples} {'=' * 20}")
        print(text, end="", flush=True)
        drawn = []  # the tokens stream yields, counted as they go: fewer than asked means it met end-of-text
        tokens = stream(model, prompt, a.max_new_tokens, temperature, top_k, a.top_p, enc.eot, generator,
                        enc.n_vocab)
        for piece in decode_stream(enc, (drawn.append(t) or t for t in tokens), prompt if text else []):
            print(piece, end="", flush=True)
        print()
        if len(drawn) < a.max_new_tokens:
            say(f"(sample {i + 1} ended at the end-of-text token after {len(drawn):,} of {a.max_new_tokens:,} "
                "tokens)")


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        temperature = 0.0 if a.greedy else a.temperature
        top_k = a.top_k or None
        check_args(a, temperature, top_k)
        text = read_prompt(a.prompt, a.prompt_file)
        device, _ = resolve_device(a.device)
        model = load_model(a.ckpt, a.hf, device)
        enc = load_tokenizer(a.tokenizer) if a.tokenizer else model_tokenizer(a.ckpt or a.hf) or load_tokenizer()
        check_tokenizer(a.ckpt or a.hf, tokenizer_id(enc.record()), say)
        check_model_vocab(model.config.vocab_size, enc)
    except (UsageError, CheckpointError, DataError, ValueError, OSError) as e:
        return report_error(e)
    seed = a.seed
    if seed is None:
        seed = draw_seed()
        if temperature > 0:  # greedy decoding draws nothing: no seed to repeat
            say(f"seed {seed} (pass --seed {seed} to repeat)")
    try:
        print_samples(model, enc, text, a, temperature, top_k, seed)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        return closed_stdout()
    except OSError as e:  # a redirect to a full disk
        return unwritable_stdout(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
