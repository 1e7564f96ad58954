"""config.py: presets, overrides from the CLI and TOML, and every validation error."""

import dataclasses

import pytest

import config
from config import StackConfig, TrainConfig
from plumbing.overrides import apply_overrides, parse_args


def test_stack100m_preset_is_the_reference_run():
    cfg = config.stack100m()
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.intermediate,
            m.max_seq_len, m.rope_theta, m.qk_norm, m.nope_every,
            m.z_loss) == (32768, 512, 30, 8, 2, 1408, 2048, 10000.0, True, 4, 1e-4)
    assert (cfg.seq_len, cfg.micro_batch_size, cfg.global_batch_tokens) == (2048, 32, 524_288)
    assert (cfg.warmup_steps, cfg.stop_at_step, cfg.adamw_peak_lr, cfg.muon_peak_lr) == \
        (2_000, 34_332, 3e-3, 6e-3)
    assert (cfg.weight_decay, cfg.betas, cfg.grad_clip, cfg.seed) == (0.1, (0.9, 0.95), 1.0, 1337)
    assert (cfg.ckpt_every, cfg.keep_last_ckpts, cfg.log_every) == (1_000, 5, 10)


def test_what_each_preset_evaluates_and_scores_is_what_readme_says():
    """README: "`tiny` scores a built-in task by default" ("the first 100 at each
    evaluation"), `downstream` empty is "none, the stack100m default"; "`tiny` evaluates all
    of it (eval_tokens none); `stack100m` reads 4,194,304 tokens of each source's"; lm-eval
    truncates to model.max_seq_len, "the same as seq_len in both presets"."""
    tiny, reference = config.tiny(), config.stack100m()
    assert [name for name, _ in config.parse_downstream(tiny.downstream)] == ["nextline"]
    assert (tiny.downstream_items, tiny.downstream_every) == (100, None)
    assert reference.downstream == ""
    assert (tiny.eval_tokens, reference.eval_tokens) == (None, 4_194_304)
    for cfg in (tiny, reference):
        assert cfg.model.max_seq_len == cfg.seq_len


def test_batch_arithmetic_banner():
    cfg = config.stack100m()
    assert cfg.batch_summary(1) == \
        "524,288 tokens/step = 256 seqs × 2,048 = 32 micro × 8 accum × 1 rank"
    assert cfg.batch_summary(8) == \
        "524,288 tokens/step = 256 seqs × 2,048 = 32 micro × 1 accum × 8 ranks"
    # the accumulation is derived, so tokens per step survive a change of GPU count
    for world in (1, 2, 4, 8):
        accum = cfg.grad_accum_steps(world)
        assert accum * cfg.micro_batch_size * cfg.seq_len * world == cfg.global_batch_tokens


def test_indivisible_global_batch_is_refused_with_a_fix():
    cfg = config.stack100m()
    with pytest.raises(ValueError, match=r"32\*2048\*3=196,608; use global_batch_tokens=589,824"):
        cfg.grad_accum_steps(3)
    with pytest.raises(ValueError, match=r"32\*2048\*16=1,048,576; use micro_batch_size=16"):
        cfg.grad_accum_steps(16)
    # construction checks one rank, so the fix is the batch alone, not another rank count
    with pytest.raises(ValueError, match=r"32\*2048\*1=65,536; use global_batch_tokens=524,288$"):
        dataclasses.replace(cfg, global_batch_tokens=500_000)
    with pytest.raises(ValueError, match=r"32\*2048\*1=65,536; use micro_batch_size=24$"):
        dataclasses.replace(cfg, global_batch_tokens=48 * 2048)


def test_cli_overrides_are_typed_from_the_dataclass():
    cfg, args = parse_args(["--preset", "tiny", "--warmup_steps=7", "--muon_peak_lr=0.01",
                            "--betas=0.8,0.9", "--decay_steps=none", "--model.qk_norm=false",
                            "--model.n_layers=2", "--out_dir=/tmp/x"])
    assert args.preset == "tiny"
    assert cfg.warmup_steps == 7 and cfg.muon_peak_lr == 0.01 and cfg.betas == (0.8, 0.9)
    assert cfg.decay_steps is None and cfg.model.qk_norm is False and cfg.model.n_layers == 2
    assert cfg.out_dir == "/tmp/x" and cfg.model.d_model == config.tiny_model().d_model


