import errno
import json
import math
import os
import shutil
import stat
import sys

import pytest
import tokenizers
import torch

import checkpoint
import hf
import atomic
import prepare
from conftest import WORD_TEXT, write_checkpoint, write_word_tokenizer
from hf import export_hf, load_hf
from hf_layout import QWEN3_NEXT, architecture, hf_config, layout, looks_back, to_hf
from model import GPT, QWEN3_VALUES, ModelConfig
from sample import generate
from tokenizer import bpe_merges, get_tokenizer, load_tokenizer

# The GPT-2 vocabulary (export checks it against the tokenizer), otherwise tiny: GQA, head_dim not
# n_embd // n_head, a small rope_theta so the rotation matters; Qwen3's architecture (QWEN3_VALUES), with
# gated=True the attention gates, with look_back=True the smear and a small bigram table too: what the export
# writes.
TINY = dict(vocab_size=50257, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, head_dim=16, ffn_dim=96,
            max_seq_len=32, rope_theta=500.0, **QWEN3_VALUES)


LOOK_BACK = {"smear": True, "bigram_embed": 300}


def tiny_model(tied: bool, seed: int = 0, gated: bool = False, look_back: bool = False) -> GPT:
    torch.manual_seed(seed)
    toggles = {"attn_gate": gated, **(LOOK_BACK if look_back else {})}
    model = GPT(ModelConfig(**{**TINY, **toggles}, tie_embeddings=tied)).eval()
    # Norm weights away from 1 (a swapped or dropped norm would show) and matrices large enough that
    # attention is far from uniform and greedy argmaxes are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module",
                params=[(True, False, False), (False, False, False), (True, True, False), (False, True, False),
                        (False, True, True), (True, False, True)],
                ids=["qwen3-tied", "qwen3-untied", "next-tied", "next-untied", "look-back", "look-back-qwen3-tied"])
def exported(request, tmp_path_factory):
    tied, gated, look_back = request.param
    model = tiny_model(tied, gated=gated, look_back=look_back)
    out = tmp_path_factory.mktemp("hf")
    state = model.state_dict()
    state["blocks.1.mlp._extra_state"] = torch.zeros(0)  # as a Transformer Engine block writes
    export_hf(model.config, state, str(out))
    return model, out


