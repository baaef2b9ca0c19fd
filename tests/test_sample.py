import json
import math
import os
import re
import sys

import pytest
import torch

import checkpoint
import sample
from conftest import write_checkpoint, write_word_tokenizer
from model import GPT, QWEN3_VALUES, KVCache, ModelConfig
from sample import decode_stream, generate, next_token, sample_text, top_k_filter, top_p_filter
from tokenizer import get_tokenizer, load_tokenizer, train_bpe

# GQA (4 query heads per kv head), head_dim not n_embd // n_head, a padded vocab, a small rope_theta so
# that the rotation matters over a short sequence.
TINY = dict(vocab_size=200, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, head_dim=16, ffn_dim=96,
            max_seq_len=32, rope_theta=500.0)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**{**TINY, **overrides})).eval()
    # Larger weights than the init's, so attention is far from uniform and sampling far from flat.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


@torch.no_grad()
def test_kv_cache_matches_full_forward():
    model = tiny_model()
    idx = torch.randint(0, 200, (2, 32))
    full, _ = model(idx)
    cache = KVCache(model.config, batch_size=2)
    # A prefill, a multi-token chunk at an offset (the case SDPA's is_causal gets wrong), then one at a time.
    pieces = [model(idx[:, :9], cache=cache)[0], model(idx[:, 9:14], cache=cache)[0]]
    pieces += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(14, 32)]
    incremental = torch.cat(pieces, dim=1)
    assert cache.pos == 32
    rel_err = (incremental - full).abs().max() / full.abs().max()
    assert rel_err < 1e-5, f"relative error {rel_err:.2e}"


@torch.no_grad()
def test_kv_cache_rewind_and_training_path():
    model = tiny_model()
    idx = torch.randint(0, 200, (1, 12))
    full, _ = model(idx)
    cache = KVCache(model.config, batch_size=1, max_len=12)
    model(torch.randint(0, 200, (1, 12)), cache=cache)
    cache.pos = 0  # rewinding overwrites the old keys and values
    again, _ = model(idx, cache=cache)
    torch.testing.assert_close(again, full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="KV cache holds 12 positions, 13 needed"):
        model(idx[:, :1], cache=cache)


def test_greedy_generate_matches_uncached_argmax():
    model = tiny_model()
    prompt = [5, 17, 42]
    tokens = generate(model, prompt, 12, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(torch.tensor([seq]))
            seq.append(int(logits[0, -1, :200].argmax()))
    assert tokens == seq[3:]


def test_generate_past_max_seq_len_restarts_cache():
    model = tiny_model()
    prompt = list(range(20))
    tokens = generate(model, prompt, 30, temperature=0)  # 50 positions, max_seq_len 32
    assert len(tokens) == 30
    assert tokens[:12] == generate(model, prompt, 12, temperature=0)  # identical until the cache fills


def test_generate_never_samples_padding_and_stops_at_eot():
    model = tiny_model()
    # At a huge temperature every column is about equally likely: unsliced, 56 of 256 would be padding.
    g = torch.Generator().manual_seed(0)
    assert all(t < 200 for t in generate(model, [1, 2], 30, temperature=1e4, generator=g))
    first = generate(model, [1, 2], 1, temperature=0)[0]
    assert generate(model, [1, 2], 10, temperature=0, eot=first) == []


def test_sample_text_draws_only_ids_the_tokenizer_has():
    """A model padded beyond its tokenizer (269 ids, the vocabulary 384, as data.check_vocab allows): a flat
    draw never takes an id above the tokenizer's, which it could not decode."""
    enc = train_bpe(["the cat sat on the mat"], 300, "trained:300")
    model = tiny_model(vocab_size=384)
    text = sample_text(model, enc, "the cat", max_new_tokens=40, temperature=1e4, top_k=None, seed=0)
    assert text.startswith("the cat") and len(text) > len("the cat")
    g = torch.Generator().manual_seed(0)
    assert max(generate(model, [1, 2], 40, temperature=1e4, generator=g, n_vocab=enc.n_vocab)) < enc.n_vocab

def test_top_k_filter():
    logits = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    out = top_k_filter(logits, 2)
    assert torch.equal(out, torch.tensor([-math.inf, -math.inf, -math.inf, 5.0, 4.0]))
    assert torch.equal(top_k_filter(logits, 5), logits)


def test_top_p_filter():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p)).tolist()  # noqa: E731
    assert kept(0.6) == [True, True, False]
    assert kept(0.5) == [True, False, False]  # the top token alone already holds 0.5
    assert kept(0.01) == [True, False, False]  # never empty
    assert kept(1.0) == [True, True, True]


