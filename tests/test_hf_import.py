"""plumbing/hf_import.py, --init_from: public models' folders imported, checked against
transformers itself (a test-only dependency): for each family, a small random model built
from its own config class and saved by save_pretrained gives stacklm's fp32 logits equal to
transformers' to 1e-5, and its first cross-entropy equals transformers' loss; a run started
from it, trained and exported, loads back as the class it came from with the trained
logits. Plus what cannot be imported, each refused in one line, and a folder that cannot
start a run (a damaged download, data of another vocabulary), refused before any work; and
a run on a public tokenizer's data exports the end-of-text token sample.py needs."""

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import export
import prepare
import sample
import train
import config
from config import StackConfig
from conftest import micro_config
from model import Transformer
from plumbing import hf_import, overrides
from public_model import public_model as make_public_model
from test_train import cli_args

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOLERANCE = 1e-5  # fp32
# family: (config class, its settings; rope_theta off every default, where a missing one hides)
FAMILIES = {
    "llama": ("LlamaConfig", {"rope_theta": 123_456.0, "head_dim": 16}),
    "qwen3": ("Qwen3Config", {"rope_theta": 123_456.0, "head_dim": 16}),
    "qwen3_wide_heads": ("Qwen3Config", {"rope_theta": 123_456.0, "head_dim": 32}),
    "smollm3": ("SmolLM3Config", {"rope_theta": 123_456.0, "no_rope_layers": [1, 0, 1, 0],
                                  "pad_token_id": None, "bos_token_id": None,
                                  "eos_token_id": None}),
}
EXPECTED = {"llama": (False, 0, None), "qwen3": (True, 0, None),
            "qwen3_wide_heads": (True, 0, 32), "smollm3": (False, 2, None)}  # qk, nope, head_dim


def public_model(folder: Path, family: str, tokenizer: Path | None = None, **changes):
    config_class, settings = FAMILIES[family]
    return make_public_model(folder, config_class, tokenizer, **{**settings, **changes})


def imported(folder) -> Transformer:
    model = Transformer(StackConfig(**hf_import.model_shape(folder)))
    model.load_state_dict(hf_import.read_weights(folder, model.cfg))
    return model.eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


def hf_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch, use_cache=False).logits


def stack_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(batch)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_imports_with_transformers_logits_and_loss(family, tmp_path):
    """The shape read from config.json (QK-norm, NoPE layers, head width, rope_theta, eps),
    the weights by name, no q/k permutation: fp32 logits within 1e-5 of transformers'; and
    the cross-entropy of unpacked rows (stacklm's `ce`, without the z-loss) equals
    transformers' loss on the same ids."""
    hf = public_model(tmp_path, family)
    ours = imported(tmp_path)
    qk_norm, nope_every, head_dim = EXPECTED[family]
    assert (ours.cfg.qk_norm, ours.cfg.nope_every, ours.cfg.head_dim) == \
        (qk_norm, nope_every, head_dim)
    assert (ours.cfg.rope_theta, ours.cfg.norm_eps) == (123_456.0, 1e-5)
    batch = ids()
    assert (stack_logits(ours, batch) - hf_logits(hf, batch)).abs().max() < TOLERANCE
    with torch.no_grad():
        ce = ours(batch[:, :-1], targets=batch[:, 1:]).ce
        want = hf(batch, labels=batch, use_cache=False).loss
    assert abs(ce.item() - want.item()) < TOLERANCE


def test_weights_in_bf16_or_in_shards_arrive_as_fp32_master_weights(tmp_path):
    """A download in bf16 is read as fp32 (the master weights), with bf16's values; weights
    split over several files by an index are read from each."""
    hf = public_model(tmp_path / "one", "llama")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    weights = hf_import.read_weights(tmp_path / "bf16", imported(tmp_path / "one").cfg)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert torch.equal(weights["embed.weight"],
                       hf.model.embed_tokens.weight.float())


