"""pdctl.vllm.tiny_model / `pdctl model tiny`: the tiny random Qwen3 the CPU demo and the real e2e serve."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdctl.cli import app
from pdctl.config.recipe import RECIPE_REQUESTS
from pdctl.vllm.tiny_model import SPECIAL_TOKENS, TINY_MODEL_FILES, generate_tiny_model, model_digest

RECIPE_PROMPTS = tuple(r.prompt for r in RECIPE_REQUESTS)

needs_transformers = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "torch", "tokenizers")),
    reason="transformers/torch not installed (scripts/install-cpu-engine.sh)",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    generate_tiny_model(path, seed=0)
    return path


@needs_transformers
def test_same_seed_gives_identical_files(tiny: Path, tmp_path: Path) -> None:
    again = generate_tiny_model(tmp_path / "again", seed=0)
    first, second = model_digest(tiny), model_digest(again.path)
    for name in TINY_MODEL_FILES:
        assert first[name] == second[name], name
    assert first == second


@needs_transformers
def test_other_seed_changes_weights_not_tokenizer(tiny: Path, tmp_path: Path) -> None:
    other = model_digest(generate_tiny_model(tmp_path / "seed1", seed=1).path)
    base = model_digest(tiny)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


@needs_transformers
def test_config_has_the_recipe_shape(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is False
    assert config["initializer_range"] == 0.3
    assert config["dtype"] == "bfloat16"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert 300 <= config["vocab_size"] <= 512


@needs_transformers
def test_tokenizer_round_trips_chinese_and_has_chatml(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    config = json.loads((tiny / "config.json").read_text())
    # Every id the model can emit must decode: the vocabulary and the embedding table agree.
    assert len(tok) == config["vocab_size"]
    for prompt in (*RECIPE_PROMPTS, "emoji 😀 and ñ"):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert tok.decode(ids) == prompt
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.convert_ids_to_tokens(config["eos_token_id"]) == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": RECIPE_PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert text == f"<|im_start|>user\n{RECIPE_PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"


@needs_transformers
def test_greedy_output_depends_on_the_whole_context(tiny: Path) -> None:
    """A broken KV transfer must change the output: same last token, different prefix -> different tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    outputs = []
    for prefix in ("The quick brown fox jumps over the lazy dog", "预填充阶段计算提示词的缓存"):
        ids = tok(prefix + " KV Cache", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        outputs.append(out[0, ids.shape[1] :].tolist())
    assert outputs[0] != outputs[1]
    assert len(set(outputs[0])) > 1


@needs_transformers
def test_cli_writes_then_reuses(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "m"
    first = runner.invoke(app, ["model", "tiny", str(target), "--seed", "3"])
    assert first.exit_code == 0, first.output
    assert "wrote" in first.output
    digest = model_digest(target)
    second = runner.invoke(app, ["model", "tiny", str(target), "--seed", "3"])
    assert second.exit_code == 0, second.output
    assert "reusing" in second.output
    assert model_digest(target) == digest
    other = runner.invoke(app, ["model", "tiny", str(target), "--seed", "4"])
    assert other.exit_code == 1
    assert "another seed" in other.output and "--force" in other.output
    forced = runner.invoke(app, ["model", "tiny", str(target), "--seed", "4", "--force"])
    assert forced.exit_code == 0, forced.output
    assert model_digest(target)["model.safetensors"] != digest["model.safetensors"]


def test_cli_refuses_a_folder_with_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    runner = CliRunner()
    for args in ([], ["--force"]):
        result = runner.invoke(app, ["model", "tiny", str(tmp_path), *args])
        assert result.exit_code == 1
        assert "error:" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_transformers_names_the_install_step(tmp_path: Path) -> None:
    # Make the optional engine unimportable in a child interpreter (a third-party boundary).
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["transformers"] = None
        sys.argv = ["pdctl", "model", "tiny", {str(tmp_path / "m")!r}]
        from pdctl.cli import main
        main()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "transformers" in proc.stderr
    assert "install-cpu-engine.sh" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "m").exists()


@needs_transformers
def test_small_size_shape_and_bench_words_are_one_token_each(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pdctl.bench.workload import WORDS, WorkloadSpec, make_workload
    from pdctl.vllm.tiny_model import SIZES

    model = generate_tiny_model(tmp_path / "small", seed=0, spec=SIZES["small"])
    config = json.loads((model.path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (512, 4, 1536)
    assert config["max_position_embeddings"] == 8192 and config["head_dim"] == 64
    assert 12_000_000 < model.num_parameters < 15_000_000
    tok = AutoTokenizer.from_pretrained(str(model.path))
    assert [w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False)) != 1] == []
    # So a bench prompt's estimated length is its length on the engine, within the tag's few tokens.
    long = make_workload(WorkloadSpec("mixed", long_len=2048, long_fraction=1.0)).request(0, "red blue green")
    assert 0 <= len(tok.encode(long.prompt, add_special_tokens=False)) - long.prompt_len <= 8
    for prompt in RECIPE_PROMPTS:
        assert tok.decode(tok.encode(prompt, add_special_tokens=False)) == prompt


@needs_transformers
def test_cli_size_is_part_of_what_is_reused(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "m"
    assert runner.invoke(app, ["model", "tiny", str(target)]).exit_code == 0
    other = runner.invoke(app, ["model", "tiny", str(target), "--size", "medium"])
    assert other.exit_code == 1 and "another size" in other.output and "--force" in other.output
    bad = runner.invoke(app, ["model", "tiny", str(tmp_path / "x"), "--size", "huge"])
    assert bad.exit_code == 1 and "unknown size 'huge'" in bad.output and "tiny, small, medium" in bad.output


@needs_transformers
def test_gateway_counts_prompts_like_the_engine_tokenizer(tiny: Path) -> None:
    """The gateway's TokenCounter (tokenizer.json via `tokenizers`) agrees with transformers' tokenizer, which
    vLLM loads from the same folder, on English and Chinese prompts (issue 17, item 2)."""
    import asyncio

    from transformers import AutoTokenizer

    from pdctl.gateway.tokens import TokenCounter

    counter = TokenCounter()
    counter.load({"tiny": str(tiny)})
    engine = AutoTokenizer.from_pretrained(str(tiny))
    for text in ("the quick brown fox jumps over the lazy dog " * 8, "请用中文解释预填充和解码分离" * 10):
        body = {"model": "tiny", "prompt": text}
        assert asyncio.run(counter.count("tiny", body)) == len(engine(text, add_special_tokens=False)["input_ids"])
