"""Hugging Face export and import: a checkpoint as a transformers directory, and such a directory back.

Hugging Face import and export: our checkpoints as transformers directories and back, in the layout
hf_layout.py maps (Qwen3ForCausalLM for a model without attention gates, Qwen3NextForCausalLM for a gated
one; with the smear or the bigram table, as the default model has, that class with the look-back, from
hf_look_back.py, which the export carries). The command line exports; train.py --from-hf, sample.py --hf and
score.py import (load_hf).

    python hf.py --ckpt out/ckpt_00000150.pt --out hf_model   # export: write a transformers directory
    python hf.py --ckpt out --out hf_model                    # a run directory: its newest good checkpoint
    python sample.py --hf hf_model                            # import: read it back (load_hf)

The directory holds config.json, hf_look_back.py for a look-back model, model.safetensors (float32, the
vocabulary padded as in training; a
Qwen3-Next export's zero-centred norm weights float64, so that they read back bit for bit: hf_layout),
generation_config.json (the document separator as bos/eos, the ids beyond the tokenizer's, the padding,
suppressed so transformers' generate never picks them), tokenizer_note.txt, and the transformers tokenizer
files of the tokenizer the model was trained with (by default the one its training data's data.json records,
model_tokenizer): for GPT-2, vocab.json, merges.txt, tokenizer_config.json, and tokenizer.json for the fast
tokenizer, rebuilt
offline from tiktoken's ranks; for a Hugging Face tokenizer, the tokenizer.json the shards were made with and
a tokenizer_config.json. Every file gets the mode open() gives (0644 under the usual umask).

The target must be empty or not yet exist (a killed export's staging directory does not count); --overwrite
allows a non-empty one, and replaces the earlier export's files there (a stale shard index included; other
files stay). The new files are written aside and moved in only once all of them are, config.json last, after
the earlier export's have left, config.json first: a reader never sees the two mixed, and a failed export
leaves the directory as it was.

load_hf(DIR) reads such a directory, or any bias-free Qwen3ForCausalLM directory, or a Qwen3NextForCausalLM
one that is the Qwen3 block plus a per-head gate (hf_layout.config_from_hf), back into our names.
"""

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

import torch

from atomic import lock_directory
from checkpoint import CheckpointError
from cli import (ArgumentParser, DataError, UsageError, closed_stdout, first_line, plural, report_error,
                 unwritable_stdout)
from data import tokenizer_id
from hf_layout import (LOOK_BACK_MODULE, architecture, check_hf_weights, config_from_hf, exportable_problem, from_hf,
                       hf_config, looks_back, to_hf)
from model import ModelConfig
from tokenizer import (HFTokenizer, TiktokenTokenizer, Tokenizer, check_model_vocab, load_tokenizer, tokenizer_flag,
                       write_gpt2_tokenizer, write_hf_tokenizer)
from trained import check_tokenizer, model_tokenizer, read_ckpt

LOOK_BACK_FILE = LOOK_BACK_MODULE + ".py"  # the classes a look-back export's auto_map names, copied in
# What an export writes, and what transformers would read along with it (another exporter's sharded weights,
# a fast tokenizer): an export into a directory holding any of these must replace them all, or refuse.
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer_note.txt", "vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json",
                LOOK_BACK_FILE)