def test_filters_match_transformers():
    generation = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    for k in (1, 7, 50):
        expected = generation.TopKLogitsWarper(k)(None, logits.clone())
        assert torch.equal(top_k_filter(logits, k), expected)
    for p in (0.1, 0.5, 0.9):
        expected = generation.TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(torch.isfinite(top_p_filter(logits, p)), torch.isfinite(expected))


def test_next_token():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert next_token(logits, 0, None, None, None) == 1
    g = torch.Generator().manual_seed(0)
    assert {next_token(logits, 1.0, 1, None, g) for _ in range(20)} == {1}
    assert {next_token(logits, 1.0, None, 0.6, g) for _ in range(50)} <= {1, 2}


def test_sampling_limits():
    model, g = tiny_model(), torch.Generator().manual_seed(0)
    assert len(generate(model, [1, 2], 4, temperature=sample.MIN_TEMPERATURE, generator=g)) == 4  # no overflow
    for temperature in (math.nan, math.inf, sample.MIN_TEMPERATURE / 2):
        with pytest.raises(ValueError, match="temperature"):
            generate(model, [1, 2], 4, temperature=temperature, generator=g)
    low, high = sample.SEED_RANGE  # torch's own range: the seeds at the ends work, the ones past them do not
    for seed in (low, high):
        sample.check_seed(seed)
        torch.Generator().manual_seed(seed)
    for seed in (low - 1, high + 1):
        with pytest.raises(ValueError, match="seed must be in"):
            sample.check_seed(seed)
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(seed)


def test_seeded_sampling_is_deterministic():
    model = tiny_model()

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(model, [3, 4, 5], 16, temperature=1.0, top_k=50, top_p=0.95, generator=g)

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_decode_stream_joins_split_utf8():
    enc = get_tokenizer()
    text = "héllo 日本語 🤖 ok"
    tokens = enc.encode(text)
    split = [t for t in tokens if not _is_utf8(enc.decode_single_token_bytes(t))]
    assert split, "the text should hold a character split across tokens"
    pieces = list(decode_stream(load_tokenizer(), tokens))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def gpt2_sized(seed=0, **overrides) -> GPT:
    """The GPT-2 vocabulary, so the tokenizer's ids fit; otherwise tiny."""
    return tiny_model(seed, **{"vocab_size": 50257, "n_embd": 32, "head_dim": 8, "ffn_dim": 64, "n_head": 4,
                               **overrides})