def test_stacklms_own_export_comes_back(small_data_dir, tmp_path):
    """An HF export with QK-norm and NoPE layers (StackLMForCausalLM) imports as the model
    that was exported, bit for bit."""
    cfg = StackConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                      intermediate=176, max_seq_len=64, rope_theta=500_000.0, nope_every=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), cfg,
                             Path(small_data_dir) / "tokenizer.json", 0, {"trained_by": "x"})
    back = imported(folder)
    assert dataclasses.asdict(back.cfg) == dataclasses.asdict(cfg)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                  model.state_dict().values(), strict=True))


def public_run(folder: Path, data_dir: str, out: Path, **knobs):
    """micro_config with --init_from=folder, its shape read as train.py's command line reads
    it."""
    given = {"init_from": str(folder), **knobs}
    return overrides.apply_overrides(micro_config(data_dir, str(out)),
                                     given | overrides.public_model_shape(given))


@pytest.mark.parametrize("family", ["llama", "smollm3"])
def test_a_run_from_a_public_model_starts_from_it_and_exports_back_as_its_class(
        family, small_data_dir, tmp_path, capsys):
    """The run's model starts with the public weights (fp32, equal), trains, stops; the same
    command continues its own checkpoint and says so; export --format hf loads back as the
    class it came from, with the trained model's logits."""
    hf = public_model(tmp_path / "public", family, Path(small_data_dir) / "tokenizer.json")
    cfg = public_run(tmp_path / "public", small_data_dir, tmp_path / "run", stop_at_step=4)
    run = train.setup(cfg)
    mine = dict(run.accelerator.unwrap_model(run.model).state_dict())
    want = hf_import.read_weights(tmp_path / "public", cfg.model)
    assert all(torch.equal(mine[name], want[name]) for name in want)
    printed = capsys.readouterr().out
    assert "init: " in printed
    assert f"model shape: {tmp_path / 'public'}/config.json's: d_model 64, 4 layers, 4 heads " \
           f"of 16 (2 KV), MLP 176, vocab 512" in printed
    train.main(cfg)
    train.main(dataclasses.replace(cfg, stop_at_step=8))  # the same command, further
    assert f"(its own; --init_from={tmp_path / 'public'} is where this run began" in \
        capsys.readouterr().out
    folder = export.export(cfg.out_dir, "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(back) is type(hf)
    trained = imported(folder)
    batch = ids()
    assert (hf_logits(back, batch) - stack_logits(trained, batch)).abs().max() < TOLERANCE


# config.json changes StackConfig cannot express, each refused naming its field
REFUSED = [
    ("llama", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_"),
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("llama", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ("smollm3", {"no_rope_layers": [1, 0, 1, 1]}, "no_rope_layers=[1, 0, 1, 1] is not every"),
]


@pytest.mark.parametrize("family, change, message", REFUSED)
def test_what_stacklm_cannot_express_is_refused_in_one_line(family, change, message,
                                                            tmp_path):
    public_model(tmp_path, family)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        hf_import.model_shape(tmp_path)
    # nothing in stacklm can fix it: the line says what the user can do instead
    assert str(e.value).endswith("; " + hf_import.ELSEWHERE)
    assert "drop --init_from and set --model.* flags" in hf_import.ELSEWHERE


def test_other_architectures_pickles_and_missing_weights_are_refused(tmp_path):
    hf = public_model(tmp_path / "a", "llama")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps(config | {
        "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*is not one whose blocks"):
        hf_import.model_shape(tmp_path / "a")
    (tmp_path / "bin").mkdir()  # the older transformers layout: pickles, no safetensors
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"PyTorch pickles .* convert it once with "
                                         r"transformers: python -c"):
        hf_import.weight_files(tmp_path / "bin")
    public_model(tmp_path / "cut", "qwen3")  # QK-norm's gains are in its file: remove one
    weights = load_file(tmp_path / "cut" / "model.safetensors")
    del weights["model.layers.2.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no weight model\.layers\.2\.self_attn\.k_norm\.weight"):
        imported(tmp_path / "cut")


def test_a_model_flag_that_disagrees_and_data_of_another_tokenizer_are_refused(
        small_data_dir, tmp_path):
    """--init_from's config.json sets the shape: a model flag may repeat it, not change it.
    Data prepared with another tokenizer than the model's is refused before any work, with
    the prepare command that fixes it."""
    public_model(tmp_path / "public", "llama", Path(small_data_dir) / "tokenizer.json")
    base = ["--preset", "tiny", f"--init_from={tmp_path / 'public'}", "--seq_len=64",
            "--micro_batch_size=4", "--global_batch_tokens=512"]
    cfg, _ = overrides.parse_args(base + ["--model.n_layers=4"])  # agrees: taken
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (4, 64, 512)
    with pytest.raises(ValueError, match=r"--model\.n_layers=7 disagrees with .*config\.json "
                                         r"\(n_layers 4\)"):
        overrides.parse_args(base + ["--model.n_layers=7"])
    other = Tokenizer.from_file(str(Path(small_data_dir) / "tokenizer.json"))
    other.add_tokens(["an extra token"])
    other.save(str(tmp_path / "public" / "tokenizer.json"))
    cfg = public_run(tmp_path / "public", small_data_dir, tmp_path / "run")
    with pytest.raises(ValueError, match=r"prepared with another tokenizer .* python "
                                         r"prepare\.py --source CORPUS --tokenizer"):
        train.main(cfg)


@pytest.fixture(scope="module")
def good_public(small_data_dir, tmp_path_factory) -> Path:
    """A public Llama folder whose tokenizer is small_data_dir's: a run can start from it."""
    folder = tmp_path_factory.mktemp("good") / "public"
    public_model(folder, "llama", Path(small_data_dir) / "tokenizer.json")
    return folder


def edit_config(folder: Path, drop: str | None = None, **changes):
    config = json.loads((folder / "config.json").read_text()) | changes
    config.pop(drop, None)
    (folder / "config.json").write_text(json.dumps(config))


def cut_in_half(name: str):
    """The file's first half, as an interrupted download leaves it."""
    def damage(folder: Path, tokenizer: Path):
        payload = (folder / name).read_bytes()
        (folder / name).write_bytes(payload[:len(payload) // 2])
    return damage


def index_naming_a_missing_shard(folder: Path, tokenizer: Path):
    names = list(load_file(folder / "model.safetensors"))
    weight_map = {name: "model.safetensors" for name in names} | \
        {names[-1]: "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def smaller_vocabulary(data_tokenizer: bool):
    """A model of 300 ids whose tokenizer.json is the data's (512 ids: the folder disagrees
    with itself), or another (300 ids: the data is not the model's)."""
    def damage(folder: Path, tokenizer: Path):
        shutil.rmtree(folder)
        if not data_tokenizer:
            tokenizer = byte_level_tokenizer(folder.parent / "other", "</s>")
        public_model(folder, "llama", tokenizer, vocab_size=300)
    return damage


# what makes a public folder unfit to start a run: (damage, the --init_from given, more flags,
# what the one line must say)
UNFIT = {
    "config.json cut off": (cut_in_half("config.json"), None, [],
                            ["config.json is not JSON", "download it again"]),
    "config.json without hidden_size": (lambda f, t: edit_config(f, drop="hidden_size"), None,
                                        [], ["config.json has no hidden_size",
                                             "download it again"]),
    "weights cut in half": (cut_in_half("model.safetensors"), None, [],
                            ["model.safetensors is cut short", "download it again"]),
    "no weights": (lambda f, t: (f / "model.safetensors").unlink(), None, [],
                   ["no model.safetensors", "download it again"]),
    "an index naming a missing shard": (index_naming_a_missing_shard, None, [],
                                        ["names model-00002-of-00002.safetensors, which is "
                                         "not there", "download it again"]),
    "head_dim the weights do not have": (lambda f, t: edit_config(f, head_dim=32), None, [],
                                         ["config.json's num_key_value_heads 2 × head_dim 32",
                                          "download it again"]),
    "odd head_dim": (lambda f, t: edit_config(f, head_dim=15), None, [],
                     ["config.json: head_dim=15 is odd"]),
    "a vocabulary below the data's": (smaller_vocabulary(data_tokenizer=False), None, [],
                                      ["prepared with another tokenizer", "python prepare.py "
                                       "--source CORPUS --tokenizer"]),
    "a vocabulary below its own tokenizer's": (smaller_vocabulary(data_tokenizer=True), None,
                                               [], ["config.json: vocab_size=300 is below its "
                                                    "own tokenizer.json's 512 ids"]),
    "seq_len past max_position_embeddings": (lambda f, t: None, None, ["--seq_len=128"],
                                             ["max_position_embeddings=64", "--seq_len=64"]),
    "the config.json itself": (lambda f, t: None, "config.json", [],
                               ["is a file; pass the folder that holds it"]),
}


def never(*args):
    raise AssertionError("the model was built")


@pytest.mark.parametrize("damage, given, flags, fragments", UNFIT.values(), ids=list(UNFIT))
def test_a_public_folder_unfit_to_start_from_is_one_line_before_any_work(
        damage, given, flags, fragments, good_public, small_data_dir, tmp_path, capsys,
        monkeypatch):
    """Whatever the files show (config.json, the safetensors headers, the index, the
    tokenizer) is refused before the model is built and the banner printed, in one line
    that names the file or field and a fix --init_from accepts (never a model flag);
    nothing of the user's is touched. Under an FSDP2 launch config, as each rank of one
    runs it (in this process: a launch of 2 ranks takes half a minute here; the weights
    were read after sharding, where each rank printed a traceback)."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setattr(train, "build_model", never)
    folder = tmp_path / "public"
    shutil.copytree(good_public, folder)
    damage(folder, Path(small_data_dir) / "tokenizer.json")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    capsys.readouterr()  # transformers' progress bar, saving a model
    base = [a for a in cli_args(micro_config(small_data_dir, str(tmp_path / "out")))
            if not a.startswith("--model.")]
    with pytest.raises(SystemExit) as exit_:
        train.cli(base + [f"--init_from={folder / (given or '')}", *flags])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(fragment in err for fragment in fragments) and "--model." not in err, err
    assert "model shape:" not in out  # the banner's line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not (tmp_path / "out").exists()


def byte_level_tokenizer(folder: Path, special: str, before: tuple[str, ...] = ()) -> Path:
    """A small byte-level BPE whose end-of-text token is `special` (after the special tokens
    `before`, which take the first ids), as a public model's tokenizer.json, for a
    tokenizer_config.json to name it (Llama 3's way, or Llama 2's </s> after <unk> and <s>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[*before, special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_a_public_tokenizer_separates_documents_with_its_own_end_of_text(tmp_path):
    """prepare.py --tokenizer with a public model's tokenizer that has no <|endoftext|>: its
    tokenizer_config.json's eos_token opens every document in the shards and is recorded in
    the manifest; without one named beside it, the tokenizer is refused, naming the files."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"f{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    path = byte_level_tokenizer(tmp_path / "public", "<|end_of_text|>")
    with pytest.raises(ValueError, match=r"no '<\|endoftext\|>' token, and no end-of-text token "
                                         r"of its own .*tokenizer_config\.json"):
        prepare.prepare(source=str(corpus), out_dir=str(tmp_path / "refused"),
                        tokenizer=str(path), val_fraction=0.2)
    (path.parent / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|end_of_text|>", "special": True}}))
    manifest = prepare.prepare(source=str(corpus), out_dir=str(tmp_path / "data"),
                               tokenizer=str(path), val_fraction=0.2)
    separator = Tokenizer.from_file(str(path)).token_to_id("<|end_of_text|>")
    assert (manifest["eos_token"], manifest["eos_id"]) == ("<|end_of_text|>", separator)
    stream = torch.from_numpy(prepare.np.fromfile(tmp_path / "data" / "train_00000.bin",
                                                  dtype=manifest["dtype"]).astype("int64"))
    assert stream[0] == separator and (stream == separator).sum() == \
        manifest["splits"]["train"]["documents"]


def test_a_run_on_a_public_tokenizer_exports_its_end_of_text_for_sample_py(tmp_path, capsys):
    """Data prepared with a public tokenizer whose end of text is its own </s> (Llama 2's
    way, no <|endoftext|>; id 2, not a default 0): the export of a run on it (stacklm's
    format) writes the tokenizer_config.json that names </s>, and sample.py opens and cuts
    each completion with that token."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        shutil.copy(path, corpus / f"{path.stem}.txt")
    tokenizer = byte_level_tokenizer(tmp_path / "public", "</s>", before=("<unk>", "<s>"))
    (tmp_path / "public" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    prepare.prepare(source=str(corpus), out_dir=str(tmp_path / "data"), tokenizer=str(tokenizer),
                    val_fraction=0.2)
    cfg = micro_config(str(tmp_path / "data"), str(tmp_path / "run"), total_steps=4,
                       stop_at_step=4, warmup_steps=1)
    train.main(cfg)
    folder = export.export(cfg.out_dir)
    end = Tokenizer.from_file(str(tokenizer)).token_to_id("</s>")
    assert end == 2 and Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>") is None
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}
    assert sample.load_export(str(folder))[2] == end
    capsys.readouterr()
    sample.main(["--export", str(folder), "--max_new_tokens", "4", "--num_samples", "1",
                 "--device", "cpu"])
    assert capsys.readouterr().out.endswith("---------------\n")


def test_a_public_model_continued_at_the_from_scratch_peaks_is_warned(small_data_dir, tmp_path):
    """Either peak a run uses left at its from-scratch default (AdamW's always: the embedding
    and gains; Muon's on the matrices) gets the warning, naming the measured fix; a tenth of
    both, as docs/recipe.md's commands continue, gets none; a run from scratch neither."""
    public_model(tmp_path / "public", "llama", Path(small_data_dir) / "tokenizer.json")
    scratch = config.TrainConfig()
    both = dict(muon_peak_lr=scratch.muon_peak_lr, adamw_peak_lr=scratch.adamw_peak_lr)
    [warning] = hf_import.peak_warnings(public_run(tmp_path / "public", small_data_dir,
                                                   tmp_path / "out", **both))
    assert warning == (f"warning: --init_from continues a pretrained model at the from-scratch "
                       f"peaks (muon_peak_lr=0.006, adamw_peak_lr=0.003); on a stand-in they "
                       f"made it forget three times as much of its own data as a tenth did; to "
                       f"keep what it knows, pass {hf_import.CONTINUE_AT} (docs/recipe.md)")
    for knobs in ({**both, "muon_peak_lr": 6e-4}, {**both, "adamw_peak_lr": 3e-4}):
        assert len(hf_import.peak_warnings(public_run(tmp_path / "public", small_data_dir,
                                                      tmp_path / "out", **knobs))) == 1
    tenth = public_run(tmp_path / "public", small_data_dir, tmp_path / "out",
                       muon_peak_lr=6e-4, adamw_peak_lr=3e-4)
    assert hf_import.peak_warnings(tenth) == []
    recipe = public_run(tmp_path / "public", small_data_dir, tmp_path / "out",
                        **dict(flag[2:].split("=") for flag in hf_import.CONTINUE_AT.split()))
    assert hf_import.peak_warnings(recipe) == []  # Muon's peak is unused there
    assert hf_import.peak_warnings(dataclasses.replace(tenth, init_from=None, **both)) == []