def test_unknown_key_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"did you mean --warmup_steps\?"):
        parse_args(["--warmup_step=3"])
    with pytest.raises(ValueError, match=r"did you mean --model.n_kv_heads\?"):
        parse_args(["--model.n_kv_head=1"])
    with pytest.raises(ValueError, match="expected int"):
        parse_args(["--warmup_steps=lots"])
    with pytest.raises(ValueError, match="write overrides as --key=value or --key value"):
        parse_args(["3"])
    with pytest.raises(ValueError, match="--warmup_steps has no value"):
        parse_args(["--warmup_steps"])
    with pytest.raises(ValueError, match="--warmup_steps has no value"):
        parse_args(["--warmup_steps", "--seed=3"])


def test_both_flag_forms_mean_the_same():
    """`--key value` (argparse's form, which prepare.py and sample.py take) and
    `--key=value` give the same config, negative numbers and spaces included."""
    spaced, _ = parse_args(["--preset", "tiny", "--warmup_steps", "7", "--model.n_layers", "2",
                            "--sample_prompt", "def f(x):", "--final_frac", "-0"])
    joined, _ = parse_args(["--preset=tiny", "--warmup_steps=7", "--model.n_layers=2",
                            "--sample_prompt=def f(x):", "--final_frac=-0"])
    assert spaced == joined and spaced.warmup_steps == 7 and spaced.sample_prompt == "def f(x):"


def test_toml_then_cli_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('warmup_steps = 11\nmuon_peak_lr = 0.02\nbetas = [0.85, 0.9]\n'
                    '[model]\nn_layers = 3\n')
    cfg, _ = parse_args(["--preset=tiny", "--config", str(toml), "--warmup_steps=12"])
    assert cfg.warmup_steps == 12  # the flag wins over the file
    assert cfg.muon_peak_lr == 0.02 and cfg.betas == (0.85, 0.9) and cfg.model.n_layers == 3
    toml.write_text("warmup_stepz = 1\n")
    with pytest.raises(ValueError, match="did you mean --warmup_steps"):
        parse_args(["--config", str(toml)])
    with pytest.raises(ValueError, match="missing.toml"):
        parse_args(["--config", str(tmp_path / "missing.toml")])


@pytest.mark.parametrize("change, message", [
    (dict(d_model=500), "model.d_model=500 is not divisible by model.n_heads=8"),
    (dict(n_kv_heads=3), "model.n_kv_heads=3 does not divide model.n_heads=8"),
    (dict(vocab_size=0), "model.vocab_size=0 must be positive"),
])
def test_model_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        StackConfig(**change)


def test_a_record_older_than_the_knobs_removal_still_reads():
    """A checkpoint's or an export's model config from before tie_embeddings was removed (a
    knob that only true passed) reads as the same shape; any other unknown knob is refused."""
    saved = dataclasses.asdict(config.tiny_model()) | {"tie_embeddings": True}
    assert StackConfig.from_saved(saved) == config.tiny_model()
    old_run = dataclasses.asdict(config.tiny()) | {"model": saved}
    assert TrainConfig(**old_run) == config.tiny()
    with pytest.raises(TypeError, match="tied_embedding"):
        StackConfig.from_saved(saved | {"tied_embedding": True})


# `python config.py --world_size=N` reads the batch's knobs itself (without torch); it must
# read them as train.py's full parser does, the oracle here.
@pytest.mark.parametrize("flags", [
    [], ["--preset=tiny"], ["--preset", "tiny", "--sample_prompt", "def main(x):"],
    ["--micro_batch_size=8", "--seed=3"], ["--seq_len", "1024", "--micro_batch_size", "16"],
    ["--global_batch_tokens=1_048_576"], ["--config", "{toml}", "--micro_batch_size=4"],
    ["--config={toml}"]])