def test_sample_text_is_seeded_and_leaves_global_rng_alone():
    model, enc = gpt2_sized(), load_tokenizer()
    before = torch.get_rng_state()
    a = sample_text(model, enc, "Hello", max_new_tokens=8, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert a == sample_text(model, enc, "Hello", max_new_tokens=8, seed=3)
    assert a.startswith("Hello") and len(a) > len("Hello")




@pytest.mark.parametrize("gated", [True, False], ids=["gated", "qwen3"])
@pytest.mark.parametrize("source", ["ckpt", "hf"])
def test_cli_prints_text(tmp_path, capsys, source, gated):
    model = gpt2_sized(**{**QWEN3_VALUES, "attn_gate": gated})  # the architectures an export can write
    path = tmp_path / "ckpt.pt"
    write_checkpoint(path, model)
    if source == "hf":
        from hf import export_hf
        from trained import read_checkpoint

        path = tmp_path / "hf"
        export_hf(*read_checkpoint(str(tmp_path / "ckpt.pt")), str(path))
    argv = [f"--{source}", str(path), "--prompt", "Hello", "--max-new-tokens", "12", "--device", "cpu", "--greedy"]
    assert sample.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello") and len(out.strip()) > len("Hello")
    enc = get_tokenizer()
    expected = generate(model, enc.encode("Hello"), 12, temperature=0, eot=enc.eot_token)
    assert out == "Hello" + enc.decode(expected) + "\n"
    if source == "hf":  # an export given as a checkpoint: one line that says which flag it needs
        assert sample.main(["--ckpt", str(path), "--device", "cpu"]) == 2
        assert capsys.readouterr().err == f"error: --ckpt {path} is a Hugging Face directory (it has a " \
                                          "config.json); pass it as --hf\n"


def test_a_tokenizer_that_does_not_fit_the_model_is_refused_with_advice_that_works(tmp_path, capsys):
    """A model of 300 ids from shards that record no tokenizer: GPT-2's does not fit; the advice, followed with
    the tokenizer it was trained with, samples."""
    model = tiny_model(vocab_size=300)
    write_checkpoint(tmp_path / "ckpt.pt", model)
    args = ["--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "the cat", "--max-new-tokens", "4", "--greedy"]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and err == ("error: model vocab_size 300 does not fit the gpt2 tokenizer (50,257 tokens; a model "
                                 "may pad that to 50,304); pass --tokenizer with the tokenizer the model was trained "
                                 "with (a tokenizer.json or tiktoken name of 257 to 300 ids)\n")
    own = write_word_tokenizer(tmp_path / "tok.json", ["the", "cat"], size=299)  # and its separator: 300
    code, out, err = run_cli(capsys, *args, "--tokenizer", own)
    assert (code, err) == (0, "") and out.startswith("the cat")


def test_a_model_padded_beyond_its_tokenizer_samples_and_exports_only_the_tokenizers_ids(tmp_path, capsys):
    """`--vocab-size 50304` on GPT-2's ids trains (data.check_vocab allows the padding); sampling and an export
    take the model, and neither picks an id the tokenizer lacks, though here those ids' logits are the largest."""
    from hf import export_hf

    model, enc = gpt2_sized(vocab_size=50304, tie_embeddings=False), get_tokenizer()
    first = generate(model, enc.encode("Hello"), 1, temperature=0, n_vocab=enc.n_vocab)[0]
    with torch.no_grad():
        model.lm_head.weight[enc.n_vocab:] = 50 * model.lm_head.weight[first]
    assert generate(model, enc.encode("Hello"), 1, temperature=0)[0] >= enc.n_vocab  # unrestricted, it would
    write_checkpoint(tmp_path / "ckpt.pt", model)
    code, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "Hello", "--greedy")
    ours = generate(model, enc.encode("Hello"), 8, temperature=0, eot=enc.eot_token, n_vocab=enc.n_vocab)
    assert (code, err, out) == (0, "", "Hello" + enc.decode(ours) + "\n") and ours[0] == first
    export_hf(model.config, model.state_dict(), str(tmp_path / "hf"))
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(enc.n_vocab, 50304))


def test_cli_samples_a_checkpoint_with_every_recipe_toggle(tmp_path, capsys):
    """The toggles' parameters (attention gates, value embeddings, U-net weights) are the model's own: the
    checkpoint loads with them, however Qwen3's names differ."""
    model = gpt2_sized(mlp="relu2", logit_softcap=3.0, value_embeds=1, unet_skips=True, attn_gate=True)
    write_checkpoint(tmp_path / "ckpt.pt", model)
    code, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "Hello", "--greedy")
    assert (code, err) == (0, "") and out == greedy_text(model)