def load_transformers(out, monkeypatch):
    """The directory as transformers loads it, offline (a look-back export's class is its own file's)."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()


def test_transformers_loads_the_export(exported, monkeypatch):
    model, out = exported
    qwen = load_transformers(out, monkeypatch)
    assert type(qwen).__name__ == architecture(model.config)
    assert qwen.config.tie_word_embeddings == model.config.tie_embeddings
    assert (qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()) == model.config.tie_embeddings
    assert qwen.config.rope_parameters["rope_theta"] == model.config.rope_theta
    assert qwen.config.vocab_size == model.config.padded_vocab_size

    idx = torch.randint(0, model.config.vocab_size, (2, model.config.max_seq_len))
    with torch.no_grad():
        expected = qwen(input_ids=idx).logits
        logits, _ = model(idx)
    rel_err = (logits - expected).abs().max() / expected.abs().max()
    assert rel_err < 1e-5, f"relative error {rel_err:.2e}"

    # transformers' greedy generate (its generation_config suppresses the padding ids) against ours.
    prompt = idx[:1, :6]
    with torch.no_grad():
        hf_out = qwen.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10)
    hf_new = hf_out[0, 6:].tolist()
    eot = get_tokenizer().eot_token
    ours = generate(model, prompt[0], 10, temperature=0, eot=eot)
    assert hf_new == ours + ([eot] if len(ours) < 10 else [])
    if model.config.attn_gate:  # a gate that did nothing would leave these equal
        with torch.no_grad():
            qwen.model.layers[0].self_attn.q_proj.weight.view(8, 2, 16, 64)[:, 1] = 0
            assert (qwen(input_ids=idx).logits - expected).abs().max() > 1e-2
    if looks_back(model.config):  # each of the two parts counts: without it the logits move
        for part in (qwen.look_back.smear_weight, qwen.look_back.bigram_embed.weight):
            with torch.no_grad():
                before = qwen(input_ids=idx).logits
                part.zero_()
                assert (qwen(input_ids=idx).logits - before).abs().max() > 1e-2


@pytest.mark.parametrize("gated, cache", [(True, "dynamic"), (False, "static")])
def test_a_look_back_export_generates_a_left_padded_batch_as_each_prompt_alone(gated, cache, monkeypatch, tmp_path):
    """A static cache (the compiled route) turns the mask into 4-D ones inside generate: the previous ids are
    read from the 2-D mask before that."""
    model = tiny_model(False, gated=gated, look_back=True)
    export_hf(model.config, model.state_dict(), str(tmp_path))
    qwen = load_transformers(tmp_path, monkeypatch)
    eot = get_tokenizer().eot_token
    long, short = torch.randint(0, eot, (6,), generator=torch.Generator().manual_seed(3)).split([4, 2])
    long = torch.cat([short, long])
    batch = torch.stack([long, torch.cat([torch.full((4,), eot), short])])
    mask = torch.tensor([[1] * 6, [0] * 4 + [1] * 2])
    with torch.no_grad():
        out = qwen.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=eot,
                            cache_implementation=cache)
    for row, prompt in zip(out[:, 6:].tolist(), (long, short)):
        ours = generate(model, prompt, 8, temperature=0, eot=eot)
        assert row[:len(ours)] == ours


def test_a_look_back_exports_own_decoding_loop_passes_the_previous_ids_or_is_refused(monkeypatch, tmp_path):
    model = tiny_model(False, look_back=True)
    export_hf(model.config, model.state_dict(), str(tmp_path))
    qwen = load_transformers(tmp_path, monkeypatch)
    idx = torch.randint(0, 50257, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = qwen(input_ids=idx).logits[:, -1]
        first = qwen(input_ids=idx[:, :-1], use_cache=True)
        with pytest.raises(ValueError, match="needs previous_token_ids"):
            qwen(input_ids=idx[:, -1:], cache=first.cache)
        step = qwen(input_ids=idx[:, -1:], cache=first.cache, previous_token_ids=idx[:, -2:-1]).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


def test_a_look_back_export_needs_trust_remote_code(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model(False, look_back=True)
    export_hf(model.config, model.state_dict(), str(tmp_path))
    with pytest.raises(ValueError, match="trust_remote_code"):  # never a plain Qwen3 without the look-back
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)


def test_the_written_config_loads_with_auto_config_offline(exported, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, out = exported
    config = transformers.AutoConfig.from_pretrained(out, trust_remote_code=looks_back(model.config))
    assert config.model_type == hf_config(model.config, 50256)["model_type"]
    assert config.architectures == [architecture(model.config)]
    assert config.num_hidden_layers == model.config.n_layer and config.head_dim == model.config.resolved_head_dim
    if layout(model.config) == QWEN3_NEXT:  # the Qwen3 block and a gate: no linear attention, no experts
        assert config.layer_types == ["full_attention"] * model.config.n_layer
        assert config.mlp_only_layers == list(range(model.config.n_layer))
        assert config.rope_parameters["partial_rotary_factor"] == 1.0


def test_export_directory_contents(exported):
    model, out = exported
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert not any(k.endswith("_extra_state") for k in weights)
    gated = layout(model.config) == QWEN3_NEXT
    norms = {k for k in weights if k.endswith("norm.weight")}
    assert len(norms) == 4 * model.config.n_layer + 1
    assert all(t.dtype == (torch.float64 if gated and k in norms else torch.float32) for k, t in weights.items())
    assert weights["model.embed_tokens.weight"].shape == (model.config.padded_vocab_size, model.config.n_embd)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == 50256
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(50257, model.config.padded_vocab_size))
    assert "GPT-2" in (out / "tokenizer_note.txt").read_text()
    assert (out / "hf_look_back.py").is_file() == looks_back(model.config)


def test_load_hf_round_trips(exported):
    model, out = exported
    config, state = load_hf(str(out))
    assert config == model.config
    original = model.state_dict()
    assert list(state) == list(original)
    assert all(torch.equal(state[k], original[k]) for k in original)
    if config.tie_embeddings:
        assert state["lm_head.weight"] is state["embed.weight"]


def test_tokenizer_files_match_tiktoken(exported):
    transformers = pytest.importorskip("transformers")
    model, out = exported
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=looks_back(model.config))
    enc = get_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    text = "Hello world\n\n    def f(x):\treturn x**2  # héllo wörld 日本語 🤖 it's   \r\n<|endoftext|>"
    ids = enc.encode(text, allowed_special="all")
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text
    assert tok.eos_token_id == enc.eot_token


# Unicode, runs of spaces, tabs and newlines (GPT-2's regex keeps the last space of a run for the next word),
# contractions, digits, and the end-of-text token inside and around text.
TOKENIZER_TEXTS = ["Hello world", "  a   b \t\t c\n\n\n  d  ", "héllo wörld 日本語 🤖 Ελληνικά", "it's they'll 1234567",
                   "<|endoftext|>", "x<|endoftext|> y<|endoftext|><|endoftext|>", "a , b . c ' s", "\r\n\r\n   "]


def test_tokenizer_json_alone_is_the_fast_tokenizer_with_tiktoken_ids(exported, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, out = exported
    only_fast = tmp_path / "fast"  # without vocab.json and merges.txt: nothing to build a tokenizer from but it
    only_fast.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (only_fast / name).write_bytes((out / name).read_bytes())
    enc = get_tokenizer()
    raw = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for directory in (out, only_fast):
        tok = transformers.AutoTokenizer.from_pretrained(directory)
        assert tok.is_fast
        for text in TOKENIZER_TEXTS:
            ids = enc.encode(text, allowed_special="all")
            assert tok.encode(text) == ids == raw.encode(text).ids, text
            assert tok.decode(ids) == text
        assert tok.eos_token_id == enc.eot_token


def test_export_files_get_the_mode_open_gives(tmp_path):
    model = tiny_model(True)
    previous = os.umask(0o027)
    try:
        export_hf(model.config, model.state_dict(), str(tmp_path / "hf"))
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, 0o640)  # 0o666 less the umask, model.safetensors too


def test_bpe_merges_rebuild_the_ranks():
    # A toy BPE: "ab" (rank 3) then "abc" (rank 4, built from "ab" + "c"), "bc" ranked after it.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c")]




def test_a_tokenizer_that_does_not_fit_is_refused_with_advice_that_works(tmp_path, capsys):
    model = GPT(ModelConfig(**{**TINY, "vocab_size": 300, "n_embd": 32, "head_dim": 8}))
    write_checkpoint(tmp_path / "ckpt.pt", model)  # no --data recorded: GPT-2's tokenizer is assumed
    args = ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf")]
    assert hf.main(args) == 2
    assert capsys.readouterr().err.strip().endswith("pass --tokenizer with the tokenizer the model was trained with "
                                                    "(a tokenizer.json or tiktoken name of 257 to 300 ids)")
    own = write_word_tokenizer(tmp_path / "tok.json", ["the", "cat"], size=299)  # and its separator: 300
    assert hf.main([*args, "--tokenizer", own]) == 0 and (tmp_path / "hf" / "tokenizer.json").exists()


def test_export_writes_the_recorded_tokenizer_for_auto_tokenizer(word_tokenizer, tmp_path, monkeypatch):
    """A model trained on shards of a 70,001-id tokenizer.json (its checkpoint records their --data): the export
    carries that tokenizer, and AutoTokenizer gives its ids, its separator as bos and eos."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": WORD_TEXT}) + "\n")
    prepare.prepare(tmp_path / "docs.jsonl", tmp_path / "data", word_tokenizer, val_tokens=4)
    model = GPT(ModelConfig(**{**TINY, "vocab_size": 70_001, "n_embd": 32, "head_dim": 8}))
    write_checkpoint(tmp_path / "ckpt.pt", model, {"data": {"data": str(tmp_path / "data")}})
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf")]) == 0
    tok, enc = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"), load_tokenizer(word_tokenizer)
    own = tokenizers.Tokenizer.from_file(word_tokenizer)
    for text in (WORD_TEXT, "a dog , some unknown words", "the <|endoftext|> cat"):
        assert tok.encode(text) == own.encode(text).ids  # the tokenizer's own ids, its special token included
    assert tok.encode(WORD_TEXT) == enc.encode(WORD_TEXT) and tok.decode(enc.encode(WORD_TEXT)) == WORD_TEXT
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert tok.bos_token_id == tok.eos_token_id == config["eos_token_id"] == enc.eot == 70_000
    assert enc.sha256 in (tmp_path / "hf" / "tokenizer_note.txt").read_text()


