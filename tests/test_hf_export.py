"""The transformers export, checked against transformers itself (a test-only dependency,
pinned in requirements-dev.txt): fp32 logits equal to 1e-5 on every shape, with perturbed
norm gains and rope_theta 500,000 (transformers' default and Stack-100M's is 10,000, where a
missing rope_theta would go unseen); greedy generation; no missing or unexpected keys; the
tokenizer's ids. Two wrong exports must fail the same logit check."""

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import export
import train
from config import StackConfig
from conftest import micro_config
from model import KVCache, Transformer
from test_train import REPO, checkpoint_weights
from plumbing import log

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOLERANCE = 1e-5  # fp32; measured differences are ~4e-7
SHAPES = {  # (qk_norm, nope_every) -> the class that must read it
    (True, 0): "Qwen3ForCausalLM", (False, 2): "SmolLM3ForCausalLM",
    (False, 0): "LlamaForCausalLM", (True, 2): "StackLMForCausalLM"}
PROVENANCE = {"trained_by": "x"}  # what write_hf records of the checkpoint it writes
TEXTS = ["def f(x):\n    return x  # café ☕\n", "import json, os\n\n\nclass A:\n  pass"]


def stack_model(qk_norm: bool, nope_every: int) -> Transformer:
    """A 4-layer model with rope_theta 500,000 and every norm gain perturbed (a gain of 1
    hides a norm applied in the wrong place)."""
    cfg = StackConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                      intermediate=176, max_seq_len=64, rope_theta=500_000.0,
                      qk_norm=qk_norm, nope_every=nope_every)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def stack_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_cached(torch.tensor([ids]), 0, [KVCache() for _ in model.blocks])


def load(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True)
    return model.eval(), info


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def ids_of(tokenizer_file) -> list[int]:
    return [0] + Tokenizer.from_file(tokenizer_file).encode(TEXTS[0]).ids


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_loads_as_its_class_with_equal_logits_and_greedy_text(shape, small_data_dir,
                                                                         tmp_path):
    model = stack_model(*shape)
    tokenizer = str(Path(small_data_dir) / "tokenizer.json")
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), model.cfg, tokenizer, 0,
                             PROVENANCE)
    hf, info = load(folder)
    assert type(hf).__name__ == SHAPES[shape]
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ids = ids_of(tokenizer)
    assert (hf_logits(hf, ids) - stack_logits(model, ids)).abs().max() < TOLERANCE
    prompt = torch.tensor([ids[:8]])
    want = model.generate(prompt, 16, temperature=0)
    got = hf.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(got, want)


def test_the_tokenizer_gives_the_ids_of_tokenizers_itself(small_data_dir, tmp_path):
    tokenizer = str(Path(small_data_dir) / "tokenizer.json")
    model = stack_model(True, 2)
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), model.cfg, tokenizer, 0,
                             PROVENANCE)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_file(tokenizer)
    for text in TEXTS:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text).ids
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.eos_token_id == 0
    # transformers 5 would name its own TokenizersBackend, which 4.57 cannot load
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("mistake", ["default shape as plain Qwen3", "no rope_theta"])
def test_wrong_exports_fail_the_logit_check(mistake, small_data_dir, tmp_path):
    """Negative controls: the parity check must see both (greedy text alone does not)."""
    model = stack_model(True, 2) if mistake.startswith("default") else stack_model(True, 0)
    config = export.hf_config(model.cfg, 0, "x")
    if mistake.startswith("default"):
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        del config["auto_map"], config["no_rope_layers"]
    else:
        del config["rope_theta"], config["rope_parameters"]
    tokenizer = str(Path(small_data_dir) / "tokenizer.json")
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), model.cfg, tokenizer, 0,
                             PROVENANCE,
                             config=config)
    hf, _ = load(folder)
    ids = ids_of(tokenizer)
    assert (hf_logits(hf, ids) - stack_logits(model, ids)).abs().max() > 100 * TOLERANCE


def test_without_remote_code_the_stacklm_folder_is_refused_not_run_as_qwen3(small_data_dir,
                                                                          tmp_path):
    model = stack_model(True, 2)  # QK-norm and NoPE layers: Stack-100M's shape
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), model.cfg,
                             str(Path(small_data_dir) / "tokenizer.json"), 0, PROVENANCE)
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)