def test_decode_stream_keeps_a_word_tokenizers_spaces(word_tokenizer):
    """A decoder that puts a space between words: the pieces are what each token adds to the text so far,
    after the prompt's too."""
    enc = load_tokenizer(word_tokenizer)
    ids = enc.encode("the cat sat")
    assert list(decode_stream(enc, ids)) == ["the", " cat", " sat"]
    assert list(decode_stream(enc, ids[1:], context=ids[:1])) == [" cat", " sat"]


def test_cli_samples_with_the_tokenizer_the_model_was_trained_with(word_tokenizer, tmp_path, capsys):
    """A checkpoint's data.json names a 70,001-id tokenizer.json: sample.py encodes and decodes with it, from
    the checkpoint (through its recorded --data) and from its export (through the export's tokenizer.json)."""
    import prepare
    from hf import export_hf
    from trained import read_checkpoint

    (tmp_path / "docs.jsonl").write_text('{"text": "the cat sat"}\n' * 4)
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "data", word_tokenizer, val_tokens=4)
    model = tiny_model(vocab_size=70_001, n_embd=32, head_dim=8, ffn_dim=64, n_head=4, **QWEN3_VALUES)  # exported
    write_checkpoint(tmp_path / "ckpt.pt", model, {"data": {"data": str(tmp_path / "data")}})
    enc = load_tokenizer(word_tokenizer)
    prompt = enc.encode("the cat")
    new = generate(model, prompt, 6, temperature=0, eot=enc.eot)
    export_hf(*read_checkpoint(str(tmp_path / "ckpt.pt")), str(tmp_path / "hf"), enc)
    capsys.readouterr()  # prepare's summary
    for source in ("--ckpt", "ckpt.pt"), ("--hf", "hf"):
        argv = [source[0], str(tmp_path / source[1]), "--prompt", "the cat", "--max-new-tokens", "6", "--greedy"]
        assert sample.main([*argv, "--device", "cpu"]) == 0
        assert capsys.readouterr().out == enc.decode(prompt + new) + "\n"


@pytest.mark.parametrize("argv, words", [
    (["--ckpt", "missing.pt"], "missing.pt"), (["--hf", "missing_dir"], "missing_dir"),
    (["--ckpt", "x", "--top-k", "-1"], "--top-k must be >= 0 (0: off), got -1"),
    (["--ckpt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--ckpt", "x", "--top-p", "0"], "--top-p"), (["--ckpt", "x", "--max-new-tokens", "-5"], "--max-new-tokens must"),
    (["--ckpt", "x", "--temperature", "-1"], "--temperature must be 0"),
    (["--ckpt", "x", "--temperature", "nan"], "--temperature"),
    (["--ckpt", "x", "--temperature", "inf"], "--temperature"), (["--ckpt", "x", "--temperature", "1e-45"], "--temperature"),
    (["--ckpt", "x", "--seed", str(2**64)], "--seed must be in"),
    (["--ckpt", "x", "--seed", str(-2**63 - 1)], "--seed"),
    (["--ckpt", "x", "--num-samples", "0"], "--num-samples must be >= 1"),
    (["--ckpt", "x", "--greedy", "--num-samples", "2"], "2 identical samples"),
    (["--ckpt", "x", "--prompt", "a", "--prompt-file", "p.txt"], "not allowed with argument --prompt"),
    (["--ckpt", "x", "--prompt-file", "missing.txt"], "missing.txt: No such file"),
    (["--ckpt", "missing_run"], "missing_run")])