def test_cli(tmp_path, capsys):
    model = tiny_model(False)
    write_checkpoint(tmp_path / "ckpt.pt", model)
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf")]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    config, _ = load_hf(str(tmp_path / "hf"))
    assert config == model.config
    assert hf.main(["--ckpt", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_cli_takes_the_newest_good_checkpoint_of_a_run_directory(tmp_path, capsys, monkeypatch):
    """As sample.py and score.py do: the newest checkpoint that verifies, and which one is said on stderr."""
    run = tmp_path / "run"
    run.mkdir()
    old, new = tiny_model(True, seed=1), tiny_model(False, seed=2)
    write_checkpoint(checkpoint.checkpoint_path(str(run), 2, sharded=False), old)
    newest = checkpoint.checkpoint_path(str(run), 4, sharded=False)
    write_checkpoint(newest, new)
    written = []
    monkeypatch.setattr(hf, "export_hf", lambda config, state, *_: written.append((config, state)))
    argv = ["--ckpt", str(run), "--out", str(tmp_path / "hf")]
    assert hf.main(argv) == 0
    assert capsys.readouterr().err == f"checkpoint {newest} (step 4): the newest good one in {run}\n"
    assert written[-1][0] == new.config and torch.equal(written[-1][1]["embed.weight"], new.embed.weight)
    with open(newest, "r+b") as f:  # damaged: the one before it is taken
        f.seek(os.path.getsize(newest) // 2)
        f.write(b"\x00" * 8)
    assert hf.main(argv) == 0
    skipped, took = capsys.readouterr().err.splitlines()
    assert "skipping checkpoint" in skipped and took.startswith(f"checkpoint {run / 'ckpt_00000002.pt'} (step 2)")
    assert written[-1][0] == old.config


def test_cli_exits_quietly_when_the_reader_stops(tmp_path, capsys, monkeypatch):
    """`hf.py ... | true`: the closing line meets a closed pipe; no traceback, the status SIGPIPE gives."""
    write_checkpoint(tmp_path / "ckpt.pt", tiny_model(True))
    monkeypatch.setattr(hf, "export_hf", lambda *_: None)
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf")]) == 141
    assert capsys.readouterr().err == ""
    stdout.close()  # a flush into /dev/null now
    if os.path.exists("/dev/full"):  # `hf.py ... > file` on a full disk: one line, exit 2
        stdout = open("/dev/full", "w")
        monkeypatch.setattr(sys, "stdout", stdout)
        assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "hf2")]) == 2
        assert capsys.readouterr().err == "error: cannot write to standard output: No space left on device\n"
        stdout.close()