SHARD_PATTERN = "model-*.safetensors"
# export_hf writes here inside the target, then moves the files out; it holds the directory locked meanwhile, so
# that a later export can tell a killed export's (unlocked) from a running one's.
STAGING_PREFIX = ".export-"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("the safetensors package is needed: pip install safetensors") from None
    return safetensors.torch


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object. ValueError (one line) naming the file, and for a syntax error the
    line (json's message has it)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nesting too deep
        raise ValueError(f"{path}: not valid JSON: {first_line(e)}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a JSON object")
    return d


def weight_files(directory: str) -> list[str]:
    """The paths of a Hugging Face directory's weights: the files its model.safetensors.index.json maps the
    tensors to, or model.safetensors. ValueError (one line, naming the index) for an index of another shape."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.isfile(index_path):
        return [os.path.join(directory, "model.safetensors")]
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map must be an object of tensor names to file names")
    return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]


def _read_safetensors(path: str, read):
    """read(path), a safetensors file's error as one line naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found")
    try:
        return read(path)
    except Exception as e:  # safetensors' own error type differs between its versions
        raise ValueError(f"cannot read {path}: {first_line(e)}") from None


def _header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from a safetensors file's header alone."""
    with _safetensors().safe_open(path, framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def hf_model_config(directory: str) -> ModelConfig:
    """The model of a Hugging Face directory load_hf reads, from its config.json alone (ValueError, one line,
    for one it cannot read): what train.py's flags take for the model's shape under --from-hf."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory} is not a Hugging Face model directory (no config.json)")
    d = read_json_object(config_path)
    try:
        return config_from_hf(d)
    except KeyError as e:
        raise ValueError(f"{config_path} lacks {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None


def load_hf(directory: str) -> tuple[ModelConfig, dict]:
    """A Hugging Face Qwen3ForCausalLM or Qwen3NextForCausalLM directory (hf_layout) -> (ModelConfig, our state
    dict). The weights' names and shapes are checked against config.json from the files' headers before any
    tensor is read."""
    load_file = _safetensors().load_file
    config = hf_model_config(directory)
    paths = weight_files(directory)
    shapes = {}
    for path in paths:
        shapes.update(_read_safetensors(path, _header_shapes))
    try:
        check_hf_weights(config, shapes)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    hf_state = {}
    for path in paths:
        hf_state.update(_read_safetensors(path, load_file))
    try:
        return config, from_hf(config, hf_state)
    except ValueError as e:  # a Qwen3-Next gate that is not one per head
        raise ValueError(f"{directory}: {e}") from None


# ----------------------------------------------------------------------------- tokenizer files


def tokenizer_note(enc: Tokenizer, wrote_files: bool, wrote_fast: bool = True) -> str:
    padding = "The embedding has extra rows that pad the vocabulary to a multiple of 128; no token uses them.\n"
    if isinstance(enc, HFTokenizer):
        return (f"Tokenizer: {enc.name} (sha256 {enc.sha256}), document separator {enc.separator} = {enc.eot}.\n"
                "tokenizer.json is the file the training shards were made with; AutoTokenizer.from_pretrained(DIR)\n"
                "loads it and gives the same ids, except on text that holds a special token's text, such as the\n"
                f"separator {enc.separator}: transformers encodes that as the special token, the shards as text;\n"
                "AutoTokenizer.from_pretrained(DIR, split_special_tokens=True) gives the shards' ids there too.\n"
                + padding)
    if not wrote_files:
        return (f"Tokenizer: tiktoken encoding {enc.name!r}; no transformers tokenizer files were written for it.\n"
                + padding)
    fast = ("tokenizer.json (the fast tokenizer) was built from the same vocabulary and merges.\n" if wrote_fast else
            "tokenizer.json was not written: the exporting machine lacked the tokenizers package; transformers\n"
            "builds the fast tokenizer from vocab.json and merges.txt when it loads them.\n")
    return ("Tokenizer: GPT-2 byte-level BPE (tiktoken r50k_base), end of text <|endoftext|> = 50256.\n"
            "vocab.json and merges.txt were rebuilt from tiktoken's ranks; AutoTokenizer.from_pretrained(DIR)\n"
            "loads them and gives the same ids as tiktoken.get_encoding('r50k_base').encode_ordinary, which made\n"
            "the shards, except on text that holds <|endoftext|>: transformers encodes that as the token 50256;\n"
            "AutoTokenizer.from_pretrained(DIR, split_special_tokens=True) gives the shards' ids there too.\n"
            + fast + padding)


# ----------------------------------------------------------------------------- export


def export_files(out_dir: str) -> list[str]:
    """The paths of out_dir that belong to an earlier export (EXPORT_FILES and weight shards)."""
    paths = [os.path.join(out_dir, name) for name in EXPORT_FILES]
    shards = glob.glob(os.path.join(glob.escape(out_dir), SHARD_PATTERN))
    return [p for p in paths if os.path.exists(p)] + sorted(shards)


def _staging_dirs(out_dir: str) -> list[str]:
    """The staging directories of exports into out_dir (STAGING_PREFIX): a running export's, or a killed one's."""
    return sorted(p for p in glob.glob(os.path.join(glob.escape(out_dir), STAGING_PREFIX + "*")) if os.path.isdir(p))


def _unlocked(directory: str) -> bool:
    """Whether no process holds directory locked (lock_directory): a staging directory of a killed export."""
    fd = lock_directory(directory)
    if fd is None:
        return False
    os.close(fd)
    return True


def check_target(out_dir: str, overwrite: bool) -> None:
    """ValueError (one line) for a directory the export must not write into: a file, or a directory that is
    not empty, unless overwrite. A stray file beside a model confuses its readers (another exporter's shard
    index is read before model.safetensors), and --out . by mistake should not litter a source tree. Staging
    directories (STAGING_PREFIX) are the exporter's own: a killed export's does not count, a running one's
    (locked) does, so that two exports never run into one directory at once."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory")
    killed = {os.path.basename(p) for p in _staging_dirs(out_dir) if _unlocked(p)}  # a running export's counts
    held = sorted(set(os.listdir(out_dir)) - killed) if os.path.isdir(out_dir) else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{out_dir} is not empty ({shown}); pass --overwrite to replace an earlier export there "
                         "(other files stay), or choose another directory")