def test_cli_errors_exit_2_in_one_line(tmp_path, capsys, argv, words):
    argv = [a if not a.startswith("missing") else str(tmp_path / a) for a in argv]
    assert sample.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_cli_rejects_a_foreign_checkpoint(tmp_path, capsys):
    path = tmp_path / "foreign.pt"
    checkpoint.save_file({"model": {}}, str(path))  # with a valid checksum: intact, just not ours
    assert sample.main(["--ckpt", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint of this trainer" in err and err.count("\n") == 1


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = sample.main([*argv, "--device", "cpu", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def greedy_text(model, prompt="Hello", n=8) -> str:
    enc = get_tokenizer()
    return prompt + enc.decode(generate(model, enc.encode(prompt), n, temperature=0, eot=enc.eot_token)) + "\n"


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended here
def test_cli_takes_the_newest_good_checkpoint_of_a_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    old, new = gpt2_sized(seed=1), gpt2_sized(seed=2)
    assert greedy_text(old) != greedy_text(new)
    write_checkpoint(checkpoint.checkpoint_path(str(run), 2, sharded=False), old)
    write_checkpoint(tmp_path / "new.pt", new)  # the newest is a sharded directory, as FSDP2 writes
    newest = checkpoint.checkpoint_path(str(run), 4, sharded=True)
    checkpoint.file_to_dcp(str(tmp_path / "new.pt"), newest)

    code, out, err = run_cli(capsys, "--ckpt", str(run), "--prompt", "Hello", "--greedy")
    assert code == 0 and out == greedy_text(new)
    assert err == f"checkpoint {newest} (step 4): the newest good one in {run}\n"

    flip_a_byte(next(os.path.join(newest, n) for n in os.listdir(newest) if n.endswith(".distcp")))
    code, out, err = run_cli(capsys, "--ckpt", str(run), "--prompt", "Hello", "--greedy")
    assert code == 0 and out == greedy_text(old)
    skipped, took = err.splitlines()
    assert skipped.startswith("warning: skipping checkpoint: ") and "is damaged" in skipped
    assert took.startswith(f"checkpoint {run / 'ckpt_00000002.pt'} (step 2)")


def test_cli_names_a_run_directory_without_a_good_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    code, out, err = run_cli(capsys, "--ckpt", str(run))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {run}: it holds no checkpoint")
    write_checkpoint(run / "ckpt_00000003.pt", gpt2_sized())
    flip_a_byte(run / "ckpt_00000003.pt")
    code, out, err = run_cli(capsys, "--ckpt", str(run))
    assert code == 2 and err.splitlines()[-1] == (f"error: {run}: its one checkpoint does not verify and load "
                                                  "(ckpt_N.pt files or ckpt_N directories)")


def test_cli_exits_quietly_when_the_reader_stops(tmp_path, capsys, monkeypatch):
    """`sample.py | head -n 2`: the pipe closes under the stream; no traceback, the status SIGPIPE gives."""
    write_checkpoint(tmp_path / "ckpt.pt", gpt2_sized())
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    code, _, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--seed", "1")
    assert code == 141 and err == ""
    stdout.write("x" * 100_000)  # stdout now leads nowhere, so the interpreter's last flush at exit succeeds
    stdout.flush()
    stdout.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_cli_says_in_one_line_when_stdout_is_a_full_disk(tmp_path, capsys, monkeypatch):
    """`sample.py > file` on a full disk: one line, exit 2, no traceback."""
    write_checkpoint(tmp_path / "ckpt.pt", gpt2_sized())
    stdout = open("/dev/full", "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    code, _, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--seed", "1")
    assert code == 2 and err == "error: cannot write to standard output: No space left on device\n"
    stdout.close()  # a flush into /dev/null now


def test_cli_num_samples_prints_each_under_a_heading(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt.pt", gpt2_sized())
    code, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "Hello", "--num-samples", "3",
                             "--temperature", "2", "--seed", "5")
    assert code == 0 and err == ""
    parts = re.split(r"^=+ sample (\d) of 3 =+\n", out, flags=re.M)
    assert parts[0] == "" and parts[1::2] == ["1", "2", "3"]
    samples = parts[2::2]
    assert all(text.startswith("Hello") and text.endswith("\n") for text in samples)
    assert len(set(samples)) == 3  # one generator runs on across the samples: each draws anew


def test_cli_reads_the_prompt_from_a_file(tmp_path, capsys):
    model = gpt2_sized()
    write_checkpoint(tmp_path / "ckpt.pt", model)
    prompt = "Hé said:\n  «"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    code, out, _ = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt-file", str(tmp_path / "prompt.txt"),
                           "--greedy")
    assert code == 0 and out == greedy_text(model, prompt)
    (tmp_path / "latin1.txt").write_bytes("Hé!".encode("latin-1"))
    code, _, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt-file", str(tmp_path / "latin1.txt"))
    assert code == 2 and err.count("\n") == 1
    assert err == f"error: --prompt-file {tmp_path / 'latin1.txt'}: not UTF-8 text (invalid continuation byte at " \
                  "byte 1)\n"


def test_cli_draws_a_seed_prints_it_and_repeats_with_it(tmp_path, capsys):
    model = gpt2_sized()
    write_checkpoint(tmp_path / "ckpt.pt", model)
    argv = ["--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "Hello", "--temperature", "2"]
    code, drawn, err = run_cli(capsys, *argv)
    seed = re.fullmatch(r"seed (\d+) \(pass --seed \1 to repeat\)\n", err)
    assert code == 0 and seed
    code, repeated, err = run_cli(capsys, *argv, "--seed", seed.group(1))
    assert code == 0 and repeated == drawn and err == ""
    # With --seed, exactly what it always was: one generator seeded with it, drawing the tokens.
    enc = get_tokenizer()
    g = torch.Generator().manual_seed(int(seed.group(1)))
    expected = generate(model, enc.encode("Hello"), 8, 2.0, 200, 1.0, enc.eot_token, g)
    assert repeated == "Hello" + enc.decode(expected) + "\n"


def test_drawn_seeds_come_from_the_os_and_fit_torch(monkeypatch):
    monkeypatch.setattr(sample.secrets, "randbits", lambda bits: 2**bits - 1)
    seed = sample.draw_seed()
    assert seed == 2**sample.DRAWN_SEED_BITS - 1
    sample.check_seed(seed)


def test_cli_says_when_a_sample_ended_at_end_of_text(tmp_path, capsys, monkeypatch):
    write_checkpoint(tmp_path / "ckpt.pt", gpt2_sized())
    monkeypatch.setattr(sample, "stream", lambda *args, **kwargs: iter([15496, 11]))  # "Hello", ","; then eot
    code, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", "A", "--greedy")
    assert code == 0 and out == "AHello,\n"
    assert err == "(sample 1 ended at the end-of-text token after 2 of 8 tokens)\n"  # run_cli asks for 8


def test_cli_says_when_the_prompt_is_cut_to_the_models_context(tmp_path, capsys):
    """A prompt longer than the model's context (32 tokens here) is read from its last 32: said on stderr, once;
    one that fits, or one that nothing is generated after, is not."""
    model = gpt2_sized()
    write_checkpoint(tmp_path / "ckpt.pt", model)
    code, out, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", " Hello" * 40, "--greedy")
    assert code == 0 and out == greedy_text(model, " Hello" * 40)
    assert err == "note: the prompt was cut to its last 32 tokens, the model's context (it is 40 tokens)\n"
    code, _, err = run_cli(capsys, "--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", " Hello" * 32, "--greedy")
    assert code == 0 and err == ""
    assert sample.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", " Hello" * 40, "--greedy", "--device",
                        "cpu", "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("program", ["sample", "score", "hf"])
def test_an_empty_tokenizer_is_refused_not_taken_for_the_default(program, capsys):
    import importlib

    try:
        code = importlib.import_module(program).main(["--tokenizer", ""])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--tokenizer: is empty" in capsys.readouterr().err