def test_cli_refuses_an_earlier_export_unless_told_to_overwrite(tmp_path, capsys, monkeypatch):
    old, new = tiny_model(True, seed=1), tiny_model(False)
    write_checkpoint(tmp_path / "old.pt", old)
    write_checkpoint(tmp_path / "new.pt", new)
    out = tmp_path / "hf"
    assert hf.main(["--ckpt", str(tmp_path / "old.pt"), "--out", str(out)]) == 0
    # Make it a sharded export, as transformers writes a large model: loaders read the index, if there is one.
    shard = "model-00001-of-00001.safetensors"
    (out / "model.safetensors").rename(out / shard)
    weight_map = {k: shard for k in to_hf(old.config, old.state_dict())}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    argv = ["--ckpt", str(tmp_path / "new.pt"), "--out", str(out)]
    assert hf.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched

    assert hf.main(argv + ["--overwrite"]) == 0
    assert not (out / shard).exists() and not (out / "model.safetensors.index.json").exists()
    assert (out / "notes.txt").read_text() == "mine"
    qwen = load_transformers(out, monkeypatch)
    assert type(qwen).__name__ == "Qwen3ForCausalLM" and not qwen.config.tie_word_embeddings  # the new config
    idx = torch.randint(0, new.config.vocab_size, (1, 16))
    with torch.no_grad():
        expected, _ = new(idx)
        torch.testing.assert_close(qwen(input_ids=idx).logits, expected, rtol=0, atol=1e-4)