def _file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask. Reading the umask means setting it: it is put
    back at once."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _move(names: list[str], src: str, dst: str, moved: list[str]) -> None:
    """Rename each of names from src to dst, in order, appending each to moved once it is there."""
    for name in names:
        os.replace(os.path.join(src, name), os.path.join(dst, name))
        moved.append(name)


def replace_export(staging: str, out_dir: str) -> None:
    """Move a finished export from staging into out_dir so that no reader ever sees two exports mixed (a new
    config.json over old weights): at every instant out_dir holds the earlier export whole, or no config.json
    (not a model to any reader, load_hf included), or the new export whole. So the earlier export's files,
    config.json first, go into staging/.earlier (removed with staging), then the new ones come in, config.json
    last; a failure midway puts the earlier export back in the same order. Staging directories of killed
    exports (unlocked: a running export holds its own locked) are removed first."""
    for path in _staging_dirs(out_dir):
        if not os.path.samefile(path, staging) and (fd := lock_directory(path)) is not None:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)
    new = sorted(os.listdir(staging), key=lambda name: (name == "config.json", name))
    earlier = sorted((os.path.basename(p) for p in export_files(out_dir)), key=lambda name: name != "config.json")
    aside = os.path.join(staging, ".earlier")
    os.mkdir(aside)
    moved_out, moved_in = [], []
    try:
        _move(earlier, out_dir, aside, moved_out)
        _move(new, staging, out_dir, moved_in)
    except BaseException:
        _move(moved_in[::-1], out_dir, staging, [])  # config.json, moved in last, leaves first
        _move(moved_out[::-1], aside, out_dir, [])  # and the earlier one's comes back last
        raise


def write_export(config: ModelConfig, weights: dict, enc: Tokenizer, directory: str) -> None:
    """Every file of the export (see the module docstring) into directory."""
    path = os.path.join(directory, "model.safetensors")
    _safetensors().save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, _file_mode())  # safetensors writes a private (0600) temporary file and renames it
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config, enc.eot), f, indent=2)
    if looks_back(config):
        shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), LOOK_BACK_FILE),
                        os.path.join(directory, LOOK_BACK_FILE))
    generation = {"bos_token_id": enc.eot, "eos_token_id": enc.eot,
                  "suppress_tokens": list(range(enc.n_vocab, config.padded_vocab_size))}
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    gpt2 = isinstance(enc, TiktokenTokenizer) and enc.encoding.name == "r50k_base"
    fast = write_gpt2_tokenizer(enc.encoding, directory, config.max_seq_len) if gpt2 else False
    if isinstance(enc, HFTokenizer):
        write_hf_tokenizer(enc, directory, config.max_seq_len)
    with open(os.path.join(directory, "tokenizer_note.txt"), "w", encoding="utf-8") as f:
        f.write(tokenizer_note(enc, gpt2, fast))
        if looks_back(config):  # AutoTokenizer reads config.json, whose auto_map is remote code
            f.write("This model's class is hf_look_back.py's: pass trust_remote_code=True to AutoTokenizer too.\n")