@pytest.mark.parametrize("world_size", [1, 2, 8, 16])
def test_config_py_answers_the_micro_batch_train_py_would_use(flags, world_size, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("seed = 5\nmicro_batch_size = 16\nseq_len = 512\n[model]\nn_layers = 2\n")
    flags = [flag.format(toml=toml) for flag in flags]
    full, _ = parse_args(flags)
    assert config.fit_micro_batch([f"--world_size={world_size}", *flags]) == \
        full.fitting_micro_batch(world_size)
    with pytest.raises(ValueError, match="is not divisible by"):
        config.fit_micro_batch(["--world_size=3", *flags])


@pytest.mark.parametrize("change, message", [
    (dict(seq_len=4096), "seq_len=4096 exceeds model.max_seq_len=2048"),
    (dict(stop_at_step=40_000), "stop_at_step=40,000 is past total_steps=38,147"),
    (dict(micro_batch_size=0), "micro_batch_size=0 must be a positive"),
    (dict(decay_shape="exp"), "decay_shape='exp' is not one of"),
    (dict(mixed_precision="fp16"), "mixed_precision='fp16' is not one of"),
    (dict(activation_recompute="half"), "activation_recompute='half' is not none"),
    (dict(activation_recompute="every-0"), "activation_recompute='every-0' is not none"),
    (dict(muon_adjust_lr="raw"), "muon_adjust_lr='raw' is not one of"),
    (dict(final_frac=2.0), r"final_frac=2.0 must be within \[0, 1\]"),
])
def test_run_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(config.stack100m(), **change)


def test_activation_recompute_modes():
    """Which blocks recompute what, for six blocks (every-N: blocks 0, N, 2N, …)."""
    modes = {"none": "nnnnnn", "full": "ffffff", "every-1": "ffffff", "every-3": "fnnfnn",
             "every-12": "fnnnnn", "selective": "ssssss"}
    for mode, blocks in modes.items():
        cfg = dataclasses.replace(config.tiny(), activation_recompute=mode)
        assert "".join(cfg.block_recompute(layer)[0] for layer in range(6)) == blocks, mode


def test_overrides_return_a_new_config():
    base = config.tiny()
    new = apply_overrides(base, {"seed": "7", "model.n_layers": 2})
    assert (new.seed, new.model.n_layers) == (7, 2)
    assert (base.seed, base.model.n_layers) == (1337, 4)


def test_help_describes_every_knob(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    # one line per knob: the flag with its stack100m default, then the description
    assert "  --warmup_steps=2000               linear warmup length, in optimizer steps" in lines
    assert any(line.startswith("  --sample_prompt='def '  ") for line in lines)  # pasteable
    assert any(line.endswith("  linear | sqrt | cosine: shape of the decay leg (sqrt: 1-sqrt, "
                             "arXiv 2405.18392)") for line in lines)
    fields = [("", f) for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    fields += [("model.", f) for f in dataclasses.fields(StackConfig)]
    for prefix, f in fields:
        description = f.metadata.get("help", "").strip()
        assert description, f"{prefix}{f.name} has no description: declare it with config.knob"
        [line] = [line for line in lines if line.startswith(f"  --{prefix}{f.name}=")]
        assert line.endswith(description)
    model_field = {f.name: f for f in dataclasses.fields(TrainConfig)}["model"]
    assert f" model: {model_field.metadata['help']}" in lines
    # the groups of config.py, in its order, each above its first knob
    sections = [line.strip() for line in lines if line.startswith(" ") and
                not line.startswith("  ") and line.strip()]
    assert [s.split(":")[0] for s in sections] == [
        "data and outputs", "batch", "schedule", "optimizers", "hardware and numerics",
        "logging, evaluation, checkpoints", "model"]
    assert lines.index(" data and outputs") < lines.index(next(
        line for line in lines if line.startswith("  --data_dir=")))


def test_help_shows_the_defaults_of_the_preset_that_would_run(capsys):
    """On a CPU-only machine the bare command runs `tiny`: --help says so and shows tiny's
    defaults; --preset stack100m --help shows Stack-100M's."""
    for argv, preset, seq_len in ([["--help"], "tiny", 256],
                                  [["--preset", "stack100m", "--help"], "stack100m", 2048]):
        with pytest.raises(SystemExit):
            parse_args(argv, default_preset="tiny")
        out = capsys.readouterr().out
        assert f"knobs, with the defaults of the {preset} preset" in out
        assert f"  --seq_len={seq_len} " in out