def _hf_dir(directory, case):
    """A Hugging Face directory of the tiny model, spoilt as `case` says."""
    model = tiny_model(True, gated=case == "elementwise-gate")
    if case != "no-weights":
        weights = {k: v.clone() for k, v in to_hf(model.config, model.state_dict()).items()}
        if case == "elementwise-gate":  # head 3's gate rows no longer all alike
            weights["model.layers.1.self_attn.q_proj.weight"][(2 * 3 + 1) * 16 + 5, 0] += 0.5
        hf._safetensors().save_file(weights, str(directory / "model.safetensors"))
    config = hf_config(model.config, eot=50256)
    config = {"config-list": [config], "string-int": {**config, "num_hidden_layers": "2"},
              "wrong-shape": {**config, "hidden_size": 128}, "missing-layer": {**config, "num_hidden_layers": 3},
              "extra-layer": {**config, "num_hidden_layers": 1}, "huge-depth": {**config, "num_hidden_layers": 10**12},
              "huge-width": {**config, "hidden_size": 10**30},
              "inf-theta": {**config, "rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}}.get(case, config)
    if case != "no-config":
        (directory / "config.json").write_text('{"vocab_size": 50304,\n' if case == "config-syntax" else json.dumps(config))
    index = {"index-list": [], "index-no-map": {"metadata": {}}, "index-map-list": {"weight_map": ["model.safetensors"]},
             "index-non-string": {"weight_map": {"model.norm.weight": 1}}}
    if case.startswith("index"):
        text = '{"weight_map": {\n  "model.norm.weight": model.safetensors}}' if case == "index-syntax" else json.dumps(index[case])
        (directory / "model.safetensors.index.json").write_text(text)


@pytest.mark.parametrize("case, words", [
    ("no-config", "no config.json"), ("no-weights", "model.safetensors not found"),
    ("config-list", "config.json: not a JSON object"),
    ("string-int", 'config.json: num_hidden_layers must be an integer, got "2"'),
    ("wrong-shape", "wrong shape model.embed_tokens.weight 50304x64 (config: 50304x128)"),
    ("missing-layer", "missing model.layers.2."), ("extra-layer", "unknown model.layers.1."),
    ("huge-depth", "missing model.layers.2."), ("huge-width", "hidden_size must be a 64-bit integer, got 10000"),
    ("inf-theta", "config.json: rope_theta must be a finite number, got Infinity"),
    ("config-syntax", "config.json: not valid JSON: Expecting property name enclosed in double quotes: line 2"),
    ("index-list", "model.safetensors.index.json: not a JSON object"),
    ("index-no-map", "model.safetensors.index.json: weight_map must be an object of tensor names to file names"),
    ("index-map-list", "model.safetensors.index.json: weight_map must be an object"),
    ("index-non-string", "model.safetensors.index.json: weight_map must be an object"),
    ("index-syntax", "model.safetensors.index.json: not valid JSON: Expecting value: line 2 column 24"),
    ("elementwise-gate", "model.layers.1.self_attn.q_proj.weight: the gate rows of head 3 differ")])
def test_load_hf_errors_are_one_line(tmp_path, case, words):
    _hf_dir(tmp_path, case)
    with pytest.raises(ValueError) as e:
        load_hf(str(tmp_path))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_a_non_empty_directory_and_writes_into_an_empty_one(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt.pt", tiny_model(True))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out)]
    assert hf.main(argv) == 2
    assert capsys.readouterr().err == (f"error: {out} is not empty (notes.txt); pass --overwrite to replace an "
                                       "earlier export there (other files stay), or choose another directory\n")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "ckpt.pt")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'ckpt.pt'} exists and is not a directory\n"
    (out / "notes.txt").unlink()
    assert hf.main(argv) == 0  # an empty directory is fine
    assert {p.name for p in out.iterdir()} == set(hf.EXPORT_FILES) - {"model.safetensors.index.json", "hf_look_back.py"}


def test_an_out_that_cannot_be_made_is_one_line_naming_out(tmp_path, capsys):
    """--out under a file: the directory cannot be made; the line names --out and the reason in words."""
    write_checkpoint(tmp_path / "ckpt.pt", tiny_model(True))
    out = tmp_path / "ckpt.pt" / "hf" / "x"
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --out {out}: cannot write the export: Not a directory "
                                       f"({tmp_path / 'ckpt.pt' / 'hf'})\n")


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, capsys, monkeypatch):
    write_checkpoint(tmp_path / "old.pt", tiny_model(True, seed=1))
    write_checkpoint(tmp_path / "new.pt", tiny_model(False))
    out = tmp_path / "hf"
    assert hf.main(["--ckpt", str(tmp_path / "old.pt"), "--out", str(out)]) == 0
    (out / f"{hf.STAGING_PREFIX}killed").mkdir()  # what an export killed halfway leaves behind
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # fails after model.safetensors and config.json are written
        m.setattr(hf, "write_gpt2_tokenizer", full_disk)
        assert hf.main(["--ckpt", str(tmp_path / "new.pt"), "--out", str(out), "--overwrite"]) == 2
        assert hf.main(["--ckpt", str(tmp_path / "new.pt"), "--out", str(tmp_path / "fresh")]) == 2
    assert capsys.readouterr().err.count("No space left on device") == 2
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not (tmp_path / "fresh").exists()  # a directory the failed export made is gone again

    assert hf.main(["--ckpt", str(tmp_path / "new.pt"), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # the killed export's leftovers are gone
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_killed_exports_staging_directory_does_not_block_a_plain_rerun_and_goes(tmp_path, capsys):
    """The staging directory an export killed halfway leaves is the exporter's, not the user's: a rerun without
    --overwrite goes ahead and removes it. A running export's (held locked) is left alone, and a second export
    into that directory is refused meanwhile: two at once could mix their files."""
    write_checkpoint(tmp_path / "ckpt.pt", tiny_model(True))
    out = tmp_path / "hf"
    killed, running = out / f"{hf.STAGING_PREFIX}killed", out / f"{hf.STAGING_PREFIX}running"
    for staging in killed, running:
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_bytes(b"half")
    held = atomic.lock_directory(str(running))  # as a running export holds its own
    try:
        assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out)]) == 2
    finally:
        os.close(held)
    assert f"is not empty ({hf.STAGING_PREFIX}running)" in capsys.readouterr().err
    assert (running / "model.safetensors").read_bytes() == b"half"
    assert hf.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(out)]) == 0  # both killed now: both go
    assert not killed.exists() and not running.exists()
    assert load_hf(str(out))[0] == tiny_model(True).config