def export_hf(config: ModelConfig, state: dict, out_dir: str, tokenizer: Tokenizer | None = None,
              overwrite: bool = False) -> None:
    """Write a transformers directory in the model's layout (see the module docstring) for a model trained
    with `tokenizer` (None: GPT-2's).

    A non-empty out_dir is an error unless overwrite (check_target). The files are written into a staging
    directory inside out_dir (the same filesystem, so each move is a rename) and moved into place only once
    all of them are written: a failed export leaves an earlier one as it was. With overwrite, the earlier
    export's files (a stale shard index included) are replaced then (replace_export); other files stay."""
    _safetensors()  # the one optional dependency, checked before anything is written
    if problem := exportable_problem(config):
        raise ValueError(problem)
    enc = tokenizer or load_tokenizer("gpt2")
    check_model_vocab(config.vocab_size, enc)
    check_target(out_dir, overwrite)
    # Fresh float32 copies (float64 stays: hf_layout's zero-centred norms): safetensors refuses tensors that share
    # storage, as the views of a fused weight do.
    weights = {k: v.detach().to("cpu", v.dtype if v.dtype == torch.float64 else torch.float32).clone()
               for k, v in to_hf(config, state).items()}
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    lock = lock_directory(staging)  # so that another export into out_dir does not take it for a killed one's
    try:
        write_export(config, weights, enc, staging)
        replace_export(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        if created and not os.listdir(out_dir):  # a failed export into a directory it made: no trace left
            os.rmdir(out_dir)


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, metavar="PATH",
                        help="a checkpoint written by train.py (a .pt file or a sharded directory), or a run's "
                             "--out-dir: its newest good one")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: created if needed, else it must be empty (or --overwrite)")
    parser.add_argument("--tokenizer", type=tokenizer_flag, metavar="NAME|PATH",
                        help="the tokenizer the model was trained with, as prepare.py --tokenizer takes it "
                             "(default: the one its training data's data.json records, else GPT-2's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty DIR, replacing an earlier export's weights, config and "
                             "tokenizer files there (other files stay); only once the new export is complete")
    try:
        args = parser.parse_args(argv)
        check_target(args.out, args.overwrite)  # before a checkpoint that may take minutes to read
        config, state = read_ckpt(args.ckpt, lambda line: print(line, file=sys.stderr, flush=True))
        enc = load_tokenizer(args.tokenizer) if args.tokenizer else model_tokenizer(args.ckpt) or load_tokenizer()
        check_tokenizer(args.ckpt, tokenizer_id(enc.record()), lambda line: print(line, file=sys.stderr))
        try:
            export_hf(config, state, args.out, enc, args.overwrite)
        except OSError as e:  # the checkpoint is read by now: what failed is making or filling --out
            place = f" ({e.filename})" if e.filename and e.filename != args.out else ""
            raise UsageError(f"--out {args.out}: cannot write the export: {e.strerror or e}{place}") from None
    except (UsageError, CheckpointError, DataError, ValueError, OSError) as e:
        return report_error(e)
    try:
        padded = f" (padded from {config.vocab_size})" if config.padded_vocab_size != config.vocab_size else ""
        print(f"wrote {args.out}: {architecture(config)}, {plural(config.n_layer, 'layer')}, "
              f"vocab {config.padded_vocab_size}{padded}, "
              f"{'tied' if config.tie_embeddings else 'untied'} embeddings", flush=True)
    except BrokenPipeError:
        return closed_stdout()
    except OSError as e:  # a redirect to a full disk
        return unwritable_stdout(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