def test_the_folder_holds_the_tied_embedding_once_and_the_config_readme_lists(small_data_dir,
                                                                              tmp_path):
    """model.safetensors: one tensor per Stack parameter, the head not written again;
    config.json: rope_theta and rope_parameters (transformers 4.57 reads the first, 5 the
    second), the EOS id as bos, eos and pad, and the code revision."""
    from safetensors import safe_open
    model = stack_model(True, 0)
    eos_id = 7  # not 0, so a field left at a default shows
    folder = export.write_hf(tmp_path / "hf", model.state_dict(), model.cfg,
                             str(Path(small_data_dir) / "tokenizer.json"), eos_id,
                             {"trained_by": "abc123"})
    with safe_open(folder / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert len(keys) == len(model.state_dict()) and not any("lm_head" in k for k in keys)
    assert torch.equal(embedding, model.embed.weight)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 500_000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500_000.0}
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (7, 7, 7)
    assert config["stacklm_revision"] == "abc123"


def test_export_format_hf_writes_the_checkpoint_as_a_transformers_folder(
        small_data_dir, tmp_path, capsys):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4,
                       **{"model.rope_theta": 500_000.0})
    train.main(cfg)
    export.main([str(tmp_path), "--format", "hf"])
    assert "trust_remote_code=True" in capsys.readouterr().out  # NoPE and QK-norm: remote
    hf, info = load(tmp_path / "export-hf")
    assert not any(info.values()), info
    model = Transformer(cfg.model).eval()
    model.load_state_dict(checkpoint_weights(cfg, 4))
    ids = ids_of(str(Path(small_data_dir) / "tokenizer.json"))
    assert (hf_logits(hf, ids) - stack_logits(model, ids)).abs().max() < TOLERANCE
    assert hf.config.stacklm_revision == log.code_revision()
    assert dataclasses.asdict(cfg.model)["nope_every"] == 2  # micro_config's NoPE layers

    # docs/checkpoints.md's Python lines, as written, on this folder, with no terminal to answer a
    # question: transformers asks before it runs a folder's code unless it is told it may.
    snippet = re.search(r"```python\n(.*?)```", (REPO / "docs" / "checkpoints.md").read_text(),
                        re.S)[1]
    done = subprocess.run([sys.executable, "-c", snippet.replace("out/tiny/export-hf",
                                                                 str(tmp_path / "export-hf"))],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Do you wish to run the custom code?" not in done.stdout + done.stderr
    assert "You are using a model of type `stacklm`" not in done.stderr
    assert "def " in done.stdout


def test_an_outside_scorer_reproduces_val_bpb_from_the_listed_val_documents(small_data_dir,
                                                                            tmp_path):
    """What lm-evaluation-harness needs to score the run's own val text, done here with
    plain transformers code: the val documents named in val_documents.json, read from the
    source files and tokenized by the export's tokenizer, laid end to end with EOS before
    each, cut into windows of seq_len + 1 at stride seq_len; each document's part of a
    window scored alone (its positions from 0). Bits per byte over every target equals the
    run's final val_bpb, which covers all of val (eval_tokens none)."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4, eval_tokens=None)
    want = train.main(cfg)["val_bpb"]
    export.main([str(tmp_path), "--format", "hf"])
    hf, _ = load(tmp_path / "export-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export-hf",
                                                           trust_remote_code=True)
    manifest = json.loads((Path(small_data_dir) / "manifest.json").read_text())
    keys = json.loads((Path(small_data_dir) / manifest["splits"]["val"]["keys"]).read_text())
    eos = tokenizer.eos_token_id
    stream = []
    for key in keys:  # "<file>.txt:<i>": the i-th document of a file split on EOS text
        name, i = key.rsplit(":", 1)
        text = (Path(manifest["source"]) / name).read_text().split(tokenizer.eos_token)[int(i)]
        stream += [eos] + tokenizer(text, add_special_tokens=False).input_ids
    symbols = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    nbytes = [0 if i == eos else len(s) for i, s in enumerate(symbols)]  # byte-level BPE
    T, nats, total_bytes = cfg.seq_len, 0.0, 0
    for w in range((len(stream) - 1) // T):
        inputs, targets = stream[w * T:w * T + T], stream[w * T + 1:w * T + T + 1]
        starts = [0] + [j for j in range(1, T) if inputs[j] == eos] + [T]
        for a, b in zip(starts, starts[1:]):
            with torch.no_grad():
                logits = hf(torch.tensor([inputs[a:b]]), use_cache=False).logits[0]
            nats += torch.nn.functional.cross_entropy(logits.double(), torch.tensor(
                targets[a:b]), reduction="sum").item()
        total_bytes += sum(nbytes[t] for t in targets)
    assert nats / math.log(2) / total_bytes == pytest.approx(want, abs=1e-4)