def _write(directory, files):
    directory.mkdir(exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def _files(directory):
    return {p.name: p.read_text() for p in directory.iterdir() if p.is_file()}


def test_replacing_an_export_never_shows_two_mixed_and_a_failed_move_puts_the_earlier_one_back(tmp_path, monkeypatch):
    """After every rename into or out of OUT it holds the earlier export whole, or no config.json (not a model to
    any reader), or the new one whole; a rename that fails at any point leaves the earlier one as it was."""
    out, replace = tmp_path / "hf", os.replace
    earlier = {"config.json": "old", "model-00001-of-00001.safetensors": "old", "model.safetensors.index.json": "old",
               "vocab.json": "old", "notes.txt": "mine"}
    new = {"config.json": "new", "model.safetensors": "new", "vocab.json": "new", "tokenizer.json": "new"}
    whole = [earlier, {**new, "notes.txt": "mine"}]

    def replace_export(fail_at=None):
        """-> the renames it made, failing the fail_at-th."""
        staging, moves = out / f"{hf.STAGING_PREFIX}test", []
        _write(out, earlier)
        _write(staging, new)

        def move(src, dst):
            moves.append(dst)
            if len(moves) == fail_at:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            replace(src, dst)
            files = _files(out)
            assert "config.json" not in files or files in whole

        monkeypatch.setattr(os, "replace", move)
        try:
            hf.replace_export(str(staging), str(out))
        finally:
            monkeypatch.setattr(os, "replace", replace)
            shutil.rmtree(staging)
        return len(moves)

    renames = replace_export()
    assert _files(out) == whole[1] and renames == 8  # the earlier export's 4 files out, the new one's 4 in
    for fail_at in range(1, renames + 1):
        shutil.rmtree(out)
        with pytest.raises(OSError, match="Input/output error"):
            replace_export(fail_at)
        assert _files(out) == earlier


def test_export_refuses_a_model_with_recipe_toggles_in_one_line(tmp_path):
    config = ModelConfig(**{**TINY, "unet_skips": True, "mlp": "relu2", "attn_gate": True})
    with pytest.raises(ValueError, match=r"^--mlp relu2, --unet-skips: neither Qwen3ForCausalLM nor "
                                         r"Qwen3NextForCausalLM has such a part") as e:
        export_hf(config, {}, str(tmp_path / "out"))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    assert str(e.value).endswith("(a model trained with --mlp swiglu --no-unet-skips can)")
